"""Prefill attention: causal attention of varlen queries over the paged cache (chunked prefill over a cached
prefix, a whole prompt, or a single token), `paged_prefill_attention` and its Triton kernel.

A program packs a tile of query tokens times the GQA group into the rows of one `tiles._attend_range` loop, so each
K/V row is read once per group; keys before the tile's first query run unmasked, the rest under the causal mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import INTERPRET
from governor.kernels.launch_policy import LaunchPolicy, policy_for

from .checks import FP8_KV_DTYPE, _check_attention_args, _check_out, _needs_int64_offsets, _require_triton
from .tiles import _LOG2E, _MIN_DOT, _attend_range, _dot_precision


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    # Program (query tile, seq, kv head). Its BLOCK_M rows pack BLOCK_Q query tokens x GROUP heads
    # (row r = token r // GROUP, head r % GROUP), so K/V are read once per GQA group.
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    tile_begin = q_tile * BLOCK_Q
    # The grid is sized for the longest query run; shorter sequences have idle tiles.
    if tile_begin >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_begin = seq_len - q_len  # absolute position of this sequence's first query

    r = tl.arange(0, BLOCK_M)
    tok = tile_begin + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_begin + tok
    d = tl.arange(0, HEAD_DIM)
    q_row = (q_begin + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_valid[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys before the tile's first query are visible to every row: no causal mask there.
    full_end = (context_begin + tile_begin) // TILE_N * TILE_N
    kv_end = context_begin + tl.minimum(q_len, tile_begin + BLOCK_Q)
    if KV_FP8:
        # As in the decode kernel: K's scale folds into the scores, V's into the output.
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, 0, full_end, q_pos, kv_head, qk_scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        BLOCK_SIZE, TILE_N, HEAD_DIM, False, DOT_PRECISION, INTERPRET, OFFSETS_64,
    )  # fmt: skip
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, full_end, kv_end, q_pos, kv_head, qk_scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        BLOCK_SIZE, TILE_N, HEAD_DIM, True, DOT_PRECISION, INTERPRET, OFFSETS_64,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)

    # Every valid row sees key 0, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_row = (q_begin + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    policy: LaunchPolicy | None = None,
) -> torch.Tensor:
    """Causal attention of varlen queries over a paged KV cache: q [T, Hq, D] -> [T, Hq, D].

    The queries of sequence i are its last `q_len_i` context tokens (chunked prefill over a cached
    prefix, a whole prompt, or a single decode token). `max_query_len` must be >= every q_len_i
    (it sizes the grid; a host int so no sync). `k_scale`/`v_scale`: float32 [num_kv_heads],
    required with an fp8 cache (package docstring). `policy`: the launch settings (None: the device's).
    """
    num_kv_heads = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    _require_triton(q, "paged_prefill_attention")
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(
            f"paged_prefill_attention: query_start_loc must be int32 [num_seqs + 1] = [{num_seqs + 1}], "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    out = _check_out(out, q)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    if policy is None:
        policy = policy_for(q.device)
    group = num_q_heads // num_kv_heads
    # Pack enough query tokens to fill BLOCK_M rows; a group wider than BLOCK_M gets one token.
    block_q = max(1, policy.prefill_block_m // group)
    block_m = max(_MIN_DOT, triton.next_power_of_2(block_q * group))
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        k_scale if fp8 else out, v_scale if fp8 else out,  # never dereferenced unless KV_FP8
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=policy.tile_n,
        HEAD_DIM=head_dim,
        KV_FP8=fp8,
        DOT_PRECISION=_dot_precision(q.dtype),
        INTERPRET=INTERPRET,
        OFFSETS_64=_needs_int64_offsets(k_cache, v_cache),
    )  # fmt: skip
    return out
