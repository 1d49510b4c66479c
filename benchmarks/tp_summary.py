"""The table of a tensor-parallel benchmark run (benchmarks/tensor-parallel.sh): every latency and throughput result
under a results folder, the engine's and vLLM's, and for each engine latency row at TP > 1 its roofline with the
all-reduces counted: the per-GPU weight and KV bytes over the copy bandwidth measured in the engine's process (what
`bench latency` reports), plus (2 × layers + 1) all-reduces of batch × hidden values at the time `bench all-reduce`
measured for that size (the message size at or above it) in the same run.

    python3 -m benchmarks.tp_summary RESULTS_DIR      (prints the table; writes RESULTS_DIR/summary.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def all_reduce_us(results: Path, tp: int, nbytes: int) -> float | None:
    """The measured time of one all-reduce of `nbytes` at `tp` ranks on the path the engine takes for it (the
    smallest measured size at or above it); None without a measurement."""
    f = results / f"allreduce-tp{tp}.json"
    if not f.exists():
        return None
    r = json.loads(f.read_text())["result"]
    policy = r["info"]["policy"]
    path = ("one_shot" if nbytes <= policy["one_shot_max"] else
            "two_shot" if nbytes <= policy["two_shot_max"] else "nccl")
    rows = sorted((x for x in r["rows"] if x["path"] == path and x["bytes"] >= nbytes), key=lambda x: x["bytes"])
    return rows[0]["us"] if rows else None


def latency_line(results: Path, env: dict[str, Any], tp: int) -> str:
    parts = []
    config_path = Path(env["model"]) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else None
    for x in env["result"]["rows"]:
        line = f"batch {x['batch']}: {x['ms_per_token_p50']:.2f} ms/token"
        if "roofline_ms" in x:
            roof = x["roofline_ms"]
            if tp > 1 and config is not None:
                us = all_reduce_us(results, tp, x["batch"] * config["hidden_size"] * 2)
                if us is not None:
                    roof += (2 * config["num_hidden_layers"] + 1) * us / 1e3
                    line += f" (roofline {roof:.2f} ms with all-reduces: {x['ms_per_token_p50'] / roof:.2f}x)"
            else:
                line += f" (roofline {roof:.2f} ms: {x['ms_per_token_p50'] / roof:.2f}x)"
        parts.append(line)
    return "; ".join(parts)


def summarize(results: Path) -> dict[str, str]:
    rows: dict[str, str] = {}
    for f in sorted(results.glob("*.json")):
        name = f.stem
        if not any(name.startswith(k) for k in ("latency-", "throughput-", "vllm-latency-", "vllm-throughput-")):
            continue
        env = json.loads(f.read_text())
        tp = int(name.rsplit("-tp", 1)[1])
        r = env["result"]
        if "latency" in name:
            rows[name] = latency_line(results, env, tp)
        else:
            rows[name] = f"{r['output_tokens_per_s']:.0f} output tok/s ({r['total_tokens_per_s']:.0f} total)"
    for f in sorted(results.glob("allreduce-tp*.json")):
        r = json.loads(f.read_text())["result"]
        by_size: dict[int, list[str]] = {}
        for x in r["rows"]:
            by_size.setdefault(x["bytes"], []).append(f"{x['path']} {x['us']:.1f}")
        rows[f.stem] = "; ".join(f"{b // 1024} KiB: " + ", ".join(v) + " us" for b, v in sorted(by_size.items()))
    return rows


def main(argv: list[str] | None = None) -> int:
    results = Path((argv if argv is not None else sys.argv[1:])[0])
    rows = summarize(results)
    for name, line in rows.items():
        print(f"{name:28} {line}")
    (results / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
