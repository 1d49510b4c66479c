"""The one-row products over AWQ's and GPTQ's packed integer weights (`governor.kernels.packed_gemv`) against the
exact product of the weight the packed tensors stand for, dequantized by the quantized-weights test's own code.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import governor.kernels.packed_gemv as packed_gemv_module
from governor.kernels.launch_policy import LaunchPolicy
from governor.kernels.packed_gemv import (
    awq_gemv,
    awq_gemv_ref,
    gptq_gemv,
    gptq_gemv_ref,
    packed_k_step,
    packed_split_shape,
)
from tests import test_quantized_weights as qw
from tests.conftest import DEVICE, needs_triton, seeded_randn
from tests.test_kernels_gemv import assert_sum_order_close

# --- AWQ int4 weights -----------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (72, 64, 64), (136, 192, 64), (32, 96, 24)],
                         ids=["two-k-steps", "ragged-columns", "ragged-columns-three-k-steps",
                              "groups-across-k-steps"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_awq_gemv_matches_the_exact_product_of_the_dequantized_weight(dtype: torch.dtype, n: int, k: int, group: int,
                                                                     with_bias: bool) -> None:
    """The packed tensors come from the quantized-weights test's own AWQ packing, and the weight they stand for from
    its own unpacking (independent of the kernel and of models/quantization.py). Groups of 24 share no power-of-two
    K step: that case takes each code's zero point and scale (the general path), the others a group's per step."""
    w = seeded_randn(n, k, dtype=torch.float32, seed=17, scale=0.1)
    scheme = qw.Scheme("awq", 4, group)
    g_idx = torch.arange(k) // group
    q, z, s = qw.quantize(w, scheme, g_idx)
    packed = {"qweight": qw.pack_awq(q), "qzeros": qw.pack_awq(z), "scales": s}
    weight = qw.dequantize(qw.unpack_awq(packed["qweight"]), qw.unpack_awq(packed["qzeros"]), s, g_idx)
    x = seeded_randn(1, k, dtype=dtype, seed=18)
    bias = seeded_randn(n, dtype=dtype, seed=19) if with_bias else None
    args = [packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales")]
    assert packed_k_step(k, group, True)[1] == (group != 24)
    got = awq_gemv(x, *args, group, bias)
    assert_sum_order_close(got, x, weight.to(DEVICE), bias, False)
    assert_sum_order_close(awq_gemv_ref(x, *args, group, bias), x, weight.to(DEVICE), bias, False)


@needs_triton
def test_awq_gemv_refuses_what_it_cannot_compute_with_a_clear_message() -> None:
    x = seeded_randn(1, 64, dtype=torch.float32, seed=20)
    qweight = torch.zeros(64, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="group_size 48 must divide"):
        awq_gemv(x, qweight, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
                 torch.ones(1, 16, dtype=torch.float16, device=DEVICE), 48)
    with pytest.raises(ValueError, match=r"qzeros must be \[2, 2\] and scales \[2, 16\]"):
        awq_gemv(x, qweight, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
                 torch.ones(1, 16, dtype=torch.float16, device=DEVICE), 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)], ids=["qkv", "down"])
def test_gpu_awq_gemv_at_real_shapes_is_within_one_bf16_step_of_the_exact_product(n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(21)
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda", generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.01).half()
    x = seeded_randn(1, k, dtype=torch.bfloat16, seed=22)
    weight = awq_gemv_ref(torch.eye(k, dtype=torch.float32, device="cuda"), qweight, qzeros, scales, 128)  # W.T
    assert_sum_order_close(awq_gemv(x, qweight, qzeros, scales, 128), x, weight.t(), None, False)


# --- GPTQ int4 / int8 weights ---------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,n,k,group,act_order", [(4, 64, 128, 32, False), (4, 72, 96, 32, True),
                                                      (8, 136, 192, 64, True), (8, 64, 64, -1, False)],
                         ids=["int4", "int4-act-order-ragged-columns", "int8-act-order-three-k-steps",
                              "int8-one-group"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gptq_gemv_matches_the_exact_product_of_the_dequantized_weight(dtype: torch.dtype, bits: int, n: int, k: int,
                                                                      group: int, act_order: bool,
                                                                      with_bias: bool) -> None:
    """Packed, and unpacked into the weight they stand for, by the quantized-weights test's own GPTQ code (independent
    of the kernel and of models/quantization.py); act order: a random permutation assigns the groups."""
    w = seeded_randn(n, k, dtype=torch.float32, seed=23, scale=0.1)
    scheme = qw.Scheme("gptq", bits, group, desc_act=act_order)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(24))
    packed, weight = qw.pack_linear(w, scheme, perm)
    x = seeded_randn(1, k, dtype=dtype, seed=25)
    bias = seeded_randn(n, dtype=dtype, seed=26) if with_bias else None
    args = [packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales", "g_idx")]
    assert_sum_order_close(gptq_gemv(x, *args, bits, bias), x, weight.to(DEVICE), bias, False)
    assert_sum_order_close(gptq_gemv_ref(x, *args, bits, bias), x, weight.to(DEVICE), bias, False)
    if not act_order:  # the caller knows the groups are in order: the grouped steps
        assert_sum_order_close(gptq_gemv(x, *args, bits, bias, group_size=k if group == -1 else group), x,
                                weight.to(DEVICE), bias, False)


@needs_triton
def test_gptq_gemv_refuses_what_it_cannot_compute_with_a_clear_message() -> None:
    x = seeded_randn(1, 64, dtype=torch.float32, seed=27)
    qweight = torch.zeros(8, 16, dtype=torch.int32, device=DEVICE)  # 64 input features of 4 bits, 16 outputs
    zeros, scales = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), torch.ones(2, 16, dtype=torch.float16,
                                                                                        device=DEVICE)
    g_idx = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        gptq_gemv(x, qweight, zeros, scales, g_idx, 3)
    with pytest.raises(ValueError, match=r"qzeros must be \[G, 2\], scales \[G, 16\] and g_idx \[64\]"):
        gptq_gemv(x, qweight, zeros, scales, g_idx[:32], 4)
    with pytest.raises(ValueError, match="x has 64 columns and qweight holds 32 input features"):
        gptq_gemv(x, qweight[:4], zeros, scales, g_idx, 4)


@needs_triton
@pytest.mark.parametrize("method,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
@pytest.mark.parametrize("k,chunk,splits", [(1024, 256, 4), (2048, 128, 16)],
                         ids=["four-splits-of-several-steps", "sixteen-splits"])
def test_grouped_products_split_along_k_add_every_split_in_one_order(method: str, bits: int, k: int, chunk: int,
                                                                     splits: int) -> None:
    """The split kernel over several K chunks and two column blocks (one ragged), with a bias: the product of the
    dequantized weight, bit for bit the same on a second call (the partials are added in one order, whichever split
    ends last), and every counter back at zero after each call. Four splits of two or more K steps each (the K loop
    inside a program), and sixteen (the last split adds the partials eight at a time, twice)."""
    n, group = 320, 128
    base = LaunchPolicy()
    policy = dataclasses.replace(base, packed_split_chunk=chunk,
                                 packed_split_awq_tile=(base.packed_split_awq_tile[0], chunk,
                                                        base.packed_split_awq_tile[2]))
    step, got_chunk = packed_split_shape(k, group, bits, method == "gptq", chunk, policy.packed_split_rows) or (0, 0)
    assert k // got_chunk == splits and (splits == 16 or step < got_chunk)
    w = seeded_randn(n, k, dtype=torch.float32, seed=30, scale=0.1)
    g_idx = torch.arange(k) // group
    if method == "awq":
        q, z, s = qw.quantize(w, qw.Scheme("awq", 4, group), g_idx)
        packed = {"qweight": qw.pack_awq(q), "qzeros": qw.pack_awq(z), "scales": s}
        weight = qw.dequantize(qw.unpack_awq(packed["qweight"]), qw.unpack_awq(packed["qzeros"]), s, g_idx)
    else:
        packed, weight = qw.pack_linear(w, qw.Scheme("gptq", bits, group), torch.arange(k))
    x = seeded_randn(1, k, dtype=torch.bfloat16, seed=31)
    bias = seeded_randn(n, dtype=torch.bfloat16, seed=32)
    args = [packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales")]

    def run() -> torch.Tensor:
        if method == "awq":
            return awq_gemv(x, *args, group, bias, policy=policy)
        return gptq_gemv(x, *args, packed["g_idx"].to(DEVICE), bits, bias, group_size=group, policy=policy)

    first = run()
    counters = packed_gemv_module._SPLIT_COUNTERS[first.device]
    assert not counters.any()
    assert_sum_order_close(first, x, weight.to(DEVICE), bias, False)
    assert torch.equal(run(), first) and not counters.any()


def split_gemv_over_a_band_of_x(bits: int, dtype: torch.dtype, exponent: int) -> None:
    """One split GEMV of a row x whose magnitudes all lie in [2^exponent, 1.99 * 2^exponent], codes and zero points
    at their extremes (0 and 2^bits - 1 in every group, beside random ones), against the product of the
    dequantized weight."""
    n, k, group = 256, 512, 128
    gen = torch.Generator().manual_seed(40 + exponent)
    w = seeded_randn(n, k, dtype=torch.float32, seed=41, scale=0.1).cpu()  # packed by the test's own code, on CPU
    w[:, ::group] = 0.25  # each group's largest value: its top code
    w[:, 1::group] = -0.25  # and its smallest: code 0
    packed, weight = qw.pack_linear(w, qw.Scheme("gptq", bits, group), torch.arange(k))
    q = qw.unpack_gptq(packed["qweight"], bits, 0)
    assert int(q.min()) == 0 and int(q.max()) == 2**bits - 1
    signs = torch.where(torch.rand(1, k, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (signs * (1 + 0.99 * torch.rand(1, k, generator=gen).double()) * 2.0**exponent).to(dtype)  # bf16 keeps < 2
    args = [packed[name].to(DEVICE) for name in ("qweight", "qzeros", "scales", "g_idx")]
    got = gptq_gemv(x.to(DEVICE), *args, bits, group_size=group)
    assert torch.isfinite(got).all()
    assert_sum_order_close(got, x.to(DEVICE), weight.to(DEVICE), None, False)


# Magnitudes of x: where products code * x reach the subnormals' edge (2^-62, up to codes of 2^bits - 1), ones, and
# just under 2^43, above which x * 2^85 would overflow (packed_gemv.py).
X_BANDS = [-62, 0, 42]


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exponent", X_BANDS)
def test_split_gemv_holds_over_the_range_of_x_its_subnormal_codes_allow(bits: int, dtype: torch.dtype,
                                                                         exponent: int) -> None:
    """The split kernel reads GPTQ's codes as subnormal floats and scales x by up to 2^85: each band of x, the
    smallest and the largest the kernel promises, gives the product of the dequantized weight."""
    split_gemv_over_a_band_of_x(bits, dtype, exponent)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("exponent", X_BANDS)
def test_gpu_split_gemv_reads_subnormal_codes_exactly(bits: int, exponent: int) -> None:
    """On the GPU (the interpreter's NumPy keeps subnormals whatever the compiler would do): a flush-to-zero
    anywhere on the path would read every code as zero."""
    split_gemv_over_a_band_of_x(bits, torch.bfloat16, exponent)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_gptq_gemv_at_a_real_shape_is_within_one_bf16_step_of_the_exact_product(bits: int) -> None:
    n, k, per = 6144, 4096, 32 // bits
    gen = torch.Generator(device="cuda").manual_seed(28)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // per, n), dtype=torch.int32, device="cuda", generator=gen)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // per), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.01).half()
    g_idx = torch.randperm(k, device="cuda", generator=gen).to(torch.int32) // 128  # act order
    x = seeded_randn(1, k, dtype=torch.bfloat16, seed=29)
    weight = gptq_gemv_ref(torch.eye(k, dtype=torch.float32, device="cuda"), qweight, qzeros, scales, g_idx, bits)
    assert_sum_order_close(gptq_gemv(x, qweight, qzeros, scales, g_idx, bits), x, weight.t(), None, False)
    in_order = torch.arange(k, device="cuda", dtype=torch.int32) // 128  # the grouped steps
    weight = gptq_gemv_ref(torch.eye(k, dtype=torch.float32, device="cuda"), qweight, qzeros, scales, in_order, bits)
    assert_sum_order_close(gptq_gemv(x, qweight, qzeros, scales, in_order, bits, group_size=128), x, weight.t(),
                            None, False)
