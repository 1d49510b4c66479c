"""`governor bench spec`: speculative decoding speedup over plain decoding, by batch size and K.

For each draft variant (the target itself as draft: acceptance ~1; a noise-perturbed copy: lower
acceptance; n-gram lookup: free drafts; a separate, cheaper draft model whose acceptance the benchmark sets), one
engine is started and K is swept through the live knob.
Each point reports decode tokens/s, the speedup over K=0 at the same batch, the measured acceptance
rate alpha, and the tokens per verification step against (1 - alpha^(K+1)) / (1 - alpha). It also reports the
draft's cost ratio c (a draft step's time over a target step's: the target's plain decoding rate over the draft
model's own, at the same batch, measured by an engine of the draft alone; 0 for n-gram proposals, which run no model),
the theoretical speedup (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)) and the measured speedup's fraction of it.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from governor.engine.bench.cache import random_ids
from governor.engine.bench.throughput import sync_device
from governor.engine.llm import LLM
from governor.engine.models.checkpoint import weight_files
from governor.engine.sampling_params import SamplingParams
from governor.kernels.argmax import argmax_rows


def perturbed_copy(src: str, dst: str, sigma: float, seed: int = 0) -> str:
    """A copy of checkpoint `src` whose every tensor has Gaussian noise of sigma × its own std added: a
    draft that agrees with the target less often the larger sigma is."""
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    for f in weight_files(src):
        tensors = load_file(str(f))
        noisy = {}
        for name, t in tensors.items():
            x = t.float()
            noisy[name] = (x + torch.randn(x.shape, generator=gen) * sigma * x.std()).to(t.dtype)
        save_file(noisy, str(out / f.name), metadata={"format": "pt"})
    return str(out)


class ControlledAcceptance:
    """A draft model's speculation with the acceptance rate set by the benchmark, for a draft and a target with random
    weights, which agree on next to nothing. Everything runs as it would: the draft model's forwards propose its own
    tokens and the target verifies them in one forward, so every step costs what it costs. Only the decision is
    the benchmark's: each draft of a step is accepted with probability `alpha`, in order, until the first rejection,
    and the step then emits the target's own argmax at that position (the row of its logits that follows the accepted
    drafts). The output is therefore not the target's greedy output; it is consistent with the KV both models keep
    (the accepted drafts are the tokens they computed). Greedy requests without logprobs only: the decision reads one
    argmax a row, as greedy verification does, once a step.

    A reference continuation cannot serve instead: a random-weight model in bf16 flips near-tied argmaxes between
    batch shapes (a one-row GEMV against a several-row GEMM), so a recorded greedy output parts from what a
    verification computes within a few tokens."""

    def __init__(self, spec: Any, alpha: float, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"the controlled acceptance must be within [0, 1], got {alpha}")
        self.alpha = alpha
        self.rng = random.Random(seed)
        spec.verify = self.verify

    def verify(self, sampling: list[Any], logits: torch.Tensor, draft_probs: dict[int, torch.Tensor],
               generator: torch.Generator) -> list[tuple[list[int], list[Any]]]:
        if any(not s.seq.params.greedy or s.seq.params.logprobs is not None for s in sampling):
            raise ValueError("controlled acceptance decides greedy verifications only (no logprobs)")
        argmax = argmax_rows(logits).tolist()  # the one read from the device, as greedy verification makes
        out: list[tuple[list[int], list[Any]]] = []
        row = 0
        for s in sampling:
            drafts = s.draft_tokens
            accepted = 0
            while accepted < len(drafts) and self.rng.random() < self.alpha:
                accepted += 1
            tokens = [*drafts[:accepted], argmax[row + accepted]]
            out.append((tokens, [None] * len(tokens)))
            row += 1 + len(drafts)
        return out


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a verification step yields when each draft is accepted independently with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Speculative decoding's speedup over plain decoding when each of K drafts is accepted with probability alpha
    and a draft step costs c target steps: the tokens a verification step yields over its cost, cK + 1 steps."""
    return expected_tokens_per_step(alpha, k) / (c * k + 1)


