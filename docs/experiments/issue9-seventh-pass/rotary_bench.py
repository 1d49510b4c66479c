"""rotary_write_kv variants on a GPU: us a call, 50 calls captured in a CUDA graph (`graph_us_per_call`).

    python3 rotary_bench.py OUT.json per-token   # call 7: needs rotary-per-token-d456666.patch applied
    python3 rotary_bench.py OUT.json qk-norm     # call 8: the landed code (fbf173c), 4 warps against 1

The figures in rotary.json and rotary_check.json came from an earlier copy of this script that timed its own graph
(median of 20 replays of the 50 calls, and their minimum); it now uses the project's `graph_us_per_call` (mean over
5 replays), so a rerun reports no "us_min". "identical" compares each variant's outputs (rotated q, K and V caches)
with the set's first variant, bit for bit.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import torch

import governor.kernels.paged_attention as pa
from governor.engine.bench_latency import graph_us_per_call

SETS: dict[str, tuple[dict[str, dict[str, Any]], list[tuple[str, int, int, int, bool, str]]]] = {
    "per-token": (
        {"head-w4": {"_ROTARY_PER_TOKEN": False, "_ROTARY_HEAD_NUM_WARPS": 4},
         "head-w1": {"_ROTARY_PER_TOKEN": False, "_ROTARY_HEAD_NUM_WARPS": 1},
         "head-w2": {"_ROTARY_PER_TOKEN": False, "_ROTARY_HEAD_NUM_WARPS": 2},
         "token-w4": {"_ROTARY_PER_TOKEN": True, "_ROTARY_NUM_WARPS": 4},
         "token-w8": {"_ROTARY_PER_TOKEN": True, "_ROTARY_NUM_WARPS": 8},
         "token-w2": {"_ROTARY_PER_TOKEN": True, "_ROTARY_NUM_WARPS": 2}},
        [("qwen3-0.6b", 256, 16, 8, True, "fp8"), ("qwen3-0.6b", 256, 16, 8, True, "bf16"),
         ("llama3-8b", 256, 32, 8, False, "bf16"), ("llama3-8b", 1, 32, 8, False, "bf16"),
         ("llama3-8b", 32, 32, 8, False, "bf16")],
    ),
    "qk-norm": (
        {"qkn-w4": {"_ROTARY_QK_NORM_NUM_WARPS": 4}, "qkn-w1": {"_ROTARY_QK_NORM_NUM_WARPS": 1}},
        [("qwen3-0.6b", t, 16, 8, True, kv) for t in (1, 32, 256) for kv in ("fp8", "bf16")],
    ),
}


def main() -> None:
    out_path, which = sys.argv[1], sys.argv[2]
    variants, shapes = SETS[which]
    dev = torch.device("cuda")
    rows = []
    for shape, t, hq, hkv, norm, kv in shapes:
        d, blocks = 128, 4096
        gen = torch.Generator(device=dev).manual_seed(0)
        qkv0 = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=dev).bfloat16()
        cache_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        k_cache = torch.zeros(blocks, 16, hkv, d, device=dev, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(blocks * 16, generator=gen, device=dev)[:t].long()
        positions = torch.randint(0, 4000, (t,), generator=gen, device=dev)
        cos_sin = torch.randn(8192, 2, d, generator=gen, device=dev)
        q_norm = torch.rand(d, generator=gen, device=dev).bfloat16() if norm else None
        k_norm = torch.rand(d, generator=gen, device=dev).bfloat16() if norm else None
        scale = torch.full((hkv,), 0.05, device=dev) if kv == "fp8" else None
        first = None
        for name, settings in variants.items():
            for attr, value in settings.items():
                setattr(pa, attr, value)
            qkv = qkv0.clone()

            call = functools.partial(pa.rotary_write_kv, qkv, positions, cos_sin, hq, k_cache, v_cache, slots,
                                     q_norm=q_norm, k_norm=k_norm, eps=1e-6, k_scale=scale, v_scale=scale)

            k_cache.zero_()
            v_cache.zero_()
            call()
            outputs = (qkv.clone(), k_cache.float(), v_cache.float())
            first = first or outputs
            identical = all(torch.equal(a, b) for a, b in zip(outputs, first, strict=True))
            row = {"shape": shape, "t": t, "kv": kv, "variant": name,
                   "us": graph_us_per_call(lambda _i, call=call: call(), 50), "identical": identical}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
