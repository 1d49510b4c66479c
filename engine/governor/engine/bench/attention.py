"""`governor bench attention`: the paged decode attention kernel alone, its achieved bandwidth against HBM.

Each case is one `paged_decode_attention` call (the decode kernel; when the context is split into more
partitions than the decode kernel merges itself, the split-KV reduce kernel too) on a batch of sequences
that all hold `context` tokens in a paged cache of `block_size`-token blocks. The achieved bandwidth is
the K/V bytes the call must read over its time:

    kv_bytes = 2 (K and V) * batch * context * num_kv_heads * head_dim * bytes per cache element
               (+ 2 * num_kv_heads * 4 for an fp8 cache's per-head float32 scales)

Not counted (each is recorded as `other_bytes`): q and the output, the block table (4 bytes per block)
and the split-KV partials (float32 acc, m, l written by the decode programs and read back by the merge).
The fraction is `kv_gb_per_s` over the HBM bandwidth of a 1 GiB device-to-device copy measured in the
same process (`bench.latency.hbm_bandwidth_gb_per_s`, read and write counted).

Timing on CUDA: warm-up calls first (Triton compilation, allocator), then `iters` calls, each preceded by
a write of a 256 MiB buffer that evicts L2 (so K/V come from HBM), each between its own CUDA events,
all enqueued while the GPU sleeps (`time_call`: no host time between the events); the median is reported
(mean too). The events also take in the launch latency before the first kernel, any gap between the decode and
reduce kernels and the end event's; so on CUDA the kernels' own device time is reported beside it (`kernel_us_p50`,
`kernel_gb_per_s`, `fraction_of_hbm_kernels`: torch.profiler's durations of the call's kernels, summed per call,
median over `iters` calls with the same L2 flush; `kernel_times`). Off CUDA (tests, TRITON_INTERPRET=1) the same
flow is timed by the wall clock; those numbers mean nothing.

The block table is a random permutation of the cache's blocks by default (an engine's table after
churn); `table="contiguous"` lays each sequence's blocks out in order, which isolates the cost of the
scattered gather.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# torch.cuda._sleep spins for a number of GPU clock cycles; this rate overestimates no GPU here (an H200's
# boost clock is 1.98 GHz), so a sleep lasts at least the seconds it was sized for.
_SLEEP_CYCLES_PER_S = 2.0e9
_SLEEP_TRIES = 3
_SLEEP_CHUNK = 64  # timed calls behind one sleep: a few launches each, far below CUDA's pending-launch queue

KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"  # a KV_DTYPES key
    block_size: int = 16
    num_splits: int | None = None  # None: the kernel's automatic choice (as the engine calls it)
    table: str = "random"  # "random" or "contiguous"


def kv_bytes(case: AttentionCase) -> int:
    """Bytes of K and V the call must read (module docstring's formula)."""
    dtype = KV_DTYPES[case.kv_dtype]
    n = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * dtype.itemsize
    if dtype == torch.float8_e4m3fn:
        n += 2 * case.num_kv_heads * 4
    return n


def _other_bytes(case: AttentionCase, q_dtype: torch.dtype, num_splits: int) -> int:
    q_out = 2 * case.batch * case.num_q_heads * case.head_dim * q_dtype.itemsize
    table = case.batch * -(-case.context // case.block_size) * 4
    partials = 0 if num_splits <= 1 else 2 * case.batch * case.num_q_heads * num_splits * (case.head_dim + 2) * 4
    return q_out + table + partials


def _inputs(case: AttentionCase, q_dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_dtype = KV_DTYPES[case.kv_dtype]
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    # randn then cast: fp8 has no randn, and N(0, 1) fits e4m3 with scale 1.
    k_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
    fp8 = kv_dtype == torch.float8_e4m3fn
    if case.table == "random":
        order = torch.randperm(num_blocks, generator=gen, device=device)
    elif case.table == "contiguous":
        order = torch.arange(num_blocks, device=device)
    else:
        raise ValueError(f"table must be 'random' or 'contiguous', got {case.table!r}")
    return {
        "q": torch.randn(case.batch, case.num_q_heads, case.head_dim, generator=gen, device=device).to(q_dtype),
        "k_cache": k_cache, "v_cache": v_cache,
        "block_tables": order.to(torch.int32).view(case.batch, blocks_per_seq),
        "seq_lens": torch.full((case.batch,), case.context, dtype=torch.int32, device=device),
        "k_scale": torch.ones(case.num_kv_heads, device=device) if fp8 else None,
        "v_scale": torch.ones(case.num_kv_heads, device=device) if fp8 else None,
    }


def effective_num_splits(case: AttentionCase, device: torch.device) -> int:
    """The split count `paged_decode_attention` runs for this case (its automatic choice, rounded to tiles)."""
    from governor.kernels.paged_attention import decode_num_splits

    bound = -(-case.context // case.block_size) * case.block_size  # block-table capacity, as the kernel sizes it
    fp8 = KV_DTYPES[case.kv_dtype] == torch.float8_e4m3fn
    return decode_num_splits(case.batch * case.num_kv_heads, bound, device, case.num_splits, fp8)


def time_call(fn: Any, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls of `fn` after `warmup` calls (CUDA: events, L2 flushed first).

    On CUDA the GPU sleeps while the host enqueues the timed calls, so no event pair can take in host time: a
    short call's launches (Python, argument checks, one or two Triton launches) can take longer on the host
    than the call on the GPU, and a GPU that catches up with the host then idles between its own events. The calls
    go in chunks of at most `_SLEEP_CHUNK`, one sleep each, so the launch queue never fills while the GPU sleeps.
    If the GPU wakes before the host has enqueued a chunk's last call (a stalled host), the chunk is timed again
    under a sleep three times longer; RuntimeError after `_SLEEP_TRIES` tries. `fn` must not synchronize with the
    GPU (that always wakes it).
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type != "cuda":
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return times
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    # The host's time to enqueue one timed call (the GPU is idle, so nothing blocks it).
    t0 = time.perf_counter()
    flush.zero_()
    fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    while len(times) < iters:
        n = min(_SLEEP_CHUNK, iters - len(times))
        times += _time_chunk(fn, flush, n, host_s)
    return times


def _time_chunk(fn: Any, flush: torch.Tensor, n: int, host_s: float) -> list[float]:
    """`n` calls of `time_call`, enqueued behind one GPU sleep."""
    margin = 3.0
    for _ in range(_SLEEP_TRIES):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        awake = torch.cuda.Event()
        torch.cuda._sleep(int(_SLEEP_CYCLES_PER_S * (0.01 + margin * n * host_s)))
        awake.record()
        for start, end in events:
            flush.zero_()  # evicts L2 (50 MiB on an H100/H200); not inside the events
            start.record()
            fn()
            end.record()
        starved = awake.query()  # the GPU already past the sleep: some calls may have waited on the host
        torch.cuda.synchronize()
        if not starved:
            return [s.elapsed_time(e) for s, e in events]
        margin *= 3
    raise RuntimeError(f"time_call: the GPU caught up with the host in {_SLEEP_TRIES} tries ({n} calls, "
                       f"{1e3 * host_s:.2f} ms of host time each); the timings would include host time")


def kernel_times(fn: Any, device: torch.device, iters: int) -> list[float]:
    """Microseconds of device time of the kernels each of `iters` calls of `fn` launches (CUDA only), summed per call,
    L2 flushed before each. The kernels are those one call launches (profiled alone first); their durations come
    from torch.profiler (CUPTI), so launch latency and gaps between them are left out. `fn` must launch the same
    kernels on every call."""
    from torch.profiler import ProfilerActivity, profile

    def gpu_events(prof: Any) -> list[Any]:
        return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.time_range.start)

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as probe:
        fn()
        torch.cuda.synchronize(device)
    names = [e.name for e in gpu_events(probe)]
    if not names:
        raise RuntimeError("kernel_times: the call launched no kernel the profiler saw")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize(device)
    mine = [e for e in gpu_events(prof) if e.name in set(names)]
    if len(mine) != iters * len(names):
        raise RuntimeError(f"kernel_times: {len(mine)} kernels for {iters} calls of {len(names)} ({names})")
    k = len(names)
    return [sum(e.time_range.elapsed_us() for e in mine[i:i + k]) for i in range(0, len(mine), k)]


def bench_case(case: AttentionCase, q_dtype: torch.dtype, device: torch.device, warmup: int, iters: int,
               hbm_gb_per_s: float | None, seed: int = 0) -> dict[str, Any]:
    from governor.kernels.paged_attention import paged_decode_attention

    x = _inputs(case, q_dtype, device, seed)
    out = torch.empty_like(x["q"])
    scale = 1 / math.sqrt(case.head_dim)

    def call() -> None:
        paged_decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], scale, out,
                               num_splits=case.num_splits, k_scale=x["k_scale"], v_scale=x["v_scale"])

    times = sorted(time_call(call, device, warmup, iters))
    ms = times[len(times) // 2]
    splits = effective_num_splits(case, device)
    nbytes = kv_bytes(case)
    row: dict[str, Any] = {**asdict(case), "q_dtype": str(q_dtype).removeprefix("torch."),
                           "num_splits_run": splits, "kv_bytes": nbytes,
                           "other_bytes": _other_bytes(case, q_dtype, splits), "iters": iters, "warmup": warmup,
                           "us_p50": 1e3 * ms, "us_mean": 1e3 * statistics.fmean(times),
                           "us_min": 1e3 * times[0], "us_max": 1e3 * times[-1],
                           "kv_gb_per_s": nbytes / (ms * 1e-3) / 1e9}
    if device.type == "cuda":
        try:
            kernel_us = sorted(kernel_times(call, device, iters))
        except RuntimeError as e:  # e.g. no profiler (CUPTI) events: the event timings still stand
            row["kernel_time_error"] = str(e)
        else:
            row["kernel_us_p50"] = kernel_us[len(kernel_us) // 2]
            row["kernel_gb_per_s"] = nbytes / (row["kernel_us_p50"] * 1e-6) / 1e9
    if hbm_gb_per_s:
        row["fraction_of_hbm"] = row["kv_gb_per_s"] / hbm_gb_per_s
        if "kernel_gb_per_s" in row:
            row["fraction_of_hbm_kernels"] = row["kernel_gb_per_s"] / hbm_gb_per_s
    return row


def bench_attention(cases: list[AttentionCase], q_dtype: torch.dtype = torch.bfloat16, device: str = "auto",
                    warmup: int = 10, iters: int = 50, on_row: Any = None) -> dict[str, Any]:
    """Time every case; `on_row(rows_so_far)` after each, so a long sweep leaves partial results."""
    from governor.engine.bench.latency import hbm_bandwidth_gb_per_s

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    hbm = hbm_bandwidth_gb_per_s() if dev.type == "cuda" else None
    timing = "cuda events per call, L2 flushed before each, median" if dev.type == "cuda" else "wall clock (no use)"
    info: dict[str, Any] = {"device": str(dev), "hbm_copy_gb_per_s": hbm,
                            "q_dtype": str(q_dtype).removeprefix("torch."), "timing": timing}
    if dev.type == "cuda":
        info["sm_count"] = torch.cuda.get_device_properties(dev).multi_processor_count
    rows: list[dict[str, Any]] = []
    for case in cases:
        rows.append(bench_case(case, q_dtype, dev, warmup, iters, hbm))
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the case's caches (GBs at long contexts) go back before the next
        if on_row is not None:
            on_row({"rows": rows, "info": info})
    return {"rows": rows, "info": info}


def parse_cases(batches: str, contexts: str, heads: str, head_dim: int, kv_dtypes: str, block_size: int,
                splits: str, tables: str) -> list[AttentionCase]:
    """The cross product of comma-separated lists; heads as Q:KV pairs ("32:8,16:8"), splits "auto" or ints."""
    cases = []
    for hq_hkv in heads.split(","):
        hq, hkv = (int(v) for v in hq_hkv.split(":"))
        for kvd in kv_dtypes.split(","):
            if kvd not in KV_DTYPES:
                raise ValueError(f"unknown KV dtype {kvd!r}; one of {sorted(KV_DTYPES)}")
            for ctx in (int(c) for c in contexts.split(",")):
                for b in (int(v) for v in batches.split(",")):
                    for table in tables.split(","):
                        for s in splits.split(","):
                            cases.append(AttentionCase(b, ctx, hq, hkv, head_dim, kvd, block_size,
                                                       None if s == "auto" else int(s), table))
    return cases


def write_envelope(result: dict[str, Any], output_json: str | None) -> dict[str, Any]:
    """The result with the time and the hardware/software envelope; written to `output_json` if given."""
    from governor.engine.bench.throughput import hardware

    env = {"benchmark": "bench-attention", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": hardware(), "kv_bytes_formula": "2 * batch * context * num_kv_heads * head_dim * itemsize"
           " (+ 2 * num_kv_heads * 4 fp8 scales)", "result": result}
    if output_json:
        Path(output_json).write_text(json.dumps(env, indent=2, default=str) + "\n")
    return env
