"""V laid out [blocks, heads, head_dim, block_size] (module `pa_vt` in .exp/) against the landed kernel, fp8.

    python3 docs/experiments/issue9-sixth-pass/vt_bench.py OUT_JSON   (call 11's variants; README.md here)
"""

import functools
import json
import math
import sys

import torch

sys.path.insert(0, ".exp")
import pa_vt  # (881e1d6's paged_attention.py with v-transposed-881e1d6.patch applied)

import governor.kernels.paged_attention as pa
from governor.engine.bench_attention import AttentionCase, _inputs, kv_bytes, time_call
from governor.engine.bench_latency import hbm_bandwidth_gb_per_s

SHAPES = [(32, 4096, 32, 8), (32, 32768, 32, 8), (256, 612, 16, 8), (256, 1024, 16, 8), (16, 8192, 32, 8),
          (32, 4096, 16, 8), (256, 100, 16, 8)]
VARIANTS = {"landed": (pa, {}), "vt-r168": (pa_vt, {"_DECODE_TILE_N_FP8": 128, "_DECODE_MAXNREG_FP8": 168}),
            "vt-t64": (pa_vt, {"_DECODE_TILE_N_FP8": 64, "_DECODE_MAXNREG_FP8": None}),
            "vt-r128": (pa_vt, {"_DECODE_TILE_N_FP8": 128, "_DECODE_MAXNREG_FP8": 128})}

dev = torch.device("cuda")
hbm = hbm_bandwidth_gb_per_s()
rows = []
for batch, ctx, hq, hkv in SHAPES:
    case = AttentionCase(batch, ctx, hq, hkv, 128, "fp8")
    x = _inputs(case, torch.bfloat16, dev, seed=0)
    v_t = x["v_cache"].permute(0, 2, 3, 1).contiguous()
    ref = None
    for rnd in range(2):
        for name, (mod, knobs) in VARIANTS.items():
            for k, v in knobs.items():
                setattr(mod, k, v)
            out = torch.empty_like(x["q"])
            vc = x["v_cache"] if mod is pa else v_t
            call = functools.partial(mod.paged_decode_attention, x["q"], x["k_cache"], vc, x["block_tables"],
                                     x["seq_lens"], 1 / math.sqrt(128), out, k_scale=x["k_scale"],
                                     v_scale=x["v_scale"])
            t = sorted(time_call(call, dev, 5, 50))
            ref = out if ref is None else ref
            ms = t[len(t) // 2]
            frac = kv_bytes(case) / (ms * 1e-3) / 1e9 / hbm
            diff = float((out.float() - ref.float()).abs().max())
            row = {"case": f"b{batch} ctx{ctx} {hq}:{hkv}", "variant": name, "round": rnd, "us_p50": 1e3 * ms,
                   "us_min": 1e3 * t[0], "fraction": frac, "diff": diff}
            rows.append(row)
            print(f"{row['case']:>22} {name:>14} r{rnd} p50 {1e3 * ms:8.1f} min {1e3 * t[0]:8.1f} us "
                  f"{100 * frac:5.1f}% diff {diff:.1e}", flush=True)
    x.clear()
    del v_t
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump({"hbm": hbm, "rows": rows}, f, indent=1)
