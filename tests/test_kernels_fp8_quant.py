"""Dynamic fp8 activation quantization (kernels/fp8_quant.py) and the W8A8 products of fp8 layers.

The kernel must give PyTorch's e4m3 conversion bit for bit (round to nearest, ties to even, subnormals, the sign of
zero), so the tests feed it every e4m3 value, every midpoint between two (the ties) and the float32 neighbours of
each midpoint, besides random rows over eleven decades; the oracle is `torch.Tensor.to(torch.float8_e4m3fn)`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import governor.engine.models.quantization as quantization
from governor.engine.models.model_config import WeightQuantization
from governor.engine.models.quantization import QuantizedLinear
from governor.kernels import fp8_gemm as fp8_gemm_module
from governor.kernels.elementwise import INTERPRET, add_rms_norm, silu_mul, silu_mul_ref, triton_usable
from governor.kernels.fp8_gemm import (
    fp8_block_gemm,
    fp8_block_gemm_ref,
    fp8_block_k_step,
    fp8_gemm_split_chunk,
    fp8_gemm_splits_k,
)
from governor.kernels.fp8_quant import (
    add_rms_norm_fp8,
    fp8_quantize,
    fp8_quantize_ref,
    fp8_round,
    fp8_round_ref,
    norm_rounding_supported,
)
from governor.kernels.launch_policy import LaunchPolicy
from tests.conftest import DEVICE, count_calls, needs_triton
from tests.test_kernels_paged_attention import LaunchSpy

FINITE = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 ... 448, every code


def hard_values() -> torch.Tensor:
    """One row: every e4m3 value, every midpoint of two neighbours, each midpoint's float32 neighbours, negated too;
    its largest magnitude is 448, so the scale is 1 and each value is rounded as it stands."""
    mids = (FINITE[:-1] + FINITE[1:]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    row = torch.cat([FINITE, mids, up[:-1], down])  # up[-1] would pass 448's midpoint with 480
    return torch.cat([row, -row]).view(1, -1)


def random_rows(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-8, 3, k)[torch.randperm(k, generator=gen)]
    x[0, :3] = 0.0
    x[-1, 1] = -0.0
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_triton
def test_the_kernel_rounds_every_value_and_tie_as_pytorch_does() -> None:
    x = hard_values().to(DEVICE)
    codes, scales = fp8_quantize(x, 0)
    assert scales.tolist() == [[1.0]]
    assert same_bits(codes, x.to(torch.float8_e4m3fn))  # ties to even, subnormals, signs
    assert torch.equal(fp8_round(x, 0), x.to(torch.float8_e4m3fn).float())


@needs_triton
@pytest.mark.parametrize(("rows", "k", "group"), [(5, 300, 0), (3, 300, 128), (4, 100, 48), (1, 4096, 0),
                                                  (7, 64, 16), (2, 2500, 0), (1, 20000, 0)])  # 20,000: two passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_scales_and_rounded_values_are_the_references_bit_for_bit(rows: int, k: int, group: int,
                                                                       dtype: torch.dtype) -> None:
    x = random_rows(rows, k, dtype, seed=rows * k + group).to(DEVICE)
    codes, scales = fp8_quantize(x, group)
    ref_codes, ref_scales = fp8_quantize_ref(x, group)
    assert same_bits(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert scales.shape == (rows, -(-k // (group or k)))
    rounded = fp8_round(x, group)
    assert rounded.dtype == dtype and torch.equal(rounded, fp8_round_ref(x, group))
    exact = fp8_round(x, group, torch.float32)
    assert exact.dtype == torch.float32 and torch.equal(exact, fp8_round_ref(x, group, torch.float32))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy, on inf / inf
def test_a_nan_or_an_infinity_makes_its_own_slice_nan_as_in_pytorch() -> None:
    x = random_rows(3, 64, torch.float32, seed=5).to(DEVICE)
    x[0, 7], x[1, 40] = float("nan"), float("inf")  # row 1's groups: features 32-63 hold the infinity
    for group in (0, 32):
        codes, scales = fp8_quantize(x, group)
        ref_codes, ref_scales = fp8_quantize_ref(x, group)
        assert same_bits(codes, ref_codes) and torch.equal(scales.isnan(), ref_scales.isnan())
        assert torch.equal(scales[~scales.isnan()], ref_scales[~ref_scales.isnan()])
        assert codes[2].float().isfinite().all()  # the clean row is untouched
    assert fp8_round(x, 0)[:2].isnan().all() and not fp8_round(x, 32)[1, :32].isnan().any()


@needs_triton
def test_an_all_zero_row_keeps_zero_codes_and_a_positive_scale() -> None:
    codes, scales = fp8_quantize(torch.zeros(2, 40, device=DEVICE), 0)
    assert not codes.float().any() and bool((scales > 0).all())


@needs_triton
def test_a_non_contiguous_input_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous rows"):
        fp8_quantize(torch.zeros(8, 4, device=DEVICE).t(), 0)


@needs_triton
@pytest.mark.parametrize(("rows", "n", "group"), [(3, 300, 0), (2, 256, 64), (4, 100, 128), (1, 96, 32), (2, 64, 16),
                                                  (2, 100, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_norm_writes_the_rounding_of_its_own_output_bit_for_bit(rows: int, n: int, group: int,
                                                                    dtype: torch.dtype, with_residual: bool) -> None:
    """`add_rms_norm_fp8` is `fp8_round` of what `add_rms_norm` writes, bit for bit, its sum too: per token, groups
    tiling the row, a row narrower than its one group (100 of 128), and rows padded past n (300, 100, 96)."""
    x = random_rows(rows, n, dtype, seed=n + group).to(DEVICE)
    residual = random_rows(rows, n, dtype, seed=n + group + 1).to(DEVICE) if with_residual else None
    weight = (torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5).to(dtype).to(DEVICE)
    got, got_sum = add_rms_norm_fp8(x, residual, weight, 1e-6, group)
    normed, want_sum = add_rms_norm(x, residual, weight, 1e-6)
    assert got.dtype == torch.float32 and torch.equal(got, fp8_round_ref(normed, group, torch.float32))
    assert torch.equal(got_sum, want_sum)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy, on inf / inf
def test_a_nan_in_the_normed_row_makes_its_own_group_nan() -> None:
    x = random_rows(2, 64, torch.float32, seed=9).to(DEVICE)
    weight = torch.ones(64, device=DEVICE)
    weight[40] = float("nan")  # features 32-63 of every row
    got, _ = add_rms_norm_fp8(x, None, weight, 1e-6, 32)
    assert got[:, 32:].isnan().all() and got[:, :32].isfinite().all()
    assert add_rms_norm_fp8(x, None, weight, 1e-6, 0)[0].isnan().all()


@needs_triton
def test_groups_the_norm_kernel_cannot_tile_are_refused() -> None:
    assert norm_rounding_supported(0, 100) and norm_rounding_supported(128, 100) and norm_rounding_supported(32, 100)
    assert not norm_rounding_supported(48, 64)
    with pytest.raises(ValueError, match="groups of 48 over rows of 64"):
        add_rms_norm_fp8(torch.zeros(1, 64, device=DEVICE), None, torch.ones(64, device=DEVICE), 1e-6, 48)


@needs_triton
@pytest.mark.parametrize(("rows", "k", "group"), [(3, 300, 0), (2, 256, 128), (1, 100, 48), (2, 2500, 0),
                                                  (1, 17000, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_its_rounding_in_one_kernel_are_the_two_kernels_bit_for_bit(rows: int, k: int, group: int,
                                                                                 dtype: torch.dtype) -> None:
    gate_up = random_rows(rows, 2 * k, dtype, seed=k + group).clamp(-60, 60).to(DEVICE)
    got = fp8_round(gate_up, group, torch.float32, silu_mul=True)
    assert got.shape == (rows, k) and torch.equal(got, fp8_round(silu_mul(gate_up), group, torch.float32))
    if DEVICE.type == "cpu":  # on a GPU the kernels' exp is Triton's, not PyTorch's: the two kernels are the oracle
        assert torch.equal(got, fp8_round_ref(silu_mul_ref(gate_up), group, torch.float32))
    with pytest.raises(ValueError, match="gate_up"):
        fp8_round(gate_up[:, 1:].contiguous(), group, silu_mul=True)


def online_fp8_layer(out_f: int, in_f: int, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    """A layer quantized at load (a scale per output feature, W8A8 per token) and its dense source weight."""
    dense = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) / in_f**0.5
    layer = QuantizedLinear(WeightQuantization("fp8", 8, -1, online=True, activation_group=0), in_f, (out_f,),
                            torch.device("cpu"))
    layer.load(0, "weight", dense, "test")
    assert layer.quantize_activations and not layer.missing()
    return layer, dense


def w8a8_product(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """This file's own W8A8 product in float64: each token's e4m3 codes times the weight's, both scaled."""
    scale_x = x.float().abs().amax(-1, keepdim=True) / 448  # the format's scale: float32
    codes_x = (x.float() / scale_x).to(torch.float8_e4m3fn).double()
    return (codes_x * scale_x.double()) @ (layer.weight.double() * layer.weight_scale_inv.double()).t()


