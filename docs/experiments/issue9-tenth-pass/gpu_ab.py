"""A/B: Triton fp8 decode kernel vs the Gluon prototype, same process, same inputs."""

import json
import math
import os
import sys

import torch

import governor.kernels.paged_attention as pa
from governor.engine.bench_attention import AttentionCase, _inputs, kernel_times, kv_bytes, time_call
from governor.engine.bench_latency import hbm_bandwidth_gb_per_s

sys.path.insert(0, "docs/experiments/issue9-tenth-pass")
import pag

out_path = sys.argv[1]
dev = torch.device("cuda")
hbm = hbm_bandwidth_gb_per_s()
print(f"hbm {hbm:.0f} GB/s", flush=True)
SHAPES = [
    s
    for s in [
        (32, 4096, 32, 8),
        (32, 32768, 32, 8),
        (256, 612, 16, 8),
        (256, 1024, 16, 8),
        (8, 4096, 32, 8),
        (64, 4096, 32, 8),
        (16, 8192, 32, 8),
    ]
    if os.environ.get("BATCHES") is None or str(s[0]) in os.environ["BATCHES"].split(",")
]

VARIANTS = [
    tuple(int(x) if x.isdigit() else x for x in v.split(":"))
    for v in os.environ.get("VARIANTS", "W4T16S3:4:16:3").split(",")
]
SPLITMULTS = [float(x) for x in os.environ.get("SPLITMULTS", "0.5,1,2").split(",")]
rows = []
for b, ctx, hq, hkv in SHAPES:
    case = AttentionCase(b, ctx, hq, hkv, 128, "fp8")
    x = _inputs(case, torch.bfloat16, dev, 0)
    scale = 1 / math.sqrt(128)
    ref = torch.empty_like(x["q"])

    def tri(x=x, scale=scale, ref=ref):
        pa.paged_decode_attention(
            x["q"],
            x["k_cache"],
            x["v_cache"],
            x["block_tables"],
            x["seq_lens"],
            scale,
            ref,
            k_scale=x["k_scale"],
            v_scale=x["v_scale"],
        )

    tri()
    torch.cuda.synchronize()
    auto = pa.decode_num_splits(b * hkv, ctx, dev, None, True)
    nb = kv_bytes(case)
    cands = [("triton", tri, auto)]
    for name, W, T, S in VARIANTS:
        for splits in sorted(
            {max(1, int(auto * m)) for m in SPLITMULTS} if auto > 1 else {max(1, int(m)) for m in SPLITMULTS}
        ):
            o = torch.empty_like(x["q"])
            if splits > 1:
                n = b * hq * splits
                part = (torch.empty(n, 128, device=dev), torch.empty(n, device=dev), torch.empty(n, device=dev))
            else:
                part = None

            def g(W=W, T=T, S=S, splits=splits, o=o, part=part, x=x, scale=scale, b=b, hq=hq):
                pag.launch(
                    x["q"],
                    x["k_cache"],
                    x["v_cache"],
                    x["block_tables"],
                    x["seq_lens"],
                    scale,
                    o,
                    x["k_scale"],
                    x["v_scale"],
                    splits,
                    part,
                    W=W,
                    TNW=T,
                    stages=S,
                )
                if splits > 1:
                    pa._decode_reduce_kernel[(b, hq)](
                        o,
                        *part,
                        x["seq_lens"],
                        hq,
                        splits,
                        o.stride(0),
                        o.stride(1),
                        SPLITS_PAD=1 << (splits - 1).bit_length(),
                        HEAD_DIM=128,
                        TILE_ALIGN=pa._TILE_N,
                        PDL=False,
                    )

            try:
                g()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{name} s{splits} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = (o.float() - ref.float()).abs().max().item()
            cands.append((f"{name}-s{splits}", g, splits, err))
    for rnd in range(2):
        for c in cands:
            name, fn, splits = c[:3]
            t = sorted(time_call(fn, dev, 5, 50))
            kt = sorted(kernel_times(fn, dev, 50))
            us, kus = 1e3 * t[len(t) // 2], kt[len(kt) // 2]
            r = dict(
                batch=b,
                context=ctx,
                heads=f"{hq}:{hkv}",
                variant=name,
                splits=splits,
                round=rnd,
                us=us,
                kernel_us=kus,
                frac=nb / (us * 1e-6) / 1e9 / hbm,
                frac_kernel=nb / (kus * 1e-6) / 1e9 / hbm,
                err=c[3] if len(c) > 3 else 0.0,
            )
            rows.append(r)
            print(
                f"b{b} {ctx} {name:12s} s{splits:<3d} r{rnd} {us:8.1f} us {kus:8.1f} kus  {100 * r['frac']:5.1f}% "
                f"{100 * r['frac_kernel']:5.1f}%k  err {r['err']:.2e}",
                flush=True,
            )
    with open(out_path, "w") as f:
        json.dump({"hbm_gb_per_s": hbm, "rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)
