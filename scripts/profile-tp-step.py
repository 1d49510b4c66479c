"""Where a decode step's time goes under tensor parallelism (GPU only), measured three ways:

    python3 scripts/profile-tp-step.py MODEL_DIR OUT_JSON --tp N [--batch 1] [--context 512] [--steps 200]
        [engine args as key=value, e.g. load_format=dummy dtype=bfloat16 max_model_len=4096 max_num_seqs=8]

1. lockstep: N processes each build their rank's Worker as the engine does (weights, KV cache, graph ladder,
   all-reduce path), stage the same decode step of `batch` sequences at `context` tokens by themselves, and replay
   its CUDA graph `steps` times back to back. No host work and no messages between replays: the GPU time of a step,
   all-reduces included (they pair up: every rank replays the same graph).
2. runner: the engine (rank 0 leading worker processes, as served) runs one of its decode steps `steps` times more
   through the executor: staging, the step message, the workers' rebuilding of it, the graph and the logits, without
   the scheduler, the sampler or the outputs.
3. engine: `steps` engine steps, everything included (what `bench latency` measures).

For 2 and 3 rank 0 also records CUDA events around each graph replay: the graph's GPU time on rank 0, which grows
when a worker reaches an all-reduce late. Wall time per step less that is rank 0's GPU waiting on its host.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from governor.engine import LLM, SamplingParams
from governor.engine.bench.throughput import step_until_every_request_decodes
from governor.engine.config import EngineConfig
from governor.engine.executor import resolve_worker_spec
from governor.engine.models.model_config import load_model_config
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.sequence import Sequence
from governor.engine.tp.group import SINGLE, destroy_tp_group, free_port, init_tp_group, rank_device
from governor.engine.worker import Worker


def _value(v: str) -> object:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        return v


def _lockstep_rank(rank: int, size: int, port: int, spec: Any, batch: int, context: int, steps: int,
                   results: Any) -> None:
    tp = init_tp_group(rank, size, port, rank_device(spec.device_type, rank, size)) if size > 1 else SINGLE
    try:
        worker = Worker(spec, tp)
        runner, bs = worker.runner, worker.block_size
        blocks = -(-(context + 1) // bs)
        scheduled = []
        for i in range(batch):
            seq = Sequence(f"s{i}", i, [2 + (i + j) % 1000 for j in range(context + 1)],
                           SamplingParams(temperature=0.0, max_tokens=1), 1)
            seq.num_computed_tokens = context
            seq.block_table = list(range(i * blocks, (i + 1) * blocks))
            scheduled.append(ScheduledSeq(seq, 1))
        shape = runner.stage(SchedulerOutput(scheduled))
        key = runner._graph_key(shape)
        runner._run(shape)  # uploads the staged step (and replays its graph) once
        if runner.graphs is None or key is None:  # eager (a dry run on CPU): the forward, host included
            graphs, replay = None, lambda: runner._forward(shape)
        else:
            graphs = runner.graphs
            replay = lambda: graphs.replay(key)  # noqa: E731
        for _ in range(10):
            replay()
        _sync(worker.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            replay()
        _sync(worker.device)
        results.put((rank, (time.perf_counter() - t0) * 1e3 / steps))
    finally:
        if size > 1:
            destroy_tp_group(tp)


def _sync_all() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lockstep(config: EngineConfig, batch: int, context: int, steps: int) -> list[float]:
    """ms per graph replay on each rank, every rank replaying back to back."""
    mc = load_model_config(config.model)
    spec = resolve_worker_spec(config, mc, config.max_model_len or mc.max_position_embeddings, mc.vocab_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    size, port = config.tensor_parallel_size, free_port()
    procs = [ctx.Process(target=_lockstep_rank, args=(r, size, port, spec, batch, context, steps, results))
             for r in range(size)]
    for p in procs:
        p.start()
    times = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return [times[r] for r in range(size)]


class _GraphTimer:
    """CUDA events around each of rank 0's graph replays."""

    def __init__(self, graphs: Any) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        if graphs is not None:  # None: eager (a dry run on CPU), nothing to time
            self.inner = graphs.replay
            graphs.replay = self

    def __call__(self, key: Any) -> torch.Tensor:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = self.inner(key)
        e.record()
        self.events.append((s, e))
        return out

    def take(self) -> tuple[float, float]:
        """(mean graph ms, mean ms from one graph's end to the next's start) of the replays since the last take."""
        _sync_all()
        ev, self.events = self.events, []
        inside = [s.elapsed_time(e) for s, e in ev]
        between = [ev[i][1].elapsed_time(ev[i + 1][0]) for i in range(len(ev) - 1)]
        return sum(inside) / max(1, len(inside)), sum(between) / max(1, len(between))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("engine_args", nargs="*")
    a = ap.parse_intermixed_args()
    engine = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.engine_args)}
    engine["tensor_parallel_size"] = a.tp
    result: dict[str, Any] = {"tp": a.tp, "batch": a.batch, "context": a.context, "steps": a.steps,
                              "engine_args": {k: str(v) for k, v in engine.items()}}

    ranks = lockstep(EngineConfig(model=a.model, **engine), a.batch, a.context, a.steps)
    result["lockstep_ms_per_step"] = ranks
    print(f"TP {a.tp}, batch {a.batch}: lockstep graph replay {max(ranks):.3f} ms/step (ranks: "
          + ", ".join(f"{t:.3f}" for t in ranks) + ")", flush=True)

    llm = LLM(a.model, **engine)
    eng = llm.engine
    timer = _GraphTimer(eng.runner.graphs)
    rng = random.Random(0)
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    params = SamplingParams(temperature=0.0, max_tokens=a.steps + 40, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(f"p{i}", [rng.randrange(2, vocab) for _ in range(a.context)], params)
    step_until_every_request_decodes(eng)  # the prefill steps
    for _ in range(4):
        eng.step()
    ex = eng.executor
    inner = ex.execute
    runner_ms: list[float] = []

    def repeat_once(*args: Any, **kwargs: Any) -> torch.Tensor:
        ex.execute = inner  # only this one step is repeated
        timer.take()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            inner(*args, **kwargs)
        _sync_all()
        runner_ms.append((time.perf_counter() - t0) * 1e3 / a.steps)
        return inner(*args, **kwargs)

    ex.execute = repeat_once
    eng.step()
    runner_graph, runner_gap = timer.take()
    eng.step()
    timer.take()
    host_ms, t0 = 0.0, time.perf_counter()
    for _ in range(a.steps):
        h0 = time.perf_counter()
        eng.step()
        host_ms += time.perf_counter() - h0
    _sync_all()
    engine_ms = (time.perf_counter() - t0) * 1e3 / a.steps
    engine_graph, engine_gap = timer.take()
    result.update(runner_ms_per_step=runner_ms[0], runner_graph_ms=runner_graph, runner_between_graphs_ms=runner_gap,
                  engine_ms_per_step=engine_ms, engine_graph_ms=engine_graph, engine_between_graphs_ms=engine_gap,
                  engine_host_ms_in_step=host_ms * 1e3 / a.steps)
    print(f"  runner: {runner_ms[0]:.3f} ms/step wall; rank 0's graph {runner_graph:.3f} ms, {runner_gap:.3f} ms "
          f"between graphs", flush=True)
    print(f"  engine: {engine_ms:.3f} ms/step wall; rank 0's graph {engine_graph:.3f} ms, {engine_gap:.3f} ms "
          f"between graphs; {host_ms * 1e3 / a.steps:.3f} ms a step inside step()", flush=True)
    llm.close()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
