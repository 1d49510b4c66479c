"""Paged attention: KV-cache writes, decode and (chunked) prefill attention over a paged KV cache.

Each Triton kernel sits beside its plain-PyTorch reference (`write_kv_ref`, `paged_attention_ref`);
the references are the oracles in tests and the CPU production path for tiny models.

Layout (the engine relies on it):
- `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim]; the token at slot
  `s` lives at block `s // block_size`, offset `s % block_size`.
- `block_tables`: int32 [num_seqs, max_blocks_per_seq]; entry `j` of row `i` is the block holding
  tokens `j * block_size .. (j + 1) * block_size - 1` of sequence `i`. Entries past the sequence's
  last block are never read.
- `seq_lens`: int32 [num_seqs]; tokens of context in the cache, including this step's queries
  (whose K/V `write_kv` has already stored).
- `query_start_loc`: int32 [num_seqs + 1]; the queries of sequence `i` are
  `q[query_start_loc[i]:query_start_loc[i + 1]]` and are the last `q_len_i` tokens of its context:
  query `j` sits at absolute position `seq_lens[i] - q_len_i + j` and attends causally to keys
  `0 ..` that position. Precondition (not checked on device, it would sync): `q_len_i <= seq_lens[i]`.
- GQA/MQA: query head `h` reads kv head `h // (num_q_heads // num_kv_heads)`.

A sequence with `seq_lens[i] == 0` (a padding row of a CUDA-graph batch) gets an all-zero output.

fp8 KV cache (`k_cache`/`v_cache` of dtype `torch.float8_e4m3fn`, q and out stay bf16/fp16/fp32):
- Every entry point then takes `k_scale`, `v_scale`: float32 [num_kv_heads], the layer's static
  per-head scales (positive; not checked on device, it would sync). Heads differ in range by orders
  of magnitude, so each gets its own; static, so CUDA graphs need no per-step update and cached
  prefix blocks stay valid forever. Non-fp8 caches take no scales (passing them is an error, so a
  misconfigured layer fails loudly instead of silently ignoring them).
- Stored value = e4m3(clamp(x / scale[head], -448, 448)), rounded to nearest even; read value =
  float(stored) * scale[head]. Saturating keeps an outlier from becoming NaN (e4m3fn has no inf).
- The kernels never materialize dequantized K/V: e4m3 values are exact in bf16/fp16/fp32, so a tile
  is converted to q's dtype losslessly, `k_scale[head]` folds into the softmax scale and
  `v_scale[head]` multiplies the accumulated output once per program.
- Decode with bf16 q multiplies in fp16 instead (q moved into fp16's range by an exact power of two,
  `_fp16_range`): e4m3 -> fp16 is one conversion per two values, e4m3 -> bf16 three per two, and
  on an H100 those conversions, not HBM, bounded the bf16-q kernel (issue #9).
- On sm_90 with bf16/fp16 q, head_dim 64/128 and up to 16 query heads a kv head, fp8 decode runs
  `_gluon_decode_kernel` (Gluon: explicit layouts; see its section below) with the same contract, math
  and partials; elsewhere, and under the interpreter, `_decode_kernel`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import INTERPRET, rms_norm_ref, rms_rstd, rms_scale, rotate, rotate_ref, triton_usable

_LOG2E = 1.4426950408889634

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# A contiguous cache of at most this many elements is addressed with int32 offsets (faster; larger ones: int64).
INT32_OFFSET_ELEMENTS = 2**31
_FP8_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q/out dtypes over an fp8 cache

# Tile sizes. tl.dot needs every dimension >= 16 on GPU, hence the floors below.
_TILE_N = 64  # keys per inner-loop step, independent of block_size (tokens are gathered per key)
# Narrow decode launches over an fp8 cache (4 warps: split launches, and unsplit ones that are not wide, see below): a
# tile of half the bytes, so it takes twice the keys a step (a multiple of _TILE_N; a tile may run past a _TILE_N-
# aligned partition's end: masked). On an H100 (docs/benchmarks.md, issue 9), against 64 keys: batch 256 at 1K context
# 66% -> 79% of HBM copy bandwidth, batch 32 at 4K 63% -> 72%, at 32K 89% either way; 4 warps (Triton's default) beat
# 8 on every fp8 shape measured.
_DECODE_TILE_N_FP8 = 128
# Registers per thread of a narrow decode program over an fp8 cache (Triton's `maxnreg`; None: the compiler's choice).
# It compiles to 168 registers for sm_90, 3 programs of 4 warps per SM; capped at 128, 4 per SM (when unsplit launches
# ran 4 warps too, 5% faster there at batch 256 on an H200). Split launches take the cap since their split count fills
# one wave of 4 programs per SM (`_choose_num_splits`): batch 32 at 4K 98.8 -> 95.6 us, at 32K 638 -> 630, batch 16
# at 8K 108 -> 96, batch 8 at 4K 41.5 -> 35.8. Alone, the cap was 13% faster where the split count stayed (batch 8 at
# 4K, 1 at 32K) and 4-10% slower where the old count took 1.45 waves; fewer splits without the cap were 9-19% slower
# (docs/benchmarks.md, issue 9, seventh pass). The 16-bit program (96 registers split, 108 unsplit) has no cap: 96 on
# the int64 kernel of the time spilled and lost 20-25%.
_DECODE_MAXNREG_FP8: int | None = 128
# Pipeline stages of the fp8 decode launches (Triton's `num_stages`, default 3): 2 (one K/V tile in flight while one
# is computed) was 1-2% faster at every fp8 shape measured on an H200 (batch 32 at 4K 96 -> 94.6 us, at 32K 635 ->
# 628, batch 256 at 612 113.7 -> 111.6, at 1,024 171.6 -> 168.7), 1 stage 5-8% slower. 16-bit launches keep the
# default: 2 stages there were 5-8% slower at batch 256 (docs/benchmarks.md, issue 9, seventh pass).
_DECODE_NUM_STAGES_FP8 = 2
_DECODE_NUM_WARPS_FP8 = 4  # warps per decode program
# Wide fp8 launches -- unsplit, with programs that fill their waves of _DECODE_WIDE_PROGRAMS_PER_SM_FP8 per SM to at
# least _DECODE_WIDE_MIN_WAVE_FILL (`_wide_decode`) -- run 1 warp over 64-key tiles with the compiler's register
# count (181 for sm_90; capped at 168 it spills, 32% slower). A warp owns the whole tile: no cross-warp max/sum or P
# exchange through shared memory (2,056 loop instructions per 64 keys against 1,201 per 128 for 4 warps, 8.0 against
# 6.8 bytes per instruction), but a program holds one warp, and waves of them are long. H200 (docs/benchmarks.md,
# issue 9, eighth pass), 1 warp against the 4-warp program, equal contexts, (seq, kv head) programs: 2,048 (batch 256
# x 8 at 612 / 1,024 tokens) 110.4 / 164.2 us against 112.3 / 170.1, 1,024 (batch 128 at 1,024) 88.0 against 91.4 --
# faster; 1,280 and 1,536 (batch 160, 192 at 612) 17% slower, 384 and 512 (batch 48, 64 at 4K) 58-86% slower.
# Offline throughput (256 x 100 -> 1,024, fp8 KV) 54.9K -> 57.2-57.9K tok/s in one process. The measured times fit
# about 8 of these programs running per SM (batch 128's 1,024 in one wave, batch 160's 1,280 in two; the compiler's
# resources would allow 10), so that is the wave; the fill rule takes the 1,024 and 2,048 cases (97%) and leaves the
# others (36-73%). Split launches keep the 4-warp settings (1-warp split launches were 6-26% slower at batch 32, 4K).
_DECODE_WIDE_NUM_WARPS_FP8 = 1
_DECODE_WIDE_TILE_N_FP8 = 64
_DECODE_WIDE_MAXNREG_FP8: int | None = None
_DECODE_WIDE_PROGRAMS_PER_SM_FP8 = 8
_DECODE_WIDE_MIN_WAVE_FILL = 0.9
_DECODE_NUM_WARPS_16 = 4
# Warps of a rotary_write_kv program (one per token and head). With per-head RMSNorms (Qwen3) and at most
# _ROTARY_ONE_WARP_MAX_TOKENS tokens, one: the norm's sum over head_dim then stays in one warp (no shared-memory round
# trip). H200, qwen3-0.6b shape, in a CUDA graph: 256 tokens 6.57 -> 4.93 us a call with an fp8 cache, 6.52 -> 5.06
# with bf16, 1 and 32 tokens equal or faster. Larger calls (prefill chunks) were not measured and keep 4, as do calls
# without norms (llama3-8b shape: 1 warp 1-3% slower; docs/benchmarks.md, issue 9, seventh pass).
_ROTARY_NUM_WARPS = 4
_ROTARY_QK_NORM_NUM_WARPS = 1
_ROTARY_ONE_WARP_MAX_TOKENS = 256
_PREFILL_BLOCK_M = 64  # (query token, group head) rows per prefill program
_MIN_DOT = 16

# Split-KV heuristic: split a decode batch whose (seq, kv head) programs fill too few SMs.
# Splits are chosen from the context bound so that a bound-long context gets partitions of >= 512 tokens
# (smaller ones cost more in the reduce than they gain); a shorter sequence's own partitions are smaller.
_SPLIT_MIN_PARTITION = 512
_SPLIT_MAX = 64
# Target programs per SM, over a 16-bit cache and over an fp8 one. For 16-bit, 3 instead of 4 splits batch 32 x 8
# kv heads two ways (512 programs, one wave of 4 per SM) instead of three (768): on an H200, 78% -> 90% of the copy
# bandwidth at 4K, 89% -> 104% at 32K, batch 16 at 8K 69% -> 90%. For fp8, 4 is the occupancy of the capped program
# (`_DECODE_MAXNREG_FP8`), and the split count rounds down so the programs fit one wave of it (batch 32 x 8 kv
# heads: 2 splits, 512 programs on 528 slots; rounding up gave 3, 1.45 waves).
_PROGRAMS_PER_SM = 3
_PROGRAMS_PER_SM_FP8 = 4
# How split launches merge their partials. Up to _DECODE_FOLD_MAX_SPLITS splits the decode kernel does it: each
# program stores its partial, counts in on a per-(seq, kv head) counter (`_fold_counters`) and the last one merges and
# resets the counter -- no second kernel. More splits run the reduce kernel, launched with programmatic dependent launch
# where the GPU has it (`_DECODE_REDUCE_PDL`, sm_90+): the decode programs signal once their partials are stored, the
# reduce's programs start early and wait in `gdc_wait` for the decode kernel's memory. H200, bf16 q, µs a call against
# the reduce kernel launched plainly: batch 32 at 4K (2 splits) fp8 95.2 -> 92.7 folded, 93.8 under PDL, bf16 142.3 ->
# 138.9 / 140.3; batch 16 at 8K (4) and 8 at 4K (7-8) also faster folded; batch 1 at 32K (47-64 splits, one program
# merging them all) 36.3 -> 46.4 folded, 34.7 under PDL (fp8). Measured at 2, 4, 7, 8, 47 and 64 splits only
# (docs/benchmarks.md, issue 9, ninth pass).
_DECODE_FOLD_MAX_SPLITS = 8
_DECODE_REDUCE_PDL = True
# The Gluon decode kernel (`_gluon_decode_kernel`) for fp8 caches on sm_90: keys a step per (one-warp) program, depth
# of its cp.async ring, register cap. A program's ring holds 2 x STAGES x TILE_N x head_dim bytes: 48 KiB at 64 keys
# (4 programs per SM), 12 KiB at 16. Launches whose programs fit one wave of 4 per SM (every split launch: their
# counts are chosen so, _PROGRAMS_PER_SM_FP8) take 64 keys, larger ones 16. H200, bf16 q, 32:8 or 16:8 heads, us a
# call in one process (docs/benchmarks.md, issue 9, tenth pass, calls 3 and 4), the landed choice against the other
# tiles: batch 32 at 4K (2 splits, 512 programs) 83.3 against 86.9 at 32 keys (call 4) and 99.7 at 16 (call 3), at 32K
# 510 against 558 / 685; batch 48 and 64 at 4K (384, 512 programs) 127.2 / 144.0 against 142.6 / 152.1 at 32 keys;
# batch 128 at 1,024 and 160, 192, 256 at 612 (1,024-2,048 programs) 16 keys 79.2 / 67.6 / 75.9 / 98.2 against 79.9 /
# 86.0 / 95.2 / 103.1 at 32 and 94.5 / 90.9 / 94.7 / 121.8 at 64 (those two under a 168-register cap, at which the
# 64-key program spills). 3 stages: 2 were slower (call 3: batch 256 at 1,024 175.8 us against 160.2), 4 the same. No
# register cap: ptxas fits the 16-key program in 128 registers and spills 32-48 bytes; capped at 168 it takes 139
# without spilling and batch 128-192 ran 1-4% faster, but batch 256 at 612 / 1,024 115.1 / 179.6 us against 98.2 /
# 149.6 (the throughput workload's decode).
_GLUON_DECODE = True  # False: fp8 decode runs the Triton kernel everywhere (A/B settings)
_GLUON_DECODE_TILE_N_NARROW = 64
_GLUON_DECODE_TILE_N_WIDE = 16
_GLUON_DECODE_STAGES = 3
_GLUON_DECODE_MAXNREG_WIDE: int | None = None
_GLUON_HEAD_DIMS = (64, 128)  # the accumulator, 16 x head_dim fp32, lives in one warp's registers: 256 would spill


# ----------------------------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------------------------


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store `key`/`value` [T, num_kv_heads, head_dim] at `slot_mapping` [T] (int64) in place.

    Slots < 0 are padding and are skipped. Plain torch indexing; the boolean mask syncs with the
    host, so this is the CPU path (`write_kv` uses a kernel on GPU, safe in CUDA graphs).
    An fp8 cache needs `k_scale`/`v_scale` [num_kv_heads] and stores clamp(x / scale, ±448) (see
    the module docstring).
    """
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(key[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(value[keep], v_cache.dtype, v_scale)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """[T, num_kv_heads, head_dim] -> the cache's dtype; fp8 divides by the head's scale and saturates."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # One program per (token, kv head): one contiguous head_dim row each for K and V.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d)
    if FP8:
        k = _quantize_e4m3(k, tl.load(k_scale_ptr + head), INTERPRET)
        v = _quantize_e4m3(v, tl.load(v_scale_ptr + head), INTERPRET)
    kc = k_cache_ptr + slot * stride_kc_slot + head * stride_kc_h + d
    vc = v_cache_ptr + slot * stride_vc_slot + head * stride_vc_h + d
    tl.store(kc, k.to(kc.dtype.element_ty))
    tl.store(vc, v.to(vc.dtype.element_ty))


@triton.jit
def _quantize_e4m3(x, scale, INTERPRET: tl.constexpr):
    # Returns fp32 values the caller casts to e4m3 (round to nearest even on GPU).
    # div_rn is IEEE division, as torch's: the kernel stores the same bytes as write_kv_ref.
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if INTERPRET:
        # The interpreter's fp32 -> e4m3 cast rounds ties away from zero, drops the mantissa carry
        # (127.99 -> 64) and mangles subnormals, but converts representable values exactly; so
        # round to the e4m3 grid here. Grid spacing is 2^(exponent - 3), and 2^-9 below 2^-6
        # (subnormals). Adding 1.5 * 2^23 * spacing moves |y| into a binade whose fp32 spacing is
        # exactly `spacing`, so fp32's own round-to-nearest-even does the rounding.
        bits = y.to(tl.int32, bitcast=True)
        exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
        spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        magic = spacing * 12582912.0
        r = (tl.abs(y) + magic) - magic
        # Sign from the sign bit, and by a product: the interpreter's negation turns 0.0 into +0.0,
        # while torch stores a negative value that rounds to zero as -0.0.
        y = tl.where(bits < 0, -1.0, 1.0) * r
    return y


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store `key`/`value` [T, num_kv_heads, head_dim] at `slot_mapping` [T] (int64) in place.

    Slots < 0 are padding and are skipped. On CUDA (or under TRITON_INTERPRET=1) a Triton kernel
    does it without a host sync, so it can be captured in a CUDA graph; otherwise `write_kv_ref`.
    An fp8 cache needs `k_scale`/`v_scale` [num_kv_heads]; the bytes stored equal `write_kv_ref`'s.
    """
    if not triton_usable(key):
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    fp8 = _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _require_pow2_head_dim(head_dim, "write_kv")
    # Flattened slot view: stride over (block, offset) pairs is the offset stride when blocks are dense.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_flat,
        v_flat,
        slot_mapping,
        k_scale if fp8 else k_flat,  # never dereferenced unless FP8
        v_scale if fp8 else v_flat,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        HEAD_DIM=head_dim,
        FP8=fp8,
        INTERPRET=INTERPRET,
    )


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    stride_t,
    stride_cs,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (token, head) over the q heads then the kv heads: a q head is normed/rotated in place, a kv
    # head's rotated key and its value go to the cache. Heads sit side by side in a qkv row, so
    # `head * HEAD_DIM` addresses q head `head` and, past NUM_HEADS, key head `head - NUM_HEADS`.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_DIM)
    d_half = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2)[d] = x[(d + D/2) mod D]
    row = qkv_ptr + token * stride_t + head * HEAD_DIM
    x = tl.load(row + d).to(tl.float32)
    x_half = tl.load(row + d_half).to(tl.float32)
    if QK_NORM:
        w_ptr = tl.where(head < NUM_HEADS, q_norm_ptr, k_norm_ptr)
        # The norm is per element after one shared statistic: normalize x, and x_half with x's statistic.
        rstd = rms_rstd(x, HEAD_DIM, eps)
        x = rms_scale(x, rstd, tl.load(w_ptr + d).to(tl.float32), dtype)
        x_half = rms_scale(x_half, rstd, tl.load(w_ptr + d_half).to(tl.float32), dtype)
    cs = cos_sin_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cs
    y = rotate(x, x_half, tl.load(cs + d).to(tl.float32), tl.load(cs + HEAD_DIM + d).to(tl.float32), dtype)
    if head < NUM_HEADS:
        tl.store(row + d, y.to(dtype))
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            v = tl.load(qkv_ptr + token * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + d)
            if FP8:
                y = _quantize_e4m3(y, tl.load(k_scale_ptr + kv_head), INTERPRET)
                v = _quantize_e4m3(v, tl.load(v_scale_ptr + kv_head), INTERPRET)
            kc = k_cache_ptr + slot * stride_kc_slot + kv_head * stride_kc_h + d
            vc = v_cache_ptr + slot * stride_vc_slot + kv_head * stride_vc_h + d
            tl.store(kc, y.to(kc.dtype.element_ty))
            tl.store(vc, v.to(vc.dtype.element_ty))


