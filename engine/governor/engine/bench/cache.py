"""`governor bench prefix` and `governor bench kv`: what the prefix cache and the fp8 KV cache buy.

prefix: time to first token with a long shared system prompt, cold (never seen) against warm (cached),
at several concurrencies; and how often a cache hit changes a greedy output against its cold run.
kv: fp8 against model-dtype KV at one memory budget — blocks, concurrent sequences at a context
length, decode throughput at that context, and logit agreement (top-1, KL) over a greedy generation.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from governor.engine.bench.throughput import hardware, sync_device
from governor.engine.llm import LLM
from governor.engine.llm_engine import LLMEngine
from governor.engine.sampling_params import SamplingParams


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n token ids drawn uniformly from [0, vocab) (benchmark prompts)."""
    return [rng.randrange(vocab) for _ in range(n)]


def _ttfts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], dict[str, list[int]]]:
    """Admit all prompts at once; seconds from admission to each request's first token, and outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync_device()
    t0 = time.perf_counter()
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        result = engine.step()
        now = time.perf_counter()  # step() ends with the sampled tokens on the host: no extra sync needed
        for ev in result.events:
            first.setdefault(ev.request_id, now - t0)
        for out in result.finished:
            outputs[out.request_id] = out.outputs[0].token_ids
    return [first[r] for r in ids], {r: outputs[r] for r in ids}


def _summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"mean_ms": 1e3 * sum(s) / len(s), "p50_ms": 1e3 * s[len(s) // 2], "max_ms": 1e3 * s[-1]}


def bench_prefix(model: str, engine_args: dict[str, Any], system_len: int, suffix_len: int,
                 concurrencies: list[int], divergence_prompts: int, divergence_tokens: int, seed: int = 0
                 ) -> dict[str, Any]:
    llm = LLM(model, **{**engine_args, "enable_prefix_caching": True})
    eng = llm.engine
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    rng = random.Random(seed)
    rows = []
    for c in concurrencies:
        # Warm-up at this shape (kernel compilation, allocator, a cache hit), not measured.
        warmup_sys = random_ids(rng, vocab, system_len)
        for _ in range(2):
            _ttfts(eng, [warmup_sys + random_ids(rng, vocab, suffix_len) for _ in range(c)], 1)
        # Cold: a system prompt never seen before. Warm: the same one after a priming request.
        cold_sys = random_ids(rng, vocab, system_len)
        cold, _ = _ttfts(eng, [cold_sys + random_ids(rng, vocab, suffix_len) for _ in range(c)], 1)
        warm_sys = random_ids(rng, vocab, system_len)
        _ttfts(eng, [warm_sys + random_ids(rng, vocab, suffix_len)], 1)
        hits_before = eng.scheduler.prefix_cache_hit_tokens
        warm, _ = _ttfts(eng, [warm_sys + random_ids(rng, vocab, suffix_len) for _ in range(c)], 1)
        rows.append({"concurrency": c, "cold": _summary(cold), "warm": _summary(warm),
                     "speedup_mean": sum(cold) / sum(warm),
                     "warm_hit_tokens": eng.scheduler.prefix_cache_hit_tokens - hits_before})
    # Divergence: each prompt alone, first cold (never seen) then again warm (every full block cached),
    # so the decode batch is the same and only the cache hit differs.
    identical = 0
    first_diff = []
    for _ in range(divergence_prompts):
        prompt = random_ids(rng, vocab, system_len + suffix_len)
        _, cold_out = _ttfts(eng, [prompt], divergence_tokens)
        _, warm_out = _ttfts(eng, [prompt], divergence_tokens)
        a, b = next(iter(cold_out.values())), next(iter(warm_out.values()))
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        identical += d is None
        if d is not None:
            first_diff.append(d)
    llm.close()
    return {
        "system_len": system_len, "suffix_len": suffix_len, "ttft": rows,
        "divergence": {"prompts": divergence_prompts, "tokens": divergence_tokens, "identical": identical,
                       "first_divergence_positions": first_diff,
                       "note": "each prompt alone: first sight (cold) vs again with every full block cached"},
        "engine": {"model_digest": eng.model_digest, "dtype": str(eng.dtype), "kv_dtype": str(eng.kv_dtype),
                   "kv_blocks_total": eng.num_blocks, "settings": eng.config.non_default_settings()},
    }


def _decode_throughput(llm: LLM, batch: int, context: int, new_tokens: int, seed: int) -> dict[str, float]:
    """Decode tokens/s at `context`: the same batch run to 1 token (prefill only) and to `new_tokens`;
    the difference in wall time is the decode of batch * (new_tokens - 1) tokens. (Early finishers of a
    chunked prefill already decode while others prefill, so a single run cannot be split cleanly.)"""
    eng = llm.engine
    rng = random.Random(seed)
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    prompts = [{"prompt_token_ids": random_ids(rng, vocab, context)} for _ in range(batch)]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sync_device()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        sync_device()
        return time.perf_counter() - t0

    prefill_s = timed(1)
    total_s = timed(new_tokens)
    decode_s = max(total_s - prefill_s, 1e-9)
    decoded = batch * (new_tokens - 1)
    return {"batch": batch, "context": context, "prefill_s": prefill_s, "total_s": total_s,
            "decode_tokens": decoded, "decode_s": decode_s, "decode_tok_s": decoded / decode_s}


def weight_bytes(llm: LLM) -> int:
    """Bytes of this rank's model parameters (packed quantized tensors as stored; a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def kv_capacity_by_weights(model: str, engine_args: dict[str, Any], context: int,
                           weights: list[str]) -> dict[str, Any]:
    """What smaller weights give the KV cache: for each weight format (`none`: the checkpoint's dense weights, or a
    `quantization` method) and each KV dtype, the weights' bytes and the KV blocks the engine sizes in what memory is
    left (on a GPU: `gpu_memory_utilization` of it, less the weights and activations; `kv_cache_memory_bytes`, when
    given, fixes the cache instead, and then only the weights change)."""
    rows: dict[str, Any] = {}
    for fmt in weights:
        for kv in ("auto", "fp8"):
            llm = LLM(model, **{**engine_args, "kv_cache_dtype": kv, "quantization": None if fmt == "none" else fmt})
            eng = llm.engine
            rows[f"{fmt}/{'model_dtype' if kv == 'auto' else 'fp8'}"] = {
                "weights": fmt, "kv_dtype": str(eng.kv_dtype), "weight_bytes": weight_bytes(llm),
                "kv_blocks_total": eng.num_blocks,
                "max_concurrent_at_context": eng.num_blocks * eng.block_size // context}
            llm.close()
            del llm, eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def bench_kv(model: str, engine_args: dict[str, Any], context: int, batches: list[int], new_tokens: int,
             accuracy_prompt_len: int, accuracy_tokens: int, seed: int = 0,
             weights: list[str] | None = None) -> dict[str, Any]:
    """fp8 against model-dtype KV for the engine `engine_args` describe: capacity, decode throughput, agreement; with
    `weights` (e.g. ["none", "fp8"]), also the KV capacity of each weight format (`kv_capacity_by_weights`)."""
    out: dict[str, Any] = {"context": context, "variants": {}}
    if weights:
        out["weights"] = kv_capacity_by_weights(model, engine_args, context, weights)
    logits: dict[str, torch.Tensor] = {}
    sequence: list[int] | None = None
    for name, kv in (("model_dtype", "auto"), ("fp8", "fp8")):
        llm = LLM(model, **{**engine_args, "kv_cache_dtype": kv})
        eng = llm.engine
        row: dict[str, Any] = {"kv_dtype": str(eng.kv_dtype), "kv_blocks_total": eng.num_blocks,
                               "max_concurrent_at_context": eng.num_blocks * eng.block_size // context}
        llm.generate([{"prompt_token_ids": [1] * context}] * 2, SamplingParams(temperature=0.0, max_tokens=2))
        row["decode"] = [_decode_throughput(llm, b, context, new_tokens, seed) for b in batches
                         if b * -(-(context + new_tokens) // eng.block_size) <= eng.num_blocks]
        if sequence is None:  # the reference generation, greedy with model-dtype KV
            rng = random.Random(seed + 1)
            prompt = random_ids(rng, min(eng.model_config.vocab_size, len(eng.tokenizer)), accuracy_prompt_len)
            gen = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=accuracy_tokens,
                                                        ignore_eos=True))
            sequence = prompt + gen[0].outputs[0].token_ids
        logits[name] = eng.prompt_logits(sequence)[accuracy_prompt_len - 1:-1].float().cpu()
        out["variants"][name] = row
        llm.close()
        del llm, eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ref, q = logits["model_dtype"].log_softmax(-1), logits["fp8"].log_softmax(-1)
    out["accuracy"] = {"positions": int(ref.shape[0]),
                       "top1_agreement": float((ref.argmax(-1) == q.argmax(-1)).float().mean()),
                       "mean_kl": float((ref.exp() * (ref - q)).sum(-1).mean()),
                       "note": "teacher-forced over a greedy generation of the model-dtype KV engine"}
    return out


def write_envelope(kind: str, model: str, result: dict[str, Any], output_json: str | None) -> dict[str, Any]:
    env = {"benchmark": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": hardware(), "model": str(Path(model).resolve()), "result": result}
    if output_json:
        Path(output_json).write_text(json.dumps(env, indent=2, default=str) + "\n")
    return env
