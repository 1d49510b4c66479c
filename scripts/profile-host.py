"""Where a decode step's host time goes: per-phase medians of `LLMEngine.step`, without cProfile.

    python scripts/profile-host.py MODEL_DIR [--device cpu] [--batch 256] [--prompt-len 100] [--new-tokens 64]
        [engine args as key=value, e.g. dtype=float32 max_model_len=1024 load_format=dummy enforce_eager=true]

Queues `batch` requests of `prompt-len` random tokens (greedy, `new-tokens` each, EOS ignored) after a
warm-up, steps until every request decodes, then times each decode step. The engine carries no timing
code: this script wraps its methods (scheduler.schedule and schedule_continuation, runner.stage,
engine.executor.execute, engine._sample, engine._complete, engine._launched) on the instance and prints the median
milliseconds per step() call of each phase as JSON:

- schedule: Scheduler.schedule, or Scheduler.schedule_continuation (async scheduling)
- stage: ModelRunner.stage (the host buffers of the step)
- launch: the rest of the runner's step: upload, forward and logits (on CPU this is the forward itself;
  on CUDA only the kernel launches, or the graph replay)
- gpu_wait (CUDA): the host blocked on the GPU for a step's tokens; measured by synchronizing at the start of
  _sample (one step at a time) or _complete (async scheduling), where their own wait would otherwise be
- propose (speculative decoding): SpeculativeDecoding.propose, the drafts of the step (a draft model's forwards);
  draft_execute, the part of it in the draft's runner (staging and launching its forwards, or running them on a
  CPU): the rest of propose is mostly the wait for the drafts on the host
- sample: the rest of _sample (sampling kernels, their sync, logprobs; a speculative step's verification)
- complete: the rest of _complete (async scheduling: appending the tokens read, stop checks, events)
- postprocess: the rest of step (settling blocks, appending tokens, stop checks, events; the argmax launch
  and token copy of async scheduling)
- step: the whole step() call
- gpu_busy / gpu_idle (CUDA, from CUDA events, per step the GPU runs): from the step's first upload to the
  end of its sampling (or argmax and token copy), and from the previous step's end to this step's first
  upload -- the time the GPU waits for the host. With async scheduling the next step is queued before the
  running one ends, so the idle time is what is left of the host's lag.

With speculative decoding, `decode.spec` holds the acceptance counters and the phase medians of the steps that
verified drafts alone. Beside the medians, `decode` sums the timed steps: wall time, step mean/p90/p99/max, GPU
busy and idle totals, and the time the garbage collector ran (gc.callbacks) with its count of full (generation 2) runs.
`--gc-freeze` calls gc.freeze() after the warm-up, moving every object alive then out of the collector's
reach, as a server would after start-up.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from governor.engine import LLM, SamplingParams
from governor.engine.bench.throughput import step_until_every_request_decodes


def _value(v: str) -> object:
    if v.startswith("{"):  # a JSON object, e.g. speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        return json.loads(v)
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


class PhaseTimer:
    """Wall time per phase of the current step, summed over calls (a phase may run more than once)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up")
    ap.add_argument("--draft-acceptance", type=float, default=None,
                    help="with a draft model: each draft accepted with this probability, in order, as `governor bench "
                         "spec --draft-acceptance` sets it (bench.spec.ControlledAcceptance)")
    ap.add_argument("engine_args", nargs="*", help="EngineConfig fields as key=value")
    a = ap.parse_intermixed_args()
    kwargs = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.engine_args)}
    kwargs.setdefault("max_model_len", a.prompt_len + a.new_tokens + 16)
    kwargs.setdefault("max_num_seqs", max(a.batch, 1))
    llm = LLM(a.model, device=a.device, **kwargs)
    eng = llm.engine
    cuda = eng.device.type == "cuda"
    if a.draft_acceptance is not None:
        if eng.spec is None:
            raise SystemExit("--draft-acceptance needs a speculative_config")
        from governor.engine.bench.spec import ControlledAcceptance

        ControlledAcceptance(eng.spec, a.draft_acceptance)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(eng.device)

    rng = random.Random(a.seed)
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))

    def prompt() -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(a.prompt_len)]

    # Warm-up: a few requests through prefill and decode (allocator, kernels, graphs).
    llm.generate([prompt() for _ in range(min(a.batch, 4))],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    if a.gc_freeze:
        gc.collect()
        gc.freeze()
    collections = {"s": 0.0, "full": 0, "t0": 0.0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections["t0"] = time.perf_counter()
        else:
            collections["s"] += time.perf_counter() - collections["t0"]
            collections["full"] += info["generation"] == 2

    timer = PhaseTimer()
    sched, runner = eng.scheduler, eng.runner
    inner_execute = eng.executor.execute
    sched.schedule = timer.wrap("schedule", sched.schedule)  # type: ignore[method-assign]
    sched.schedule_continuation = timer.wrap("schedule", sched.schedule_continuation)  # type: ignore[method-assign]
    runner.stage = timer.wrap("stage", runner.stage)  # type: ignore[method-assign]
    eng.executor.execute = timer.wrap("execute", inner_execute)  # type: ignore[method-assign]
    if eng.spec is not None:
        eng.spec.propose = timer.wrap("propose", eng.spec.propose)  # type: ignore[method-assign]
        draft_runner = getattr(eng.spec.proposer, "runner", None)
        if draft_runner is not None:  # a draft model's forwards: staged and launched (or run, on a CPU)
            draft_runner.execute = timer.wrap("draft_execute", draft_runner.execute)  # type: ignore[method-assign]

    # CUDA: an event when the step's GPU work starts (its first upload, after staging) and one when its
    # sampling is done; the gap from one step's end to the next one's start is GPU idle time.
    starts: list[torch.cuda.Event] = []
    ends: list[torch.cuda.Event] = []
    if cuda:
        inner_upload = runner._upload

        def upload(*args: Any, **kwargs: Any) -> Any:
            if len(starts) == len(ends):  # the step's first upload (not a padding one)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                starts.append(ev)
            return inner_upload(*args, **kwargs)
        runner._upload = upload  # type: ignore[method-assign]

    inner_sample = eng._sample

    def record_end() -> None:  # the step's GPU work ends here (its sampling, or its argmax and token copy)
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ends.append(ev)

    def sample(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            t0 = time.perf_counter()
            torch.cuda.current_stream(eng.device).synchronize()
            timer.current["gpu_wait"] += time.perf_counter() - t0
        out = inner_sample(*args, **kwargs)
        record_end()
        return out
    eng._sample = timer.wrap("_sample", sample)  # type: ignore[method-assign]

    inner_launched, inner_complete = eng._launched, eng._complete

    def launched(*args: Any, **kwargs: Any) -> Any:
        flight = inner_launched(*args, **kwargs)
        record_end()
        return flight

    def complete(flight: Any, result: Any) -> Any:
        if flight.ready is not None:
            t0 = time.perf_counter()
            flight.ready.synchronize()
            timer.current["gpu_wait"] += time.perf_counter() - t0
        return inner_complete(flight, result)
    eng._launched = launched  # type: ignore[method-assign]
    eng._complete = timer.wrap("_complete", complete)  # type: ignore[method-assign]

    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(f"p{i}", prompt(), params)
    step_until_every_request_decodes(eng)  # the prefill steps, untimed
    sync()
    timer.current.clear()
    starts.clear()
    ends.clear()

    step_ms: list[float] = []
    gc.callbacks.append(on_gc)
    decode_t0 = time.perf_counter()
    verified: list[bool] = []  # per step: whether it verified drafts
    while eng.has_unfinished_requests():
        before = eng.spec.counters["spec_verification_steps"] if eng.spec is not None else 0
        t0 = time.perf_counter()
        eng.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        verified.append(eng.spec is not None and eng.spec.counters["spec_verification_steps"] > before)
        timer.steps.append(dict(timer.current))
        timer.current.clear()
    sync()
    decode_wall = time.perf_counter() - decode_t0
    gc.callbacks.remove(on_gc)

    rows = []
    for s, total in zip(timer.steps, step_ms, strict=True):
        ms = {k: v * 1e3 for k, v in s.items()}
        launch = ms.get("execute", 0.0) - ms.get("stage", 0.0)
        waited = ms.get("gpu_wait", 0.0)
        in_sample = waited if "_sample" in ms else 0.0
        row = {"schedule": ms.get("schedule", 0.0), "propose": ms.get("propose", 0.0),
               "draft_execute": ms.get("draft_execute", 0.0), "stage": ms.get("stage", 0.0),
               "launch": launch,
               "sample": ms.get("_sample", 0.0) - in_sample,
               "complete": ms.get("_complete", 0.0) - (waited - in_sample),
               "postprocess": total - ms.get("schedule", 0.0) - ms.get("propose", 0.0) - ms.get("execute", 0.0)
               - ms.get("_sample", 0.0) - ms.get("_complete", 0.0), "step": total}
        if cuda:
            row["gpu_wait"] = waited
        rows.append(row)
    gpu: list[dict[str, float]] = []
    if cuda:  # per GPU step: each start (first upload) is followed by its end before the next start
        for i, (st, en) in enumerate(zip(starts, ends, strict=True)):
            gpu.append({"gpu_busy": st.elapsed_time(en)} | ({"gpu_idle": ends[i - 1].elapsed_time(st)} if i else {}))
    keys = list(dict.fromkeys(k for r in rows + gpu for k in r))
    medians = {k: round(statistics.median(r[k] for r in rows + gpu if k in r), 4) for k in keys}
    ordered = sorted(step_ms)
    decode = {"wall_s": round(decode_wall, 4), "step_mean_ms": round(statistics.fmean(step_ms), 4),
              "step_p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
              "step_p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 4), "step_max_ms": round(ordered[-1], 4),
              "gc_s": round(collections["s"], 4), "gc_full_runs": collections["full"]}
    if gpu:
        decode["gpu_busy_s"] = round(sum(g["gpu_busy"] for g in gpu) / 1e3, 4)
        decode["gpu_idle_s"] = round(sum(g.get("gpu_idle", 0.0) for g in gpu) / 1e3, 4)
    if eng.spec is not None:
        decode["spec"] = {k: v for k, v in eng.spec.stats().items() if not isinstance(v, list)}
        spec_rows = [r for r, v in zip(rows, verified, strict=True) if v]
        if spec_rows:  # the steps that verified drafts alone (host phases only: GPU events are not per kind)
            decode["spec"]["median_ms_of_verification_steps"] = {
                k: round(statistics.median(r[k] for r in spec_rows), 4) for k in spec_rows[0]}
    report = {"device": str(eng.device), "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
              "cuda_graphs": runner.graphs is not None, "async_scheduling": eng.config.async_scheduling,
              "gc_freeze": a.gc_freeze, "timed_steps": len(rows), "gpu_steps": len(gpu), "median_ms": medians,
              "decode": decode}
    print(json.dumps(report, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
