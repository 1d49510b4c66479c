"""The decode GEMV (`governor.kernels.gemv`) against F.linear, and the model's use of it.

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import governor.kernels.gemv as gemv_module
from governor.engine import LLM, SamplingParams
from governor.engine.models import llama
from governor.kernels import elementwise as ew
from governor.kernels.gemv import (
    FP8_SCALE_ON_X,
    FP8_SCALE_PER_ELEMENT,
    FP8_SCALE_PER_ROW,
    awq_gemv,
    awq_gemv_ref,
    block_k_for,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_scale_mode,
    gemv,
    gemv_ref,
    gemv_usable,
    gptq_gemv,
    gptq_gemv_ref,
    packed_k_step,
    packed_split_shape,
)
from governor.kernels.launch_policy import GemvConfig, LaunchPolicy, policy_for
from tests import test_quantized_weights as qw
from tests.conftest import DEVICE, TINY, needs_triton, seeded_randn
from tests.test_engine_parity import hf_greedy, mixed_prompts

POLICY = policy_for(DEVICE)  # what gemv launches with when given no policy


def _tiles(block_n: int, block_k: int, num_warps: int) -> LaunchPolicy:
    """The device's policy with another one-row launch shape (16-bit and fp8)."""
    tile = GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)
    return dataclasses.replace(POLICY, gemv=tile, fp8_gemv=tile)


def _assert_sum_order_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                            silu_mul: bool) -> None:
    """got equals the fp32 product of the same (rounded) inputs, up to fp32 sum order and one final rounding:
    within one output-dtype step of the exact value (2^-8 relative in bf16), plus a summation slack."""
    xs = ew.silu_mul_ref(x) if silu_mul else x
    exact = torch.nn.functional.linear(xs.double(), w.double(), None if bias is None else bias.double())
    step = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}[got.dtype]
    slack = 1e-5 * (xs.double().abs() @ w.double().abs().T)  # fp32 accumulation over k terms
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= step * exact.abs() + slack + 1e-30).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 128), (100, 200), (36, 64)], ids=["even", "ragged", "one-k-step"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu-mul"])
def test_gemv_matches_the_exact_product(dtype: torch.dtype, n: int, k: int, with_bias: bool, silu_mul: bool
                                        ) -> None:
    x = seeded_randn(1, 2 * k if silu_mul else k, dtype=dtype, seed=0, scale=2.0)
    w = seeded_randn(n, k, dtype=dtype, seed=1, scale=0.1)
    bias = seeded_randn(n, dtype=dtype, seed=2) if with_bias else None
    got = gemv(x, w, bias, silu_mul, policy=_tiles(block_n=16, block_k=64, num_warps=4))
    _assert_sum_order_close(got, x, w, bias, silu_mul)
    torch.testing.assert_close(got.float(), gemv_ref(x, w, bias, silu_mul).float(),
                               **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}))


@needs_triton
def test_silu_mul_prologue_rounds_where_the_silu_mul_kernel_rounds() -> None:
    """Through an identity weight the output is the prologue's value itself: bitwise the SiLU·mul kernel's
    (same formula and roundings), so folding it into the GEMV changes nothing the model computed before."""
    k = 96
    gate_up = seeded_randn(1, 2 * k, dtype=torch.bfloat16, seed=3, scale=4.0)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    got = gemv(gate_up, eye, silu_mul=True, policy=_tiles(block_n=8, block_k=32, num_warps=4))
    assert torch.equal(got, ew.silu_mul(gate_up))


@needs_triton
def test_gemv_default_config_takes_shapes_it_does_not_divide() -> None:
    """The default configuration over N = 70 (not a multiple of its N block) and K = 2,368 (more than one of
    its K steps, and not a multiple of one): masked on both sides, and a partial last K step."""
    default = POLICY.gemv
    assert 70 % default.block_n and default.block_k < 2368 < 2 * default.block_k
    x = seeded_randn(1, 2368, dtype=torch.bfloat16, seed=4)
    w = seeded_randn(70, 2368, dtype=torch.bfloat16, seed=5, scale=0.1)
    _assert_sum_order_close(gemv(x, w), x, w, None, False)


def test_a_launch_takes_the_largest_whole_k_step_up_to_the_policys() -> None:
    assert block_k_for(2048, 4096) == 2048 and block_k_for(2048, 14336) == 2048  # llama3-8b
    assert block_k_for(2048, 7168) == 1024 and block_k_for(2048, 3584) == 512  # its down_proj at TP 2 and 4
    assert block_k_for(2048, 3072) == 1024 and block_k_for(1024, 1024) == 1024
    assert block_k_for(2048, 2368) == 2048  # no power-of-two step from 128 up divides it: masked steps


