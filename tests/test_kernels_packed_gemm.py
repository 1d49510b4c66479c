"""Products of several rows over AWQ's and GPTQ's packed weights (`governor.kernels.packed_gemm`), and the model's
use of them. The packed tensors, and the weight they stand for, come from the quantized-weights test's own packing
and unpacking (independent of the kernel and of models/quantization.py). Without CUDA the kernel runs under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The model's use of the kernel is tested in
tests/test_quantized_weights.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from governor.kernels import packed_gemm as packed_gemm_module
from governor.kernels.launch_policy import policy_for
from governor.kernels.packed_gemm import (
    PACKED_GEMM_MAX_ROWS,
    packed_dequantize,
    packed_gemm,
    packed_gemm_split_shape,
    packed_gemm_usable,
)
from tests import test_quantized_weights as qw
from tests.conftest import DEVICE, needs_triton, seeded_randn
from tests.test_kernels_paged_attention import LaunchSpy


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x times the exact weight rounded to x's dtype (what the reference path multiplies), summed in float64."""
    out = x.double() @ weight.to(x.dtype).double().t()
    return out if bias is None else out + bias.double()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the order of an fp32 sum, plus (bf16) one rounding of the output."""
    assert got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _grouped_in_order(bits: int, n: int, k: int, group: int, zeros_as_stored: bool, seed: int
                      ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """GPTQ-layout tensors of a weight in groups of `group` consecutive inputs (as AWQ repacked at load when
    `zeros_as_stored`, else GPTQ v1's zero points less one), and the weight they stand for (fp32 [N, K])."""
    w = seeded_randn(n, k, dtype=torch.float32, seed=seed, scale=0.1)
    g_idx = torch.arange(k) // group
    q, z, sc = qw.quantize(w, qw.Scheme("gptq", bits, group), g_idx)
    stored = z if zeros_as_stored else z - 1
    args = [qw.pack_gptq(q, bits, 0), qw.pack_gptq(stored & (2**bits - 1), bits, 1), sc]
    return [a.to(DEVICE) for a in args], qw.dequantize(q, z, sc, g_idx).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,rows,n,k,group,zeros_as_stored", [
    (4, 2, 64, 256, 128, True), (4, 5, 72, 1024, 128, True), (8, 16, 64, 512, 64, False), (4, 9, 136, 256, 256, False),
    (4, 3, 64, 512, 32, True), (8, 4, 40, 256, 16, False),
], ids=["awq-repacked-two-rows", "awq-repacked-ragged-columns-two-splits", "gptq8-sixteen-rows",
        "gptq4-groups-over-steps", "awq-repacked-four-groups-a-step", "gptq8-groups-of-16"])
def test_codes_in_groups_in_order_match_the_exact_product(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                          bits: int, rows: int, n: int, k: int, group: int,
                                                          zeros_as_stored: bool) -> None:
    """Codes in GPTQ's layout whose groups are in order (AWQ repacked at load, GPTQ without act order) take one launch
    of `_packed_gemm_split_kernel`. Groups spanning a K step multiply the exact codes minus their zero points and
    scale the sums in fp32 (within the order of an fp32 sum, and one rounding of the output, of the exact product);
    smaller groups multiply the weight rounded to x's dtype, as the reference path does. Bias included; a chunk of
    512 inputs gives K of 1,024 two splits (the split-K epilogue)."""
    args, weight = _grouped_in_order(bits, n, k, group, zeros_as_stored, seed=60)
    x = seeded_randn(rows, k, dtype=dtype, seed=61)
    bias = seeded_randn(n, dtype=dtype, seed=62)
    policy = dataclasses.replace(policy_for(x.device), packed_gemm_tiles=((PACKED_GEMM_MAX_ROWS, (64, 512, 4)),))
    spy = LaunchSpy(packed_gemm_module._packed_gemm_split_kernel)
    monkeypatch.setattr(packed_gemm_module, "_packed_gemm_split_kernel", spy)
    got = packed_gemm(x, *args, bits, group, bias, zeros_minus_one=not zeros_as_stored, policy=policy)
    assert len(spy.launches) == 1
    exact = group >= 16 * (32 // bits)
    want = x.double() @ (weight if exact else weight.to(dtype)).double().t() + bias.double()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_the_split_kernel_takes_groups_of_whole_steps_or_whole_packed_rows() -> None:
    """A K step of 16 packed rows (128 inputs of 4 bits, 64 of 8) must divide K and either divide the groups or be
    divided by them into whole packed rows; the chunk doubles the step while it divides K and stays within the
    policy's."""
    assert packed_gemm_split_shape(4096, 128, 4, 1024) == (128, 1024)
    assert packed_gemm_split_shape(4608, 128, 4, 1024) == (128, 512)  # 4,608 = 9 x 512
    assert packed_gemm_split_shape(256, 64, 8, 1024) == (64, 256)
    assert packed_gemm_split_shape(4096, 32, 4, 128) == (128, 128)  # four groups a step
    assert packed_gemm_split_shape(4096, 4, 4, 1024) is None  # half a packed row a group
    assert packed_gemm_split_shape(4096, 96, 4, 1024) is None  # neither divides the other
    assert packed_gemm_split_shape(4096, -1, 4, 1024) is None
    assert packed_gemm_split_shape(4000, 125, 4, 1024) is None  # K not a whole number of steps


@needs_triton
def test_what_the_kernel_does_not_take_is_refused_with_a_clear_message() -> None:
    qweight = torch.zeros(16, 16, dtype=torch.int32, device=DEVICE)  # 128 inputs of 4 bits, 16 outputs
    zeros, scales = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), torch.ones(1, 16, device=DEVICE).half()
    one_row = seeded_randn(1, 128, dtype=torch.float32, seed=47)
    two_rows = seeded_randn(2, 128, dtype=torch.float32, seed=48)
    assert packed_gemm_usable(two_rows, qweight, 128, 4, True)
    assert not packed_gemm_usable(one_row, qweight, 128, 4, True)  # one row: the GEMV's
    assert not packed_gemm_usable(seeded_randn(PACKED_GEMM_MAX_ROWS + 1, 128, dtype=torch.float32, seed=48), qweight,
                                  128, 4, True)  # more: the dense weight's
    assert not packed_gemm_usable(two_rows, qweight, 128, 4, False)  # act order
    assert not packed_gemm_usable(two_rows, qweight, 96, 4, True)
    with pytest.raises(ValueError, match=f"needs 2 to {PACKED_GEMM_MAX_ROWS} contiguous rows"):
        packed_gemm(one_row, qweight, zeros, scales, 4, 128)
    with pytest.raises(ValueError, match="x has 256 columns for a weight of 128 inputs and 16 outputs"):
        packed_gemm(seeded_randn(2, 256, dtype=torch.float32, seed=49), qweight, zeros, scales, 4, 128)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["awq", "awq-ragged", "awq-repacked", "gptq4", "gptq4-act-order", "gptq8-act-order",
                                  "gptq8-one-group"])