def _qkv_views(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D]: views of a qkv projection row [q | k | v]."""
    t, num_kv_heads, head_dim = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * kv_size or qkv.stride(-1) != 1:
        raise ValueError(f"rotary_write_kv: qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[T, {q_size + 2 * kv_size}] with contiguous rows, got {tuple(qkv.shape)}")
    return (qkv[:, :q_size].view(t, num_heads, head_dim), qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads,
            head_dim), qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))


def rotary_write_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of a qkv projection [T, (Hq + 2 Hkv) D] by their tokens' rotary rows
    `cos_sin[positions]` (`cos_sin` [max_positions, 2, D]: cos, and sin with its first half negated), after
    the per-head RMSNorms `q_norm`/`k_norm` [D] when given (Qwen3); store the rotated k and v at
    `slot_mapping` like `write_kv_ref`. Returns the rotated q [T, Hq, D] (a new tensor; qkv is unchanged)."""
    q, k, v = _qkv_views(qkv, num_heads, k_cache)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    rows = cos_sin[positions].unsqueeze(2)
    q, k = rotate_ref(q, rows), rotate_ref(k, rows)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


def rotary_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rotary_write_kv_ref` in one kernel, without a host sync (CUDA-graph safe). The rotated q is written
    into qkv in place and returned as a view [T, Hq, D]; k in qkv is left unrotated. Same rounding as the
    reference (`elementwise` module docstring); the cache bytes equal `write_kv`'s for the same k and v."""
    if not triton_usable(qkv):
        q = _qkv_views(qkv, num_heads, k_cache)[0]
        return q.copy_(rotary_write_kv_ref(qkv, positions, cos_sin, num_heads, k_cache, v_cache, slot_mapping,
                                           q_norm=q_norm, k_norm=k_norm, eps=eps, k_scale=k_scale, v_scale=v_scale))
    q, k, v = _qkv_views(qkv, num_heads, k_cache)
    fp8 = _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    t, num_kv_heads, head_dim = k.shape
    _require_pow2_head_dim(head_dim, "rotary_write_kv")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_write_kv: pass both q_norm and k_norm, or neither")
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, head_dim) or not cos_sin.is_contiguous():
        raise ValueError(f"rotary_write_kv: cos_sin must be a contiguous [max_positions, 2, {head_dim}], "
                         f"got {tuple(cos_sin.shape)}")
    if positions.shape != (t,):
        raise ValueError(f"rotary_write_kv: positions must be [{t}], got {tuple(positions.shape)}")
    if t == 0:
        return q
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    _rotary_write_kv_kernel[(t, num_heads + num_kv_heads)](
        qkv, positions, cos_sin,
        q_norm if q_norm is not None else cos_sin, k_norm if k_norm is not None else cos_sin,  # unread w/o QK_NORM
        k_flat, v_flat, slot_mapping,
        k_scale if fp8 else k_flat, v_scale if fp8 else v_flat,  # never dereferenced unless FP8
        eps, qkv.stride(0), cos_sin.stride(0),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        QK_NORM=q_norm is not None,
        FP8=fp8,
        INTERPRET=INTERPRET,
        num_warps=_ROTARY_QK_NORM_NUM_WARPS if q_norm is not None and t <= _ROTARY_ONE_WARP_MAX_TOKENS
        else _ROTARY_NUM_WARPS,
    )  # fmt: skip
    return q


def _check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate write_kv's arguments; return whether the cache is fp8."""
    fp8 = _check_cache(k_cache, v_cache, k_scale, v_scale)
    expected = (key.shape[0], k_cache.shape[2], k_cache.shape[3])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[T, num_kv_heads, head_dim] = {expected} to match the cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"write_kv: slot_mapping must be int64 [{key.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv: key and value need a contiguous last (head_dim) dimension")
    return fp8


# ----------------------------------------------------------------------------------------------
# Reference attention
# ----------------------------------------------------------------------------------------------


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of varlen queries over a paged KV cache, in float32; the oracle.

    q: [T, num_q_heads, head_dim]; returns [T, num_q_heads, head_dim] in q.dtype. Loops over
    sequences (one host sync for the lengths) and is vectorized within each. An fp8 cache needs
    `k_scale`/`v_scale` [num_kv_heads]: K/V are dequantized to float32, then the same math.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{seq_lens.shape[0] + 1}], got {tuple(query_start_loc.shape)}"
        )
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_begin
        if q_len == 0 or seq_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {i}: {q_len} queries but only {seq_len} tokens of context")
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = _read_context(k_cache, blocks, seq_len, k_scale)
        v = _read_context(v_cache, blocks, seq_len, v_scale)
        # [q_len, Hq, D] -> [kv heads, group * q_len, D]: a group's heads share one K/V.
        qi = q[q_begin:q_end].float().reshape(q_len, num_kv_heads, group, head_dim)
        qi = qi.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        scores = torch.bmm(qi, k.transpose(1, 2)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).repeat(group)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        o = torch.bmm(scores.softmax(dim=-1), v)  # [kv heads, group * q_len, D]
        o = o.reshape(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_begin:q_end] = o.reshape(q_len, num_q_heads, head_dim).to(q.dtype)
    return out


def _read_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scale: torch.Tensor | None) -> torch.Tensor:
    """One sequence's first `seq_len` cached K or V as float32 [kv heads, seq_len, D], dequantized."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    x = cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    if scale is not None:
        x = x * scale[:, None]
    return x.transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# Shared inner step: one tile of keys against a block of query rows, online softmax
# ----------------------------------------------------------------------------------------------


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
        # sm_90 saves the fp8 decode loop 7% of its instructions (docs/benchmarks.md, issue 9, sixth pass).
        block = block.to(tl.int64)
        offset = offset.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        # One 64-bit pointer add per row instead of three: fewer loop instructions and 4-5% faster fp8 decode on
        # an H200. The 16-bit kernel keeps three: summed, its batch-256 decode lost 5-6% there (it then fit 5
        # programs per SM instead of 4; docs/benchmarks.md, issue 9, sixth pass).
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


# ----------------------------------------------------------------------------------------------
# Decode: one query per sequence
# ----------------------------------------------------------------------------------------------


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


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    counter_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    num_q_heads,
    num_splits,
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
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE_ALIGN: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP16_PRODUCTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    FOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (seq, kv head, partition): all GROUP query heads of the kv head at once, so each K/V
    # row is read once per group. Rows >= GROUP are padding (tl.dot needs >= 16 rows).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        # Partitions past seq_len run no tiles; the reduce ignores them (it recounts valid ones).
        partition_size = _partition_size(seq_len, num_splits, TILE_ALIGN)
        kv_begin = split * partition_size
        kv_end = tl.minimum(seq_len, kv_begin + partition_size)
    else:
        kv_begin = 0
        kv_end = seq_len

    g = tl.arange(0, GROUP_PAD)
    row_valid = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if KV_FP8:
        # Dequantization by linearity: q.(k8 * ks) = (q.k8) * ks, and P.(v8 * vs) = (P.v8) * vs.
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        if FP16_PRODUCTS:
            # bf16 q over fp8 K/V: tiles widen to fp16 (module docstring), so q goes there too.
            q, q_down = _fp16_range(q)
            qk_scale = qk_scale * q_down
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, kv_begin, kv_end, g, kv_head, qk_scale,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        BLOCK_SIZE, TILE_N, HEAD_DIM, False, DOT_PRECISION, INTERPRET, OFFSETS_64,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)

    if SPLIT:
        # Unnormalized partials; the reduce rescales them to a common max.
        row = (seq * num_q_heads + head).to(tl.int64) * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_m_ptr + row, m_i, mask=row_valid)
        tl.store(part_l_ptr + row, l_i, mask=row_valid)
        if PDL:
            gdc_launch_dependents()  # the reduce's programs may start (they wait for this kernel's memory)
        if FOLD:
            # Every program of the pair stores first (the barrier orders the warps' stores before the release).
            pair = seq * (num_q_heads // GROUP) + kv_head
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.store(counter_ptr + pair, 0)  # ready for the next call (and CUDA-graph replay)
                s = tl.arange(0, SPLITS_PAD)
                valid = s < tl.cdiv(seq_len, partition_size)
                rows = (seq * num_q_heads + head).to(tl.int64)[:, None] * num_splits + s[None, :]
                both = row_valid[:, None] & valid[None, :]
                m = tl.load(part_m_ptr + rows, mask=both, other=float("-inf"), cache_modifier=".cg")
                l_part = tl.load(part_l_ptr + rows, mask=both, other=0.0, cache_modifier=".cg")
                parts = tl.load(part_acc_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :], mask=both[:, :, None],
                                other=0.0, cache_modifier=".cg")
                out = _merge_partials(m, l_part, parts, both)
                o_ptrs = out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # l_i == 0 only for an empty sequence: its output is 0, not NaN.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (seq, q head): merge the valid partitions' (m, l, acc) into softmax-weighted output.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        gdc_wait()
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = tl.cdiv(seq_len, _partition_size(seq_len, num_splits, TILE_ALIGN))
    s = tl.arange(0, SPLITS_PAD)
    valid = (s < num_valid)[None, :]  # one row: _merge_partials takes [rows, splits]
    row = (seq * num_q_heads + head).to(tl.int64) * num_splits + s[None, :]
    m = tl.load(part_m_ptr + row, mask=valid, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row, mask=valid, other=0.0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + row[:, :, None] * HEAD_DIM + d[None, None, :], mask=valid[:, :, None], other=0.0)
    out = _merge_partials(m, l_part, acc, valid)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_partials(m, l_part, parts, valid):
    # Split-KV partials -> softmax-weighted outputs, per row: m, l_part, valid [rows, splits], parts [rows, splits,
    # head_dim] -> [rows, head_dim]. Every valid partition holds >= 1 key, so a row's max is finite whenever any is;
    # the floor keeps a row without one (an empty sequence) from computing (-inf) - (-inf): its output is 0.
    m_max = tl.maximum(tl.max(m, axis=1), -1.0e30)
    w = tl.where(valid, tl.exp2(m - m_max[:, None]), 0.0)
    total = tl.sum(w * l_part, axis=1)
    return tl.sum(w[:, :, None] * parts, axis=1) / tl.where(total > 0.0, total, 1.0)[:, None]


@triton.jit
def _partition_size(seq_len, num_splits, TILE_ALIGN: tl.constexpr):
    # A sequence's split-KV partition: its context over the splits, in whole tiles (at least one), so every
    # split of a short context under a CUDA graph (splits sized for max_model_len) still gets work. The
    # decode kernel and the reduce compute it alike.
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_ALIGN), 1) * TILE_ALIGN


def decode_num_splits(programs: int, context_bound: int, device: torch.device, num_splits: int | None = None,
                      fp8: bool = False) -> int:
    """The split-KV partitions the decode kernel runs for `programs` (sequence, KV head) pairs over contexts of
    at most `context_bound` tokens: `num_splits` (default: the automatic choice), less any split that would
    be empty for a `context_bound`-token sequence once partitions are whole _TILE_N tiles. Each sequence's
    partitions are sized from its own length (`_partition_size`), so a shorter one spreads over every split
    in smaller partitions. `fp8`: the cache is fp8 (its program has its own target per SM)."""
    if num_splits is None:
        num_splits = _choose_num_splits(programs, context_bound, device, fp8)
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    partition_size = _round_up(-(-context_bound // num_splits), _TILE_N)
    return -(-context_bound // partition_size)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence, q [B, num_q_heads, head_dim] -> [B, Hq, D].

    Each query sits at position `seq_lens[b] - 1` and attends to the whole context. One program
    per (sequence, kv head) serves the GQA group; for long contexts over few programs the context
    is also split into partitions (split-KV), merged by the last program of each (sequence, kv head) or,
    past _DECODE_FOLD_MAX_SPLITS partitions, by a small reduce kernel.

    `num_splits`: None picks automatically (from `max_seq_len` if given, else the block-table
    capacity, so no host sync and the choice is stable under CUDA graphs); 1 disables split-KV.
    `max_seq_len`: an upper bound on `seq_lens` known on the host, for the split count (instead of the
    block-table capacity).
    `k_scale`/`v_scale`: float32 [num_kv_heads], required with an fp8 cache (module docstring).
    """
    num_kv_heads = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    _require_triton(q, "paged_decode_attention")
    batch, num_q_heads, head_dim = q.shape
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"paged_decode_attention: q has {batch} sequences but block_tables has {block_tables.shape[0]}"
        )
    out = _check_out(out, q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    context_bound = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    context_bound = max(context_bound, 1)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    num_splits = decode_num_splits(batch * num_kv_heads, context_bound, q.device, num_splits, fp8)
    split = num_splits > 1
    wide = _wide_decode(fp8, split, batch * num_kv_heads, q.device)
    fold = split and num_splits <= _DECODE_FOLD_MAX_SPLITS
    pdl = split and not fold and _DECODE_REDUCE_PDL and _has_pdl(q.device)

    if split:
        rows = batch * num_q_heads * num_splits
        part_acc = torch.empty(rows, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(rows, dtype=torch.float32, device=q.device)
        part_l = torch.empty(rows, dtype=torch.float32, device=q.device)
    else:
        # Never dereferenced when SPLIT is off; the kernel still needs pointers.
        part_acc = part_m = part_l = out
    counters = _fold_counters(q.device, batch * num_kv_heads) if fold else seq_lens  # seq_lens: never used

    if _gluon_decode(q.device, q.dtype, k_cache.dtype, head_dim, group, _gluon_caches_aligned(k_cache, v_cache)):
        tile_n = _gluon_decode_tile(batch * num_kv_heads * num_splits, q.device)
        mma, a_op, b_op, k_load, v_load = _gluon_decode_layouts(tile_n, head_dim)
        _gluon_decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters, k_scale, v_scale,
            scale * _LOG2E, num_q_heads, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size, TILE_N=tile_n,
            HEAD_DIM=head_dim, STAGES=_GLUON_DECODE_STAGES, SPLIT=split, TILE_ALIGN=_TILE_N,
            Q_BF16=q.dtype == torch.bfloat16, OFFSETS_64=_needs_int64_offsets(k_cache, v_cache), FOLD=fold, PDL=pdl,
            MMA=mma, A=a_op, B=b_op, KL=k_load, VL=v_load, num_warps=1,
            **({"maxnreg": _GLUON_DECODE_MAXNREG_WIDE}
               if tile_n == _GLUON_DECODE_TILE_N_WIDE and _GLUON_DECODE_MAXNREG_WIDE else {}),
        )  # fmt: skip
    else:
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters,
            k_scale if fp8 else out, v_scale if fp8 else out,  # never dereferenced unless KV_FP8
            scale * _LOG2E, num_q_heads, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group,
            GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_SIZE=block_size,
            TILE_N=_decode_tile(fp8, wide),
            HEAD_DIM=head_dim,
            SPLIT=split,
            TILE_ALIGN=_TILE_N,
            KV_FP8=fp8,
            FP16_PRODUCTS=fp8 and q.dtype == torch.bfloat16,
            DOT_PRECISION=_dot_precision(q.dtype),
            INTERPRET=INTERPRET,
            OFFSETS_64=_needs_int64_offsets(k_cache, v_cache),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            FOLD=fold,
            PDL=pdl,
            **_decode_launch_options(fp8, wide),
        )  # fmt: skip
    if split and not fold:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_m, part_l, seq_lens, num_q_heads, num_splits,
            out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            TILE_ALIGN=_TILE_N,
            PDL=pdl,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out


_FOLD_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_FOLD_COUNTERS: list[torch.Tensor] = []  # outgrown, kept: CUDA graphs captured with them still use them


def _gluon_decode(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int,
                  caches_aligned: bool) -> bool:
    """Whether a decode call takes the Gluon kernel: an fp8 cache, bf16/fp16 q, head_dim in _GLUON_HEAD_DIMS, at most
    16 query heads a kv head (the mma's rows), caches whose K/V rows start 16-byte aligned (`_gluon_caches_aligned`:
    its copies move 16 bytes; a narrower one does not compile), a CUDA device of compute capability 9.x (the only
    kind it was measured and tested on; sm_100/120 have other shared-memory sizes), not under the interpreter (Gluon
    has none: there the Triton kernel runs)."""
    return (_GLUON_DECODE and not INTERPRET and kv_dtype == FP8_KV_DTYPE and device.type == "cuda"
            and q_dtype in (torch.bfloat16, torch.float16) and head_dim in _GLUON_HEAD_DIMS and group <= 16
            and caches_aligned and torch.cuda.get_device_capability(device)[0] == 9)


def _gluon_caches_aligned(*caches: torch.Tensor) -> bool:
    """Every cache's base address and block, token and head strides are multiples of 16 bytes (fp8: elements)."""
    return all(c.data_ptr() % 16 == 0 and all(s * c.element_size() % 16 == 0 for s in c.stride()[:3]) for c in caches)


def _gluon_decode_tile(programs: int, device: torch.device) -> int:
    """Keys a step of the Gluon decode kernel for a launch of `programs` programs (all splits counted)."""
    fits_one_wave = programs <= _PROGRAMS_PER_SM_FP8 * _sm_count(device)
    return _GLUON_DECODE_TILE_N_NARROW if fits_one_wave else _GLUON_DECODE_TILE_N_WIDE


def _fold_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 arrival counters on `device`, one per (seq, kv head) of a folded launch, kept across
    calls: the last program of each pair resets its counter, so they are zero between calls (and CUDA-graph replays).
    Folded launches on one device must therefore not run concurrently (the engine runs its steps on one stream).
    Split launches have fewer (seq, kv head) programs than the GPU has program slots, so 4,096 covers them; a larger
    count (an explicit num_splits) gets new counters, and the old ones stay allocated for graphs that captured them.
    New counters cannot be made during a CUDA-graph capture (their zeroing would run only at replay): a launch
    needing them must run once outside it first, as `CudaGraphs.capture` does."""
    counters = _FOLD_COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"paged_decode_attention: a folded split launch of {n} (seq, kv head) pairs needs new arrival "
                "counters during a CUDA-graph capture; run the same launch once before capturing it")
        if counters is not None:
            _RETIRED_FOLD_COUNTERS.append(counters)
        counters = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _FOLD_COUNTERS[device] = counters
    return counters


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (and Triton's gdc_* instructions): CUDA devices of compute capability 9.0+, and
    not under the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _wide_decode(fp8: bool, split: bool, programs: int, device: torch.device) -> bool:
    """Whether a decode launch of `programs` (seq, kv head) programs takes the wide fp8 settings: unsplit, and the
    programs fill their waves of 1-warp programs to at least _DECODE_WIDE_MIN_WAVE_FILL."""
    if not fp8 or split or programs < 1:
        return False
    slots = _DECODE_WIDE_PROGRAMS_PER_SM_FP8 * _sm_count(device)
    waves = -(-programs // slots)
    return programs >= _DECODE_WIDE_MIN_WAVE_FILL * waves * slots


def _decode_tile(fp8: bool, wide: bool) -> int:
    """Keys per inner-loop step of a decode launch over a cache of that dtype (`wide`: `_wide_decode`)."""
    if not fp8:
        return _TILE_N
    return _DECODE_WIDE_TILE_N_FP8 if wide else _DECODE_TILE_N_FP8


def _decode_launch_options(fp8: bool, wide: bool) -> dict[str, int]:
    """Triton launch options (warps, stages, register cap) of a decode launch over a cache of that dtype."""
    if not fp8:
        return {"num_warps": _DECODE_NUM_WARPS_16}
    warps, maxnreg = ((_DECODE_WIDE_NUM_WARPS_FP8, _DECODE_WIDE_MAXNREG_FP8) if wide
                      else (_DECODE_NUM_WARPS_FP8, _DECODE_MAXNREG_FP8))
    options = {"num_warps": warps, "num_stages": _DECODE_NUM_STAGES_FP8}
    if maxnreg and not INTERPRET:
        options["maxnreg"] = maxnreg
    return options


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200) elsewhere, so that CPU runs take the same decisions."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _choose_num_splits(num_programs: int, context_bound: int, device: torch.device, fp8: bool = False) -> int:
    """Split until the (seq, kv head, split) grid fills the GPU, keeping a context_bound-long sequence's
    partitions >= _SPLIT_MIN_PARTITION tokens."""
    slots = (_PROGRAMS_PER_SM_FP8 if fp8 else _PROGRAMS_PER_SM) * _sm_count(device)
    # fp8: as many splits as fit one wave (at least one); 16-bit: enough to fill the target.
    wanted = max(1, slots // num_programs) if fp8 else -(-slots // num_programs)
    by_length = context_bound // _SPLIT_MIN_PARTITION
    return max(1, min(wanted, by_length, _SPLIT_MAX))


# ----------------------------------------------------------------------------------------------
# Decode over an fp8 cache on sm_90: a Gluon kernel (explicit layouts), one warp a program
# ----------------------------------------------------------------------------------------------
#
# The Triton kernel above reads V's bytes one at a time from shared memory (P.V contracts over keys, V's strided
# dimension, and Triton has no transposing 8-bit shared-memory load) and, with 4 warps, exchanges the row max and P
# between warps through shared memory every tile. This kernel controls its layouts (Gluon) and avoids both:
# - One warp a program (its own (seq, kv head, split)), so no cross-warp traffic at all.
# - K and V tiles travel by cp.async into a _GLUON_DECODE_STAGES-deep ring in shared memory and come back in 16-byte
#   loads, each lane reading exactly what its mma fragments need. That works because the dot products may permute
#   their contraction and output dims freely: a lane's B fragment of K^T covers logical dims 16i + 2c + {0, 1, 8, 9}
#   (c = lane % 4), which are mapped to physical dims c*D/4 + 4i + {0..3} -- D/4 contiguous bytes per key (q is
#   gathered with the same map); a lane's B fragment of V covers output dims g + 8u (g = lane // 4), mapped to
#   physical g*D/8 + u -- D/8 contiguous bytes per key (the output store undoes it). The relabelings are
#   reshape/permute (no data movement); the layout conversions into the mma operands move registers only.
# - S's accumulator feeds P's A operand in registers (the FlashAttention-2 layout identity).
# sm_90 SASS (scripts/decode-sass.py --gluon), per 32 keys: 16 LDGSTS.128, 16 LDS.128, 128 e4m3 -> fp16 conversions,
# 64 HMMA and no byte loads, 658-682 instructions against the 4-warp Triton program's 4 x 1,196 per 128 keys (4,784).
# 186-205 registers at 64 keys, no spills; at 16 keys 128 and a few spilled bytes (below). Triton's barrier pass adds
# a bar.sync per ring step (a no-op cost for one warp; it also orders the ring's reuse of a stage). Each program holds
# one warp; rows >= GROUP of the 16-row mma are padding.


@functools.cache
def _gluon_decode_layouts(tile_n: int, head_dim: int) -> tuple[Any, ...]:
    """(mma, A operand, B operand, K tile as loaded, V tile as loaded) for one warp, `tile_n` keys a step."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    keys_8 = [[8 << i, 0] for i in range((tile_n // 8).bit_length() - 1)]  # keys +8, +16, ... in registers
    # K as loaded, [keys, p]: lane (g, c) holds keys g + 8j and physical dims c*D/4 .. c*D/4 + D/4 - 1.
    k_regs = [[0, 1 << i] for i in range((head_dim // 4).bit_length() - 1)] + keys_8
    k_lanes = [[0, head_dim // 4], [0, head_dim // 2], [1, 0], [2, 0], [4, 0]]
    k_load = gl.DistributedLinearLayout(k_regs, k_lanes, [], [], [tile_n, head_dim])
    # V as loaded, [keys, p]: lane (g, c) holds keys 2c + {0, 1} + 8j and physical dims g*D/8 .. g*D/8 + D/8 - 1.
    v_regs = [[0, 1 << i] for i in range((head_dim // 8).bit_length() - 1)] + [[1, 0]] + keys_8
    v_lanes = [[2, 0], [4, 0], [0, head_dim // 8], [0, head_dim // 4], [0, head_dim // 2]]
    v_load = gl.DistributedLinearLayout(v_regs, v_lanes, [], [], [tile_n, head_dim])
    return mma, a, b, k_load, v_load


@gluon.jit
def _gluon_k_operand(k, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, B: gl.constexpr):
    # [keys, p], p = c*D/4 + 4i + 2*j1 + j0  ->  K^T [k, keys], k = 16i + 8*j1 + 2c + j0.
    x = gl.reshape(k, [TILE_N, 4, HEAD_DIM // 16, 2, 2])
    x = gl.permute(x, [0, 2, 3, 1, 4])
    x = gl.permute(gl.reshape(x, [TILE_N, HEAD_DIM]), [1, 0])
    return gl.convert_layout(x, B)


@gluon.jit
def _gluon_v_operand(v, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, B: gl.constexpr):
    # [keys, p], p = g*D/8 + u  ->  [keys, n], n = g + 8u.
    x = gl.permute(gl.reshape(v, [TILE_N, 8, HEAD_DIM // 8]), [0, 2, 1])
    return gl.convert_layout(gl.reshape(x, [TILE_N, HEAD_DIM]), B)


@gluon.jit
def _gluon_copy_kv(k_smem, v_smem, k_cache_ptr, v_cache_ptr, bt_row, start, kv_end, kv_head, k_key, k_dim, v_key,
                   v_dim, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   BLOCK_SIZE: gl.constexpr, OFFSETS_64: gl.constexpr):
    # One step's keys start .. start + TILE_N - 1 into a stage (keys at or past kv_end: zeros). Each lane copies the
    # bytes it reads back, so the ring needs no barrier between warps (there is one warp).
    k_pos = start + k_key
    k_valid = k_pos < kv_end
    k_block = gl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
    v_pos = start + v_key
    v_valid = v_pos < kv_end
    v_block = gl.load(bt_row + v_pos // BLOCK_SIZE, mask=v_valid, other=0)
    k_slot = k_pos % BLOCK_SIZE
    v_slot = v_pos % BLOCK_SIZE
    if OFFSETS_64:
        k_block = k_block.to(gl.int64)
        v_block = v_block.to(gl.int64)
        k_slot = k_slot.to(gl.int64)
        v_slot = v_slot.to(gl.int64)
    k_row = k_block * stride_kb + (k_slot * stride_kt + kv_head * stride_kh)
    v_row = v_block * stride_vb + (v_slot * stride_vt + kv_head * stride_vh)
    async_copy.async_copy_global_to_shared(k_smem, k_cache_ptr + k_row[:, None] + k_dim[None, :],
                                           mask=k_valid[:, None])
    async_copy.async_copy_global_to_shared(v_smem, v_cache_ptr + v_row[:, None] + v_dim[None, :],
                                           mask=v_valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _gluon_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    counter_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_q_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, TILE_ALIGN: gl.constexpr,
    Q_BF16: gl.constexpr, OFFSETS_64: gl.constexpr, FOLD: gl.constexpr, PDL: gl.constexpr,
    MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, KL: gl.constexpr, VL: gl.constexpr,
):
    # Program (seq, kv head, partition), one warp: the GROUP query heads are rows 0 .. GROUP - 1 of a 16-row mma.
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    if SPLIT:
        partition_size = _partition_size(seq_len, num_splits, TILE_ALIGN)
        kv_begin = split * partition_size
        kv_end = gl.minimum(seq_len, kv_begin + partition_size)
    else:
        kv_begin = 0
        kv_end = seq_len

    # q in the A layout, its dims gathered through K's map (logical k = 16i + 8*j1 + 2c + j0 <- physical
    # c*D/4 + 4i + 2*j1 + j0), as fp16.
    q_row = gl.arange(0, 16, layout=gl.SliceLayout(1, A))
    q_k = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, A))
    q_dim = ((q_k >> 1) & 3) * (HEAD_DIM // 4) + (q_k >> 4) * 4 + ((q_k >> 3) & 1) * 2 + (q_k & 1)
    q_ptrs = q_ptr + seq * stride_qt + (kv_head * GROUP + q_row)[:, None] * stride_qh + q_dim[None, :]
    q = gl.load(q_ptrs, mask=(q_row < GROUP)[:, None] & (q_k < HEAD_DIM)[None, :], other=0.0)
    qk_scale = qk_scale * gl.load(k_scale_ptr + kv_head)
    if Q_BF16:
        # bf16 q into fp16's range by _fp16_range's exact power of two (found from a plain load of the rows; then
        # applied to the gathered q, 1 / down being exact too).
        QB: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
        qb_row = gl.arange(0, GROUP_PAD, layout=gl.SliceLayout(1, QB))
        qb_dim = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, QB))
        qb = gl.load(q_ptr + seq * stride_qt + (kv_head * GROUP + qb_row)[:, None] * stride_qh + qb_dim[None, :],
                     mask=(qb_row < GROUP)[:, None] & (qb_dim < HEAD_DIM)[None, :], other=0.0)
        _, down = _fp16_range(qb)
        q = (q.to(gl.float32) * gl.div_rn(1.0, down)).to(gl.float16)  # rounded division: exact
        qk_scale = qk_scale * down

    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    k_key = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, KL))
    k_dim = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KL))
    v_key = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, VL))
    v_dim = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, VL))
    s_key = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, MMA))
    # Padding rows keep p = 0 and alpha = 1: rows 8-15 are whole registers, so those selects fold away.
    s_row_valid = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA)) < GROUP
    SL: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    k_smem = gl.allocate_shared_memory(k_cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD_DIM], SL)
    v_smem = gl.allocate_shared_memory(v_cache_ptr.dtype.element_ty, [STAGES, TILE_N, HEAD_DIM], SL)
    for st in gl.static_range(STAGES - 1):
        _gluon_copy_kv(k_smem.index(st), v_smem.index(st), k_cache_ptr, v_cache_ptr, bt_row, kv_begin + st * TILE_N,
                       kv_end, kv_head, k_key, k_dim, v_key, v_dim, stride_kb, stride_kt, stride_kh, stride_vb,
                       stride_vt, stride_vh, BLOCK_SIZE, OFFSETS_64)

    m_i = gl.full([16], -1.0e30, gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.full([16], 0.0, gl.float32, gl.SliceLayout(1, MMA))
    acc = gl.full([16, HEAD_DIM], 0.0, gl.float32, MMA)
    for start in range(kv_begin, kv_end, TILE_N):
        step = (start - kv_begin) // TILE_N
        ahead = (step + STAGES - 1) % STAGES
        _gluon_copy_kv(k_smem.index(ahead), v_smem.index(ahead), k_cache_ptr, v_cache_ptr, bt_row,
                       start + (STAGES - 1) * TILE_N, kv_end, kv_head, k_key, k_dim, v_key, v_dim,
                       stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, OFFSETS_64)
        async_copy.wait_group(STAGES - 1)
        k = k_smem.index(step % STAGES).load(KL)
        v = v_smem.index(step % STAGES).load(VL)
        s = mma_v2(q, _gluon_k_operand(k.to(gl.float16), TILE_N, HEAD_DIM, B),
                   gl.full([16, TILE_N], 0.0, gl.float32, MMA))
        s = gl.where((start + s_key < kv_end)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.where(s_row_valid, gl.exp2(m_i - m_new), 1.0)
        p = gl.where(s_row_valid[:, None], gl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), A), _gluon_v_operand(v.to(gl.float16), TILE_N, HEAD_DIM, B),
                     acc * alpha[:, None])
        m_i = m_new
    async_copy.wait_group(0)  # the ring's last copies (past kv_end: empty) land before the program ends
    acc = acc * gl.load(v_scale_ptr + kv_head)

    o_row = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    o_n = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MMA))
    o_dim = (o_n & 7) * (HEAD_DIM // 8) + (o_n >> 3)  # logical output dim g + 8u <- physical g*D/8 + u
    o_head = kv_head * GROUP + o_row
    o_mask = (o_row < GROUP)[:, None] & (o_n < HEAD_DIM)[None, :]
    if SPLIT:
        # Unnormalized partials, as the Triton kernel stores them (physical dims), for the fold or the reduce.
        part_row = (seq * num_q_heads + o_head).to(gl.int64) * num_splits + split
        gl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + o_dim[None, :], acc, mask=o_mask)
        gl.store(part_m_ptr + part_row, m_i, mask=o_row < GROUP)
        gl.store(part_l_ptr + part_row, l_i, mask=o_row < GROUP)
        if PDL:
            _gluon_launch_dependents()
        if FOLD:
            pair = seq * (num_q_heads // GROUP) + kv_head
            gl.thread_barrier()  # every lane's stores before the release
            arrived = gl.atomic_add(counter_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                gl.store(counter_ptr + pair, 0)  # ready for the next call (and CUDA-graph replay)
                _gluon_merge(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq, kv_head, seq_len, num_q_heads,
                             num_splits, partition_size, stride_ot, stride_oh, GROUP, GROUP_PAD, HEAD_DIM)
    else:
        # l_i == 0 only for an empty sequence: its output is 0, not NaN.
        out = acc / gl.where(l_i > 0.0, l_i, 1.0)[:, None]
        gl.store(out_ptr + seq * stride_ot + o_head[:, None] * stride_oh + o_dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)


@gluon.jit
def _gluon_merge(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq, kv_head, seq_len, num_q_heads, num_splits,
                 partition_size, stride_ot, stride_oh, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr,
                 HEAD_DIM: gl.constexpr):
    # The last program of a (seq, kv head) merges its valid partitions, one at a time (a warp cannot hold them all):
    # the max over them first, then the weighted sums. Same math as _merge_partials.
    ML: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    row = gl.arange(0, GROUP_PAD, layout=gl.SliceLayout(1, ML))
    dim = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ML))
    row_valid = row < GROUP
    base = (seq * num_q_heads + kv_head * GROUP + row).to(gl.int64) * num_splits
    num_valid = gl.cdiv(seq_len, partition_size)
    m_max = gl.full([GROUP_PAD], -1.0e30, gl.float32, gl.SliceLayout(1, ML))
    for s in range(0, num_valid):
        m_max = gl.maximum(m_max, gl.load(part_m_ptr + base + s, mask=row_valid, other=-1.0e30, cache_modifier=".cg"))
    total = gl.full([GROUP_PAD], 0.0, gl.float32, gl.SliceLayout(1, ML))
    acc = gl.full([GROUP_PAD, HEAD_DIM], 0.0, gl.float32, ML)
    for s in range(0, num_valid):
        w = gl.exp2(gl.load(part_m_ptr + base + s, mask=row_valid, other=-1.0e30, cache_modifier=".cg") - m_max)
        total += w * gl.load(part_l_ptr + base + s, mask=row_valid, other=0.0, cache_modifier=".cg")
        part = gl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + dim[None, :], mask=row_valid[:, None],
                       other=0.0, cache_modifier=".cg")
        acc += w[:, None] * part
    out = acc / gl.where(total > 0.0, total, 1.0)[:, None]
    gl.store(out_ptr + seq * stride_ot + (kv_head * GROUP + row)[:, None] * stride_oh + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@gluon.jit
def _gluon_launch_dependents():
    # gdc_launch_dependents for Gluon (programmatic dependent launch; a no-op when the launch does not use it).
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


# ----------------------------------------------------------------------------------------------
# Prefill: varlen queries (chunked prefill over a cached prefix; also q_len == 1)
# ----------------------------------------------------------------------------------------------


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
) -> torch.Tensor:
    """Causal attention of varlen queries over a paged KV cache: q [T, Hq, D] -> [T, Hq, D].

    The queries of sequence i are its last `q_len_i` context tokens (chunked prefill over a cached
    prefix, a whole prompt, or a single decode token). `max_query_len` must be >= every q_len_i
    (it sizes the grid; a host int so no sync). `k_scale`/`v_scale`: float32 [num_kv_heads],
    required with an fp8 cache (module docstring).
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
    group = num_q_heads // num_kv_heads
    # Pack enough query tokens to fill BLOCK_M rows; a group wider than BLOCK_M gets one token.
    block_q = max(1, _PREFILL_BLOCK_M // group)
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
        TILE_N=_TILE_N,
        HEAD_DIM=head_dim,
        KV_FP8=fp8,
        DOT_PRECISION=_dot_precision(q.dtype),
        INTERPRET=INTERPRET,
        OFFSETS_64=_needs_int64_offsets(k_cache, v_cache),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Argument checks and small helpers
# ----------------------------------------------------------------------------------------------


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


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 (10-bit mantissa) on GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
