"""The all-reduce of a tensor-parallel step on CUDA, chosen by message size.

A decode step's all-reduces are small (batch × hidden values: 8 KiB at batch 1 of an 8B model) and there are two
per layer, so their latency, not their bandwidth, is what a step pays. NCCL's ring moves a small message through
every rank in turn. Over peer-to-peer buffers (CUDA IPC: each rank's buffer is mapped into every other rank's
address space over NVLink) a message needs no hops:

- one-shot: each rank copies its part into its own buffer, all ranks meet at a barrier, and each reads every
  rank's part and sums them. One kernel; each rank reads N parts, so it pays for small messages only;
- two-shot: a reduce-scatter (each rank sums one 1/N slice from every buffer) then an all-gather of the slices.
  Two barriers, but each rank reads 2(N-1)/N of the message, so it pays for mid-sized ones;
- NCCL for everything larger (prefill chunks), where bandwidth is what counts.

Where an all-reduce is followed by the residual add and RMSNorm (every one in a decode step: after o_proj, after
down_proj, after the embedding), a message of up to `_FUSED_MAX` takes Governor's own kernel instead, which does the
three in one (`kernels/reduce_norm.py`: each rank pushes its rows into every peer's buffer, raises flags, and sums,
adds and norms what it received; calls of a few rows go as tagged packets instead, which need no flags), on a second
pair of buffers and signal pads of its own.

The P2P paths are PyTorch's symmetric-memory kernels (`torch.ops.symm_mem`) on buffers allocated once at start.
Both end in a barrier, so a buffer is never overwritten while a peer still reads it, and neither needs the host:
they are captured into CUDA graphs like any kernel. NVLink multicast is never used: the buffers are made with
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (no multicast object is created) and only the peer-to-peer kernels are called.

Thresholds: `_ONE_SHOT_MAX`, `_TWO_SHOT_MAX` and `_FUSED_MAX` below.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from governor.kernels.launch_policy import LaunchPolicy
from governor.kernels.reduce_norm import PeerMemory, all_reduce_add_rms_norm

log = logging.getLogger("governor.engine")

# Largest message (bytes) each path takes, by group size; beyond the two-shot bound, NCCL. From `governor bench
# all-reduce --tp 2` and `--tp 4` on 2 and 4 H200s over NVLink (docs/performance/tensor-parallelism.md): at both sizes
# one-shot is fastest up to 512 KiB, one- and two-shot tie at 1 MiB, two-shot is fastest from there to 8 MiB.
_ONE_SHOT_MAX = {2: 512 * 1024, 4: 512 * 1024}
_TWO_SHOT_MAX = {2: 8 * 1024 * 1024, 4: 8 * 1024 * 1024}
_DEFAULT_ONE_SHOT_MAX = 128 * 1024
_DEFAULT_TWO_SHOT_MAX = 2 * 1024 * 1024
# Largest all-reduce + add + RMSNorm (bytes of the summed rows) the fused kernel takes, by group size. At TP 2 on 2
# H200s it beats the all-reduce + `add_rms_norm` pair up to 2 MiB (19.2 against 23.7 µs for two-shot + norm: 256 rows
# of an 8B model, a batch of 256) and loses from 4 MiB (36.4 against 32.8). TP 4 is not measured past 512 KiB.
_FUSED_MAX = {2: 2 * 1024 * 1024, 4: 512 * 1024}
_DEFAULT_FUSED_MAX = 512 * 1024
# Largest message (bytes of the summed rows) the fused kernel's packet region holds: calls of a few rows go in packets
# of twice their bytes (`LaunchPolicy.reduce_norm_packet_max_rows`); 8 rows of up to 16,384 values of bf16.
_PACKET_MAX = 256 * 1024


@dataclass(frozen=True)
class AllReducePolicy:
    """Which path a message of a given size takes (bytes): one-shot up to `one_shot_max`, two-shot up to
    `two_shot_max`, NCCL above; an all-reduce followed by add + RMSNorm of up to `fused_max` is one fused kernel.
    0 turns a P2P path off."""

    one_shot_max: int
    two_shot_max: int
    fused_max: int = 0

    @classmethod
    def for_size(cls, world: int) -> AllReducePolicy:
        return cls(_ONE_SHOT_MAX.get(world, _DEFAULT_ONE_SHOT_MAX), _TWO_SHOT_MAX.get(world, _DEFAULT_TWO_SHOT_MAX),
                   _FUSED_MAX.get(world, _DEFAULT_FUSED_MAX))

    def path(self, nbytes: int) -> str:
        if nbytes <= self.one_shot_max:
            return "one_shot"
        if nbytes <= self.two_shot_max:
            return "two_shot"
        return "nccl"

    @property
    def buffer_bytes(self) -> int:
        return max(self.one_shot_max, self.two_shot_max)


# Set when a group that had P2P buffers is closed. Buffers made in one group's lifetime rendezvous fine (the
# benchmark makes three), but a later engine's in the same process hung (4 × H200 host); until that is
# understood, a process gets P2P buffers for one engine only, and later engines send every all-reduce to NCCL.
_closed_in_this_process = False


P2P_DTYPES = (torch.bfloat16, torch.float32)  # what PyTorch's one-shot and two-shot kernels are built for


def p2p_unavailable_reason(device: torch.device, world: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the P2P paths cannot run here (None when they can): they need CUDA, a bf16 or fp32 model, PyTorch's
    symmetric-memory kernels, peer access between every pair of this host's first `world` GPUs, and a process in
    which no earlier engine had them."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype not in P2P_DTYPES:
        return f"the peer-to-peer kernels take bfloat16 and float32, not {dtype}"
    if _closed_in_this_process:
        return ("an earlier tensor-parallel engine in this process had peer-to-peer buffers; a process sets them up "
                "for one engine")
    ops = getattr(torch.ops, "symm_mem", None)
    for name in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
        if ops is None or not hasattr(ops, name):
            return f"this PyTorch ({torch.__version__}) has no torch.ops.symm_mem.{name}"
    for a in range(world):
        for b in range(world):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b}'s memory (no peer-to-peer path)"
    return None


class P2PAllReduce:
    """One-shot and two-shot all-reduce over symmetric P2P buffers of the model's dtype, NCCL above them.

    Made collectively (every rank, in the same order) after the process group exists."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, policy: AllReducePolicy) -> None:
        # No multicast object is ever created: the buffers are plain P2P mappings.
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        import torch.distributed._symmetric_memory as symm_mem

        if getattr(symm_mem, "get_backend", None) is not None and symm_mem.get_backend(device) != "CUDA":
            symm_mem.set_backend("CUDA")  # the kernels below are the CUDA backend's (not NVSHMEM's)
        self.group = group
        self.policy = policy
        # Symmetric memory keeps, per group name, the store its rendezvous goes through, for the life of the
        # process; an engine's groups are named as the last engine's were ("0"), so a second engine in this
        # process would rendezvous through the first one's closed store. Each set of buffers gets a name of
        # its own, rank 0's, registered with this engine's store and as another name of the group (the kernels
        # look the group up by name); `close` drops that name.
        name = [f"governor-p2p-{uuid.uuid4().hex}" if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group, device=device)
        self.group_name: str = str(name[0])
        c10d: Any = torch._C._distributed_c10d  # group names are str before PyTorch's GroupName type
        store = dist.PrefixStore(self.group_name, dist.distributed_c10d._get_default_store())
        c10d._SymmetricMemory.set_group_info(self.group_name, dist.get_rank(group), dist.get_world_size(group),
                                             store)
        c10d._register_process_group(self.group_name, group)
        self.buffer = symm_mem.empty(max(policy.buffer_bytes, 4096) // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # type: ignore[arg-type]  # GroupName in newer PyTorch
        self.dtype = dtype
        self.world = dist.get_world_size(group)
        self.ops = torch.ops.symm_mem
        self.calls = {"one_shot": 0, "two_shot": 0, "nccl": 0, "fused": 0}  # by path, when issued (and captured)
        self.peers = self._peer_memory(symm_mem, device)

    def _peer_memory(self, symm_mem: Any, device: torch.device) -> PeerMemory | None:
        """The fused kernel's buffers (two slots of `fused_max` per rank, per sender, then the packet region) and signal
        pads, with every rank's pad and packet region zeroed before any rank may write to it; None when the fused path
        is off."""
        if self.policy.fused_max == 0:
            return None
        # A program of the fused kernel waits for its peers' programs, so all of a call's programs must run at once:
        # no more than the SMs of any rank's GPU (one program fits on any SM). The ranks agree on the number.
        sms = torch.tensor([torch.cuda.get_device_properties(device).multi_processor_count], device=device)
        dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=self.group)
        nbytes = 2 * self.world * max(self.policy.fused_max, 4096)
        packet_bytes = 2 * self.world * 2 * _PACKET_MAX  # two slots of packets, twice the bytes of their rows
        # Held for the engine's life: every rank's buffer pointers point into it.
        self.fused_buffer = symm_mem.empty(nbytes + packet_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.fused_buffer, self.group_name)
        rank = dist.get_rank(self.group)
        handle.get_signal_pad(rank).zero_()
        self.fused_buffer[nbytes:].zero_()  # no packet's tag is 0 (a call's is its number + 1)
        torch.cuda.synchronize(device)
        dist.barrier(group=self.group)
        words = handle.signal_pad_size // 4
        at = int(getattr(handle, "offset", 0))  # the tensor's place in its allocation (0 unless it shares one)
        buffers = [ptr + at for ptr in handle.buffer_ptrs]
        return PeerMemory(rank, self.world, torch.tensor(buffers, dtype=torch.int64, device=device),
                          torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device), nbytes, words,
                          torch.zeros(words // self.world, dtype=torch.int32, device=device), int(sms.item()),
                          packet_bytes)

    def close(self) -> None:
        """Drop the group's extra name (before the group is destroyed)."""
        global _closed_in_this_process
        _closed_in_this_process = True
        c10d: Any = torch._C._distributed_c10d
        c10d._unregister_process_group(self.group_name)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     policy: LaunchPolicy) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(s + residual), s + residual) for s the ranks' sum of `x` [T, n], in one kernel
        (`all_reduce_add_rms_norm`), when the message is at most `fused_max` and fits the fused buffers; else None: the
        caller all-reduces and norms. Collective, like every call here."""
        if (self.peers is None or x.dtype != self.dtype or x.dim() != 2 or not x.is_contiguous()
                or x.nbytes > self.policy.fused_max or x.shape[0] > self.peers.max_rows(x.shape[1], x.dtype)):
            return None
        self.calls["fused"] += 1
        return all_reduce_add_rms_norm(x, residual, weight, eps, self.peers, policy=policy)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks: `x` itself, summed in place (NCCL, two-shot), or a new tensor (one-shot)."""
        path = self.policy.path(x.nbytes) if x.dtype == self.dtype and x.is_contiguous() else "nccl"
        if path == "two_shot" and x.nbytes % (self.world * 16):
            path = "nccl"  # two-shot splits the message in 16-byte-aligned slices, one per rank
        self.calls[path] += 1
        if path == "nccl":
            dist.all_reduce(x, group=self.group)
            return x
        staged = self.buffer[:x.numel()].view(x.shape)
        if path == "one_shot":  # the kernel copies x into this rank's buffer itself
            return self.ops.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, torch.empty_like(x))
        staged.copy_(x)
        return self.ops.two_shot_all_reduce_out(staged, "sum", self.group_name, x)
