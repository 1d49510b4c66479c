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

Calls of a few rows (decode steps of small batches, `LaunchPolicy.reduce_norm_packet_max_rows`) take a second protocol,
packets: a row goes as 8-byte packets, each 4 bytes of the row and 4 of a tag (the row's call number + 1), stored whole
into the peer's packet region (its own two slots after the rows' region), and the receiver polls its packets until every
one carries the call's tag. A flag must follow its row, so a sender fences (waits until the peer has its row) before it
raises it, and the receiver then reads the row: two crossings one after the other. A packet is its own flag: one
crossing, at twice the bytes. The tags of a slot's packets are those of the last call that wrote it (a call two back has
another; the region starts at zero, and no tag is 0), so the slots need no reset; a sender cannot be two calls ahead,
since its next call needs the receiver's packets of this one, which the receiver sends only after its own kernel of the
last call has finished (every kernel of the step waits for the one before). Sums, roundings and outputs are the same
bits under either protocol.

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
    INTERPRET,
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
    rank's device; each buffer holds `buffer_bytes` and then `packet_bytes` (zero at the start: no packet's tag is 0),
    each signal pad `signal_words` int32 words, zero at the start; `calls` is this rank's int32 [signal_words // world]
    zeros; `programs` the most programs a call may launch that are sure to run at once on every rank (the same number on
    every rank). The calls of all ranks must come in the same order with the same shapes (they do: every rank runs the
    same step)."""

    rank: int
    world: int
    buffers: torch.Tensor
    signal_pads: torch.Tensor
    buffer_bytes: int
    signal_words: int
    calls: torch.Tensor
    programs: int
    # Bytes after `buffer_bytes` in every buffer that hold packets (the packet protocol's two slots); 0: none.
    packet_bytes: int = 0

    def max_rows(self, n: int, dtype: torch.dtype) -> int:
        """The most rows of n values of `dtype` one call takes: two slots of [rows, world, n] in a buffer, and a flag
        per (row, rank) in a signal pad."""
        return min(self.buffer_bytes // (2 * self.world * n * dtype.itemsize), self.signal_words // self.world)

    def packet_rows(self, n: int, dtype: torch.dtype) -> int:
        """The most rows of n values of `dtype` a call in packets takes (none but of PACKET_DTYPES): two slots of
        [rows, world, n * itemsize / 4] 8-byte packets."""
        if dtype not in PACKET_DTYPES:
            return 0
        return min(self.packet_bytes // (2 * self.world * 2 * n * dtype.itemsize), self.signal_words // self.world)


PACKET_DTYPES = (torch.bfloat16, torch.float32)  # 4 bytes of payload a packet: two bf16 values or one fp32 one


def all_reduce_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` of the ranks' sum: `parts` (every rank's partial sums, in rank order) summed in fp32 in rank
    order and rounded to their dtype, then (RMSNorm(sum + residual), sum + residual)."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        total += part.float()
    return add_rms_norm_ref(total.to(parts[0].dtype), residual, weight, eps)


@triton.jit
def _store_packets(ptrs, packets, mask, INTERPRET: tl.constexpr):
    # Each 8-byte packet in one store that a peer sees whole (st.relaxed.sys: single-copy atomic); the interpreter's
    # stores are whole anyway.
    if INTERPRET:
        tl.store(ptrs, packets, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [ptrs, packets, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _unpack(payload, VALUES: tl.constexpr, BLOCK: tl.constexpr):
    # int32 payload words [BLOCK // VALUES] -> their BLOCK values in fp32, in memory order: a bf16 value is the high
    # half of its fp32 bits; the lower address is the low half of the word.
    if VALUES == 2:
        low = (payload << 16).to(tl.float32, bitcast=True)
        high = (payload & -65536).to(tl.float32, bitcast=True)
        values = tl.reshape(tl.join(low, high), [BLOCK])
    else:
        values = payload.to(tl.float32, bitcast=True)
    return values


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, buffers, signal_pads, calls, t, n, eps,
                                    stride_x, stride_r, stride_o, stride_h, slot_stride, packet_base, packet_slot,
                                    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                                    BLOCK: tl.constexpr, PDL: tl.constexpr, PACKETS: tl.constexpr,
                                    VALUES: tl.constexpr, INTERPRET: tl.constexpr):
    # Program g of G takes rows g, g + G, ...; a row's place in a buffer: [slot][row][sender][n]. The loops over
    # rows are while loops: the interpreter cannot take a runtime scalar as a range() bound.
    # PACKETS: the rows go as 8-byte packets, 4 bytes of payload (VALUES values) and the row's call number + 1 (its
    # tag), into the packet region (from byte `packet_base` of every buffer: [slot][row][sender][n / VALUES]
    # packets); a receiver polls its packets until every one carries the call's tag, so neither flags nor the fences
    # before them are needed, at twice the bytes.
    first, step = tl.program_id(0), tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    cols, mask, w = norm_row_start(w_ptr, n, BLOCK, PDL)
    words = tl.arange(0, BLOCK // VALUES)
    word_mask = words < n // VALUES
    row = first
    while row < t:
        call = tl.load(calls + row)
        if PACKETS:
            src = (x_ptr + row.to(tl.int64) * stride_x).to(tl.pointer_type(tl.int32))
            payload = tl.load(src + words, mask=word_mask, other=0)
            packets = ((call + 1).to(tl.int64) << 32) | payload.to(tl.uint32, bitcast=True).to(tl.int64)
            at = (call % 2).to(tl.int64) * packet_slot + ((row * WORLD + RANK) * (n // VALUES)).to(tl.int64)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer = (tl.load(buffers + p) + packet_base).to(tl.pointer_type(tl.int64))
                    _store_packets(peer + at + words, packets, word_mask, INTERPRET)
        else:
            at = (call % 2).to(tl.int64) * slot_stride + (row * WORLD * n).to(tl.int64)
            part = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer = tl.load(buffers + p).to(tl.pointer_type(dtype))
                    tl.store(peer + at + RANK * n + cols, part, mask=mask)
        row += step
    if not PACKETS:
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
    own_packets = (tl.load(buffers + RANK) + packet_base).to(tl.pointer_type(tl.int64))
    row = first
    while row < t:
        call = tl.load(calls + row)
        if not PACKETS:
            for p in tl.static_range(WORLD):
                if p != RANK:
                    while tl.atomic_cas(own_pad + row * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                        pass
            tl.debug_barrier()
        at = (call % 2).to(tl.int64) * slot_stride + (row * WORLD * n).to(tl.int64)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                total += tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            elif PACKETS:
                tag = (call + 1).to(tl.int64)
                src = own_packets + (call % 2).to(tl.int64) * packet_slot + (
                    (row * WORLD + p) * (n // VALUES)).to(tl.int64) + words
                got = tl.load(src, mask=word_mask, other=tag << 32, volatile=True)
                while tl.min(((got >> 32) == tag).to(tl.int32), axis=0) == 0:
                    got = tl.load(src, mask=word_mask, other=tag << 32, volatile=True)
                total += _unpack(got.to(tl.int32), VALUES, BLOCK)  # the low half: the payload
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
    the rows. Calls of up to `policy.reduce_norm_packet_max_rows` rows that `peers.packet_rows` takes go in packets
    (`uses_packets`). `policy`: the launch settings (None: the device's)."""
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
        packets = uses_packets(peers, t, n, x.dtype, policy)
        values = 4 // x.dtype.itemsize
        _all_reduce_add_rms_norm_kernel[(min(t, peers.programs),)](
            x, r, weight, out, h, peers.buffers, peers.signal_pads, peers.calls, t, n, eps,
            x.stride(0), r.stride(0), out.stride(0), h.stride(0), rows * peers.world * n, peers.buffer_bytes,
            max(peers.packet_rows(n, x.dtype), 1) * peers.world * (n // values),
            RANK=peers.rank, WORLD=peers.world, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
            PDL=pdl, PACKETS=packets, VALUES=values, INTERPRET=INTERPRET, num_warps=row_warps(policy, n),
            **pdl_launch(pdl))
    return out, h


def uses_packets(peers: PeerMemory, t: int, n: int, dtype: torch.dtype, policy: LaunchPolicy) -> bool:
    """Whether a call of T rows of n values of `dtype` goes in packets: at most the policy's
    `reduce_norm_packet_max_rows` rows, no more than the packet region holds, and rows of whole 4-byte words."""
    return (t <= min(policy.reduce_norm_packet_max_rows, peers.packet_rows(n, dtype))
            and (n * dtype.itemsize) % 4 == 0 and peers.buffer_bytes % 8 == 0)