@pytest.mark.parametrize("route", ["reference", "fused", "fused-beyond-the-split-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_rows_multiply_the_codes_and_one_row_the_rounded_values(monkeypatch, route: str,
                                                                         dtype: torch.dtype) -> None:
    """Several rows multiply the codes: on the fused path in `fp8_block_gemm`'s split launch up to the policy's
    `fp8_gemm_split_max_rows`, in torch._scaled_mm beyond them and on the reference path; one row takes the fp8 GEMV
    (fused path) or the reference matmul, on the values the codes stand for in float32. All give the float64 W8A8
    product up to float32 sums and one rounding to the model's dtype, so a token's result does not depend on its
    step's size: in bf16 one row and several differ by at most one bf16 step (the sums' order decides a rounding now
    and then)."""
    mm = count_calls(monkeypatch, torch, "_scaled_mm")
    gemm_calls = count_calls(monkeypatch, quantization, "fp8_block_gemm")
    layer, _ = online_fp8_layer(48, 96, seed=1)
    few_rows = dataclasses.replace(LaunchPolicy(), fp8_gemm_split_max_rows=4)
    kernels = {"reference": None, "fused": LaunchPolicy(), "fused-beyond-the-split-rows": few_rows}[route]
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(3)).to(dtype)
    many = layer(x, bias, kernels)
    gemm = int(route == "fused" and bool(triton_usable(x)))
    assert (gemm_calls["fp8_block_gemm"], mm["_scaled_mm"]) == (gemm, 1 - gemm) and many.dtype == dtype
    one = torch.cat([layer(x[i:i + 1], bias, kernels) for i in range(5)])
    assert (gemm_calls["fp8_block_gemm"], mm["_scaled_mm"]) == (gemm, 1 - gemm)  # one-row steps take neither
    assert one.dtype == dtype
    want = w8a8_product(x, layer) + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: one rounding of the output
    torch.testing.assert_close(many.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(one.double(), want, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        steps = (one.float() - many.float()).abs() / many.float().abs().clamp(min=1e-3)
        assert float(steps.max()) <= 2**-8 and float((one != many).float().mean()) < 0.1
    layer.quantize_activations = False  # weight-only: a measurably different product
    assert (layer(x, bias, kernels).double() - want).abs().max() > 1e-2


def test_block_scaled_layers_round_each_group_and_never_take_scaled_mm(monkeypatch) -> None:
    calls = count_calls(monkeypatch, torch, "_scaled_mm")
    rounds = count_calls(monkeypatch, quantization, "fp8_round_ref")
    quant = WeightQuantization("fp8", 8, -1, block_size=(16, 32), activation_group=32)
    layer = QuantizedLinear(quant, 64, (32,), torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    layer.load(0, "weight", torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn), "test")
    layer.load(0, "weight_scale_inv", torch.rand(2, 2, generator=gen) + 0.5, "test")
    x = torch.randn(3, 64, generator=gen)
    got = layer(x)
    assert calls["_scaled_mm"] == 0 and rounds["fp8_round_ref"] == 1
    groups = [fp8_round_ref(part.contiguous(), 0) for part in x.split(32, dim=1)]  # each group its own scale
    torch.testing.assert_close(got, torch.cat(groups, 1) @ layer.dequantize().t())


def block_product(x: torch.Tensor, group: int, codes: torch.Tensor, w_scales: torch.Tensor, block: tuple[int, int],
                  bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 over a block-scaled weight in float64: x rounded per token (`group` 0) or per `group` features (the
    reference rounding, checked above against PyTorch's, over each group's slice), times the codes each scaled by its
    block's scale (this file's own loop over blocks)."""
    xq = torch.cat([fp8_round_ref(part.contiguous(), 0) for part in x.split(group or x.shape[1], dim=1)], 1)
    bn, bk = block
    w = torch.zeros(codes.shape, dtype=torch.float64)
    for r in range(w_scales.shape[0]):
        for c in range(w_scales.shape[1]):
            w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk].double() \
                * float(w_scales[r, c])
    out = xq.double() @ w.t()
    return out if bias is None else out + bias.double()


@needs_triton
@pytest.mark.parametrize(("rows", "n", "k", "block", "group"), [(3, 64, 128, (32, 64), 64), (17, 48, 100, (16, 48), 48),
                                                             (5, 40, 64, (8, 32), 0)],
                         ids=["square-ish", "ragged-k-and-two-row-tiles", "per-token-x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_scaled_w8a8_gemm_is_the_product_of_both_sides_codes_and_scales(rows: int, n: int, k: int,
                                                                                  block: tuple[int, int], group: int,
                                                                                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # no NaN codes
    w_scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) / 100 + 1e-3
    x = random_rows(rows, k, torch.float32, seed=rows).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    if not fp8_block_k_step(block[1]):
        pytest.skip(f"blocks {block[1]} wide: no K step the GPU's e4m3 dot takes divides them")
    x_codes, x_scales = fp8_quantize(x.contiguous().to(DEVICE), group)
    got = fp8_block_gemm(x_codes, x_scales, group, codes.to(DEVICE), w_scales.to(DEVICE), block, bias.to(DEVICE),
                         dtype).cpu()
    want = block_product(x.float(), group, codes, w_scales, block, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    x_codes, x_scales = x_codes.cpu(), x_scales.cpu()
    ref = fp8_block_gemm_ref(x_codes, x_scales, group, codes, w_scales, block, bias, dtype)
    torch.testing.assert_close(ref.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@needs_triton
@pytest.mark.parametrize(("rows", "block", "group"), [(6, (32, 64), 64), (6, (1, 320), 0), (70, (32, 64), 64),
                                                     (70, (1, 320), 0)],
                         ids=["split-blocks", "split-per-feature", "tiled-blocks", "tiled-per-feature"])
def test_the_w8a8_gemm_splits_k_for_a_few_rows_and_tiles_the_rows_beyond(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                                         block: tuple[int, int], group: int) -> None:
    """Up to the policy's fp8_gemm_split_max_rows rows one program holds every row and K is split in chunks (their
    partial sums meet in the split epilogue); more rows are tiled, each program over all of K. Small tiles make
    several of each here (the policy's split rows are the default): K 320 in chunks of 128 (three splits, half the
    last one masked), 70 rows in tiles of 16."""
    spy = LaunchSpy(fp8_gemm_module._fp8_block_gemm_kernel)
    monkeypatch.setattr(fp8_gemm_module, "_fp8_block_gemm_kernel", spy)
    policy = dataclasses.replace(LaunchPolicy(), fp8_gemm_split_tile=(32, 128, 4, 1), fp8_gemm_tile=(16, 32, 4, 2))
    n, k = 80, 320
    gen = torch.Generator().manual_seed(rows + block[0])
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) / 100 + 1e-3
    x = random_rows(rows, k, torch.float32, seed=rows)
    bias = torch.randn(n, generator=gen)
    x_codes, x_scales = fp8_quantize(x.to(DEVICE), group)
    for _ in range(2):  # the split's counters are reset for the next launch
        got = fp8_block_gemm(x_codes, x_scales, group, codes.to(DEVICE), w_scales.to(DEVICE), block, bias.to(DEVICE),
                             torch.float32, policy=policy).cpu()
        want = block_product(x, group, codes, w_scales, block, bias)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    split = fp8_gemm_splits_k(rows, policy)
    # At most eight chunks: llama3-8b's down_proj (K 14,336) in seven of 2,048 rather than fourteen of 1,024.
    assert [fp8_gemm_split_chunk(k, 128, 1024) for k in (4096, 14336, 100000)] == [1024, 2048, 16384]
    assert [(launch["SPLITS"], launch["BLOCK_M"], launch["CHUNK"]) for launch in spy.launches] == \
        [(3, 16, 128) if split else (1, 16, 320)] * 2


@needs_triton
def test_the_block_gemm_takes_only_blocks_a_k_step_divides() -> None:
    # tl.dot takes e4m3 in K steps of 32 or more on a GPU; the interpreter's widened dot, 16.
    assert fp8_block_k_step(128) == 128 and fp8_block_k_step(24) == 0
    assert fp8_block_k_step(48) == (16 if INTERPRET else 0)
    codes = torch.zeros(2, 24, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="blocks whose width 24"):
        fp8_block_gemm(codes, torch.ones(2, 1, device=DEVICE), 0,
                       torch.zeros(8, 24, dtype=torch.float8_e4m3fn, device=DEVICE), torch.ones(1, 1, device=DEVICE),
                       (8, 24), None, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [0, 128])
def test_gpu_rounding_in_the_norm_and_silu_kernels_at_llama3_8b_widths(group: int) -> None:
    """On the GPU, at the llama3-8b shape's widths (4,096 hidden, 14,336 intermediate): the fused rounding gives
    exactly what the separate kernels give there."""
    x, residual = (random_rows(1, 4096, torch.bfloat16, seed=s).cuda() for s in (10, 11))
    weight = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    got, got_sum = add_rms_norm_fp8(x, residual, weight, 1e-5, group)
    normed, want_sum = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got, fp8_round(normed, group, torch.float32)) and torch.equal(got_sum, want_sum)
    gate_up = (torch.randn(1, 2 * 14336, device="cuda") * 3).bfloat16()
    assert torch.equal(fp8_round(gate_up, group, torch.float32, silu_mul=True),
                       fp8_round(silu_mul(gate_up), group, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_codes_and_the_scaled_mm_product() -> None:
    """On the GPU the kernel gives CUDA's own e4m3 conversion bit for bit, and a bf16 W8A8 layer of several rows
    (torch._scaled_mm's row-wise kernel) stays within bf16 rounding of the float64 product."""
    x = random_rows(64, 4096, torch.bfloat16, seed=5).cuda()
    codes, scales = fp8_quantize(x, 0)
    want_codes, want_scales = fp8_quantize_ref(x, 0)
    assert torch.equal(scales, want_scales), (scales - want_scales).abs().max()
    differ = (codes.view(torch.uint8) != want_codes.view(torch.uint8)).nonzero()[:5].tolist()
    assert same_bits(codes, want_codes), [(i, j, float(x[i, j] / scales[i, 0]), int(codes.view(torch.uint8)[i, j]),
                                           int(want_codes.view(torch.uint8)[i, j])) for i, j in differ]
    assert torch.equal(fp8_round(x, 128), fp8_round_ref(x, 128))
    layer, _ = online_fp8_layer(1024, 4096, seed=6)
    layer = layer.cuda()
    xs = torch.randn(32, 4096, device="cuda").bfloat16()
    got = layer(xs, None, LaunchPolicy())
    torch.testing.assert_close(got.double().cpu(), w8a8_product(xs.float().cpu(), layer.cpu()), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [8, 48, 512])
def test_gpu_block_gemm_at_a_real_shape_is_the_product_of_both_sides(rows: int) -> None:
    """The qkv shape of llama3-8b in 128 x 128 blocks (the tensor cores' e4m3 dot), against the float64 product."""
    n, k, block = 6144, 4096, (128, 128)
    gen = torch.Generator().manual_seed(53)
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # no NaN codes
    w_scales = torch.rand(n // 128, k // 128, generator=gen) / 100 + 1e-3
    x = random_rows(rows, k, torch.bfloat16, seed=54)
    x_codes, x_scales = fp8_quantize(x.cuda(), 128)
    got = fp8_block_gemm(x_codes, x_scales, 128, codes.cuda(), w_scales.cuda(), block, None, torch.bfloat16)
    want = block_product(x.float(), 128, codes, w_scales, block, None)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
