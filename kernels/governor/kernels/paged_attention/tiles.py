"""The online-softmax inner loop the Triton attention kernels share, and the tile floor it needs.

`_attend_tile` attends one tile of keys, gathered through a block table, against a block of query rows and folds it
into the running (max, sum, accumulator); `_attend_range` steps it over a key range. The decode kernel (`decode`) and
the prefill kernel (`prefill`) are both built on them. `_fp16_range` moves bf16 q into fp16's range for fp16 products
over an fp8 cache (the Triton and the Gluon decode kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634  # softmax runs in the log2 domain: the kernels take scale * log2(e)

# tl.dot needs every dimension >= 16 on GPU (a hardware requirement, not a choice): the launchers pad query rows to it.
# The key tile is a launch setting (`LaunchPolicy.tile_n`), independent of block_size (tokens are gathered per key).
_MIN_DOT = 16


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 (10-bit mantissa) on GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    start,
    kv_end,
    q_pos,
    kv_head,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    # Keys start .. start + TILE_N - 1; each key finds its block through the block table, so a
    # tile may span several (non-contiguous) blocks and block_size need not match the tile.
    k_pos = start + tl.arange(0, TILE_N)
    k_valid = k_pos < kv_end
    block = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
    offset = k_pos % BLOCK_SIZE
    if OFFSETS_64:
        # Element offsets can pass 2^31 (a cache that large, or strides that wide): int64. int32 otherwise, which on
        # sm_90 saves the fp8 decode loop 7% of its instructions (docs/design/decode-attention-kernels.md).
        block = block.to(tl.int64)
        offset = offset.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        # One 64-bit pointer add per row instead of three: fewer loop instructions and 4-5% faster fp8 decode on
        # an H200. The 16-bit kernel keeps three: summed, its batch-256 decode lost 5-6% there (it then fit 5
        # programs per SM instead of 4; docs/design/decode-attention-kernels.md).
        k_ptrs = k_cache_ptr + (block[:, None] * stride_kb + (offset[:, None] * stride_kt + kv_head * stride_kh))
        v_ptrs = v_cache_ptr + (block[:, None] * stride_vb + (offset[:, None] * stride_vt + kv_head * stride_vh))
    else:
        k_ptrs = k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt + kv_head * stride_kh
        v_ptrs = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt + kv_head * stride_vh
    # An fp8 tile widens to q's dtype exactly (e4m3 fits bf16/fp16/fp32); a no-op otherwise. Its
    # per-head scales are applied by the caller, outside the loop.
    k = tl.load(k_ptrs + d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)
    v = tl.load(v_ptrs + d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)

    # Scores in the log2 domain (exp2 is the native instruction): s = q.k * scale * log2(e).
    if INTERPRET:
        # The interpreter's tl.dot misreads bfloat16 operands; fp32 products of bf16/fp16 values
        # are exact, as on tensor cores, so this is the same math.
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = s * qk_scale
    allowed = k_valid[None, :]
    if CAUSAL:
        allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
    s = tl.where(allowed, s, float("-inf"))

    # m_i starts finite (-1e30), so a row whose keys are all masked in this tile keeps alpha = 1
    # and p = 0 instead of producing NaN from (-inf) - (-inf).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # p is rounded to V's dtype for the tensor-core product, as in FlashAttention.
    p = p.to(v.dtype)
    if INTERPRET:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_begin,
    kv_end,
    q_pos,
    kv_head,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    # Keys kv_begin .. kv_end - 1, TILE_N at a time.
    if INTERPRET:
        # The interpreter cannot take a loaded scalar as a range() bound (its scalars are
        # 1-element arrays, which numpy 2 refuses to convert to int); a while condition accepts one.
        start = kv_begin
        while start < kv_end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row_ptr, start, kv_end, q_pos,
                kv_head, qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_SIZE, TILE_N, HEAD_DIM, CAUSAL, DOT_PRECISION, INTERPRET, OFFSETS_64,
            )  # fmt: skip
            start += TILE_N
    else:
        # A for loop lets the compiler software-pipeline the K/V loads.
        for start in range(kv_begin, kv_end, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row_ptr, start, kv_end, q_pos,
                kv_head, qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_SIZE, TILE_N, HEAD_DIM, CAUSAL, DOT_PRECISION, INTERPRET, OFFSETS_64,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _fp16_range(q):
    # (q * 2^k in fp16, 2^-k) with k chosen from q's largest |value| so that it lands in [128, 256):
    # bf16 values then fit fp16 exactly (8 significant bits of fp16's 11) unless 2^21 times smaller
    # than that largest value, where they no longer move a dot product. Powers of two are built from
    # exponent bits so both factors are exact; the caller folds 2^-k into the softmax scale.
    q32 = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q32), axis=1), axis=0)
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased: amax in [2^(e-127), 2^(e-126))
    exponent = tl.minimum(tl.maximum(exponent, 8), 254)  # keeps both factors normal; all-zero q: any k
    up = ((261 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(134 - e)
    down = ((exponent - 7) << 23).to(tl.float32, bitcast=True)  # 2^(e - 134)
    return (q32 * up).to(tl.float16), down
