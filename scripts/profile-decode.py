"""Where a decode step's GPU time goes: CUDA kernel time by kernel, from torch.profiler (GPU only).

    python3 scripts/profile-decode.py MODEL_DIR OUT_JSON [--batch 1] [--context 512] [--steps 20] [engine args as
    key=value, e.g. load_format=dummy dtype=bfloat16 max_model_len=4096 enforce_eager=true]

Decodes `steps` steps of a `batch` of `context`-token prompts after a warm-up, then sums device time per
kernel name. Pass enforce_eager=true: the profiler (torch 2.11, 4 x H200) traced the kernels of about one CUDA
graph replay in twenty, so with graphs the sums are not a step's. Eager kernels take the time they take in a
graph; the gaps between them do not (scripts/profile-tp-step.py measures a graph step's time as a whole).

Prints the top kernels and writes them to OUT_JSON, with the kernel time and count per step, the wall time of a
step (timed without the profiler), the time the GPU was busy (the union of the kernels' intervals: wall less busy
is the GPU waiting for the host) and, under tensor parallelism, the time in collectives (an all-reduce's kernel
also waits for the slowest rank to reach it).

It also attributes the step's critical path: kernels in order of their end, each charged with how far it moves the
latest end seen so far (kernels under programmatic dependent launch overlap the one before, so their own durations
include waiting; what each adds to the timeline does not). Gaps longer than --segment-gap-us start a new segment
and are charged to no kernel, so with graphs the partly traced replays still give each kernel's mean added time
("added_us_per_call"), which times its calls per step in an eager profile give the step's share.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from governor.engine import LLM, SamplingParams
from governor.engine.bench.throughput import step_until_every_request_decodes, sync_device


def _value(v: str) -> object:
    if v.startswith("{"):  # a JSON object, e.g. speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        return json.loads(v)
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        return v


_COLLECTIVES = ("nccl", "all_reduce", "allreduce", "symm", "barrier")  # kernel-name parts of the collectives


def _union_us(intervals: list[tuple[int, int]]) -> float:
    """Microseconds covered by at least one of the [start, end) intervals."""
    covered, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            covered += e - s
            end = e
        elif e > end:
            covered += e - end
            end = e
    return covered


def critical_path(kernels: list[tuple[int, int, str]], segment_gap_us: float) -> dict[str, tuple[float, int]]:
    """Per kernel name, (microseconds it added to the timeline, calls): kernels taken in order of their end, each
    charged with its end less the latest end before it, or with its own duration where it starts more than
    segment_gap_us after that end (a new segment: the gap itself is charged to nobody)."""
    added: dict[str, tuple[float, int]] = {}
    latest: float | None = None
    for start, end, name in sorted(kernels, key=lambda k: k[1]):
        new_segment = latest is None or start - latest > segment_gap_us
        charge = end - start if new_segment else max(0.0, end - latest)  # type: ignore[operator]
        us, calls = added.get(name, (0.0, 0))
        added[name] = (us + charge, calls + 1)
        latest = end if latest is None else max(latest, end)
    return added


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--segment-gap-us", type=float, default=30.0,
                    help="an idle gap longer than this ends a traced segment (not charged to the next kernel)")
    ap.add_argument("engine_args", nargs="*")
    a = ap.parse_intermixed_args()
    kwargs = dict(kv.split("=", 1) for kv in a.engine_args)
    llm = LLM(a.model, **{k: _value(v) for k, v in kwargs.items()})
    eng = llm.engine
    rng = random.Random(0)
    # Enough tokens for the warm-up, timed and profiled steps.
    params = SamplingParams(temperature=0.0, max_tokens=2 * a.steps + 16, ignore_eos=True)
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    for i in range(a.batch):
        eng.add_request(f"p{i}", [rng.randrange(2, vocab) for _ in range(a.context)], params)
    step_until_every_request_decodes(eng)  # the prefill steps
    for _ in range(4):  # warm-up decode steps
        eng.step()
    sync_device()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    sync_device()
    wall_ms = (time.perf_counter() - t0) * 1e3 / a.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        sync_device()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    kernels: list[tuple[int, int, str]] = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((ev.time_range.start, ev.time_range.end))
            kernels.append((ev.time_range.start, ev.time_range.end, ev.name))
            row = by_name[ev.name]
            row[0] += ev.time_range.elapsed_us() / a.steps / 1e3  # ms per step
            row[1] += 1 / a.steps
    rows = sorted(((n, t, c) for n, (t, c) in by_name.items()), key=lambda r: -r[1])
    total = sum(t for _, t, _ in rows)
    count = sum(c for _, _, c in rows)
    busy_ms = _union_us(intervals) / a.steps / 1e3
    collective_ms = sum(t for n, t, _ in rows if any(k in n.lower() for k in _COLLECTIVES))
    added = critical_path(kernels, a.segment_gap_us)
    print(f"cuda_graphs={eng.runner.graphs is not None}: {wall_ms:.3f} ms per step (wall), GPU busy {busy_ms:.3f} ms; "
          f"{total:.3f} ms of kernels per step, {count:.0f} kernels, {collective_ms:.3f} ms in collectives")
    for n, t, c in rows[:25]:
        print(f"{t:8.3f} ms {c:6.0f}x  {n[:110]}")
    print("added to the timeline, us per call (calls traced):")
    for n, (us, calls) in sorted(added.items(), key=lambda kv: -kv[1][0] * kv[1][1])[:25]:
        print(f"{us / calls:8.2f} us {calls:6d}x  {n[:110]}")
    with open(a.out, "w") as f:
        json.dump({"batch": a.batch, "context": a.context, "steps": a.steps,
                   "cuda_graphs": eng.runner.graphs is not None, "wall_ms_per_step": wall_ms,
                   "busy_ms_per_step": busy_ms, "collective_ms_per_step": collective_ms,
                   "kernel_ms_per_step": total, "kernels_per_step": count,
                   "kernels": [{"name": n, "ms_per_step": t, "per_step": c,
                                "added_us_per_call": added[n][0] / added[n][1] if added.get(n, (0, 0))[1] else None}
                               for n, t, c in rows]}, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
