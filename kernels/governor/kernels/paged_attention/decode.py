"""Decode attention with the Triton kernel: one query per sequence over the paged cache.

Owns `paged_decode_attention` (checks, the split count and merge, the dispatch to the Gluon kernel where
`gluon_decode._gluon_decode` takes the call, else `_decode_kernel`), the Triton decode kernel and its launch settings
(tile, warps, stages, register cap; narrow and wide fp8 launches), and the merge of split-KV partials: folded into
the decode kernel through per-(seq, kv head) arrival counters (`_fold_counters`), or by `_decode_reduce_kernel`,
under programmatic dependent launch where the GPU has it. The split count itself is `splits`'.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import INTERPRET

from .checks import FP8_KV_DTYPE, _check_attention_args, _check_out, _needs_int64_offsets, _require_triton
from .gluon_decode import _gluon_caches_aligned, _gluon_decode, _launch_gluon_decode
from .splits import _partition_size, _sm_count, decode_num_splits
from .tiles import _LOG2E, _MIN_DOT, _TILE_N, _attend_range, _dot_precision, _fp16_range

# Narrow decode launches over an fp8 cache (4 warps: split launches, and unsplit ones that are not wide, see below): a
# tile of half the bytes, so it takes twice the keys a step (a multiple of _TILE_N; a tile may run past a _TILE_N-
# aligned partition's end: masked). On an H100 (docs/design/decode-attention-kernels.md), against 64 keys: batch 256
# at 1K context 66% -> 79% of HBM copy bandwidth, batch 32 at 4K 63% -> 72%, at 32K 89% either way; 4 warps
# (Triton's default) beat 8 on every fp8 shape measured.
_DECODE_TILE_N_FP8 = 128
# Registers per thread of a narrow decode program over an fp8 cache (Triton's `maxnreg`; None: the compiler's choice).
# It compiles to 168 registers for sm_90, 3 programs of 4 warps per SM; capped at 128, 4 per SM (when unsplit launches
# ran 4 warps too, 5% faster there at batch 256 on an H200). Split launches take the cap since their split count fills
# one wave of 4 programs per SM (`splits._choose_num_splits`): batch 32 at 4K 98.8 -> 95.6 us, at 32K 638 -> 630,
# batch 16 at 8K 108 -> 96, batch 8 at 4K 41.5 -> 35.8. Alone, the cap was 13% faster where the split count stayed
# (batch 8 at 4K, 1 at 32K) and 4-10% slower where the old count took 1.45 waves; fewer splits without the cap were
# 9-19% slower (docs/design/decode-attention-kernels.md). The 16-bit program (96 registers split, 108 unsplit) has no
# cap: 96 on the int64 kernel of the time spilled and lost 20-25%.
_DECODE_MAXNREG_FP8: int | None = 128
# Pipeline stages of the fp8 decode launches (Triton's `num_stages`, default 3): 2 (one K/V tile in flight while one
# is computed) was 1-2% faster at every fp8 shape measured on an H200 (batch 32 at 4K 96 -> 94.6 us, at 32K 635 ->
# 628, batch 256 at 612 113.7 -> 111.6, at 1,024 171.6 -> 168.7), 1 stage 5-8% slower. 16-bit launches keep the
# default: 2 stages there were 5-8% slower at batch 256 (docs/design/decode-attention-kernels.md).
_DECODE_NUM_STAGES_FP8 = 2
_DECODE_NUM_WARPS_FP8 = 4  # warps per decode program
# Wide fp8 launches -- unsplit, with programs that fill their waves of _DECODE_WIDE_PROGRAMS_PER_SM_FP8 per SM to at
# least _DECODE_WIDE_MIN_WAVE_FILL (`_wide_decode`) -- run 1 warp over 64-key tiles with the compiler's register
# count (181 for sm_90; capped at 168 it spills, 32% slower). A warp owns the whole tile: no cross-warp max/sum or P
# exchange through shared memory (2,056 loop instructions per 64 keys against 1,201 per 128 for 4 warps, 8.0 against
# 6.8 bytes per instruction), but a program holds one warp, and waves of them are long. H200
# (docs/design/decode-attention-kernels.md), 1 warp against the 4-warp program, equal contexts, (seq, kv head)
# programs: 2,048 (batch 256 x 8 at 612 / 1,024 tokens) 110.4 / 164.2 us against 112.3 / 170.1, 1,024 (batch 128 at
# 1,024) 88.0 against 91.4 -- faster; 1,280 and 1,536 (batch 160, 192 at 612) 17% slower, 384 and 512 (batch 48, 64
# at 4K) 58-86% slower. Offline throughput (256 x 100 -> 1,024, fp8 KV) 54.9K -> 57.2-57.9K tok/s in one process.
# The measured times fit about 8 of these programs running per SM (batch 128's 1,024 in one wave, batch 160's 1,280
# in two; the compiler's resources would allow 10), so that is the wave; the fill rule takes the 1,024 and 2,048
# cases (97%) and leaves the others (36-73%). Split launches keep the 4-warp settings (1-warp split launches were
# 6-26% slower at batch 32, 4K).
_DECODE_WIDE_NUM_WARPS_FP8 = 1
_DECODE_WIDE_TILE_N_FP8 = 64
_DECODE_WIDE_MAXNREG_FP8: int | None = None
_DECODE_WIDE_PROGRAMS_PER_SM_FP8 = 8
_DECODE_WIDE_MIN_WAVE_FILL = 0.9
_DECODE_NUM_WARPS_16 = 4
# How split launches merge their partials. Up to _DECODE_FOLD_MAX_SPLITS splits the decode kernel does it: each
# program stores its partial, counts in on a per-(seq, kv head) counter (`_fold_counters`) and the last one merges and
# resets the counter -- no second kernel. More splits run the reduce kernel, launched with programmatic dependent launch
# where the GPU has it (`_DECODE_REDUCE_PDL`, sm_90+): the decode programs signal once their partials are stored, the
# reduce's programs start early and wait in `gdc_wait` for the decode kernel's memory. H200, bf16 q, µs per decode
# against the reduce kernel launched plainly: batch 32 at 4K (2 splits) fp8 95.2 -> 92.7 folded, 93.8 under PDL, bf16
# 142.3 -> 138.9 / 140.3; batch 16 at 8K (4) and 8 at 4K (7-8) also faster folded; batch 1 at 32K (47-64 splits, one
# program merging them all) 36.3 -> 46.4 folded, 34.7 under PDL (fp8). Measured at 2, 4, 7, 8, 47 and 64 splits only
# (docs/design/decode-attention-kernels.md).
_DECODE_FOLD_MAX_SPLITS = 8
_DECODE_REDUCE_PDL = True


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
            # bf16 q over fp8 K/V: tiles widen to fp16 (package docstring), so q goes there too.
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
    `k_scale`/`v_scale`: float32 [num_kv_heads], required with an fp8 cache (package docstring).
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

    offsets_64 = _needs_int64_offsets(k_cache, v_cache)
    if _gluon_decode(q.device, q.dtype, k_cache.dtype, head_dim, group, _gluon_caches_aligned(k_cache, v_cache)):
        _launch_gluon_decode(q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters,
                             k_scale, v_scale, scale, num_splits, split=split, fold=fold, pdl=pdl,
                             offsets_64=offsets_64)
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
            OFFSETS_64=offsets_64,
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
