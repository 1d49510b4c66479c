"""Sweep `governor.kernels.gemv` launch configurations (`LaunchPolicy.gemv`, each run as the device's launch policy with
that configuration) against cuBLAS on the llama3-8b decode matmuls.

    python scripts/gemv-sweep.py [--shapes qkv,down,...] [--tp N] [--output-json FILE] [--deadline-s 300]

--tp N sweeps one rank's shard of each product under N-way tensor parallelism: qkv, gate_up and lm_head keep 1/N of
their rows (column-parallel), o and down 1/N of their columns (row-parallel).

Each product is timed inside a CUDA graph of back-to-back calls that cycle through enough distinct weight
copies (>= 4x a 50 MB L2) that every call reads its weight from HBM, as a decode step does (one weight per
layer). "down" is timed as the MLP's tail: cuBLAS runs SiLU·mul (the fused Triton kernel the model uses) and
then the GEMM; gemv runs both in one kernel (`silu_mul=True`). Prints microseconds and the weight bytes read
per second beside a 1 GiB device-to-device copy's bandwidth from the same process, the best configuration per
shape, and the per-layer sums of cuBLAS, of each shape's best and of the configuration best over the layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from governor.engine.bench.latency import graph_us_per_call, hbm_bandwidth_gb_per_s
from governor.kernels.elementwise import silu_mul
from governor.kernels.gemv import gemv
from governor.kernels.launch_policy import GemvConfig, LaunchPolicy, policy_for

# (N, K), in the order swept: the shapes cuBLAS serves worst first, in case the deadline cuts the sweep.
SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336), "o": (4096, 4096), "gate_up": (28672, 4096),
          "lm_head": (128256, 4096)}
L2_SPAN = 4 * 50 * 2**20
_ROW_PARALLEL = ("o", "down")  # split along K under tensor parallelism; the others along N


def shard(shape: tuple[int, int], name: str, tp: int) -> tuple[int, int]:
    """One rank's (N, K) of a product under `tp`-way tensor parallelism."""
    n, k = shape
    return (n, k // tp) if name in _ROW_PARALLEL else (-(-n // tp), k)


def time_calls(fn: Callable[[int], object], copies: int) -> float:
    """Microseconds per fn(i) call, i cycling over the weight copies (at least 24 calls in the graph)."""
    reps = max(copies, 24 // copies * copies)
    return graph_us_per_call(lambda i: fn(i % copies), reps)


def configs() -> list[GemvConfig]:
    grid = itertools.product((2, 4, 8), (512, 1024, 2048, 4096), (4, 8))
    return [GemvConfig(bn, bk, warps) for bn, bk, warps in grid]


def sweep_shape(name: str, copy: float, stop_at: float, tp: int = 1) -> list[dict]:
    """Time cuBLAS and every gemv configuration on one shape (one rank's shard of it under `tp`), at one row."""
    n, k = shard(SHAPES[name], name, tp)
    nbytes = n * k * 2
    copies = max(1, -(-L2_SPAN // nbytes))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    silu = name == "down"
    x = torch.randn(1, 2 * k if silu else k, dtype=torch.bfloat16, device="cuda")
    results: list[dict] = []

    def record(us: float, **extra: object) -> dict:
        r = {"gemm": name, "n": n, "k": k, "us": round(us, 2),
             "fraction_of_copy": round(nbytes / (us * 1e-6) / 1e9 / copy, 3), **extra}
        results.append(r)
        return r

    def cublas(i: int) -> torch.Tensor:
        return F.linear(silu_mul(x) if silu else x, ws[i])

    base = time_calls(cublas, copies)
    ref = cublas(0)
    r = record(base, backend="cublas")
    print(f"{name:8} cublas{' +silu_mul' if silu else ''}: {base:7.1f} us {100 * r['fraction_of_copy']:4.0f}%",
          flush=True)
    for cfg in configs():
        if time.monotonic() > stop_at:
            print("deadline reached: sweep cut short", flush=True)
            break

        policy = dataclasses.replace(policy_for(x.device), gemv=cfg)

        def mine(i: int, policy: LaunchPolicy = policy) -> torch.Tensor:
            return gemv(x, ws[i], silu_mul=silu, policy=policy)

        try:
            err = (mine(0).float() - ref.float()).abs().max().item()
            us = time_calls(mine, copies)
        except Exception as e:  # a configuration the compiler rejects (e.g. out of resources)
            print(f"{name:8} {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        r = record(us, backend="gemv", config=cfg._asdict(), cublas_us=round(base, 2), max_abs_diff_vs_cublas=err)
        print(f"{name:8} bn={cfg.block_n:<3} bk={cfg.block_k:<5} w={cfg.num_warps}: {us:7.1f} us "
              f"{100 * r['fraction_of_copy']:4.0f}% (diff {err:.3g})", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tp", type=int, default=1, help="sweep one rank's shard of each product at this TP size")
    ap.add_argument("--output-json")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="stop sweeping configs after this long")
    a = ap.parse_args()
    stop_at = time.monotonic() + a.deadline_s
    copy = hbm_bandwidth_gb_per_s()
    print(f"copy {copy:.0f} GB/s", flush=True)
    results: list[dict] = []
    for name in a.shapes.split(","):
        results += sweep_shape(name, copy, stop_at, a.tp)
        torch.cuda.empty_cache()
    layer_shapes = ("qkv", "o", "gate_up", "down")
    cublas = {r["gemm"]: r["us"] for r in results if r["backend"] == "cublas"}
    by_config: dict[tuple, dict[str, float]] = {}
    for r in results:
        if r["backend"] == "gemv":
            by_config.setdefault(tuple(r["config"].values()), {})[r["gemm"]] = r["us"]
    best = {g: min((r for r in results if r["gemm"] == g and r["backend"] == "gemv"), key=lambda r: r["us"])
            for g in cublas if any(r["gemm"] == g and r["backend"] == "gemv" for r in results)}
    for g, b in best.items():
        print(f"BEST {g}: {b['config']} {b['us']} us vs cublas {cublas[g]} us", flush=True)
    summary: dict[str, object] = {}
    if all(g in best for g in layer_shapes):
        whole = {c: sum(t[g] for g in layer_shapes) for c, t in by_config.items() if all(g in t for g in layer_shapes)}
        one = min(whole, key=lambda c: whole[c])
        summary = {"cublas_us": round(sum(cublas[g] for g in layer_shapes), 2),
                   "best_per_shape_us": round(sum(best[g]["us"] for g in layer_shapes), 2),
                   "best_one_config": dict(zip(GemvConfig._fields, one, strict=True)),
                   "best_one_config_us": round(whole[one], 2),
                   "best_one_config_lm_head_us": by_config[one].get("lm_head"),
                   "current_config_us": round(sum(by_config[tuple(policy_for(torch.device("cuda")).gemv)][g]
                                                  for g in layer_shapes), 2)
                   if tuple(policy_for(torch.device("cuda")).gemv) in by_config else None,
                   "roofline_us": round(sum(2 * r["n"] * r["k"] for r in results if r["backend"] == "cublas"
                                            and r["gemm"] in layer_shapes) / (copy * 1e3), 2)}
    print(f"per layer (qkv+o+gate_up+down incl. SiLU·mul): {json.dumps(summary)}", flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"tp": a.tp, "copy_gb_per_s": copy, "rows": results, "layer": summary,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
