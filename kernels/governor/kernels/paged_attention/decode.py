"""Decode attention with the Triton kernel: one query per sequence over the paged cache.

Owns `paged_decode_attention` (checks, the split count and merge, the dispatch to the Gluon kernel where
`gluon_decode._gluon_decode` takes the call, else `_decode_kernel`), the Triton decode kernel and the rules that turn a
`LaunchPolicy` into its launch (tile, warps, stages, register cap; narrow and wide fp8 launches), and the merge of
split-KV partials: folded into the decode kernel through per-(seq, kv head) arrival counters (`_fold_counters`), or by
`_decode_reduce_kernel`, under programmatic dependent launch where the GPU has it. The split count itself is
`splits`'. Why each setting has its value: `launch_policy.LaunchPolicy` and docs/design/decode-attention-kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import INTERPRET, chain_pdl, has_pdl, pdl_launch
from governor.kernels.launch_policy import LaunchPolicy, policy_for

from .checks import FP8_KV_DTYPE, _check_attention_args, _check_out, _needs_int64_offsets, _require_triton
from .gluon_decode import _gluon_caches_aligned, _gluon_decode, _launch_gluon_decode
from .kv_write import check_rotary_args, rotary_write_kv, rotated_heads, store_rotated_kv
from .splits import _partition_size, _sm_count, decode_num_splits
from .tiles import _LOG2E, _MIN_DOT, _attend_range, _dot_precision, _fp16_range


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
    pos_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    slot_ptr,
    qk_scale,
    eps,
    num_q_heads,
    num_splits,
    stride_cs,
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
    CHAIN_PDL: tl.constexpr,
    ROTARY: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    # Program (seq, kv head, partition): all GROUP query heads of the kv head at once, so each K/V
    # row is read once per group. Rows >= GROUP are padding (tl.dot needs >= 16 rows).
    # ROTARY: q_ptr is the step's qkv projection, [q | k | v] a row; the program norms (QK_NORM) and rotates its q
    # heads itself, and the program whose partition holds the newest position stores that token's rotated key and
    # its value in the cache before it reads the cache (what `kv_write.rotary_write_kv` would have done before).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if CHAIN_PDL:  # the decode chain (elementwise.chain_pdl): q and the newest keys are the kernel before's output
        gdc_launch_dependents()
        gdc_wait()
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
    if ROTARY:
        q_row = q_ptr + seq.to(tl.int64) * stride_qt
        cs = cos_sin_ptr + tl.load(pos_ptr + seq).to(tl.int64) * stride_cs
        q = rotated_heads(q_row + head[:, None] * HEAD_DIM, d, row_valid[:, None], cs, q_norm_ptr, eps, QK_NORM,
                          HEAD_DIM).to(q_ptr.dtype.element_ty)
        newest = seq_len - 1
        writer = newest >= 0
        if SPLIT:
            writer = writer & (newest // partition_size == split)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if writer & (slot >= 0):
            store_rotated_kv(q_row, d, cs, k_norm_ptr, eps, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                             slot // BLOCK_SIZE, slot % BLOCK_SIZE, kv_head, num_q_heads, num_q_heads // GROUP,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             HEAD_DIM, QK_NORM, KV_FP8, INTERPRET)
        tl.debug_barrier()  # the key and value stored above are read back by the program's other threads
    else:
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
    policy: LaunchPolicy | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence, q [B, num_q_heads, head_dim] -> [B, Hq, D].

    Each query sits at position `seq_lens[b] - 1` and attends to the whole context. One program
    per (sequence, kv head) serves the GQA group; for long contexts over few programs the context
    is also split into partitions (split-KV), merged by the last program of each (sequence, kv head) or,
    past `policy.decode_fold_max_splits` partitions, by a small reduce kernel.

    `num_splits`: None picks automatically (from `max_seq_len` if given, else the block-table
    capacity, so no host sync and the choice is stable under CUDA graphs); 1 disables split-KV.
    `max_seq_len`: an upper bound on `seq_lens` known on the host, for the split count (instead of the
    block-table capacity).
    `k_scale`/`v_scale`: float32 [num_kv_heads], required with an fp8 cache (package docstring).
    `policy`: the launch settings (None: the device's, `launch_policy.policy_for`).
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    _require_triton(q, "paged_decode_attention")
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, max_seq_len, k_scale,
                   v_scale, policy, None)


@dataclass(frozen=True)
class _Rotary:
    """What `rotary_decode_attention` folds into the decode launch: `rotary_write_kv`'s arguments but qkv (the launch's
    q is a view of it)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float