def _generation_rate(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> float:
    """Output tokens/s of one greedy batch, prefill included (short prompts keep it a small share; a
    prefill-only subtraction is too noisy at batch 1)."""
    eng = llm.engine
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": random_ids(rng, vocab, input_len)} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync_device()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    sync_device()
    return batch * output_len / (time.perf_counter() - t0)


def bench_spec(model: str, engine_args: dict[str, Any], variants: dict[str, dict[str, Any]], batches: list[int],
               ks: list[int], input_len: int, output_len: int) -> dict[str, Any]:
    """One row per (variant, batch, K). A variant is a speculative_config, or one with "controlled_acceptance": A
    (a draft model's proposals under `ControlledAcceptance` at alpha A)."""
    rows: list[dict[str, Any]] = []
    k_cap = max(ks)
    # (draft model, its quantization) -> batch -> its own plain decoding rate, measured as the draft runs in the
    # speculation: with the draft's quantization, not the target's.
    draft_rates: dict[tuple[str, str | None], dict[int, float]] = {}

    def draft_key(spec: dict[str, Any]) -> tuple[str, str | None]:
        return str(spec.get("model")), spec.get("quantization")

    for spec in variants.values():
        if not spec.get("model"):
            continue
        key = draft_key(spec)
        if key not in draft_rates:
            draft = LLM(key[0], **{**engine_args, "quantization": key[1]})
            _generation_rate(draft, 2, input_len, 4, seed=0)  # warm-up
            draft_rates[key] = {b: _generation_rate(draft, b, input_len, output_len, seed=b) for b in batches}
            draft.close()
            del draft
    for name, variant in variants.items():
        spec = {k: v for k, v in variant.items() if k != "controlled_acceptance"}
        llm = LLM(model, **{**engine_args, "speculative_config": {**spec, "num_speculative_tokens": k_cap}})
        eng = llm.engine
        speculation = eng.spec
        assert speculation is not None, "every variant speculates"
        if "controlled_acceptance" in variant:
            ControlledAcceptance(speculation, variant["controlled_acceptance"])
        for k in sorted(set([0, *ks])):  # warm-up: kernels for every shape the sweep will use
            eng.update_knobs(num_speculative_tokens=k)
            _generation_rate(llm, 2, input_len, 4, seed=0)
        for batch in batches:
            base = None
            for k in sorted(set([0, *ks])):
                eng.update_knobs(num_speculative_tokens=k)
                before = dict(speculation.counters)
                first_before = speculation.accepted_by_position[0] if speculation.accepted_by_position else 0
                rate = _generation_rate(llm, batch, input_len, output_len, seed=batch)
                proposed = speculation.counters["spec_proposed_tokens"] - before["spec_proposed_tokens"]
                accepted = speculation.counters["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                steps = speculation.counters["spec_verification_steps"] - before["spec_verification_steps"]
                first = (speculation.accepted_by_position[0] if speculation.accepted_by_position else 0) - first_before
                # alpha: probability a draft is accepted, estimated at the first position (every
                # verification step has one); accepted/proposed is lower since a rejection ends a step.
                alpha = first / steps if steps else 0.0
                if k == 0:
                    base = rate
                speedup = rate / base if base else None
                rates = draft_rates.get(draft_key(spec))
                c = base / rates[batch] if rates and base else 0.0
                theory = theoretical_speedup(alpha, k, c) if k else 1.0
                row = {"variant": name, "batch": batch, "k": k, "output_tok_s": rate,
                       "controlled_acceptance": variant.get("controlled_acceptance"),
                       "speedup": speedup, "alpha": alpha,
                       "accepted_per_proposed": accepted / proposed if proposed else 0.0,
                       "tokens_per_step": 1 + accepted / steps if steps else 1.0,
                       "expected_tokens_per_step": expected_tokens_per_step(alpha, k) if k else 1.0,
                       "draft_cost_ratio": c, "theoretical_speedup": theory,
                       "fraction_of_theory": speedup / theory if speedup is not None and theory else None}
                rows.append(row)
                print(json.dumps(row))
        llm.close()
        del llm, eng, speculation  # every reference to the engine, so that the next variant has its memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # Where speculation stops paying: per variant, the largest batch at which some K beats K=0.
    crossover: dict[str, Any] = {}
    for name in variants:
        paying = [b for b in batches if any(r["k"] > 0 and (r["speedup"] or 0.0) > 1.0
                                            for r in rows if r["variant"] == name and r["batch"] == b)]
        crossover[name] = {"batches_where_some_k_pays": paying}
    return {"rows": rows, "crossover": crossover, "input_len": input_len, "output_len": output_len}
