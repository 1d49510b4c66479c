"""The process groups of a tensor-parallel engine.

Two groups over the same ranks, as vLLM has them: `compute` carries the model's all-reduces (NCCL on
CUDA, rank r on cuda:r; gloo on CPU) and `control` (always gloo, on CPU tensors) carries rank 0's
messages to the workers: each prepared step, the shutdown, and the few agreements made at start.
The control group's timeout is long because a worker waits on it for as long as the engine is idle.

On CUDA the compute group's small all-reduces (a decode step's) go over peer-to-peer buffers instead of
NCCL when every GPU can reach every other (`tp/all_reduce.py`); `use_p2p` turns that on, on every rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from governor.engine.tp.all_reduce import AllReducePolicy, P2PAllReduce, p2p_unavailable_reason

# Ranks' equal tensors concatenated along dim 0 (renamed in newer PyTorch; the old name warns there).
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

COMPUTE_TIMEOUT = timedelta(minutes=10)  # rendezvous, and any one all-reduce
CONTROL_TIMEOUT = timedelta(days=365)  # a worker waits here between steps, however long the engine idles


@dataclass
class TPGroup:
    """This process's rank among `size` tensor-parallel ranks. size 1 (`SINGLE`) needs no groups and
    every collective is the identity."""

    rank: int = 0
    size: int = 1
    compute: Any = None  # torch.distributed ProcessGroup, None when size is 1
    control: Any = None
    p2p: P2PAllReduce | None = None  # the all-reduce of small messages on CUDA, when `use_p2p` set it up

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (the partial outputs of a row-parallel matmul): `x` summed in place, or a
        new tensor (the one-shot path); use the returned tensor."""
        if self.p2p is not None:
            return self.p2p(x)
        if self.size > 1:
            dist.all_reduce(x, group=self.compute)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank r's columns at r * n (a vocabulary-parallel matmul's
        outputs side by side)."""
        if self.size == 1:
            return x
        rows, n = x.shape
        out = torch.empty(self.size * rows, n, dtype=x.dtype, device=x.device)
        _all_gather_into_tensor(out, x.contiguous(), group=self.compute)
        return out.view(self.size, rows, n).permute(1, 0, 2).reshape(rows, self.size * n)

    def broadcast_device(self, x: torch.Tensor) -> None:
        """Rank 0's device tensor `x` into every rank's `x`, over the compute group (stream-ordered, no host sync)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.compute)

    def use_p2p(self, device: torch.device, dtype: torch.dtype, enabled: bool = True) -> str | None:
        """Set up the peer-to-peer all-reduce where every rank can (they agree: all or none); collective.
        Returns why it is not used, or None when it is."""
        if self.size == 1:
            return "one rank"
        reason = ("disabled (disable_custom_all_reduce)" if not enabled
                  else p2p_unavailable_reason(device, self.size, dtype))
        if self.min(0 if reason is not None else 1) == 0:
            return reason or "another rank cannot use it"
        self.p2p = P2PAllReduce(self.compute, device, dtype, AllReducePolicy.for_size(self.size))
        return None

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's CPU tensor `x` into every rank's `x` (same shape and dtype), over the control group."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.control)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_errors(self, error: BaseException | None) -> list[str | None]:
        """Every rank's error (as text) or None: each rank learns whether any rank failed."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        if self.size == 1:
            return [mine]
        errors: list[str | None] = [None] * self.size
        dist.all_gather_object(errors, mine, group=self.control)
        return errors


SINGLE = TPGroup()


def rank_device(device_type: str, rank: int, size: int) -> torch.device:
    """The device of `rank`: cuda:rank when several ranks share a CUDA host, else the device type."""
    return torch.device("cuda", rank) if device_type == "cuda" and size > 1 else torch.device(device_type)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous (rank 0 picks it before starting the workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_no_open_group() -> None:
    """RuntimeError when this process already has torch.distributed's default group (an open engine)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: another tensor-parallel "
                           "engine is open here. Close it (LLM.close() / LLMEngine.close()) before starting one")


def init_tp_group(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
    """Join the rendezvous on 127.0.0.1:`port` as `rank` of `size`; blocks until every rank has joined.

    Uses torch.distributed's default group, so one tensor-parallel engine per process at a time."""
    check_no_open_group()
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # bind the NCCL communicator to this rank's GPU now, not at first use
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=COMPUTE_TIMEOUT, **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, control)


def destroy_tp_group(tp: TPGroup) -> None:
    """Leave the groups (idempotent; a no-op for `SINGLE`)."""
    if tp.p2p is not None:
        tp.p2p.close()
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    tp.compute = tp.control = tp.p2p = None
