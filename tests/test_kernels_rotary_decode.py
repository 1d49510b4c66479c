"""Decode attention with the rotary and the K/V write folded in (`rotary_decode_attention`) against the two calls it
replaces (`rotary_write_kv`, then `paged_decode_attention`) and against the PyTorch references.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from governor.kernels import paged_attention as pa
from governor.kernels.paged_attention import decode as decode_module
from tests.conftest import DEVICE, needs_triton, rotary_setup, seeded_randn


class DecodeStep:
    """One decode step: B sequences of different context lengths over a paged cache already holding every earlier
    token, the step's qkv projection, its positions and slots. The last sequence is a padding row (length 0, slot -1,
    as CUDA-graph batches pad)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *,
                 lengths: tuple[int, ...] = (1, 7, 40, 130, 0), block_size: int = 8,
                 cache_dtype: torch.dtype | None = None, qk_norm: bool = False, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.dtype = num_heads, dtype
        self.cache_dtype = cache_dtype or dtype
        batch, max_len = len(lengths), max(160, max(lengths) + 1)
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = batch * blocks_per_seq + 3
        # Every sequence's blocks, scattered over the cache.
        self.block_tables = torch.randperm(num_blocks, generator=gen)[:batch * blocks_per_seq].view(
            batch, blocks_per_seq).to(torch.int32).to(DEVICE)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        newest = [max(n - 1, 0) for n in lengths]
        self.positions = torch.tensor(newest, device=DEVICE)
        self.slots = torch.tensor([int(self.block_tables[b, p // block_size]) * block_size + p % block_size
                                   if lengths[b] else -1 for b, p in enumerate(newest)], device=DEVICE)
        self.qkv = seeded_randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed + 1,
                                scale=2.0)
        self.cos_sin, self.norms, self.scales = rotary_setup(num_kv_heads, head_dim, max_len, dtype, qk_norm,
                                                             self.cache_dtype == pa.FP8_KV_DTYPE, seed + 2)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # The earlier tokens' keys and values (in an fp8 cache: codes of about the scales' range).
        self.k_cache = seeded_randn(*shape, dtype=torch.float32, seed=seed + 4).to(self.cache_dtype)
        self.v_cache = seeded_randn(*shape, dtype=torch.float32, seed=seed + 5).to(self.cache_dtype)
        self.scale = head_dim ** -0.5

    def fused(self, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, qkv after the call, k cache, v cache) of `rotary_decode_attention` on fresh copies."""
        qkv, k_cache, v_cache = self.qkv.clone(), self.k_cache.clone(), self.v_cache.clone()
        out = pa.rotary_decode_attention(qkv, self.positions, self.cos_sin, self.num_heads, k_cache, v_cache,
                                         self.slots, self.block_tables, self.seq_lens, self.scale, **self.norms,
                                         **self.scales, **kwargs)  # type: ignore[arg-type]
        return out, qkv, k_cache, v_cache

    def two_calls(self, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same of `rotary_write_kv` and then `paged_decode_attention`."""
        qkv, k_cache, v_cache = self.qkv.clone(), self.k_cache.clone(), self.v_cache.clone()
        q = pa.rotary_write_kv(qkv, self.positions, self.cos_sin, self.num_heads, k_cache, v_cache, self.slots,
                               **self.norms, **self.scales)  # type: ignore[arg-type]
        out = pa.paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.scale,
                                        **self.scales, **kwargs)  # type: ignore[arg-type]
        return out, qkv, k_cache, v_cache

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, k cache, v cache) of the PyTorch references."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        q = pa.rotary_write_kv_ref(self.qkv, self.positions, self.cos_sin, self.num_heads, k_cache, v_cache,
                                   self.slots, **self.norms, **self.scales)  # type: ignore[arg-type]
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
        out = pa.paged_attention_ref(q, k_cache, v_cache, self.block_tables, self.seq_lens, qsl, self.scale,
                                     **self.scales)
        return out, k_cache, v_cache


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == pa.FP8_KV_DTYPE else x


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 12], ids=["unsplit", "folded", "reduced"])
@pytest.mark.parametrize(("dtype", "cache"), [(torch.float32, "16-bit"), (torch.bfloat16, "16-bit"),
                                              (torch.bfloat16, "fp8")], ids=["fp32", "bf16", "bf16-fp8"])
def test_fused_decode_stores_and_attends_like_the_two_calls(num_splits: int, dtype: torch.dtype, cache: str) -> None:
    # Splits 3 and 12: the newest token is in one partition of each sequence (the 130-token one in the last of 3,
    # the 7-token one's partitions are a tile each), and 12 > decode_fold_max_splits takes the reduce kernel.
    step = DecodeStep(4, 2, 32, dtype, cache_dtype=pa.FP8_KV_DTYPE if cache == "fp8" else None)
    got, got_qkv, got_k, got_v = step.fused(num_splits=num_splits)
    want, _, want_k, want_v = step.two_calls(num_splits=num_splits)
    assert torch.equal(got_qkv, step.qkv)  # qkv is left as it is
    assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))
    assert torch.equal(got, want)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row
    ref, ref_k, ref_v = step.reference()
    assert torch.equal(_bits(got_k), _bits(ref_k)) and torch.equal(_bits(got_v), _bits(ref_v))
    tol = 1e-5 if dtype == torch.float32 and cache == "16-bit" else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2), (8, 1)], ids=["gqa", "mha", "mqa"])
