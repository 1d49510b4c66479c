"""The table of benchmarks/peers.sh: the engine beside its peers, from the JSON results in one folder.

    python3 -m benchmarks.peers.summary RESULTS

Offline throughput is output tokens per second (higher is better), the ratio the engine's over the peer's;
batch-1 decode is ms per token p50 (lower is better), the ratio the peer's over the engine's, so a ratio above 1
says the engine is ahead either way. A result that is missing (a stage skipped or failed) shows as "-".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# (label, file) of each column; the first is the engine.
THROUGHPUT = {"KV bf16": ("thr-governor.json", "thr-vllm.json"),
              "KV fp8": ("thr-governor-fp8.json", "thr-vllm-fp8.json")}
HF_THROUGHPUT = "thr-hf-static.json"
LATENCY = (("Governor", "latency-governor.json"), ("vLLM", "latency-vllm.json"),
           ("gpt-fast bf16", "latency-gpt-fast-bf16.json"), ("gpt-fast int8", "latency-gpt-fast-int8.json"))


def _result(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    if not path.is_file():
        return None
    result: dict[str, Any] = json.loads(path.read_text())["result"]
    return result


def output_tok_s(folder: Path, name: str) -> float | None:
    r = _result(folder, name)
    return None if r is None else float(r["output_tokens_per_s"])


def batch1_ms(folder: Path, name: str) -> float | None:
    """The batch-1 row's ms per token p50."""
    r = _result(folder, name)
    if r is None:
        return None
    rows = [row for row in r["rows"] if row["batch"] == 1]
    return float(rows[0]["ms_per_token_p50"]) if rows else None


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def summarize(folder: Path) -> str:
    hf = output_tok_s(folder, HF_THROUGHPUT)
    lines = ["offline throughput, output tok/s (Governor/peer: > 1 = Governor faster)",
             f"  {'':8} {'Governor':>9} {'vLLM':>9} {'Gov/vLLM':>9} {'transformers':>13} {'Gov/transformers':>17}"]
    for label, (gov_file, vllm_file) in THROUGHPUT.items():
        gov, vllm = output_tok_s(folder, gov_file), output_tok_s(folder, vllm_file)
        lines.append(f"  {label:8} {_num(gov, ',.0f'):>9} {_num(vllm, ',.0f'):>9} {_ratio(gov, vllm):>9} "
                     f"{_num(hf, ',.0f'):>13} {_ratio(gov, hf):>17}")
    lines.append("batch-1 decode, ms/token p50 (peer/Governor: > 1 = Governor faster)")
    gov_ms = batch1_ms(folder, LATENCY[0][1])
    for label, name in LATENCY:
        ms = batch1_ms(folder, name)
        ratio = "" if name == LATENCY[0][1] else f"  {_ratio(ms, gov_ms)}"
        lines.append(f"  {label:14} {_num(ms, '.2f'):>7}{ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m benchmarks.peers.summary RESULTS_DIR", file=sys.stderr)
        return 2
    print(summarize(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
