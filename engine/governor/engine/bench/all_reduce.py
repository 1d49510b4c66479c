"""`governor bench all-reduce`: the time of one all-reduce by message size and path, on N GPUs of this host.

Each path — one-shot and two-shot over peer-to-peer buffers, and NCCL (tp/all_reduce.py) — runs `calls`
all-reduces of one size captured in a CUDA graph, as a decode step issues them; the graph is replayed `replays`
times and rank 0 times the replays with CUDA events. Each path's sum is checked against a float64 sum of what
every rank put in. The table is what the thresholds in tp/all_reduce.py come from, and its per-size times are the
all-reduce share of a decode step's roofline (`bench latency` at TP > 1).

Messages of whole rows of `hidden` values also time what a decode step does with them: the all-reduce followed by the
residual add and RMSNorm, as two kernels (one-shot or two-shot, then `add_rms_norm`: `one_shot+norm`,
`two_shot+norm`) and as the fused kernel (`fused`, kernels/reduce_norm.py); their error is the summed rows' (plus
the residual). The fused kernel's threshold in tp/all_reduce.py comes from these rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from governor.engine.tp.all_reduce import AllReducePolicy, P2PAllReduce, p2p_unavailable_reason
from governor.engine.tp.group import destroy_tp_group, free_port, init_tp_group
from governor.kernels.elementwise import add_rms_norm
from governor.kernels.launch_policy import policy_for

PATHS = ("one_shot", "two_shot", "nccl")
_FORCED = {"one_shot": lambda big: AllReducePolicy(big, big, big), "two_shot": lambda big: AllReducePolicy(0, big),
           "nccl": lambda big: AllReducePolicy(0, 0)}


def bench_all_reduce(world: int, sizes: list[int], dtype: torch.dtype, calls: int = 20,
                     replays: int = 50, hidden: int = 4096) -> dict[str, Any]:
    """Rows {bytes, path, us, max_abs_err} for every size (bytes) and path, from `world` processes, one per GPU;
    `hidden`: the row width of the all-reduce + norm paths."""
    if torch.cuda.device_count() < world:
        raise ValueError(f"bench all-reduce --tp {world} needs {world} GPUs; torch sees {torch.cuda.device_count()}")
    reason = p2p_unavailable_reason(torch.device("cuda", 0), world)
    if reason is not None:
        raise ValueError(f"the peer-to-peer all-reduce cannot run here: {reason}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, sizes, dtype, calls, replays, hidden, queue))
             for rank in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join(60)
    if isinstance(result, str):
        raise RuntimeError(f"bench all-reduce failed: {result}")
    result["info"] = {"world": world, "dtype": str(dtype).removeprefix("torch."), "calls_per_graph": calls,
                      "replays": replays, "hidden": hidden, "policy": AllReducePolicy.for_size(world).__dict__}
    return result


def _rank_main(rank: int, world: int, port: int, sizes: list[int], dtype: torch.dtype, calls: int, replays: int,
               hidden: int, queue: Any) -> None:
    device = torch.device("cuda", rank)
    tp = init_tp_group(rank, world, port, device)
    try:
        rows = _measure(tp, device, sizes, dtype, calls, replays, hidden)
        if rank == 0:
            queue.put({"rows": rows})
    except Exception as e:
        if rank == 0:
            queue.put(f"{type(e).__name__}: {e}")
        raise
    finally:
        tp.p2p = None  # the reducers here are the bench's own
        destroy_tp_group(tp)


def _measure(tp: Any, device: torch.device, sizes: list[int], dtype: torch.dtype, calls: int,
             replays: int, hidden: int) -> list[dict[str, Any]]:
    big = max(sizes)
    reducers = {path: P2PAllReduce(tp.compute, device, dtype, _FORCED[path](big)) for path in PATHS}
    try:
        return _time_paths(tp, device, sizes, dtype, calls, replays, hidden, reducers)
    finally:
        for r in reducers.values():
            r.close()


def _ops(reducers: dict[str, P2PAllReduce], nbytes: int, hidden: int, dtype: torch.dtype, residual: torch.Tensor,
         weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each path's call on one message: its sum (the all-reduce paths) or its summed rows plus `residual` (the
    all-reduce + norm paths, where the message is whole rows that the fused kernel takes)."""
    ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {path: reducers[path] for path in PATHS}
    one_shot = reducers["one_shot"]
    rows = nbytes // (hidden * dtype.itemsize)
    if (rows and nbytes % (hidden * dtype.itemsize) == 0 and one_shot.peers is not None
            and rows <= one_shot.peers.max_rows(hidden, dtype)):
        policy = policy_for(residual.device)

        def then_norm(reduce: P2PAllReduce) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda x: add_rms_norm(reduce(x).view(rows, hidden), residual, weight, 1e-6, policy=policy)[1]

        def fused(x: torch.Tensor) -> torch.Tensor:
            out = one_shot.add_rms_norm(x.view(rows, hidden), residual, weight, 1e-6, policy)
            assert out is not None
            return out[1]

        ops.update({"one_shot+norm": then_norm(one_shot), "two_shot+norm": then_norm(reducers["two_shot"]),
                    "fused": fused})
    return ops


def _time_paths(tp: Any, device: torch.device, sizes: list[int], dtype: torch.dtype, calls: int, replays: int,
                hidden: int, reducers: dict[str, P2PAllReduce]) -> list[dict[str, Any]]:
    rows = []
    weight = torch.ones(hidden, dtype=dtype, device=device)
    for nbytes in sizes:
        n = nbytes // dtype.itemsize
        gen = torch.Generator(device=device).manual_seed(1000 * tp.rank + n)
        inputs = torch.randn(calls, n, generator=gen, device=device).to(dtype)
        residual = torch.randn(max(n // hidden, 1), hidden, generator=torch.Generator(device=device).manual_seed(n),
                               device=device).to(dtype)  # the same on every rank
        everyone = [torch.empty_like(inputs) for _ in range(tp.size)]
        dist.all_gather(everyone, inputs, group=tp.compute)
        want = torch.stack(everyone).double().sum(0)
        for path, reduce in _ops(reducers, nbytes, hidden, dtype, residual, weight).items():
            expect = want if path in PATHS else want + residual.double().reshape(-1)
            work = inputs.clone()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up outside the capture
                for i in range(calls):
                    reduce(work[i])
            torch.cuda.current_stream(device).wait_stream(side)
            work.copy_(inputs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # each call's sum: in place, or a new tensor of the graph's pool
                sums = [reduce(work[i]) for i in range(calls)]
            work.copy_(inputs)
            graph.replay()
            torch.cuda.synchronize(device)
            err = float((torch.stack([s.reshape(-1) for s in sums]).double() - expect).abs().max())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier(group=tp.compute)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize(device)
            rows.append({"bytes": nbytes, "path": path, "us": start.elapsed_time(end) * 1e3 / (replays * calls),
                         "max_abs_err": err})
    return rows


def parse_sizes(text: str) -> list[int]:
    """'8K,1M,4096' -> [8192, 1048576, 4096] (K: KiB, M: MiB)."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": 1024, "M": 1024 * 1024}.get(part[-1:], 1)
        sizes.append(int(part.rstrip("KM")) * scale)
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"--sizes needs positive byte counts, got {text!r}")
    return sizes
