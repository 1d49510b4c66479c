"""A/B of decode attention launch settings, alternated in one process (issue 9).

    python3 scripts/decode-attention-ab.py OUT_JSON [--rounds 2] [--iters 50] [--groups fp8,bf16]
                                           [--cases BATCHES] [--baseline FILE] [--variants NAMES] [--kernels]

`--baseline FILE`: another version of paged_attention.py (e.g. `git show REV:kernels/governor/kernels/paged_attention.py
> FILE`), loaded as its own module and timed first in every group as the variant "baseline", with its own defaults.

Each variant sets module attributes of governor.kernels.paged_attention (register cap, warps, tile, split heuristic,
or a function such as `_needs_int64_offsets`) before the calls and the defaults are restored after; a variant that
sets nothing is the code as it is.
Cases: the attention target (batch 32, 4K and 32K, 32:8 heads), the throughput workload's shape (batch 256, 612 and
1,024 tokens, 16:8 heads), unsplit launches of fewer programs (batch 48 and 64 at 4K, 32:8; 128 at 1,024, 160 and 192
at 612, 16:8) and a few other split counts (batch 1 at 32K, 8 at 4K, 16 at 8K, 32:8 heads), head_dim 128,
bf16 q, random block tables. Timing and bytes as `governor bench attention` (engine/governor/engine/bench_attention.py:
L2 flushed before each call, CUDA events, median; fraction of a device copy measured in the same process). Each
variant's output is compared with the group's first variant on the same inputs (max abs difference).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import time
from typing import Any

import torch

import governor.kernels.paged_attention as pa
from governor.engine.bench_attention import AttentionCase, _inputs, kernel_times, kv_bytes, time_call
from governor.engine.bench_latency import hbm_bandwidth_gb_per_s
from governor.engine.bench_throughput import hardware

# How split launches merge their partials ("cur": folded into the decode kernel up to 8 splits, else the reduce kernel
# under programmatic dependent launch).
MERGES: dict[str, dict[str, Any]] = {
    "reduce": {"_DECODE_FOLD_MAX_SPLITS": 0, "_DECODE_REDUCE_PDL": False},  # before the ninth pass
    "reduce-pdl": {"_DECODE_FOLD_MAX_SPLITS": 0},
    "fold-all": {"_DECODE_FOLD_MAX_SPLITS": 64},
}
GROUPS: dict[str, dict[str, dict[str, Any]]] = {
    "fp8": {
        "cur": {},
        "triton-kernel": {"_GLUON_DECODE": False},  # the Triton kernel where the Gluon one runs (tenth pass)
        "gluon-narrow32": {"_GLUON_DECODE_TILE_N_NARROW": 32},
        "gluon-wide32": {"_GLUON_DECODE_TILE_N_WIDE": 32},
        "gluon-wide64": {"_GLUON_DECODE_TILE_N_WIDE": 64},
        "gluon-s2": {"_GLUON_DECODE_STAGES": 2},
        "gluon-wide-cap168": {"_GLUON_DECODE_MAXNREG_WIDE": 168},  # the cap call 4 measured (as its "cur")
        "gluon-s4": {"_GLUON_DECODE_STAGES": 4},
        "wide-always": {"_DECODE_WIDE_MIN_WAVE_FILL": 0.0},  # unsplit launches of any size
        "wide-never": {"_DECODE_WIDE_MIN_WAVE_FILL": 2.0},
        **MERGES,
    },
    "bf16": {
        "cur": {},
        **MERGES,
    },
}
SHAPES = [(32, 4096, 32, 8), (32, 32768, 32, 8), (256, 612, 16, 8), (256, 1024, 16, 8), (48, 4096, 32, 8),
          (64, 4096, 32, 8), (128, 1024, 16, 8), (160, 612, 16, 8), (192, 612, 16, 8), (1, 32768, 32, 8),
          (8, 4096, 32, 8), (16, 8192, 32, 8)]


def _splits(mod: Any, programs: int, context: int, device: torch.device, fp8: bool) -> int:
    """The split count `mod` runs (a baseline older than the per-dtype heuristic takes no `fp8`)."""
    bound = -(-context // 16) * 16  # the block-table capacity the kernel sizes splits from (16-token blocks)
    try:
        return int(mod.decode_num_splits(programs, bound, device, fp8=fp8))
    except TypeError:
        return int(mod.decode_num_splits(programs, bound, device))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--groups", default="fp8,bf16")
    parser.add_argument("--cases", default="", help="only the shapes whose batch is in this comma list")
    parser.add_argument("--baseline", help="another paged_attention.py to time as the variant 'baseline'")
    parser.add_argument("--variants", default="", help="only these variants (comma list; default: all of the group)")
    parser.add_argument("--kernels", action="store_true",
                        help="also the call's kernels' device time, median of 20 calls (bench_attention.kernel_times)")
    args = parser.parse_args()
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("paged_attention_baseline", args.baseline)
        assert spec is not None and spec.loader is not None
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    device = torch.device("cuda")
    hbm = hbm_bandwidth_gb_per_s()
    defaults = {name: getattr(pa, name) for group in GROUPS.values() for v in group.values() for name in v}
    rows: list[dict[str, Any]] = []
    result = {"hardware": hardware(), "hbm_copy_gb_per_s": hbm, "rows": rows,
              "defaults": {k: repr(v) for k, v in defaults.items()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for group in args.groups.split(","):
        variants = {k: v for k, v in GROUPS[group].items() if not args.variants or k in args.variants.split(",")}
        for batch, context, hq, hkv in SHAPES:
            if args.cases and str(batch) not in args.cases.split(","):
                continue
            case = AttentionCase(batch, context, hq, hkv, 128, group)
            x = _inputs(case, torch.bfloat16, device, seed=0)
            scale = 1 / math.sqrt(case.head_dim)
            first: torch.Tensor | None = None
            for rnd in range(args.rounds):
                runs: dict[str, dict[str, Any] | None] = {"baseline": None} if baseline else {}
                for name, settings in {**runs, **variants}.items():
                    for attr, value in {**defaults, **(settings or {})}.items():
                        setattr(pa, attr, value)
                    mod = pa if settings is not None or baseline is None else baseline
                    out = torch.empty_like(x["q"])
                    call = functools.partial(
                        mod.paged_decode_attention, x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                        x["seq_lens"], scale, out, k_scale=x["k_scale"], v_scale=x["v_scale"])
                    times = sorted(time_call(call, device, 5, args.iters))
                    ms = times[len(times) // 2]
                    first = out if first is None else first
                    gbs = kv_bytes(case) / (ms * 1e-3) / 1e9
                    row = {"kv": group, "case": f"b{batch} ctx{context} {hq}:{hkv}", "variant": name, "round": rnd,
                           "splits": _splits(mod, batch * hkv, context, device, group == "fp8"),
                           "us_p50": 1e3 * ms, "us_min": 1e3 * times[0], "us_max": 1e3 * times[-1],
                           "kv_gb_per_s": gbs, "fraction_of_hbm": gbs / hbm,
                           "max_abs_diff_vs_first": float((out.float() - first.float()).abs().max())}
                    if args.kernels:
                        kernels = sorted(kernel_times(call, device, 20))
                        row["kernel_us"] = round(kernels[len(kernels) // 2], 2)
                    rows.append(row)
                    print(f"{group} {row['case']:>24} {name:>15} r{rnd} splits={row['splits']} "
                          f"p50 {row['us_p50']:8.1f} min {row['us_min']:8.1f} max {row['us_max']:8.1f} us "
                          f"{100 * row['fraction_of_hbm']:5.1f}% diff {row['max_abs_diff_vs_first']:.2e}"
                          f"{' kernels ' + str(row['kernel_us']) if args.kernels else ''}", flush=True)
                    with open(args.out_json, "w") as f:
                        json.dump(result, f, indent=2)
            x.clear()
            torch.cuda.empty_cache()
    for attr, value in defaults.items():
        setattr(pa, attr, value)


if __name__ == "__main__":
    main()
