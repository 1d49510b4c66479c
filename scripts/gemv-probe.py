"""Time the decode GEMMs of a llama3-8b (or qwen3-0.6b) layer and its lm_head at given batch sizes under each BLAS
backend torch offers on CUDA (cuBLAS, cuBLASLt), inside CUDA graphs so launch overhead is not counted.

    python scripts/gemv-probe.py [--model llama3-8b|qwen3-0.6b] [--batches 1,8,32] [--reps 20] [--output-json FILE]

Prints, per backend, shape and batch: microseconds per matmul, the weight bytes read per second beside a 1 GiB
device-to-device copy's bandwidth measured in the same process, and the TFLOP/s (2 * batch * k * n per matmul).
Weights are random bf16.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from governor.engine.bench.latency import graph_us_per_call, hbm_bandwidth_gb_per_s

MODELS = {  # (k, n) of each decode GEMM
    "llama3-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
                  "lm_head": (4096, 128256)},
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
                   "lm_head": (1024, 151936)},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--output-json")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    copy = hbm_bandwidth_gb_per_s()
    rows: list[dict[str, Any]] = []
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for name, (k, n) in MODELS[a.model].items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            for m in batches:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")

                def matmul(_i: int, x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
                    return F.linear(x, w)

                us = graph_us_per_call(matmul, a.reps)
                gbs = w.numel() * 2 / (us * 1e-6) / 1e9
                tflops = 2 * m * k * n / (us * 1e-6) / 1e12
                rows.append({"backend": backend, "gemm": name, "k": k, "n": n, "batch": m, "us": round(us, 2),
                             "weight_gb_per_s": round(gbs), "fraction_of_copy": round(gbs / copy, 3),
                             "tflops": round(tflops, 1)})
                print(f"{backend:8} {name:8} {k:6}x{n:<6} m={m:<3} {us:8.1f} us {gbs:6.0f} GB/s "
                      f"{100 * gbs / copy:4.0f}% of copy {tflops:6.1f} TFLOP/s", flush=True)
            del w
    layer = {b: {m: sum(r["us"] for r in rows if r["backend"] == b and r["batch"] == m and r["gemm"] != "lm_head")
                 for m in batches} for b in ("cublas", "cublaslt")}
    print(f"copy {copy:.0f} GB/s; per-layer GEMM us (qkv+o+gate_up+down): {json.dumps(layer)}")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"model": a.model, "copy_gb_per_s": copy, "rows": rows, "layer_us": layer,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
