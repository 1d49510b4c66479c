"""`governor bench latency`: time to first token and per-token decode latency at one context length, by
batch size. Batch 1 is the latency one user sees; it is what tensor parallelism shortens.

Every step ends with the sampled token ids on the host, so wall time between steps is the step's time.
A step counts as decode once every request of the batch has its first token; its time is the latency
of one output token of each request.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from governor.engine.bench_cache import random_ids
from governor.engine.bench_throughput import sync_device
from governor.engine.llm import LLM
from governor.engine.llm_engine import LLMEngine
from governor.engine.sampling_params import SamplingParams


def _timed_batch(engine: LLMEngine, batch: int, context: int, new_tokens: int, rng: random.Random) -> dict[str, Any]:
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"latency-{time.monotonic_ns()}-{i}" for i in range(batch)]
    sync_device()
    t0 = last = time.perf_counter()
    for rid in ids:
        engine.add_request(rid, random_ids(rng, vocab, context), params)
    started: set[str] = set()
    ttft: float | None = None
    decode: list[float] = []
    while engine.has_unfinished_requests():
        result = engine.step()
        now = time.perf_counter()
        if ttft is None:
            started.update(ev.request_id for ev in result.events if ev.token_id is not None)
            if len(started) == batch:
                ttft = now - t0
        else:
            decode.append(now - last)
        last = now
    if not decode:
        raise ValueError(f"new_tokens={new_tokens} leaves no decode step to time; ask for at least 2")
    decode.sort()
    return {"batch": batch, "context": context, "new_tokens": new_tokens, "ttft_ms": 1e3 * (ttft or 0.0),
            "decode_steps": len(decode), "ms_per_token_mean": 1e3 * statistics.fmean(decode),
            "ms_per_token_p50": 1e3 * decode[len(decode) // 2],
            "ms_per_token_p90": 1e3 * decode[int(0.9 * (len(decode) - 1))],
            "decode_tok_s": batch * len(decode) / sum(decode)}


def bench_latency(model: str, engine_args: dict[str, Any], context: int, batches: list[int], new_tokens: int,
                  seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    with LLM(model, **engine_args) as llm:
        eng = llm.engine
        _timed_batch(eng, 1, context, min(new_tokens, 8), rng)  # warm-up: kernel compilation, allocator
        rows = [_timed_batch(eng, b, context, new_tokens, rng) for b in batches]
        return {"rows": rows,
                "engine": {"model_digest": eng.model_digest, "dtype": str(eng.dtype), "device": str(eng.device),
                           "tensor_parallel_size": eng.config.tensor_parallel_size,
                           "kv_blocks_total": eng.num_blocks, "settings": eng.config.non_default_settings()}}
