"""A/B of decode attention launch settings, alternated in one process.

    python3 scripts/decode-attention-ab.py OUT_JSON [--rounds 2] [--iters 50] [--groups fp8,bf16]
                                           [--cases BATCHES] [--baseline PATH] [--variants NAMES] [--kernels]

`--baseline PATH`: another version of the paged attention code, loaded as its own package and timed first in every
group as the variant "baseline", with its own defaults: a copy of the package directory (e.g. `git archive REV
kernels/governor/kernels/paged_attention | tar -x -C DIR`, then DIR/kernels/governor/kernels/paged_attention), or
the single file `paged_attention.py` of a revision from before the package.

Each variant is a launch policy: the device's (`governor.kernels.launch_policy.policy_for`) with the fields it names
replaced (register cap, warps, tile, split heuristic, merge), passed to every call; a variant that sets nothing is the
code as it is.
Cases: the attention target (batch 32, 4K and 32K, 32:8 heads), the throughput workload's shape (batch 256, 612 and
1,024 tokens, 16:8 heads), unsplit launches of fewer programs (batch 48 and 64 at 4K, 32:8; 128 at 1,024, 160 and 192
at 612, 16:8) and a few other split counts (batch 1 at 32K, 8 at 4K, 16 at 8K, 32:8 heads), head_dim 128,
bf16 q, random block tables. Timing and bytes as `governor bench attention` (engine/governor/engine/bench/attention.py:
L2 flushed before each call, CUDA events, median; fraction of a device copy measured in the same process). Each
variant's output is compared with the group's first variant on the same inputs (max abs difference).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import governor.kernels.paged_attention as pa
from governor.engine.bench.attention import AttentionCase, _inputs, kernel_times, kv_bytes, time_call
from governor.engine.bench.latency import hbm_bandwidth_gb_per_s
from governor.engine.bench.throughput import hardware
from governor.kernels.launch_policy import LaunchPolicy, policy_for

# How split launches merge their partials ("cur": folded into the decode kernel up to 8 splits, else the reduce kernel
# under programmatic dependent launch).
MERGES: dict[str, dict[str, Any]] = {
    "reduce": {"decode_fold_max_splits": 0, "decode_reduce_pdl": False},  # the merge before the fold
    "reduce-pdl": {"decode_fold_max_splits": 0},
    "fold-all": {"decode_fold_max_splits": 64},
}
GROUPS: dict[str, dict[str, dict[str, Any]]] = {
    "fp8": {
        "cur": {},
        "triton-kernel": {"gluon_decode": False},  # the Triton kernel where the Gluon one runs
        "gluon-narrow32": {"gluon_tile_n_narrow": 32},
        "gluon-wide32": {"gluon_tile_n_wide": 32},
        "gluon-wide64": {"gluon_tile_n_wide": 64},
        "gluon-s2": {"gluon_stages": 2},
        "gluon-wide-cap168": {"gluon_maxnreg_wide": 168},  # the 16-key launches under a cap
        "gluon-s4": {"gluon_stages": 4},
        "wide-always": {"decode_wide_min_wave_fill": 0.0},  # unsplit launches of any size
        "wide-never": {"decode_wide_min_wave_fill": 2.0},
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


def _load_baseline(path: str) -> ModuleType:
    """Another version of the code, as a package of its own (its submodules import each other relatively), or a
    single-file module of a revision from before the package."""
    p = Path(path)
    name = "paged_attention_baseline"
    if p.is_dir():
        spec = importlib.util.spec_from_file_location(name, p / "__init__.py", submodule_search_locations=[str(p)])
    else:
        spec = importlib.util.spec_from_file_location(name, p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _splits(mod: Any, programs: int, context: int, device: torch.device, fp8: bool,
            policy: LaunchPolicy | None) -> int:
    """The split count `mod` runs under `policy` (None: a baseline, which takes none; one older than the per-dtype
    heuristic takes no `fp8` either)."""
    bound = -(-context // 16) * 16  # the block-table capacity the kernel sizes splits from (16-token blocks)
    if policy is not None:
        return int(mod.decode_num_splits(programs, bound, device, fp8=fp8, policy=policy))
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
    parser.add_argument("--baseline", help="another version of the package (a directory) or of paged_attention.py "
                                           "(a file) to time as the variant 'baseline'")
    parser.add_argument("--variants", default="", help="only these variants (comma list; default: all of the group)")
    parser.add_argument("--kernels", action="store_true",
                        help="also the call's kernels' device time, median of 20 calls (bench.attention.kernel_times)")
    args = parser.parse_args()
    baseline = _load_baseline(args.baseline) if args.baseline else None
    device = torch.device("cuda")
    hbm = hbm_bandwidth_gb_per_s()
    base = policy_for(device)
    rows: list[dict[str, Any]] = []
    result = {"hardware": hardware(), "hbm_copy_gb_per_s": hbm, "rows": rows,
              "defaults": {f.name: repr(getattr(base, f.name)) for f in dataclasses.fields(base)},
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
                    # The baseline runs its own defaults; every variant the device's policy with its fields replaced.
                    policy = None if settings is None else dataclasses.replace(base, **settings)
                    mod = pa if policy is not None or baseline is None else baseline
                    out = torch.empty_like(x["q"])
                    call = functools.partial(
                        mod.paged_decode_attention, x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                        x["seq_lens"], scale, out, k_scale=x["k_scale"], v_scale=x["v_scale"],
                        **({} if policy is None else {"policy": policy}))
                    times = sorted(time_call(call, device, 5, args.iters))
                    ms = times[len(times) // 2]
                    first = out if first is None else first
                    gbs = kv_bytes(case) / (ms * 1e-3) / 1e9
                    row = {"kv": group, "case": f"b{batch} ctx{context} {hq}:{hkv}", "variant": name, "round": rnd,
                           "splits": _splits(mod, batch * hkv, context, device, group == "fp8", policy),
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


if __name__ == "__main__":
    main()
