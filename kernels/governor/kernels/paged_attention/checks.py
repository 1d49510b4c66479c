"""The KV cache's contract as every entry point checks it: the fp8 format's constants, argument validation, and
the offset width a cache needs.

The checks run on the host and never sync with the device. `_needs_int64_offsets` decides whether a kernel addresses
the caches with int32 (faster) or int64 element offsets; the engine sizes caches with INT32_OFFSET_ELEMENTS in mind.
"""

from __future__ import annotations

import torch

from governor.kernels.elementwise import triton_usable

from .tiles import _MIN_DOT

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# A contiguous cache of at most this many elements is addressed with int32 offsets (faster; larger ones: int64).
INT32_OFFSET_ELEMENTS = 2**31
_FP8_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q/out dtypes over an fp8 cache


def _check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate the caches and their scales (required iff fp8); return whether the cache is fp8."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] of one "
            f"dtype, got {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dimension")
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if k_cache.dtype.is_floating_point and k_cache.itemsize == 1 and not fp8:
        raise ValueError(f"the only fp8 KV cache dtype supported is {FP8_KV_DTYPE}, got {k_cache.dtype}")
    num_kv_heads = k_cache.shape[2]
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale apply only to an fp8 ({FP8_KV_DTYPE}) KV cache; this cache is "
                f"{k_cache.dtype}: pass None, or allocate the cache in {FP8_KV_DTYPE}"
            )
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(
                f"an fp8 ({FP8_KV_DTYPE}) KV cache needs k_scale and v_scale (float32 [num_kv_heads] = "
                f"[{num_kv_heads}], the layer's per-head dequantization scales); {name} is None"
            )
        if s.shape != (num_kv_heads,) or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(
                f"{name} must be float32 [num_kv_heads] = [{num_kv_heads}] on {k_cache.device}, "
                f"got {s.dtype} {tuple(s.shape)} on {s.device}"
            )
        if s.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous (the kernels index it by kv head)")
    return True


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> int:
    """Validate shapes and dtypes shared by all attention entry points; return num_kv_heads."""
    fp8 = _check_cache(k_cache, v_cache, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q must be [T, num_q_heads, {head_dim}] with num_q_heads a multiple of num_kv_heads "
            f"({num_kv_heads}), got {tuple(q.shape)}"
        )
    if fp8:
        if q.dtype not in _FP8_Q_DTYPES:
            raise ValueError(f"q over an fp8 KV cache must be one of {_FP8_Q_DTYPES}, got {q.dtype}")
    elif q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_cache.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks_per_seq], "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (block_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens must be int32 [num_seqs] = [{block_tables.shape[0]}], "
            f"got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    return num_kv_heads


def _needs_int64_offsets(*caches: torch.Tensor) -> bool:
    """Whether an element offset into one of the caches can reach 2^31 (the kernels then compute in int64)."""
    return any(sum(max(n - 1, 0) * s for n, s in zip(c.shape, c.stride(), strict=True)) >= INT32_OFFSET_ELEMENTS
               for c in caches)


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    _require_pow2_head_dim(q.shape[2], "paged attention")
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return out


def _require_pow2_head_dim(head_dim: int, what: str) -> None:
    # tl.arange needs a power of two and tl.dot needs >= 16.
    if head_dim < _MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(
            f"{what}: head_dim must be a power of two >= {_MIN_DOT} (e.g. 64, 128), got {head_dim}; "
            "use paged_attention_ref for other sizes"
        )


def _require_triton(t: torch.Tensor, what: str) -> None:
    if not triton_usable(t):
        raise RuntimeError(
            f"{what} runs Triton on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set before import); "
            f"got a {t.device} tensor. Use paged_attention_ref on CPU."
        )