@needs_triton
def test_gemv_halves_its_k_step_until_it_divides_k() -> None:
    """K = 384 under a 256-column policy: a 128-column step, three whole steps (the kernel's peeled first step and
    its loop), the same product."""
    x = seeded_randn(1, 384, dtype=torch.float32, seed=8)
    w = seeded_randn(12, 384, dtype=torch.float32, seed=9, scale=0.1)
    assert block_k_for(256, 384) == 128
    _assert_sum_order_close(gemv(x, w, policy=_tiles(4, 256, 4)), x, w, None, False)


@needs_triton
def test_gemv_refuses_what_it_cannot_compute_with_a_clear_message() -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x \[1, K\].*use F.linear for more rows"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"needs 32 \(gate and up side by side\)"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, silu_mul=True)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, bias=torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(1, 16, device=DEVICE, dtype=torch.bfloat16), w)
    assert not gemv_usable(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 8, device=DEVICE).T)  # a view


@needs_triton
def test_the_fused_model_runs_small_steps_through_gemv_and_keeps_transformers_tokens(
        hf_checkpoint, hf_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2 (qkv bias) on the Triton backend: one sequence decodes through gemv for qkv, o, gate_up, down
    (SiLU·mul folded) and the lm_head, and the greedy tokens stay those of transformers fp32."""
    calls: list[tuple[int, bool]] = []

    def spy(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, *,
            policy: LaunchPolicy | None = None) -> torch.Tensor:
        calls.append((x.shape[0], silu_mul))
        return gemv(x, w, bias, silu_mul, policy=policy)

    monkeypatch.setattr(llama, "gemv", spy)
    path = hf_checkpoint("qwen2")
    prompt = mixed_prompts(1, seed=5, lo=12, hi=12)[0]
    llm = LLM(str(path), dtype="float32", attention_backend="triton")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(path), prompt, 6)
    layers = TINY["num_hidden_layers"]
    # Six lm_head products (one a step; the prefill's logits are of its last token only) and five decode steps
    # (the first token comes from the 12-token prefill, which F.linear runs) of four products a layer, one of
    # them with the folded SiLU·mul.
    assert len(calls) == 6 + 5 * 4 * layers
    assert sum(silu for _, silu in calls) == 5 * layers
    assert {rows for rows, _ in calls} == {1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,silu_mul", [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False),
                                          (4096, 14336, True), (128256, 4096, False), (1024, 3072, True),
                                          (4096, 7168, True), (4096, 3584, True), (4096, 1024, False)],
                         ids=["qkv", "o", "gate_up", "down-silu", "lm_head", "qwen3-0.6b-down-silu", "down-silu-tp2",
                              "down-silu-tp4", "o-tp4"])
def test_gpu_gemv_at_real_shapes_is_within_one_bf16_step_of_the_exact_product(n: int, k: int, silu_mul: bool
                                                                             ) -> None:
    x = seeded_randn(1, 2 * k if silu_mul else k, dtype=torch.bfloat16, seed=6)
    w = seeded_randn(n, k, dtype=torch.bfloat16, seed=7, scale=0.02)
    _assert_sum_order_close(gemv(x, w, silu_mul=silu_mul), x, w, None, silu_mul)


# --- fp8 weights ---------------------------------------------------------------------------------------------------


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight with float32 scales per block, from the test's own per-block quantization."""
    w = seeded_randn(n, k, dtype=torch.float32, seed=seed, scale=0.1)
    bn, bk = block
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    codes = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]
            scale[r, c] = tile.abs().max() / 448.0
            codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = (tile / scale[r, c]).to(torch.float8_e4m3fn)
    return codes.to(DEVICE), scale.to(DEVICE)


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                 ) -> torch.Tensor:
    """W = codes * their block's scale, in fp32, rounded to `dtype` (the test's own loop over blocks)."""
    bn, bk = block
    w = torch.zeros(codes.shape, device=codes.device)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk].float() \
                * scale[r, c]
    return w.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,block,mode", [(64, 128, (1, 128), FP8_SCALE_PER_ROW),
                                            (48, 200, (16, 48), FP8_SCALE_ON_X),
                                            (36, 64, (36, 64), FP8_SCALE_PER_ROW),
                                            (40, 96, (10, 32), FP8_SCALE_PER_ELEMENT)],
                         ids=["per-row", "ragged-blocks", "one-block", "rows-across-blocks"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_gemv_matches_the_exact_product_of_the_dequantized_weight(dtype: torch.dtype, n: int, k: int,
                                                                     block: tuple[int, int], mode: int,
                                                                     with_bias: bool) -> None:
    """Every place the scales apply (per row, on x's side, per element, by the blocking and a tile of 4 rows) gives
    x times the exact dequantized weight (the codes times their scales in fp32, never rounded), in one rounding."""
    assert fp8_scale_mode(block, k, 4) == mode
    codes, scale = _fp8_weight(n, k, block, seed=10)
    x = seeded_randn(1, k, dtype=dtype, seed=11)
    bias = seeded_randn(n, dtype=dtype, seed=12) if with_bias else None
    got = fp8_gemv(x, codes, scale, block, bias, policy=_tiles(4, 64, 4))  # several K steps, a ragged last one
    _assert_sum_order_close(got, x, _dequantized(codes, scale, block, torch.float32), bias, False)
    ref = fp8_gemv_ref(x, codes, scale, block, bias)
    _assert_sum_order_close(ref, x, _dequantized(codes, scale, block, torch.float32), bias, False)


@needs_triton
def test_fp8_gemv_refuses_what_it_cannot_compute_with_a_clear_message() -> None:
    codes, scale = _fp8_weight(16, 32, (16, 16), seed=13)
    x = seeded_randn(1, 32, dtype=torch.float32, seed=14)
    with pytest.raises(ValueError, match=r"scale must be float32 \[1, 2\]"):
        fp8_gemv(x, codes, scale[:, :1].contiguous(), (16, 16))
    with pytest.raises(ValueError, match="contiguous float8_e4m3fn"):
        fp8_gemv(x, codes.float(), scale, (16, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,block", [(6144, 4096, (128, 128)), (4096, 14336, (1, 14336)), (1024, 3072, (128, 128))],
                         ids=["qkv-block", "down-per-row", "qwen3-0.6b-down-block"])
def test_gpu_fp8_gemv_at_real_shapes_is_within_one_bf16_step_of_the_exact_product(n: int, k: int,
                                                                                block: tuple[int, int]) -> None:
    codes, scale = _fp8_weight(n, k, block, seed=15)
    x = seeded_randn(1, k, dtype=torch.bfloat16, seed=16)
    _assert_sum_order_close(fp8_gemv(x, codes, scale, block), x, _dequantized(codes, scale, block, torch.float32),
                            None, False)


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
    _assert_sum_order_close(got, x, weight.to(DEVICE), bias, False)
    _assert_sum_order_close(awq_gemv_ref(x, *args, group, bias), x, weight.to(DEVICE), bias, False)


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
    _assert_sum_order_close(awq_gemv(x, qweight, qzeros, scales, 128), x, weight.t(), None, False)


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
    _assert_sum_order_close(gptq_gemv(x, *args, bits, bias), x, weight.to(DEVICE), bias, False)
    _assert_sum_order_close(gptq_gemv_ref(x, *args, bits, bias), x, weight.to(DEVICE), bias, False)
    if not act_order:  # the caller knows the groups are in order: the grouped steps
        _assert_sum_order_close(gptq_gemv(x, *args, bits, bias, group_size=k if group == -1 else group), x,
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
def test_grouped_products_split_along_k_add_every_split_in_one_order(method: str, bits: int) -> None:
    """The split kernel over several K chunks and two column blocks (one ragged), with a bias: the product of the
    dequantized weight, bit for bit the same on a second call (the partials are added in one order, whichever split
    ends last), and every counter back at zero after each call."""
    n, k, group = 320, 1024, 128
    step, chunk = packed_split_shape(k, group, bits, method == "gptq") or (0, 0)
    assert k // chunk == 4 and step < chunk  # four splits of two or more K steps each
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
            return awq_gemv(x, *args, group, bias)
        return gptq_gemv(x, *args, packed["g_idx"].to(DEVICE), bits, bias, group_size=group)

    first = run()
    counters = gemv_module._SPLIT_COUNTERS[first.device]
    assert not counters.any()
    _assert_sum_order_close(first, x, weight.to(DEVICE), bias, False)
    assert torch.equal(run(), first) and not counters.any()


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
    _assert_sum_order_close(gptq_gemv(x, qweight, qzeros, scales, g_idx, bits), x, weight.t(), None, False)
    in_order = torch.arange(k, device="cuda", dtype=torch.int32) // 128  # the grouped steps
    weight = gptq_gemv_ref(torch.eye(k, dtype=torch.float32, device="cuda"), qweight, qzeros, scales, in_order, bits)
    _assert_sum_order_close(gptq_gemv(x, qweight, qzeros, scales, in_order, bits, group_size=128), x, weight.t(),
                            None, False)
