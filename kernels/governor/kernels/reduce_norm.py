"""The all-reduce of a row-parallel matmul's partial sums fused with the residual add and RMSNorm that follow it.

Under tensor parallelism every o_proj and down_proj output (and the embedding) is a partial sum that an all-reduce
completes, and the next thing the layer does is `add_rms_norm` of that sum. Unfused, a decode step pays for both
kernels twice a layer, and for the all-reduce's own copy into a peer-visible buffer. Here each program takes rows
r, r + G, r + 2G, ... of the G programs of the call and, for each of its rows in turn:

1. pushes the row of partial sums into every other rank's buffer (peer-to-peer stores: each rank's buffer is mapped
   into every rank's address space), at the slot of its own rank;
2. raises a flag in every other rank's signal pad, then waits for every other rank's flag in its own: then every
   rank's row is in its buffer (all of a program's rows are pushed and flagged before it waits for any);
3. sums the rows in rank order, in fp32 (the same bits on every rank), rounds the sum to the model dtype (where the
   unfused all-reduce's output is rounded), adds the residual and norms the row as `add_rms_norm` does.

A program waits for the same program of every other rank, so all G programs of a call must run at once: G is at
most `PeerMemory.programs` (the fewest SMs of any rank's GPU, one program fitting on any SM). Messages of more rows
than that (a batch of 256 sequences) loop rather than fall back to two kernels.

The buffer has two slots and a row alternates between them with every call it is in (`calls`, a device counter per
row), so a rank never overwrites a slot a peer may still read: before a row is written to a slot again, its next
call's flags have been passed, which a peer raises only after its previous kernel has finished. A flag is a signal
pad word per (row, sender) that the sender sets from 0 to 1 and the receiver takes back from 1 to 0, both spinning:
a sender that is a call ahead waits for the receiver. Nothing runs on the host, so the kernel is captured into CUDA
graphs like any other, and it is a link of the decode chain's programmatic dependent launch.

`PeerMemory` describes the ranks' memory (addresses as this process maps them); the engine sets it up from PyTorch's
symmetric memory (engine/tp/all_reduce.py). Under TRITON_INTERPRET=1 the ranks can be threads of one process over
ordinary CPU tensors, which is how the tests run the protocol on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import (
    add_rms_norm_ref,
    chain_pdl,
    norm_row_start,
    pdl_launch,
    rms_rstd,
    rms_scale,
    round_to,
    row_warps,
)
from governor.kernels.launch_policy import LaunchPolicy, policy_for


@dataclass(frozen=True)
class PeerMemory:
    """Every rank's peer-visible buffer and signal pad as this rank sees them, and this rank's call counters.

    Made the same way on every rank: `buffers` and `signal_pads` are int64 [world] addresses (rank r's at r), on this
    rank's device; each buffer holds `buffer_bytes`, each signal pad `signal_words` int32 words, zero at the start;
    `calls` is this rank's int32 [signal_words // world] zeros; `programs` the most programs a call may launch that
    are sure to run at once on every rank (the same number on every rank). The calls of all ranks must come in the
    same order with the same shapes (they do: every rank runs the same step)."""

    rank: int
    world: int
    buffers: torch.Tensor
    signal_pads: torch.Tensor
    buffer_bytes: int
    signal_words: int
    calls: torch.Tensor
    programs: int

    def max_rows(self, n: int, dtype: torch.dtype) -> int:
        """The most rows of n values of `dtype` one call takes: two slots of [rows, world, n] in a buffer, and a flag
        per (row, rank) in a signal pad."""
        return min(self.buffer_bytes // (2 * self.world * n * dtype.itemsize), self.signal_words // self.world)


def all_reduce_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` of the ranks' sum: `parts` (every rank's partial sums, in rank order) summed in fp32 in rank
    order and rounded to their dtype, then (RMSNorm(sum + residual), sum + residual)."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        total += part.float()
    return add_rms_norm_ref(total.to(parts[0].dtype), residual, weight, eps)


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, buffers, signal_pads, calls, t, n, eps,
                                    stride_x, stride_r, stride_o, stride_h, slot_stride,
                                    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program g of G takes rows g, g + G, ...; a row's place in a buffer: [slot][row][sender][n]. The loops over
    # rows are while loops: the interpreter cannot take a runtime scalar as a range() bound.
    first, step = tl.program_id(0), tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    cols, mask, w = norm_row_start(w_ptr, n, BLOCK, PDL)
    row = first
    while row < t:
        at = (tl.load(calls + row) % 2).to(tl.int64) * slot_stride + (row * WORLD * n).to(tl.int64)
        part = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = tl.load(buffers + p).to(tl.pointer_type(dtype))
                tl.store(peer + at + RANK * n + cols, part, mask=mask)
        row += step
    tl.debug_barrier()  # every thread's stores before the flags (a release orders what the block did before it)
    row = first
    while row < t:
        for p in tl.static_range(WORLD):
            if p != RANK:
                pad = tl.load(signal_pads + p).to(tl.pointer_type(tl.int32))
                while tl.atomic_cas(pad + row * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                    pass
        row += step
    own_pad = tl.load(signal_pads + RANK).to(tl.pointer_type(tl.int32))
    own = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
    row = first
    while row < t:
        for p in tl.static_range(WORLD):
            if p != RANK:
                while tl.atomic_cas(own_pad + row * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()
        call = tl.load(calls + row)
        at = (call % 2).to(tl.int64) * slot_stride + (row * WORLD * n).to(tl.int64)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                total += tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            else:  # past L1: the peers wrote these lines over the interconnect
                total += tl.load(own + at + p * n + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        h = round_to(total, dtype)
        if HAS_RESIDUAL:
            h = round_to(h + tl.load(res_ptr + row.to(tl.int64) * stride_r + cols, mask=mask, other=0.0).to(
                tl.float32), dtype)
        tl.store(h_ptr + row.to(tl.int64) * stride_h + cols, h.to(dtype), mask=mask)
        tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, rms_scale(h, rms_rstd(h, n, eps), w, dtype).to(dtype),
                 mask=mask)
        tl.debug_barrier()  # every thread has read the row's count before it moves on
        tl.store(calls + row, call + 1)
        row += step


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            peers: PeerMemory, *, policy: LaunchPolicy | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s + residual), s + residual) where s is the sum of every rank's `x` [T, n], in one kernel
    (`all_reduce_add_rms_norm_ref`); no residual: (RMSNorm(s), s). Collective: every rank calls it with the same
    shapes, in the same order. T is at most `peers.max_rows(n, x.dtype)`; min(T, `peers.programs`) programs share
    the rows. `policy`: the launch settings (None: the device's)."""
    if x.dim() != 2 or x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape
                                                                        or residual.stride(-1) != 1)):
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)} and residual must be [T, n] with contiguous "
                         "rows")
    t, n = x.shape
    rows = peers.max_rows(n, x.dtype)
    if t > rows:
        raise ValueError(f"all_reduce_add_rms_norm takes at most {rows} rows of {n} {x.dtype} values, got {t}")
    out, h = torch.empty_like(x), torch.empty_like(x)
    if t:
        if policy is None:
            policy = policy_for(x.device)
        r = x if residual is None else residual  # never read without a residual
        pdl = chain_pdl(policy, x.device)
        _all_reduce_add_rms_norm_kernel[(min(t, peers.programs),)](
            x, r, weight, out, h, peers.buffers, peers.signal_pads, peers.calls, t, n, eps,
            x.stride(0), r.stride(0), out.stride(0), h.stride(0), rows * peers.world * n,
            RANK=peers.rank, WORLD=peers.world, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
            PDL=pdl, num_warps=row_warps(policy, n), **pdl_launch(pdl))
    return out, h
