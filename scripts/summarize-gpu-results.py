"""Print a summary of the results a deadline-driven GPU script gathered (benchmarks/*.sh):

    python3 scripts/summarize-gpu-results.py RESULTS_DIR

Reads what is there, in this order: latency*.json (`bench latency`), attention*.json (`bench attention`),
profile-*.json (scripts/profile-decode.py), host-*.log (scripts/profile-host.py), compile-check.log
(scripts/compile-check.py), thr-*.json (`bench throughput`, engine or transformers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _json_in_log(path: Path) -> Any:
    text = path.read_text()
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def main() -> None:
    out = Path(sys.argv[1])
    for f in sorted(out.glob("latency*.json")):
        r = json.loads(f.read_text())["result"]
        e = r["engine"]
        print(f"{f.stem}: cuda_graphs={e['cuda_graphs']} hbm_copy_gb_per_s={e.get('hbm_copy_gb_per_s', 0):.0f}")
        for x in r["rows"]:
            print(f"  batch {x['batch']}: {x['ms_per_token_p50']:.2f} ms/token p50 (p90 {x['ms_per_token_p90']:.2f}), "
                  f"GPU {x.get('forward_ms_p50', 0):.2f} ms, roofline {x.get('roofline_ms', 0):.2f} ms = "
                  f"{100 * x.get('roofline_fraction_p50', 0):.0f}%, TTFT {x['ttft_ms']:.0f} ms")
    for f in sorted(out.glob("attention*.json")):
        r = json.loads(f.read_text())["result"]
        print(f"{f.stem}: HBM copy {r['info']['hbm_copy_gb_per_s'] or 0:.0f} GB/s")
        for x in r["rows"]:
            table = f" {x['table']:10}" if "table" in x else ""
            splits = str(x.get("num_splits") or "auto")
            print(f"  b{x['batch']} {x['num_q_heads']}:{x['num_kv_heads']} ctx {x['context']:6} {x['kv_dtype']:4}"
                  f"{table} splits {splits:4}={x['num_splits_run']:2}: {x['us_p50']:8.1f} us, "
                  f"{x['kv_gb_per_s']:6.0f} GB/s, {100 * x.get('fraction_of_hbm', 0):3.0f}%"
                  + (f"; kernels alone {x['kernel_us_p50']:8.1f} us, {100 * x.get('fraction_of_hbm_kernels', 0):3.0f}%"
                     if "kernel_us_p50" in x else ""))
    for f in sorted(out.glob("profile-*.json")):
        r = json.loads(f.read_text())
        print(f"{f.stem}: {r['kernel_ms_per_step']:.2f} ms kernels/step, {r['kernels_per_step']:.0f} kernels/step")
        for k in r["kernels"][:8]:
            print(f"  {k['ms_per_step']:.3f} ms x{k['per_step']:.0f}  {k['name'][:90]}")
    for f in sorted(out.glob("host-*.log")):
        r = _json_in_log(f)
        print(f"{f.stem}: " + ("(no JSON)" if r is None else f"{r['median_ms']}\n   decode {r.get('decode')}"))
    f = out / "compile-check.log"
    if f.exists():
        r = _json_in_log(f)
        print("compile-check:", "(no JSON)" if r is None else json.dumps(r))
    for f in sorted(out.glob("thr-*.json")):
        r = json.loads(f.read_text())["result"]
        extra = f", {r['steps']} steps" if "steps" in r else ""
        if "batches_timed" in r:
            extra += (f", batches {r['batches_timed']}/{r['batches_total']}, warm-up {r['warmup_s']:.1f} s, "
                      f"graphs compiled while timed {r['dynamo_graphs_compiled_during_timing']}, "
                      f"attn {r['attn_implementation']}")
        print(f"{f.stem}: {r['output_tokens_per_s']:.0f} output tok/s, {r['generated_tokens']} tokens in "
              f"{r['elapsed_s']:.2f} s{extra}")


if __name__ == "__main__":
    main()
