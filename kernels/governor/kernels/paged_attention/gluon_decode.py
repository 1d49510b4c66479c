"""Decode over an fp8 cache on sm_90: a Gluon kernel (explicit layouts), one warp a program, with the rules for
which calls take it (`_gluon_decode`), its keys a step (`_gluon_decode_tile`), its layouts and its launch
(`_launch_gluon_decode`).

`decode.paged_decode_attention` dispatches here; the contract, math and split-KV partials are those of the Triton
decode kernel (`decode._decode_kernel`), which runs every other call and, under the interpreter, this one's too.

The Triton kernel reads V's bytes one at a time from shared memory (P.V contracts over keys, V's strided dimension,
and Triton has no transposing 8-bit shared-memory load) and, with 4 warps, exchanges the row max and P between warps
through shared memory every tile. This kernel controls its layouts (Gluon) and avoids both:
- One warp a program (its own (seq, kv head, split)), so no cross-warp traffic at all.
- K and V tiles travel by cp.async into a `LaunchPolicy.gluon_stages`-deep ring in shared memory and come back in
  16-byte loads, each lane reading exactly what its mma fragments need. That works because the dot products may permute
  their contraction and output dims freely: a lane's B fragment of K^T covers logical dims 16i + 2c + {0, 1, 8, 9}
  (c = lane % 4), which are mapped to physical dims c*D/4 + 4i + {0..3} -- D/4 contiguous bytes per key (q is
  gathered with the same map); a lane's B fragment of V covers output dims g + 8u (g = lane // 4), mapped to
  physical g*D/8 + u -- D/8 contiguous bytes per key (the output store undoes it). The relabelings are
  reshape/permute (no data movement); the layout conversions into the mma operands move registers only.
- S's accumulator feeds P's A operand in registers (the FlashAttention-2 layout identity).
Triton's barrier insertion adds a bar.sync per ring step (a no-op cost for one warp; it also orders the ring's reuse
of a stage). Each program holds one warp; rows >= GROUP of the 16-row mma are padding. A program's ring holds
2 x stages x keys a step x head_dim bytes. Its machine code (scripts/decode-sass.py --gluon) and timings:
docs/design/decode-attention-kernels.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from governor.kernels.elementwise import INTERPRET
from governor.kernels.launch_policy import LaunchPolicy

from .checks import FP8_KV_DTYPE
from .splits import _partition_size, _sm_count
from .tiles import _LOG2E, _fp16_range

_GLUON_HEAD_DIMS = (64, 128)  # the accumulator, 16 x head_dim fp32, lives in one warp's registers: 256 would spill


def _gluon_decode(policy: LaunchPolicy, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  head_dim: int, group: int, caches_aligned: bool) -> bool:
    """Whether a decode call takes the Gluon kernel: `policy.gluon_decode`, an fp8 cache, bf16/fp16 q, head_dim in
    _GLUON_HEAD_DIMS, at most 16 query heads a kv head (the mma's rows), caches whose K/V rows start 16-byte aligned
    (`_gluon_caches_aligned`: its copies move 16 bytes; a narrower one does not compile), a CUDA device of compute
    capability 9.x (the only kind it was measured and tested on; sm_100/120 have other shared-memory sizes), not under
    the interpreter (Gluon has none: there the Triton kernel runs)."""
    return (policy.gluon_decode and not INTERPRET and kv_dtype == FP8_KV_DTYPE and device.type == "cuda"
            and q_dtype in (torch.bfloat16, torch.float16) and head_dim in _GLUON_HEAD_DIMS and group <= 16
            and caches_aligned and torch.cuda.get_device_capability(device)[0] == 9)


def _gluon_caches_aligned(*caches: torch.Tensor) -> bool:
    """Every cache's base address and block, token and head strides are multiples of 16 bytes (fp8: elements)."""
    return all(c.data_ptr() % 16 == 0 and all(s * c.element_size() % 16 == 0 for s in c.stride()[:3]) for c in caches)


def _gluon_decode_tile(policy: LaunchPolicy, programs: int, device: torch.device) -> int:
    """Keys a step of the Gluon decode kernel for a launch of `programs` programs (all splits counted): narrow where
    they fit one wave of `policy.programs_per_sm_fp8` per SM, as every split launch does, else wide."""
    fits_one_wave = programs <= policy.programs_per_sm_fp8 * _sm_count(device)
    return policy.gluon_tile_n_narrow if fits_one_wave else policy.gluon_tile_n_wide


def _launch_gluon_decode(policy: LaunchPolicy, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, part_acc: torch.Tensor,
                         part_m: torch.Tensor, part_l: torch.Tensor, counters: torch.Tensor,
                         k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, scale: float, num_splits: int, *,
                         split: bool, fold: bool, pdl: bool, offsets_64: bool) -> None:
    """`_gluon_decode_kernel` over (seq, kv head, split) for `decode.paged_decode_attention`, which has checked the
    arguments, asked `_gluon_decode`, and chosen the split count, the merge (`fold`, `pdl`) and the offset width."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    tile_n = _gluon_decode_tile(policy, batch * num_kv_heads * num_splits, q.device)
    maxnreg = policy.gluon_maxnreg_wide if tile_n == policy.gluon_tile_n_wide else None
    mma, a_op, b_op, k_load, v_load = _gluon_decode_layouts(tile_n, head_dim)
    _gluon_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters, k_scale, v_scale,
        scale * _LOG2E, num_q_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size, TILE_N=tile_n,
        HEAD_DIM=head_dim, STAGES=policy.gluon_stages, SPLIT=split, TILE_ALIGN=policy.tile_n,
        Q_BF16=q.dtype == torch.bfloat16, OFFSETS_64=offsets_64, FOLD=fold, PDL=pdl,
        MMA=mma, A=a_op, B=b_op, KL=k_load, VL=v_load,
        num_warps=1,  # not a setting: the layouts (`_gluon_decode_layouts`) are one warp's
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


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
    # the max over them first, then the weighted sums. Same math as decode._merge_partials.
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

