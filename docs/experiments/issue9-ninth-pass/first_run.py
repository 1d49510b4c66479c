"""What the first run of the throughput workload pays that the second does not (issue 9, ninth pass).

    python3 first_run.py MODEL OUT_JSON [--workload 256,100,1024] [--engine-args JSON] [--profile OUT_TXT]

One engine (fp8 KV cache, defaults otherwise), the 2-prompt warm-up of `governor bench throughput`, then the workload
twice. Per `engine.step()` call: its wall time, the Triton kernel variants compiled so far (every JIT function of
governor.kernels, all devices) and the caching allocator's device allocations (`num_device_alloc`). Modules the CUDA
driver loads lazily (cuBLAS kernels on first use) are not visible from here: run the script again under
CUDA_MODULE_LOADING=EAGER to compare. Prints the steps whose first-run time exceeds the second run's by > 2 ms.
`--profile`: the host's cProfile (cumulative, top 25) of each run's first 5 and last 5 step calls, written there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from typing import Any

import torch
import triton

import governor.kernels.elementwise as ew
import governor.kernels.gemv as gemv
import governor.kernels.paged_attention as pa
from governor.engine import LLM, SamplingParams
from governor.engine.bench_throughput import Workload, hardware, sync_device
from governor.engine.llm_engine import startup_objects_frozen


def compiled_variants() -> int:
    """Kernel variants Triton holds compiled for the JIT functions of governor.kernels."""
    total = 0
    for mod in (pa, ew, gemv):
        for obj in vars(mod).values():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                total += sum(len(c[0]) for c in obj.device_caches.values())
    return total


def device_allocs() -> int:
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0)) if torch.cuda.is_available() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--workload", default="256,100,1024", help="prompts,input_len,output_len")
    ap.add_argument("--engine-args", default="{}", help="JSON, e.g. for a CPU check of the script")
    ap.add_argument("--profile", help="text file for the host profiles of each run's first and last 5 steps")
    args = ap.parse_args()
    n, i, o = (int(x) for x in args.workload.split(","))
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"hardware": hardware(), "runs": runs,
                              "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
                              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with LLM(args.model, kv_cache_dtype="fp8", **json.loads(args.engine_args)) as llm:
        eng = llm.engine
        prompts, out_lens = Workload(n, (i, i), (o, o)).make(min(eng.model_config.vocab_size, len(eng.tokenizer)))
        params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in out_lens]
        llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        result["after_warm_up"] = {"compiled": compiled_variants(), "device_allocs": device_allocs()}
        steps: list[dict[str, Any]] = []
        step = eng.step
        profiles = {k: cProfile.Profile() for k in ("first", "last")}
        expected_steps: list[int] = [10**9]  # the previous run's step count (the last 5 are profiled from it)

        def timed_step() -> Any:
            k = len(steps)
            prof = (profiles["first"] if k < 5 else profiles["last"] if k >= expected_steps[0] - 5 else None)
            t = time.perf_counter()
            if args.profile and prof is not None:
                prof.enable()
            r = step()
            if args.profile and prof is not None:
                prof.disable()
            steps.append({"s": time.perf_counter() - t, "compiled": compiled_variants(),
                          "device_allocs": device_allocs()})
            return r

        eng.step = timed_step  # type: ignore[method-assign]
        text = io.StringIO()
        for rnd in range(2):
            steps.clear()
            profiles = {k: cProfile.Profile() for k in ("first", "last")}
            with startup_objects_frozen():
                sync_device()
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                sync_device()
                elapsed = time.perf_counter() - t0
            gen = sum(len(x.outputs[0].token_ids) for x in outs)
            runs.append({"round": rnd, "elapsed_s": elapsed, "output_tokens_per_s": gen / elapsed,
                         "steps": list(steps)})
            print(json.dumps({"round": rnd, "elapsed_s": round(elapsed, 3), "tok_s": round(gen / elapsed),
                              "compiled_end": steps[-1]["compiled"], "allocs_end": steps[-1]["device_allocs"]}),
                  flush=True)
            with open(args.out_json, "w") as f:
                json.dump(result, f, indent=2)
            expected_steps[0] = len(steps)
            if args.profile:
                for name, prof in profiles.items():
                    if rnd == 0 and name == "last":
                        continue  # run 0 did not know its step count yet; run 1 profiles its last steps
                    text.write(f"=== run {rnd}, {name} 5 steps\n")
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        if args.profile:
            with open(args.profile, "w") as f:
                f.write(text.getvalue())
    a, b = runs[0]["steps"], runs[1]["steps"]
    start = result["after_warm_up"]
    print("after warm-up:", start)
    for k in range(min(len(a), len(b))):
        if a[k]["s"] - b[k]["s"] > 2e-3:
            print(f"step {k}: {1e3 * a[k]['s']:.1f} ms vs {1e3 * b[k]['s']:.1f}; compiled {a[k]['compiled']} / "
                  f"{b[k]['compiled']}, device allocs {a[k]['device_allocs']} / {b[k]['device_allocs']}")
    print(f"first 10 steps: {sum(x['s'] for x in a[:10]):.3f} s vs {sum(x['s'] for x in b[:10]):.3f} s")


if __name__ == "__main__":
    main()
