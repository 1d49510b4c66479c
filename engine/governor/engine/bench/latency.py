"""`governor bench latency`: time to first token and per-token decode latency at one context length, by
batch size. Batch 1 is the latency one user sees; it is what tensor parallelism shortens.

Every step ends with the sampled token ids on the host, so wall time between steps is the step's time.
A step counts as decode once every request of the batch has its first token, while every request still
gets a token from it; its time is the latency of one output token of each request. Requests are greedy;
`--penalties` and `--structured json` add logits processing to every one (`bench.throughput.RequestOptions`),
whose per-token cost is the difference to the plain run. A structured request ends with its object, so
its decode steps are those up to the first request's end.

On a GPU it also reports the memory roofline: a decode step must read every weight the step uses (all
but the input embedding table, of which it gathers a row per token) and each sequence's KV, so the
fastest possible step is those bytes over the HBM bandwidth, measured in the same run with a large
device-to-device copy. `forward_ms_p50` is the GPU time of the runner's part of a decode step (uploads,
forward, logits) between CUDA events; the rest of the wall time is host work (scheduling, staging,
sampling, launches the GPU waited for).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from governor.engine.bench.cache import random_ids
from governor.engine.bench.throughput import RequestOptions, sync_device
from governor.engine.gc_freeze import startup_objects_frozen
from governor.engine.kv.cache import bytes_per_block
from governor.engine.llm import LLM
from governor.engine.llm_engine import LLMEngine


def hbm_bandwidth_gb_per_s(nbytes: int = 2**30, iters: int = 20) -> float:
    """Achieved HBM bandwidth of a device-to-device copy of `nbytes` (each byte is read and written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds / 1e9


def graph_us_per_call(fn: Callable[[int], object], calls: int, replays: int = 5) -> float:
    """Microseconds per call of fn(0), fn(1), ..., fn(calls - 1), captured once in a CUDA graph (so launch
    overhead is not counted) and replayed `replays` times after a warm replay. fn(i) may use the i-th of several
    inputs, e.g. weight copies that together overflow L2 so every call reads from HBM."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, cuBLAS picks) outside the capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def decode_weight_bytes(engine: LLMEngine) -> int:
    """Weight bytes one decode step reads: every parameter, except that the input embedding table is only
    gathered from (unless it doubles as the output projection)."""
    model = engine.model
    total = sum(p.nbytes for p in model.parameters())  # tied parameters are counted once
    tied = model.lm_head is not None and model.lm_head.data_ptr() == model.embed_tokens.data_ptr()
    return total if tied else total - model.embed_tokens.nbytes


def _record_forward_times(engine: LLMEngine) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """Wrap the runner's step in CUDA events; returns the list each step appends its (start, end) to."""
    times: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    inner = engine.runner.execute

    def execute(*args: Any, **kwargs: Any) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = inner(*args, **kwargs)
        end.record()
        times.append((start, end))
        return logits

    engine.runner.execute = execute  # type: ignore[method-assign]
    return times


def _timed_batch(engine: LLMEngine, batch: int, context: int, new_tokens: int, rng: random.Random,
                 options: RequestOptions) -> dict[str, Any]:
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    params = options.params(new_tokens)
    ids = [f"latency-{time.monotonic_ns()}-{i}" for i in range(batch)]
    sync_device()
    forward_times = _record_forward_times(engine) if engine.device.type == "cuda" else None
    t0 = last = time.perf_counter()
    for rid in ids:
        engine.add_request(rid, random_ids(rng, vocab, context), params)
    started: set[str] = set()
    ttft: float | None = None
    decode: list[float] = []
    timed_forwards: list[int] = []  # the forward_times entry of each timed decode step
    whole = True  # every request took part in every decode step so far
    while engine.has_unfinished_requests():
        result = engine.step()
        now = time.perf_counter()
        got = [ev.request_id for ev in result.events if ev.token_id is not None]
        if ttft is None:
            started.update(got)
            if len(started) == batch:
                ttft = now - t0
        elif whole and len(got) == batch:
            decode.append(now - last)
            if forward_times is not None:
                timed_forwards.append(len(forward_times) - 1)
        else:
            whole = False
        last = now
    if not decode:
        raise ValueError(f"new_tokens={new_tokens} leaves no decode step to time; ask for at least 2")
    decode.sort()
    row = {"batch": batch, "context": context, "new_tokens": new_tokens, "ttft_ms": 1e3 * (ttft or 0.0),
           "decode_steps": len(decode), "ms_per_token_mean": 1e3 * statistics.fmean(decode),
           "ms_per_token_p50": 1e3 * decode[len(decode) // 2],
           "ms_per_token_p90": 1e3 * decode[int(0.9 * (len(decode) - 1))],
           "decode_tok_s": batch * len(decode) / sum(decode)}
    if forward_times is not None:
        del engine.runner.execute  # back to the class's method
        sync_device()
        forward = sorted(forward_times[i][0].elapsed_time(forward_times[i][1]) for i in timed_forwards)
        row["forward_ms_p50"] = forward[len(forward) // 2]
    return row


def _roofline(engine: LLMEngine, row: dict[str, Any], weight_bytes: int, gb_per_s: float) -> None:
    """Add the step's bytes, its time at `gb_per_s`, and the fraction of that the measured step reaches."""
    kv_per_token = bytes_per_block(engine.model_config, engine.block_size, engine.kv_dtype) // engine.block_size
    step_bytes = weight_bytes + row["batch"] * row["context"] * kv_per_token
    row["roofline_bytes_per_step"] = step_bytes
    row["roofline_ms"] = step_bytes / (gb_per_s * 1e9) * 1e3
    row["roofline_fraction_p50"] = row["roofline_ms"] / row["ms_per_token_p50"]


def bench_latency(model: str, engine_args: dict[str, Any], context: int, batches: list[int], new_tokens: int,
                  seed: int = 0, options: RequestOptions | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    opts = options or RequestOptions()
    # Before the engine takes the free memory for its KV cache.
    gb_per_s = hbm_bandwidth_gb_per_s() if torch.cuda.is_available() and engine_args.get("device") != "cpu" else None
    with LLM(model, **engine_args) as llm:
        eng = llm.engine
        # Warm-up: kernel compilation, allocator, a structured request's grammar.
        _timed_batch(eng, 1, context, min(new_tokens, 8), rng, opts)
        with startup_objects_frozen():  # as `governor serve` has them once its engine has started
            rows = [_timed_batch(eng, b, context, new_tokens, rng, opts) for b in batches]
        graphs = eng.runner.graphs
        info: dict[str, Any] = {
            "model_digest": eng.model_digest, "dtype": str(eng.dtype), "device": str(eng.device),
            "tensor_parallel_size": eng.config.tensor_parallel_size, "kv_blocks_total": eng.num_blocks,
            "settings": eng.config.non_default_settings(), "cuda_graphs": graphs is not None,
            "cuda_graph_captures": graphs.num_captures if graphs is not None else 0,
            "cuda_graph_capture_s": eng.executor.cuda_graph_capture_s, "requests": opts.describe()}
        if gb_per_s is not None and eng.device.type == "cuda":
            weight_bytes = decode_weight_bytes(eng)
            info.update(hbm_copy_gb_per_s=gb_per_s, decode_weight_bytes=weight_bytes)
            for row in rows:
                _roofline(eng, row, weight_bytes, gb_per_s)
        return {"rows": rows, "engine": info}
