"""Offline throughput A/B in one process (issue 9, eighth pass): per variant of the decode kernel's module settings,
one engine (fp8 KV cache, defaults otherwise), then the workload of `governor bench throughput` (qwen3-0.6b shape,
256 prompts, 100 -> 1,024 tokens, ignore_eos) run ROUNDS times, with `--pack-ab` the runner's block-table packing on
and off alternately (the packing is decided per step on the host, so one engine serves both). Each `engine.step()`
call's wall time is recorded (`step_s`: with async scheduling a call returns the previous step's tokens, so these are
the host's intervals, which follow the device's steps once it is ahead).

    python3 thr_ab.py MODEL OUT_JSON [--rounds 2] [--pack-ab] [--variants '{"cur": {}, "old": {"NAME": value}}']

Variants run in the order given, one engine each; a variant's name may end in "#N" to run it again ("new#2").
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import governor.engine.runner as runner
import governor.kernels.paged_attention as pa
from governor.engine import LLM, SamplingParams
from governor.engine.bench_throughput import Workload, hardware, sync_device
from governor.engine.llm_engine import startup_objects_frozen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default='{"cur": {}}')
    ap.add_argument("--pack-ab", action="store_true")
    ap.add_argument("--workload", default="256,100,1024", help="prompts,input_len,output_len")
    ap.add_argument("--engine-args", default="{}", help="JSON, e.g. for a CPU check of the script")
    args = ap.parse_args()
    variants: dict[str, dict[str, Any]] = json.loads(args.variants)
    pack_default = runner._PACK_TABLES_MIN_SAVED_BYTES
    rows: list[dict[str, Any]] = []
    result = {"hardware": hardware(), "rows": rows, "variants": variants,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    n, i, o = (int(x) for x in args.workload.split(","))
    workload = Workload(n, (i, i), (o, o))
    for name, settings in variants.items():
        name = name.split("#")[0]
        saved = {k: getattr(pa, k) for k in settings}
        for k, v in settings.items():
            setattr(pa, k, v)
        with LLM(args.model, kv_cache_dtype="fp8", **json.loads(args.engine_args)) as llm:
            eng = llm.engine
            prompts, out_lens = workload.make(min(eng.model_config.vocab_size, len(eng.tokenizer)))
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
            llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            first: list[list[int]] | None = None
            step = eng.step
            step_s: list[float] = []

            def timed_step(step: Any = step, step_s: list[float] = step_s) -> Any:
                t = time.perf_counter()
                r = step()
                step_s.append(time.perf_counter() - t)
                return r

            eng.step = timed_step  # type: ignore[method-assign]
            for rnd in range(args.rounds):
                for pack in (True, False) if args.pack_ab else (True,):
                    step_s.clear()
                    runner._PACK_TABLES_MIN_SAVED_BYTES = pack_default if pack else 2**62
                    with startup_objects_frozen():
                        sync_device()
                        t0 = time.perf_counter()
                        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                        sync_device()
                        elapsed = time.perf_counter() - t0
                    tokens = [list(o.outputs[0].token_ids) for o in outs]
                    first = tokens if first is None else first
                    gen = sum(len(t) for t in tokens)
                    row = {"variant": name, "round": rnd, "packed_tables": pack, "elapsed_s": elapsed,
                           "generated_tokens": gen, "output_tokens_per_s": gen / elapsed,
                           "tokens_equal_first_run": tokens == first, "step_s": list(step_s)}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
                    with open(args.out_json, "w") as f:
                        json.dump(result, f, indent=2)
        runner._PACK_TABLES_MIN_SAVED_BYTES = pack_default
        for k, v in saved.items():
            setattr(pa, k, v)


if __name__ == "__main__":
    main()