def test_the_dense_weight_is_the_dequantized_weight_bit_for_bit(dtype: torch.dtype, case: str) -> None:
    """`packed_dequantize` writes (code - zero) * scale, computed in fp32 and rounded once to `dtype`, [K, N]: the
    test's own dequantization of its own packing, rounded the same way, bit for bit. "awq-repacked" is the layout the
    engine runs AWQ in: GPTQ's packing along the input features, groups in order, zero points stored as they are."""
    n, k = (72, 96) if case == "awq-ragged" else (136, 192)
    w = seeded_randn(n, k, dtype=torch.float32, seed=53, scale=0.1)
    zeros_minus_one = case.startswith("gptq")
    if case.startswith("awq"):
        bits, group = 4, 32
        g_idx = torch.arange(k) // group
        q, z, sc = qw.quantize(w, qw.Scheme("awq", 4, group), g_idx)
        if case == "awq-repacked":
            args = [qw.pack_gptq(q, 4, 0), qw.pack_gptq(z, 4, 1), sc, g_idx.int()]
        else:
            args = [qw.pack_awq(q), qw.pack_awq(z), sc, None]
        weight = qw.dequantize(q, z, sc, g_idx)
    else:
        bits, group = (8 if "8" in case else 4), (-1 if "one-group" in case else 64)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(54))
        packed, weight = qw.pack_linear(w, qw.Scheme("gptq", bits, group, desc_act="act-order" in case), perm)
        args = [packed[name] for name in ("qweight", "qzeros", "scales", "g_idx")]
    got = packed_dequantize(*(a.to(DEVICE) if a is not None else None for a in args), bits,
                            k if group == -1 else group, dtype, zeros_minus_one=zeros_minus_one)
    assert got.shape == (k, n) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.cpu(), weight.t().to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dense_weight_at_a_real_shape_is_the_dequantized_weight() -> None:
    """gate_up's shape of the llama3-8b layer, GPTQ int4 with act-order groups, bf16: bit for bit the test's own
    dequantization."""
    n, k, group = 2 * 14336, 4096, 128
    gen = torch.Generator().manual_seed(55)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.01).half()
    g_idx = torch.randperm(k, generator=gen).int() // group
    q = torch.stack([(qweight.long() >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(k, n)
    z = torch.stack([(qzeros.long() >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(k // group, n) + 1
    want = qw.dequantize(q, z, scales, g_idx).t().to(torch.bfloat16)
    got = packed_dequantize(qweight.cuda(), qzeros.cuda(), scales.cuda(), g_idx.cuda(), 4, group, torch.bfloat16,
                            zeros_minus_one=True)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 4), (torch.float16, 4), (torch.float16, 8),
                                        (torch.bfloat16, 8)], ids=["bf16-int4", "fp16-int4", "fp16-int8", "bf16-int8"])
@pytest.mark.parametrize("rows", [8, 16])
def test_gpu_grouped_codes_in_order_at_a_real_shape_match_the_exact_product(dtype: torch.dtype, bits: int,
                                                                             rows: int) -> None:
    """qkv's shape of the llama3-8b layer in groups of 128, 8 and 16 rows: the split kernel's codes as bit patterns
    (MAGIC: bf16 int4, fp16) or converted (bf16 int8) against the exact product."""
    from governor.kernels.packed_gemv import gptq_gemv_ref

    n, k, group, per = 6144, 4096, 128, 32 // bits
    gen = torch.Generator(device="cuda").manual_seed(63)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // per, n), dtype=torch.int32, device="cuda", generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // per), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(k // group, n, device="cuda", generator=gen) * 0.01).half()
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // group
    weight = gptq_gemv_ref(torch.eye(k, device="cuda"), qweight, qzeros, scales, g_idx, bits,
                           zeros_minus_one=False).t()  # exact, [N, K]
    x = seeded_randn(rows, k, dtype=dtype, seed=64).cuda()
    got = packed_gemm(x, qweight, qzeros, scales, bits, group, zeros_minus_one=False)
    assert_close(got, x.double() @ weight.double().t(), dtype)