def test_fused_decode_with_per_head_norms_matches_the_two_calls(num_heads: int, num_kv_heads: int) -> None:
    step = DecodeStep(num_heads, num_kv_heads, 32, torch.bfloat16, qk_norm=True)
    got, _, got_k, got_v = step.fused(num_splits=3)
    want, _, want_k, want_v = step.two_calls(num_splits=3)
    # The per-head norm's fp32 sum may run in another order (its q heads are normed as rows of a tile): one bf16
    # step at most in q and k.
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(got_v, want_v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_triton
def test_only_the_program_holding_the_newest_position_stores_it() -> None:
    # Four partitions a sequence, one writer: exactly the two newest slots change, each once (a store by another
    # partition would change another slot; a missing one, none).
    step = DecodeStep(4, 2, 32, torch.float32, lengths=(64, 64), block_size=16)
    before_k = step.k_cache.clone()
    _, _, got_k, _ = step.fused(num_splits=4)
    changed = (got_k != before_k).any(dim=(-1, -2)).nonzero().tolist()
    newest = [(int(step.slots[b]) // 16, int(step.slots[b]) % 16) for b in range(2)]
    assert sorted(map(tuple, changed)) == sorted(newest)


@needs_triton
def test_a_step_over_an_fp8_cache_where_the_gluon_kernel_runs_takes_the_two_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_rotary = decode_module.rotary_write_kv
    monkeypatch.setattr(decode_module, "_gluon_decode", lambda *args: True)
    monkeypatch.setattr(decode_module, "_launch_gluon_decode",
                        lambda policy, q, k_cache, v_cache, block_tables, seq_lens, out, *rest, **kw:
                        calls.append("gluon") or out.zero_())

    def rotary(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("rotary")
        return real_rotary(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_module, "rotary_write_kv", rotary)
    step = DecodeStep(4, 2, 32, torch.bfloat16, cache_dtype=pa.FP8_KV_DTYPE)
    _, _, got_k, _ = step.fused()
    assert calls == ["rotary", "gluon"]
    _, _, want_k, _ = step.two_calls()
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))


@needs_triton
def test_fused_decode_rejects_what_the_two_calls_reject() -> None:
    step = DecodeStep(4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="qkv must be"):
        pa.rotary_decode_attention(step.qkv[:, :-32], step.positions, step.cos_sin, 4, step.k_cache, step.v_cache,
                                   step.slots, step.block_tables, step.seq_lens, step.scale)
    with pytest.raises(ValueError, match="positions must be"):
        pa.rotary_decode_attention(step.qkv, step.positions[:-1], step.cos_sin, 4, step.k_cache, step.v_cache,
                                   step.slots, step.block_tables, step.seq_lens, step.scale)
    with pytest.raises(ValueError, match="seq_lens must be"):
        pa.rotary_decode_attention(step.qkv, step.positions, step.cos_sin, 4, step.k_cache, step.v_cache,
                                   step.slots, step.block_tables[:-1], step.seq_lens, step.scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "qk_norm"), [(32, 8, False), (16, 4, False), (16, 8, True)],
                         ids=["llama3-8b", "llama3-8b-tp2", "qwen3-0.6b"])
def test_gpu_fused_decode_real_shapes_in_a_cuda_graph(num_heads: int, num_kv_heads: int, qk_norm: bool) -> None:
    step = DecodeStep(num_heads, num_kv_heads, 128, torch.bfloat16, lengths=(1, 100, 512, 513, 0), block_size=16,
                      qk_norm=qk_norm)
    want, _, want_k, want_v = step.two_calls()
    qkv, k_cache, v_cache = step.qkv.clone(), step.k_cache.clone(), step.v_cache.clone()

    def run() -> torch.Tensor:
        return pa.rotary_decode_attention(qkv, step.positions, step.cos_sin, num_heads, k_cache, v_cache, step.slots,
                                          step.block_tables, step.seq_lens, step.scale, **step.norms)  # type: ignore

    run()  # compiles, and makes the fold counters outside the capture
    k_cache.copy_(step.k_cache)
    v_cache.copy_(step.v_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    graph.replay()
    torch.cuda.synchronize()
    if qk_norm:
        torch.testing.assert_close(k_cache.float(), want_k.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(k_cache, want_k)
        assert torch.equal(got, want)
    assert torch.equal(v_cache, want_v)
