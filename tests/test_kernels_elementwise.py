"""Fused elementwise kernels (residual add + RMSNorm, SiLU·mul, rotary + KV write) against their references.

The references are the PyTorch code the model ran before the kernels existed, so "matches the reference"
means "the fused model computes what the unfused one did". Without CUDA the kernels run under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import pytest
import torch
import triton
import triton.language as tl

from governor.kernels import elementwise as ew
from governor.kernels import paged_attention as pa
from governor.kernels.elementwise import round_to
from tests.conftest import DEVICE, needs_triton, rotary_setup, seeded_randn

# fp32: the kernels' only difference is the order of a norm's fp32 sum. bf16: that can move a value across a
# rounding boundary, one bf16 step (2^-8 relative) at most.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("hidden", [64, 96], ids=["pow2", "not-pow2"])
def test_add_rms_norm_matches_the_reference(dtype: torch.dtype, with_residual: bool, hidden: int) -> None:
    x = seeded_randn(5, hidden, dtype=dtype, seed=0, scale=3.0)
    residual = seeded_randn(5, hidden, dtype=dtype, seed=1) if with_residual else None
    weight = seeded_randn(hidden, dtype=dtype, seed=2)
    want_out, want_h = ew.add_rms_norm_ref(x, residual, weight, 1e-6)
    got_out, got_h = ew.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_h, want_h)  # one rounded add, the same in both
    _close(got_out, want_out)


@needs_triton
def test_add_rms_norm_of_a_zero_row_is_zero_not_nan() -> None:
    out, _ = ew.add_rms_norm(torch.zeros(2, 32, device=DEVICE), None, torch.ones(32, device=DEVICE), 1e-6)
    assert torch.equal(out, torch.zeros_like(out))


@triton.jit
def _round_to_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, round_to(x, tl.bfloat16), mask=i < n)


@needs_triton
def test_round_to_bf16_rounds_to_nearest_even_and_keeps_nan_and_infinity() -> None:
    bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000,  # NaNs: the rounding carry must not eat them
            0x7F800000, 0xFF800000,  # +-inf
            0x3F808000, 0x3F818000,  # 1 + 2^-8 and 1 + 3 * 2^-8: ties, to even (down, then up)
            0x3F808001, 0xBF807FFF,  # just above and (negative) just below a tie
            0x7F7FFFFF, 0x00000001, 0x80000000]  # fp32 max (rounds to inf, as torch does), a subnormal, -0
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).to(DEVICE)
    out = torch.empty_like(x)
    _round_to_bf16_kernel[(1,)](x, out, x.numel(), BLOCK=16)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(out.isnan(), x.isnan())
    assert torch.equal(out[~x.isnan()].view(torch.int32), want[~x.isnan()].view(torch.int32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [48, 1100], ids=["one-block", "two-blocks"])
def test_silu_mul_matches_the_reference(dtype: torch.dtype, intermediate: int) -> None:
    gate_up = seeded_randn(3, 2 * intermediate, dtype=dtype, seed=3, scale=4.0)
    _close(ew.silu_mul(gate_up), ew.silu_mul_ref(gate_up))


@needs_triton
def test_fused_kernels_take_empty_batches() -> None:
    x = torch.zeros(0, 32, device=DEVICE)
    out, h = ew.add_rms_norm(x, x, torch.ones(32, device=DEVICE), 1e-6)
    assert out.shape == h.shape == (0, 32)
    assert ew.silu_mul(torch.zeros(0, 64, device=DEVICE)).shape == (0, 32)


@needs_triton
def test_fused_kernels_reject_rows_that_are_not_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous rows"):
        ew.silu_mul(torch.zeros(64, 3, device=DEVICE).t())


class RotaryCase:
    """A qkv projection of T tokens, a rotary table and an empty paged cache; some tokens are padding."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, qk_norm: bool = False, seed: int = 0) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim
        t, max_positions, num_blocks, block_size = 6, 40, 4, 4
        self.qkv = seeded_randn(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
        self.positions = torch.tensor([0, 3, 17, 39, 5, 8], device=DEVICE)
        self.slots = torch.tensor([3, 0, -1, 9, 12, -1], device=DEVICE)  # -1: padding, written nowhere
        self.cache_dtype = cache_dtype or dtype
        self.cos_sin, self.norms, self.scales = rotary_setup(num_kv_heads, head_dim, max_positions, dtype, qk_norm,
                                                             self.cache_dtype == pa.FP8_KV_DTYPE, seed)
        self.shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def run(self, fn: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, qkv after the call, k cache, v cache) of `fn` on fresh copies."""
        qkv = self.qkv.clone()
        k_cache = torch.full(self.shape, 7.0, device=DEVICE).to(self.cache_dtype)
        v_cache = torch.full(self.shape, 7.0, device=DEVICE).to(self.cache_dtype)
        q = fn(qkv, self.positions, self.cos_sin, self.num_heads, k_cache, v_cache,  # type: ignore[operator]
               self.slots, **self.norms, **self.scales)
        return q, qkv, k_cache, v_cache


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_rotary_write_kv_matches_the_reference(dtype: torch.dtype, qk_norm: bool, num_heads: int,
                                               num_kv_heads: int) -> None:
    case = RotaryCase(num_heads, num_kv_heads, 32, dtype, qk_norm=qk_norm)
    want_q, want_qkv, want_k, want_v = case.run(pa.rotary_write_kv_ref)
    got_q, got_qkv, got_k, got_v = case.run(pa.rotary_write_kv)
    _close(got_q, want_q)
    q_size = num_heads * 32
    assert got_q.data_ptr() == got_qkv.data_ptr()  # rotated in place: q is a view of qkv
    assert torch.equal(got_qkv[:, q_size:], want_qkv[:, q_size:])  # k and v in qkv untouched
    assert torch.equal(want_qkv, case.qkv)  # the reference leaves qkv alone
    if qk_norm:
        _close(got_k, want_k)  # the norm's fp32 sum runs in another order
    else:
        assert torch.equal(got_k, want_k)  # the same roundings, so the same bits (padding slots untouched)
    assert torch.equal(got_v, want_v)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_into_an_fp8_cache_stores_the_references_bytes(dtype: torch.dtype) -> None:
    case = RotaryCase(4, 2, 32, dtype, cache_dtype=pa.FP8_KV_DTYPE)
    _, _, want_k, want_v = case.run(pa.rotary_write_kv_ref)
    _, _, got_k, got_v = case.run(pa.rotary_write_kv)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@needs_triton
def test_rotary_at_position_zero_is_the_identity() -> None:
    # cos 1, sin 0: the rotation must not move q or k (a check of the table layout the kernel assumes).
    case = RotaryCase(2, 1, 16, torch.float32)
    case.cos_sin[0, 0], case.cos_sin[0, 1] = 1.0, 0.0
    q, _, k_cache, _ = case.run(pa.rotary_write_kv)
    assert torch.equal(q[0], case.qkv[0, :32].view(2, 16))
    assert torch.equal(k_cache.view(-1, 1, 16)[3, 0], case.qkv[0, 32:48])


def test_rotary_write_kv_rejects_a_qkv_of_the_wrong_width() -> None:
    case = RotaryCase(4, 2, 32, torch.float32)
    k_cache = torch.zeros(case.shape, device=DEVICE)
    with pytest.raises(ValueError, match="qkv must be"):
        pa.rotary_write_kv(case.qkv[:, :-32], case.positions, case.cos_sin, 4, k_cache, k_cache.clone(),
                           case.slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the small shapes above)")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "qk_norm", "hidden", "intermediate"),
                         [(32, 8, False, 4096, 14336), (16, 8, True, 1024, 3072)], ids=["llama3-8b", "qwen3-0.6b"])
def test_gpu_fused_kernels_real_shapes(num_heads: int, num_kv_heads: int, qk_norm: bool, hidden: int,
                                       intermediate: int) -> None:
    dtype = torch.bfloat16
    x, residual = seeded_randn(64, hidden, dtype=dtype, seed=0), seeded_randn(64, hidden, dtype=dtype, seed=1)
    weight = seeded_randn(hidden, dtype=dtype, seed=2)
    got_out, got_h = ew.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_h = ew.add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(got_h, want_h)
    _close(got_out, want_out)
    gate_up = seeded_randn(64, 2 * intermediate, dtype=dtype, seed=3, scale=3.0)
    _close(ew.silu_mul(gate_up), ew.silu_mul_ref(gate_up))
    case = RotaryCase(num_heads, num_kv_heads, 128, dtype, qk_norm=qk_norm)
    want_q, _, want_k, want_v = case.run(pa.rotary_write_kv_ref)
    got_q, _, got_k, got_v = case.run(pa.rotary_write_kv)
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(got_v, want_v)