def rotary_decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    policy: LaunchPolicy | None = None,
) -> torch.Tensor:
    """`kv_write.rotary_write_kv` and then `paged_decode_attention`, in one kernel, for a step whose every token is its
    sequence's one query: token b of the qkv projection [B, (Hq + 2 Hkv) D] is sequence b's, at `positions[b]`
    (`seq_lens[b] - 1`), its K/V going to `slot_mapping[b]` (< 0: a padding row, nothing stored). Returns the
    attention output [B, Hq, D] (a new tensor). Each program norms (`q_norm`/`k_norm`, Qwen3) and rotates its query
    heads itself, and the one program of each (sequence, kv head) whose partition holds the newest position stores the
    rotated key and the value before it reads the cache, so the stored bytes, q and the output are those of the two
    calls (up to the order of the per-head norm's sum), and qkv is left as it is. Where the Gluon fp8 kernel takes the
    call it is the two calls (q then rotated in place in qkv, as `rotary_write_kv` does). Arguments as the two
    functions'."""
    q, _ = check_rotary_args("rotary_decode_attention", qkv, positions, cos_sin, num_heads, k_cache, v_cache,
                             slot_mapping, q_norm, k_norm, k_scale, v_scale)
    _require_triton(qkv, "rotary_decode_attention")
    head_dim = k_cache.shape[3]
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    policy = policy or policy_for(qkv.device)
    if _gluon_decode(policy, q.device, q.dtype, k_cache.dtype, head_dim, num_heads // k_cache.shape[2],
                     _gluon_caches_aligned(k_cache, v_cache)):
        q = rotary_write_kv(qkv, positions, cos_sin, num_heads, k_cache, v_cache, slot_mapping, q_norm=q_norm,
                            k_norm=k_norm, eps=eps, k_scale=k_scale, v_scale=v_scale, policy=policy)
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, None, num_splits, max_seq_len, k_scale,
                       v_scale, policy, None)
    rotary = _Rotary(positions, cos_sin, slot_mapping, q_norm, k_norm, eps)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, None, num_splits, max_seq_len, k_scale,
                   v_scale, policy, rotary)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None, num_splits: int | None,
            max_seq_len: int | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            policy: LaunchPolicy | None, rotary: _Rotary | None) -> torch.Tensor:
    """The launch of `paged_decode_attention` and `rotary_decode_attention` (checked arguments; with `rotary`, q is the
    q part of the qkv projection, unrotated, and the Gluon kernel does not take the call)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"paged_decode_attention: q has {batch} sequences but block_tables has {block_tables.shape[0]}"
        )
    out = _check_out(out, q)  # a new one is contiguous also when q is a view of qkv
    if batch == 0:
        return out
    if policy is None:
        policy = policy_for(q.device)
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    context_bound = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    context_bound = max(context_bound, 1)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    num_splits = decode_num_splits(batch * num_kv_heads, context_bound, q.device, num_splits, fp8, policy=policy)
    split = num_splits > 1
    wide = _wide_decode(policy, fp8, split, batch * num_kv_heads, q.device)
    fold = split and num_splits <= policy.decode_fold_max_splits
    pdl = split and not fold and policy.decode_reduce_pdl and has_pdl(q.device)
    # In the decode chain unless a reduce kernel follows (that pairing has its own trigger, after the partials).
    chain = chain_pdl(policy, q.device) and not (split and not fold)

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
    if rotary is None and _gluon_decode(policy, q.device, q.dtype, k_cache.dtype, head_dim, group,
                                        _gluon_caches_aligned(k_cache, v_cache)):
        _launch_gluon_decode(policy, q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
                             counters, k_scale, v_scale, scale, num_splits, split=split, fold=fold, pdl=pdl,
                             offsets_64=offsets_64)
    else:
        # Without rotary its pointers are never dereferenced (out stands in for them).
        r = rotary or _Rotary(seq_lens, out.view(-1, 1, 1), seq_lens, None, None, 0.0)
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters,
            k_scale if fp8 else out, v_scale if fp8 else out,  # never dereferenced unless KV_FP8
            r.positions, r.cos_sin, out if r.q_norm is None else r.q_norm, out if r.k_norm is None else r.k_norm,
            r.slot_mapping,
            scale * _LOG2E, r.eps, num_q_heads, num_splits, r.cos_sin.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group,
            GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_SIZE=block_size,
            TILE_N=_decode_tile(policy, fp8, wide),
            HEAD_DIM=head_dim,
            SPLIT=split,
            TILE_ALIGN=policy.tile_n,
            KV_FP8=fp8,
            FP16_PRODUCTS=fp8 and q.dtype == torch.bfloat16,
            DOT_PRECISION=_dot_precision(q.dtype),
            INTERPRET=INTERPRET,
            OFFSETS_64=offsets_64,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            FOLD=fold,
            PDL=pdl,
            CHAIN_PDL=chain,
            ROTARY=rotary is not None,
            QK_NORM=rotary is not None and rotary.q_norm is not None,
            **_decode_launch_options(policy, fp8, wide),
            **pdl_launch(chain),
        )  # fmt: skip
    if split and not fold:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_m, part_l, seq_lens, num_q_heads, num_splits,
            out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            TILE_ALIGN=policy.tile_n,
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


def _wide_decode(policy: LaunchPolicy, fp8: bool, split: bool, programs: int, device: torch.device) -> bool:
    """Whether a decode launch of `programs` (seq, kv head) programs takes the wide fp8 settings: unsplit, and the
    programs fill their waves of `policy.decode_wide_programs_per_sm_fp8` per SM to at least
    `policy.decode_wide_min_wave_fill`."""
    if not fp8 or split or programs < 1:
        return False
    slots = policy.decode_wide_programs_per_sm_fp8 * _sm_count(device)
    waves = -(-programs // slots)
    return programs >= policy.decode_wide_min_wave_fill * waves * slots


def _decode_tile(policy: LaunchPolicy, fp8: bool, wide: bool) -> int:
    """Keys per inner-loop step of a decode launch over a cache of that dtype (`wide`: `_wide_decode`)."""
    if not fp8:
        return policy.tile_n
    return policy.decode_wide_tile_n_fp8 if wide else policy.decode_tile_n_fp8


def _decode_launch_options(policy: LaunchPolicy, fp8: bool, wide: bool) -> dict[str, int]:
    """Triton launch options (warps, stages, register cap) of a decode launch over a cache of that dtype. Wide
    programs run at the compiler's register count (a cap of 168 spilled); the interpreter takes no cap."""
    if not fp8:
        return {"num_warps": policy.decode_num_warps_16}
    if wide:
        return {"num_warps": policy.decode_wide_num_warps_fp8, "num_stages": policy.decode_num_stages_fp8}
    options = {"num_warps": policy.decode_num_warps_fp8, "num_stages": policy.decode_num_stages_fp8}
    if policy.decode_maxnreg_fp8 and not INTERPRET:
        options["maxnreg"] = policy.decode_maxnreg_fp8
    return options
