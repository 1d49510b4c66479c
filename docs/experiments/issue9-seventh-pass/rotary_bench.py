"""rotary_write_kv variants on a GPU: 50 calls captured in a CUDA graph, replayed 20 times; us a call (median).

    python3 rotary_bench.py OUT.json per-token   # call 7: needs rotary-per-token-d456666.patch applied
    python3 rotary_bench.py OUT.json qk-norm     # call 8: the landed code (fbf173c), 4 warps against 1

"identical" compares each variant's outputs (rotated q, K and V caches) with the set's first variant, bit for bit.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import torch

import governor.kernels.paged_attention as pa

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


def graph_us(call: Any, calls: int = 50, replays: int = 20) -> tuple[float, float]:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                call()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2], times[0]


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
            us, us_min = graph_us(call)
            row = {"shape": shape, "t": t, "kv": kv, "variant": name, "us": us, "us_min": us_min,
                   "identical": identical}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
