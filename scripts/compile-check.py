"""Which Triton kernels compile while requests run, after the engine has started (CUDA graphs captured,
kernels warmed up)? Run with a fresh TRITON_CACHE_DIR so nothing is found on disk:

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile-check.py MODEL_DIR [engine args as key=value]

Starts the engine, lists the cache, then runs a mixed workload (batches of 1, 8, 32 and 81 prompts of
assorted lengths through prefill, mixed and decode steps) and prints, as JSON, the kernels whose compiled
artifacts appeared meanwhile, and the seconds each batch took.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from governor.engine import LLM, SamplingParams


def kernels(cache: Path) -> set[str]:
    """Compiled kernels in the cache, one per specialization: its hash folder and the kernel's name."""
    return {str(p.relative_to(cache)) for p in cache.rglob("*.json") if not p.name.startswith("__grp__")}


def main() -> None:
    model, *pairs = sys.argv[1:]
    kwargs: dict[str, object] = {}
    for kv in pairs:
        k, v = kv.split("=", 1)
        kwargs[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    start_s = time.perf_counter() - t0
    before = kernels(cache)
    rng = random.Random(0)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.tokenizer))
    batches = []
    for n, lo, hi in [(1, 5, 600), (8, 5, 600), (32, 300, 700), (81, 90, 110)]:
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        batches.append({"prompts": n, "seconds": round(time.perf_counter() - t, 3)})
    new = sorted(kernels(cache) - before)
    print(json.dumps({"engine_start_s": round(start_s, 2), "kernels_at_start": len(before),
                      "compiled_while_serving": new, "batches": batches}, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
