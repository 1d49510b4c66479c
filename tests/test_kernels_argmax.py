"""`argmax_rows` (kernels/argmax.py) against torch.argmax(dim=1): the first index of the largest value, a NaN larger
than every number; rows cut into slices, so ties and NaNs are placed within a slice and across slices."""

from __future__ import annotations

import pytest
import torch

from governor.kernels.argmax import argmax_rows, argmax_usable
from tests.conftest import DEVICE, needs_triton


def check(x: torch.Tensor) -> None:
    got = argmax_rows(x.to(DEVICE), interpret=True)
    assert got.dtype == torch.int64 and got.device == x.to(DEVICE).device
    assert got.tolist() == x.argmax(dim=1).tolist()


@needs_triton
@pytest.mark.parametrize("n", [1, 7, 1000, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_rows_give_torchs_argmax(n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n)
    check(torch.randn(2, n, generator=gen).to(dtype))


@needs_triton
def test_ties_go_to_the_first_index_within_and_across_slices() -> None:
    n = 20000  # 79 slices of 256 columns
    x = torch.zeros(5, n)
    x[0, [5, 6, 17000]] = 3.0  # within a slice, then a later slice
    x[1, [17000, 300]] = 3.0  # set in the other order: slice 1 holds the first
    x[2, [255, 256]] = 2.0  # the two sides of a slice boundary
    x[3] = 1.0  # every column ties: column 0
    x[4, n - 1] = 1.0  # the last column
    check(x)
    check(torch.randint(0, 3, (2, 5000), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_nans_and_infinities_are_ordered_as_torch_orders_them() -> None:
    n = 3000  # slices of 32 columns
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(2))
    x[0, 2900] = float("nan")
    x[1, [2900, 30]] = float("nan")  # the first NaN, in an earlier slice
    x[1, 50] = float("inf")
    x[2] = float("-inf")  # every column -inf: column 0
    x[3, 2000] = float("inf")
    x[3, 100] = float("inf")  # two infinities: the first
    x[4, :] = float("-inf")
    x[4, n - 3] = -1e30
    x[5, 77] = float("nan")
    x[5, 76] = float("inf")
    check(x)


@needs_triton
def test_rows_of_a_step_of_several_sequences() -> None:
    check(torch.randn(3, 3000, generator=torch.Generator().manual_seed(3)))
    assert argmax_rows(torch.empty(0, 10, device=DEVICE), interpret=True).shape == (0,)


def test_what_the_kernels_do_not_take_falls_back_to_torch() -> None:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4)).t()  # columns not contiguous
    assert not argmax_usable(x.to(DEVICE), interpret=True)
    assert argmax_rows(x.to(DEVICE), interpret=True).tolist() == x.argmax(dim=1).tolist()
    wide = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64)  # apart in float64, equal in float32
    assert not argmax_usable(wide.to(DEVICE), interpret=True)
    assert argmax_rows(wide.to(DEVICE), interpret=True).tolist() == [1]


def test_the_engine_keeps_torchs_argmax_on_a_cpu() -> None:
    """The engine's calls (no `interpret`) take the kernels on a GPU only: on a CPU the interpreter would run a
    greedy step's argmax program by program in Python."""
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(5))
    assert not argmax_usable(x)
    assert argmax_usable(x.to(DEVICE)) == (DEVICE.type == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 8, 40])
def test_gpu_argmax_of_vocabulary_wide_rows(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, device="cuda", generator=gen).bfloat16()
    x[0, [1000, 90000]] = 100.0  # a tie across slices
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    assert torch.equal(argmax_rows(x.float()), x.float().argmax(dim=1))
