"""Time the one-row GEMVs of quantized weights on the llama3-8b decode products, beside the bf16 `gemv`, under launch
policies that differ in the quantized kernels' fields, and print each product's microseconds and its fraction of the
copy bandwidth (weight, zero-point and scale bytes read).

    python scripts/quantized-gemv-sweep.py [--formats fp8,awq,gptq] [--shapes qkv,o] [--output-json FILE]
                                           [--deadline-s 300] [--gemm-rows M]
    TRITON_INTERPRET=1 python scripts/quantized-gemv-sweep.py --check   (CPU: every variant against its reference)

`--gemm-rows M` times the products of M rows instead, each against the exact product: with `--formats gptq`,
`packed_gemm` (GPTQ int4 in groups of 128 in order) under the tiles of the launch policy's `packed_gemm_tiles`; with
`--formats fp8`, the W8A8 GEMM `fp8_block_gemm` over 128 x 128 block scales under its split tiles (M up to
FP8_GEMM_SPLIT_MAX_ROWS) and its tiled ones, and `torch._scaled_mm` over per-feature scales (x quantized beforehand,
as W8A8 does once per step).

Variants: fp8 — `fp8_gemv` over per-feature (quantized at load) and 128 x 128 block scales with the policy's
`fp8_gemv` tile, the x rounding W8A8 runs before it (`fp8_round`); AWQ — `awq_gemv` on AWQ's own layout, split along
K or not (`packed_split`), and the layout the engine repacks AWQ into at load (`gptq_gemv` with the zero points as
stored); GPTQ (4-bit, groups of 128 in order) — `gptq_gemv` split or not, and the split's column block, chunk, warps
and packed rows a K step;
for AWQ and GPTQ also the policy's split without programmatic dependent launch.
Each product is timed in a CUDA graph of back-to-back calls over enough weight copies that every call reads from
HBM, as scripts/gemv-sweep.py does.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable

import torch

from governor.engine.models.quantization import pack_int32, unpack_awq
from governor.kernels.fp8_gemm import FP8_GEMM_SPLIT_MAX_ROWS, fp8_block_gemm, fp8_block_gemm_ref
from governor.kernels.fp8_quant import fp8_quantize, fp8_round
from governor.kernels.gemv import fp8_gemv, fp8_gemv_ref, gemv
from governor.kernels.launch_policy import GemvConfig, LaunchPolicy, policy_for
from governor.kernels.packed_gemm import packed_gemm
from governor.kernels.packed_gemv import awq_gemv, awq_gemv_ref, gptq_gemv, gptq_gemv_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CHECK_SHAPES = {"a": (96, 512), "b": (320, 1024)}
L2_SPAN = 4 * 50 * 2**20
GROUP = 128


def variants(fmt: str, base: LaunchPolicy, check: bool) -> list[tuple[str, LaunchPolicy]]:
    """(name, policy) pairs swept for a format."""
    if fmt == "fp8":
        tiles = [(4, 128, 4), (8, 256, 4)] if check else [(4, 2048, 4), (4, 4096, 4), (8, 2048, 4), (8, 4096, 4),
                                                          (8, 4096, 8), (16, 1024, 4)]
        return [(f"tile {t}", dataclasses.replace(base, fp8_gemv=GemvConfig(*t))) for t in tiles]
    out = [("unsplit", dataclasses.replace(base, packed_split=False))]
    # Column blocks with every warp along the columns (4 or 8 columns a thread), K chunks, packed rows a K step (GPTQ's
    # layout; AWQ's own takes the same columns, chunk and warps).
    shapes = [(256, 4, 256, 16), (512, 4, 128, 8)] if check else [
        (bn, warps, chunk, rows) for bn, warps in ((256, 4), (256, 2), (512, 4), (512, 2), (1024, 8), (1024, 4))
        for chunk in (128, 256) for rows in (8, 16)]
    for block_n, warps, chunk, rows in shapes:
        out.append((f"split {block_n} x {chunk} w{warps} r{rows}", dataclasses.replace(
            base, packed_split=True, packed_split_block_n=block_n, packed_split_chunk=chunk,
            packed_split_warps=warps, packed_split_rows=rows, packed_split_awq_tile=(block_n, chunk, warps))))
    out.append(("split, no PDL", dataclasses.replace(base, packed_split=True, packed_split_pdl=False)))
    return out


def random_words(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def operands(fmt: str, n: int, k: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layout, the tensors of one product (on the CPU)."""
    scales = (torch.rand(k // GROUP, n, generator=gen) * 0.01 + 1e-3).half()
    if fmt == "fp8":
        codes = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"row": (codes, torch.rand(n, 1, generator=gen) / 100 + 1e-3),
                "block": (codes, torch.rand(-(-n // 128), -(-k // 128), generator=gen) / 100 + 1e-3)}
    if fmt == "awq":
        qw, qz = random_words(gen, k, n // 8), random_words(gen, k // GROUP, n // 8)
        repacked = (pack_int32(unpack_awq(qw), 4, dim=0), pack_int32(unpack_awq(qz), 4, dim=-1))
        return {"awq": (qw, qz, scales), "repacked": (*repacked, scales)}
    return {"gptq": (random_words(gen, k // 8, n), random_words(gen, k // GROUP, n // 8), scales)}


def product(fmt: str, layout: str, x: torch.Tensor, t: tuple[torch.Tensor, ...], policy: LaunchPolicy
            ) -> torch.Tensor:
    k = x.shape[1]
    if fmt == "fp8":
        block = (1, k) if layout == "row" else (128, 128)
        return fp8_gemv(x, t[0], t[1], block, policy=policy, out_dtype=torch.bfloat16 if x.is_cuda else x.dtype)
    qweight, qzeros, scales = t
    if layout == "awq":
        return awq_gemv(x, qweight, qzeros, scales, GROUP, policy=policy)
    g_idx = torch.arange(k, dtype=torch.int32, device=x.device) // GROUP
    return gptq_gemv(x, qweight, qzeros, scales, g_idx, 4, group_size=GROUP, policy=policy,
                     zeros_minus_one=layout == "gptq")


def reference(fmt: str, layout: str, x: torch.Tensor, t: tuple[torch.Tensor, ...]) -> torch.Tensor:
    k = x.shape[1]
    if fmt == "fp8":
        return fp8_gemv_ref(x, t[0], t[1], (1, k) if layout == "row" else (128, 128))
    qweight, qzeros, scales = t
    if layout == "awq":
        return awq_gemv_ref(x, qweight, qzeros, scales, GROUP)
    g_idx = torch.arange(k, dtype=torch.int32, device=x.device) // GROUP
    return gptq_gemv_ref(x, qweight, qzeros, scales, g_idx, 4, zeros_minus_one=layout == "gptq")


def run_format(fmt: str, shapes: dict[str, tuple[int, int]], check: bool, copy: float, stop_at: float) -> list[dict]:
    from governor.engine.bench.latency import graph_us_per_call
    device = torch.device("cpu" if check else "cuda")
    dtype = torch.float32 if check else torch.bfloat16
    base = policy_for(device)
    rows: list[dict] = []

    def timed(fn: Callable[[int], object], calls: int) -> float | None:
        return None if check else graph_us_per_call(fn, max(calls, 24 // calls * calls))

    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(n + k)
        x = torch.randn(1, k, generator=gen).to(device, dtype)
        if not check:
            w16 = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(max(1, -(-L2_SPAN // (2 * n * k))))]
            def dense(i: int, x: torch.Tensor = x, ws: list[torch.Tensor] = w16) -> torch.Tensor:
                return gemv(x, ws[i % len(ws)])
            us = timed(dense, len(w16))
            assert us is not None
            rows.append({"format": "bf16", "gemm": name, "us": round(us, 2),
                         "fraction_of_copy": round(2 * n * k / (us * 1e-6) / 1e9 / copy, 3)})
            print(f"{name:8} bf16 gemv: {us:7.1f} us {100 * rows[-1]['fraction_of_copy']:4.0f}%", flush=True)
            del w16
        if fmt == "fp8":  # W8A8's one-row rounding of x before the GEMV
            def rounding(i: int, x: torch.Tensor = x) -> torch.Tensor:
                return fp8_round(x, 0, torch.float32)
            us = timed(rounding, 1)
            rows.append({"format": fmt, "gemm": name, "kind": "fp8_round", "us": us})
            print(f"{name:8} fp8_round: {us} us", flush=True)
            xin = fp8_round(x, 0, torch.float32)
        else:
            xin = x
        for layout, tensors in operands(fmt, n, k, gen).items():
            on = tuple(t.to(device) for t in tensors)
            nbytes = sum(t.numel() * t.element_size() for t in on)
            copies = 1 if check else max(1, -(-L2_SPAN // nbytes))
            sets = [on] + [tuple(t.clone() for t in on) for _ in range(copies - 1)]
            want = reference(fmt, layout, xin, on).float()
            for label, policy in variants(fmt, base, check):
                if time.monotonic() > stop_at:
                    print("deadline reached", flush=True)
                    return rows
                err = (product(fmt, layout, xin, on, policy).float() - want).abs().max().item()
                def call(i: int, p: LaunchPolicy = policy, layout: str = layout, x: torch.Tensor = xin,
                         sets: list[tuple[torch.Tensor, ...]] = sets) -> torch.Tensor:
                    return product(fmt, layout, x, sets[i % len(sets)], p)
                us = timed(call, copies)
                r = {"format": fmt, "gemm": name, "layout": layout, "variant": label, "max_abs_err": err,
                     "max_abs_want": want.abs().max().item()}
                if us is not None:
                    r |= {"us": round(us, 2), "fraction_of_copy": round(nbytes / (us * 1e-6) / 1e9 / copy, 3)}
                rows.append(r)
                print(f"{name:8} {layout:8} {label:18} " + (f"{us:7.1f} us {100 * r['fraction_of_copy']:4.0f}% "
                      if us is not None else "") + f"err {err:.3g} of {r['max_abs_want']:.3g}", flush=True)
    return rows


GEMM_TILES = [(64, 1024, 4), (128, 512, 4), (128, 1024, 8), (256, 512, 8), (256, 1024, 8), (64, 512, 4)]


def measured(call: Callable[[int], torch.Tensor], want: torch.Tensor, copies: int, nbytes: int, check: bool,
             copy: float, label: str, **fields: object) -> dict:
    """A row of a `--gemm-rows` sweep: `call`'s largest error against `want` and, on a GPU, its microseconds over
    `copies` weight copies and the fraction of the copy bandwidth its `nbytes` reach; printed as it comes."""
    from governor.engine.bench.latency import graph_us_per_call
    err = (call(0).float() - want).abs().max().item()
    r: dict = {**fields, "max_abs_err": err, "max_abs_want": want.abs().max().item()}
    if not check:
        us = graph_us_per_call(call, copies)
        r |= {"us": round(us, 2), "fraction_of_copy": round(nbytes / (us * 1e-6) / 1e9 / copy, 3)}
    print(f"{label} " + (f"{r['us']:7.1f} us " if "us" in r else "") + f"err {err:.3g} of {r['max_abs_want']:.3g}",
          flush=True)
    return r


def run_rows(rows: int, shapes: dict[str, tuple[int, int]], check: bool, copy: float, stop_at: float) -> list[dict]:
    """`packed_gemm` on `rows` rows of x per product and tile (GPTQ int4, groups of 128 in order, zero points as
    stored), each against the exact product, and its microseconds and fraction of the copy bandwidth."""
    device = torch.device("cpu" if check else "cuda")
    dtype = torch.float32 if check else torch.bfloat16
    base = policy_for(device)
    out: list[dict] = []
    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(n + k)
        t = tuple(a.to(device) for a in operands("gptq", n, k, gen)["gptq"])
        nbytes = sum(a.numel() * a.element_size() for a in t)
        copies = 1 if check else max(1, -(-L2_SPAN // nbytes))
        sets = [t] + [tuple(a.clone() for a in t) for _ in range(copies - 1)]
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        g_idx = torch.arange(k, dtype=torch.int32, device=device) // GROUP
        want = torch.cat([gptq_gemv_ref(x[i:i + 1], *t, g_idx, 4, zeros_minus_one=False) for i in range(rows)]).float()
        for tile in GEMM_TILES[:2] if check else GEMM_TILES:
            if time.monotonic() > stop_at:
                print("deadline reached", flush=True)
                return out
            policy = dataclasses.replace(base, packed_gemm_tiles=((rows, tile),))

            def call(i: int, p: LaunchPolicy = policy, x: torch.Tensor = x,
                     sets: list[tuple[torch.Tensor, ...]] = sets) -> torch.Tensor:
                return packed_gemm(x, *sets[i % len(sets)], 4, GROUP, zeros_minus_one=False, policy=p)
            out.append(measured(call, want, copies, nbytes, check, copy, f"{name:8} {rows} rows tile {tile}:",
                                format="gptq", rows=rows, gemm=name, tile=list(tile)))
    return out


FP8_SPLIT_TILES = [(64, 1024, 4, 3), (64, 1024, 4, 1), (64, 2048, 4, 3), (128, 1024, 4, 3)]
FP8_TILES = [(64, 128, 4, 4), (64, 128, 4, 3), (16, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)]


def run_fp8_rows(rows: int, shapes: dict[str, tuple[int, int]], check: bool, copy: float,
                 stop_at: float) -> list[dict]:
    """`fp8_block_gemm` on `rows` rows per product over 128 x 128 block scales (x in 1 x 128 groups): its split
    launch's tiles (up to FP8_GEMM_SPLIT_MAX_ROWS rows) and its tiled launch's; and `torch._scaled_mm` over
    per-feature scales (x per token), what such layers run; each against the exact product of the codes, its
    microseconds and fraction of the copy (of the block-scaled weight's bytes)."""
    device = torch.device("cpu" if check else "cuda")
    base = policy_for(device)
    policies = [(f"tiled {tile}", dataclasses.replace(base, fp8_gemm_split_max_rows=0, fp8_gemm_tile=tile))
                for tile in FP8_TILES[:2 if check else None]]
    if rows <= FP8_GEMM_SPLIT_MAX_ROWS:
        policies = [(f"split {tile}", dataclasses.replace(base, fp8_gemm_split_max_rows=rows, fp8_gemm_split_tile=tile))
                    for tile in FP8_SPLIT_TILES[:2 if check else None]] + policies
    out: list[dict] = []
    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(n + k + rows)
        layouts = operands("fp8", n, k, gen)
        x = torch.randn(rows, k, generator=gen).to(device, torch.float32 if check else torch.bfloat16)
        block_codes, block_scales = layouts["block"]
        nbytes = block_codes.numel() + block_scales.numel() * 4
        copies = 1 if check else max(1, -(-L2_SPAN // nbytes))
        for layout, (codes, w_scales) in layouts.items():
            if layout == "row" and check:
                continue
            block, group = ((1, k), 0) if layout == "row" else ((128, 128), 128)
            sets = [(codes.to(device), w_scales.to(device)) for _ in range(copies)]
            x_codes, x_scales = fp8_quantize(x, group)
            want = fp8_block_gemm_ref(x_codes.cpu(), x_scales.cpu(), group, codes, w_scales, block, None,
                                      torch.float32).to(device)

            def gemm(i: int, policy: LaunchPolicy, group: int = group,
                     xq: tuple[torch.Tensor, torch.Tensor] = (x_codes, x_scales),
                     sets: list[tuple[torch.Tensor, torch.Tensor]] = sets) -> torch.Tensor:
                w, w_scales = sets[i % len(sets)]
                return fp8_block_gemm(*xq, group, w, w_scales, (128, 128), None,
                                      torch.float32 if check else torch.bfloat16, policy=policy)

            def scaled_mm(i: int, xq: tuple[torch.Tensor, torch.Tensor] = (x_codes, x_scales),
                          sets: list[tuple[torch.Tensor, torch.Tensor]] = sets) -> torch.Tensor:
                w, w_scales = sets[i % len(sets)]
                return torch._scaled_mm(xq[0], w.t(), scale_a=xq[1], scale_b=w_scales.view(1, -1),
                                        out_dtype=torch.bfloat16)
            cases: list[tuple[str, Callable[[int], torch.Tensor]]] = (
                [("torch._scaled_mm", scaled_mm)] if layout == "row" else
                [(label, functools.partial(gemm, policy=policy)) for label, policy in policies])
            for label, call in cases:
                if time.monotonic() > stop_at:
                    print("deadline reached", flush=True)
                    return out
                out.append(measured(call, want, copies, nbytes, check, copy,
                                    f"{name:8} {rows} rows {layout:5} {label:26}", format="fp8", rows=rows,
                                    gemm=name, layout=layout, variant=label))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="awq,gptq,fp8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--check", action="store_true", help="small shapes on the CPU, against the references only")
    ap.add_argument("--output-json")
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--gemm-rows", type=int, help="time packed_gemm's tiles on this many rows instead")
    a = ap.parse_args()
    stop_at = time.monotonic() + a.deadline_s
    if a.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--check runs under TRITON_INTERPRET=1")
        shapes, copy = CHECK_SHAPES, 1.0
    else:
        from governor.engine.bench.latency import hbm_bandwidth_gb_per_s
        shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
        copy = hbm_bandwidth_gb_per_s()
        print(f"copy {copy:.0f} GB/s", flush=True)
    rows: list[dict] = []
    gemm_shapes = {"a": (64, 512), "b": (136, 1024)} if a.check else shapes
    if a.gemm_rows and "gptq" in a.formats.split(","):
        rows = run_rows(a.gemm_rows, gemm_shapes, a.check, copy, stop_at)
    if a.gemm_rows and "fp8" in a.formats.split(","):
        rows += run_fp8_rows(a.gemm_rows, gemm_shapes, a.check, copy, stop_at)
    for fmt in [] if a.gemm_rows else a.formats.split(","):
        rows += run_format(fmt, shapes, a.check, copy, stop_at)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"copy_gb_per_s": copy, "rows": rows,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
