"""Products of several rows over AWQ's and GPTQ's packed weights (`governor.kernels.packed_gemm`), and the model's
use of them. The packed tensors, and the weight they stand for, come from the quantized-weights test's own packing
and unpacking (independent of the kernel and of models/quantization.py). Without CUDA the kernel runs under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The model's use of the kernel is tested in
tests/test_quantized_weights.py.
"""

from __future__ import annotations

import pytest
import torch

from governor.kernels.packed_gemm import PACKED_GEMM_MAX_ROWS, packed_dequantize, packed_gemm, packed_gemm_usable
from tests import test_quantized_weights as qw
from tests.conftest import DEVICE, needs_triton, seeded_randn


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x times the exact weight rounded to x's dtype (what the reference path multiplies), summed in float64."""
    out = x.double() @ weight.to(x.dtype).double().t()
    return out if bias is None else out + bias.double()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the order of an fp32 sum, plus (bf16) one rounding of the output."""
    assert got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,group", [(2, 64, 128, 32), (5, 72, 64, 64), (17, 136, 192, 64), (3, 32, 96, 24)],
                         ids=["two-rows", "ragged-columns", "two-row-tiles", "groups-across-k-steps"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_awq_rows_match_the_product_of_the_dequantized_weight(dtype: torch.dtype, rows: int, n: int, k: int,
                                                              group: int, with_bias: bool) -> None:
    w = seeded_randn(n, k, dtype=torch.float32, seed=40, scale=0.1)
    g_idx = torch.arange(k) // group
    q, z, s = qw.quantize(w, qw.Scheme("awq", 4, group), g_idx)
    packed = {"qweight": qw.pack_awq(q), "qzeros": qw.pack_awq(z), "scales": s}
    weight = qw.dequantize(qw.unpack_awq(packed["qweight"]), qw.unpack_awq(packed["qzeros"]), s, g_idx).to(DEVICE)
    x = seeded_randn(rows, k, dtype=dtype, seed=41)
    bias = seeded_randn(n, dtype=dtype, seed=42) if with_bias else None
    got = packed_gemm(x, *(packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales")), None, 4, group, bias)
    assert_close(got, reference(x, weight, bias), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group,act_order", [(4, 64, 128, 32, False), (4, 72, 96, 32, True),
                                                      (8, 136, 192, 64, True), (8, 64, 64, -1, False)],
                         ids=["int4", "int4-act-order-ragged-columns", "int8-act-order", "int8-one-group"])
def test_gptq_rows_match_the_product_of_the_dequantized_weight(dtype: torch.dtype, bits: int, n: int, k: int,
                                                               group: int, act_order: bool) -> None:
    w = seeded_randn(n, k, dtype=torch.float32, seed=43, scale=0.1)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(44))
    packed, weight = qw.pack_linear(w, qw.Scheme("gptq", bits, group, desc_act=act_order), perm)
    x = seeded_randn(6, k, dtype=dtype, seed=45)
    bias = seeded_randn(n, dtype=dtype, seed=46)
    args = [packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales", "g_idx")]
    got = packed_gemm(x, *args, bits, k if group == -1 else group, bias)
    assert_close(got, reference(x, weight.to(DEVICE), bias), dtype)


@needs_triton
def test_what_the_kernel_does_not_take_is_refused_with_a_clear_message() -> None:
    qweight = torch.zeros(64, 2, dtype=torch.int32, device=DEVICE)
    zeros, scales = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), torch.ones(2, 16, device=DEVICE).half()
    one_row = seeded_randn(1, 64, dtype=torch.float32, seed=47)
    assert not packed_gemm_usable(one_row, qweight)  # one row: the GEMV's
    assert not packed_gemm_usable(seeded_randn(PACKED_GEMM_MAX_ROWS + 1, 64, dtype=torch.float32, seed=48), qweight)
    with pytest.raises(ValueError, match="needs 2 to 64 contiguous rows"):
        packed_gemm(one_row, qweight, zeros, scales, None, 4, 32)
    with pytest.raises(ValueError, match="x has 48 columns for a weight of 64 inputs and 16 outputs"):
        packed_gemm(seeded_randn(2, 48, dtype=torch.float32, seed=49), qweight, zeros, scales, None, 4, 32)


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
@pytest.mark.parametrize("rows", [8, 64])
def test_gpu_awq_rows_at_a_real_shape_match_the_product_of_the_dequantized_weight(rows: int) -> None:
    n, k = 6144, 4096
    gen = torch.Generator(device="cuda").manual_seed(51)
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda", generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.01).half()
    from governor.kernels.packed_gemv import awq_gemv_ref

    weight = awq_gemv_ref(torch.eye(k, device="cuda"), qweight, qzeros, scales, 128).t()  # exact, [N, K]
    x = seeded_randn(rows, k, dtype=torch.bfloat16, seed=52)
    assert_close(packed_gemm(x, qweight, qzeros, scales, None, 4, 128), reference(x, weight, None), torch.bfloat16)
