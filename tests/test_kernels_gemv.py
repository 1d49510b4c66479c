"""The decode GEMV (`governor.kernels.gemv`) against F.linear, and the model's use of it.

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from governor.engine import LLM, SamplingParams
from governor.engine.models import llama
from governor.kernels import elementwise as ew
from governor.kernels.gemv import (
    FP8_SCALE_ON_X,
    FP8_SCALE_PER_ELEMENT,
    FP8_SCALE_PER_ROW,
    block_k_for,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_scale_mode,
    gemv,
    gemv_ref,
    gemv_usable,
)
from governor.kernels.launch_policy import GemvConfig, LaunchPolicy, policy_for
from tests.conftest import DEVICE, TINY, needs_triton, seeded_randn
from tests.test_engine_parity import hf_greedy, mixed_prompts

POLICY = policy_for(DEVICE)  # what gemv launches with when given no policy


def _tiles(block_n: int, block_k: int, num_warps: int) -> LaunchPolicy:
    """The device's policy with another one-row launch shape (16-bit and fp8)."""
    tile = GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)
    return dataclasses.replace(POLICY, gemv=tile, fp8_gemv=tile)


def assert_sum_order_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
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
    assert_sum_order_close(got, x, w, bias, silu_mul)
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
    assert_sum_order_close(gemv(x, w), x, w, None, False)


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
    assert_sum_order_close(gemv(x, w, policy=_tiles(4, 256, 4)), x, w, None, False)


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
    assert_sum_order_close(gemv(x, w, silu_mul=silu_mul), x, w, None, silu_mul)


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
    assert_sum_order_close(got, x, _dequantized(codes, scale, block, torch.float32), bias, False)
    ref = fp8_gemv_ref(x, codes, scale, block, bias)
    assert_sum_order_close(ref, x, _dequantized(codes, scale, block, torch.float32), bias, False)


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
    assert_sum_order_close(fp8_gemv(x, codes, scale, block), x, _dequantized(codes, scale, block, torch.float32),
                            None, False)
