"""Host starvation of the attention benchmark (call 1, 2f3dfbb's parent code plus the new time_call).

    python3 kernel_times.py OUT.json

For each case, three rounds of: the old timing loop (each timed call enqueued right after the previous one, so a GPU
that catches up with the host idles inside the next call's events), `time_call` (every call enqueued while the GPU
sleeps) and the profiler's kernel durations (decode + reduce kernels, median over 20 calls).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import governor.kernels.paged_attention as pa
from governor.engine.bench_attention import AttentionCase, _inputs, kv_bytes, time_call
from governor.engine.bench_latency import hbm_bandwidth_gb_per_s

DEV = torch.device("cuda")
FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)


def old_time(fn: Any, iters: int = 50) -> tuple[float, float]:
    """(median ms between events, host seconds a call) with the loop as it was before the sleep."""
    for _ in range(5):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start, end in events:
        FLUSH.zero_()
        start.record()
        fn()
        end.record()
    host = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in events)
    return ms[len(ms) // 2], host


def kernel_us(fn: Any) -> dict[str, float]:
    """Median device time of each decode kernel over 20 profiled calls, in us."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            FLUSH.zero_()
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "decode" in ev.name:
            per.setdefault(ev.name, []).append(ev.device_time_total)
    return {name: sorted(v)[len(v) // 2] for name, v in per.items()}


def main() -> None:
    hbm = hbm_bandwidth_gb_per_s()
    rows = []
    for kv in ("fp8", "bf16"):
        for batch, ctx, hq, hkv in [(32, 4096, 32, 8), (32, 32768, 32, 8), (256, 612, 16, 8), (8, 4096, 32, 8)]:
            case = AttentionCase(batch, ctx, hq, hkv, 128, kv)
            x = _inputs(case, torch.bfloat16, DEV, 0)
            out = torch.empty_like(x["q"])
            fn = functools.partial(pa.paged_decode_attention, x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                                   x["seq_lens"], 1 / math.sqrt(128), out, k_scale=x["k_scale"],
                                   v_scale=x["v_scale"])
            nbytes = kv_bytes(case)
            for rnd in range(3):
                old_ms, host = old_time(fn)
                times = sorted(time_call(fn, DEV, 5, 50))
                new_ms = times[len(times) // 2]
                kernels = kernel_us(fn)
                kern = sum(kernels.values())
                row = {"kv": kv, "case": f"b{batch} ctx{ctx} {hq}:{hkv}", "rnd": rnd, "old_us": 1e3 * old_ms,
                       "host_us": 1e6 * host, "new_us": 1e3 * new_ms, "kernels_us": kern, "kernels": kernels,
                       "old_pct": 100 * nbytes / (old_ms * 1e-3) / 1e9 / hbm,
                       "new_pct": 100 * nbytes / (new_ms * 1e-3) / 1e9 / hbm,
                       "kern_pct": 100 * nbytes / (kern * 1e-6) / 1e9 / hbm}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x
            torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
