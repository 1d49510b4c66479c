"""The decode attention kernel's machine code for sm_90 without a GPU: registers, spills, shared memory and the
instruction mix of its main loop.

    python3 scripts/decode-sass.py [--kv-dtype fp8|bf16] [--tile N] [--group G] [--head-dim D] [--block-size B]
                                   [--num-warps W] [--num-stages S] [--maxnreg R] [--offsets-64]
                                   [--split/--no-split] [--merge fold|reduce|pdl]
                                   [--splits N] [--top 25]

Tile, warps, stages and register cap default to what `paged_decode_attention` launches with on sm_90 for the dtype and
split or not (its launch policy, `launch_policy.policy_for_arch("sm_90")`, through `decode._decode_tile` and
`decode._decode_launch_options`; `--no-split` takes the settings of wide launches, the unsplit ones with enough
programs). Compiles `decode._decode_kernel` (with `--gluon`,
`gluon_decode._gluon_decode_kernel`) of governor.kernels.paged_attention with Triton for sm_90a (the pointer and
stride arguments marked 16-divisible, as Triton's launcher specializes them at run time), runs the ptxas and nvdisasm
that ship with Triton, and prints the registers, spill bytes and shared memory of the compiled kernel and a histogram
of the SASS instructions in its longest loop (the loop over K/V tiles): per-tile instruction counts per warp. Needs no
CUDA device; the numbers are the compiler's, not a measurement of time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from governor.kernels.launch_policy import policy_for_arch
from governor.kernels.paged_attention import decode, gluon_decode, tiles

_NOT_DIVISIBLE = {"qk_scale", "num_splits"}
POLICY = policy_for_arch("sm_90")  # the settings the kernels launch with on the architecture compiled for


def compile_decode(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    fn = decode._decode_kernel
    fp8 = args.kv_dtype == "fp8"
    kv = "fp8e4nv" if fp8 else args.kv_dtype
    q = "fp16" if args.kv_dtype == "fp16" else "bf16"  # q's dtype is the cache's, bf16 over fp8 (as the engine runs)
    sig = {"q_ptr": f"*{q}", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": f"*{q}", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
           "part_l_ptr": "*fp32", "counter_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
           "qk_scale": "fp32"}
    for name in fn.arg_names:
        sig.setdefault(name, "i32")
    group_pad = max(tiles._MIN_DOT, triton.next_power_of_2(args.group))
    constants = {"GROUP": args.group, "GROUP_PAD": group_pad, "BLOCK_SIZE": args.block_size, "TILE_N": args.tile,
                 "HEAD_DIM": args.head_dim, "SPLIT": args.split, "TILE_ALIGN": POLICY.tile_n, "KV_FP8": fp8,
                 "FP16_PRODUCTS": fp8, "DOT_PRECISION": "tf32", "INTERPRET": False, "OFFSETS_64": args.offsets_64,
                 "SPLITS_PAD": triton.next_power_of_2(args.splits), "FOLD": args.merge == "fold",
                 "PDL": args.merge == "pdl"}
    for name in constants:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t not in ("constexpr", "fp32") and n not in _NOT_DIVISIBLE}
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constants.items()}, attrs)
    options = {"num_warps": args.num_warps, "num_stages": args.num_stages}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon_decode(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    """The Gluon fp8 decode kernel (`gluon_decode._gluon_decode_kernel`), as `paged_decode_attention` launches it on
    sm_90."""
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gluon_decode._gluon_decode_kernel
    sig = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
           "part_l_ptr": "*fp32", "counter_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
           "qk_scale": "fp32"}
    for name in fn.arg_names:
        sig.setdefault(name, "i32")
    mma, a_op, b_op, k_load, v_load = gluon_decode._gluon_decode_layouts(args.tile, args.head_dim)
    constants = {"GROUP": args.group, "GROUP_PAD": triton.next_power_of_2(args.group), "BLOCK_SIZE": args.block_size,
                 "TILE_N": args.tile, "HEAD_DIM": args.head_dim, "STAGES": args.num_stages, "SPLIT": args.split,
                 "TILE_ALIGN": POLICY.tile_n, "Q_BF16": True, "OFFSETS_64": args.offsets_64,
                 "FOLD": args.split and args.merge == "fold", "PDL": args.split and args.merge == "pdl",
                 "MMA": mma, "A": a_op, "B": b_op, "KL": k_load, "VL": v_load}
    for name in constants:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t not in ("constexpr", "fp32") and n not in _NOT_DIVISIBLE}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constants.items()}, attrs)
    options: dict[str, int] = {"num_warps": 1}
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_usage(ptx: str, maxnreg: int | None) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) as ptxas reports them for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cap = ["--maxrregcount", str(maxnreg)] if maxnreg else []
        log = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", *cap, path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spill is None:
        raise RuntimeError(f"unexpected ptxas output:\n{log}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def loop_histogram(cubin: bytes) -> collections.Counter[str]:
    """Opcode counts between the label and the backward branch of the longest loop in the SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        lines = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line.strip()))}
    loop = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    ops: collections.Counter[str] = collections.Counter()
    for line in lines[loop[0]:loop[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16", "fp16"])
    ap.add_argument("--tile", type=int, help="keys per loop step (default: the kernel's for the dtype)")
    ap.add_argument("--group", type=int, default=4, help="query heads per kv head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-warps", type=int, help="default: what the kernel launches with for the dtype")
    ap.add_argument("--num-stages", type=int, help="default: as launched (Triton's 3 unless the kernel sets it)")
    ap.add_argument("--maxnreg", type=int, help="default: as launched; 0: the compiler's choice")
    ap.add_argument("--offsets-64", action="store_true", help="int64 cache offsets (a cache of 2^31+ elements)")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--merge", default="fold", choices=["fold", "reduce", "pdl"],
                    help="how split partials merge: folded in, by the reduce kernel, by the reduce kernel under PDL")
    ap.add_argument("--splits", type=int, default=2, help="split count the fold's merge is compiled for")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon fp8 decode kernel (one warp; --tile defaults to its narrow launches' keys a step, "
                         "--num-stages to its ring depth)")
    args = ap.parse_args()
    if args.gluon:
        args.kv_dtype = "fp8"
        args.tile = args.tile or POLICY.gluon_tile_n_narrow
        args.num_stages = args.num_stages or POLICY.gluon_stages
        args.num_warps = 1
        if args.maxnreg is None:  # as launched: the cap applies to the wide launches' tile
            wide = args.tile == POLICY.gluon_tile_n_wide
            args.maxnreg = POLICY.gluon_maxnreg_wide if wide else None
        args.maxnreg = args.maxnreg or None
        kernel = compile_gluon_decode(args)
        _report(args, kernel)
        return
    if args.tile is None:
        args.tile = decode._decode_tile(POLICY, args.kv_dtype == "fp8", not args.split)
    launch = decode._decode_launch_options(POLICY, args.kv_dtype == "fp8", not args.split)
    args.num_warps = args.num_warps or launch["num_warps"]
    args.num_stages = args.num_stages or launch.get("num_stages", 3)
    args.maxnreg = launch.get("maxnreg") if args.maxnreg is None else args.maxnreg or None
    kernel = compile_decode(args)
    _report(args, kernel)


def _report(args: argparse.Namespace, kernel: triton.compiler.CompiledKernel) -> None:
    regs, spill_st, spill_ld = ptxas_usage(kernel.asm["ptx"], args.maxnreg)
    ops = loop_histogram(kernel.asm["cubin"])
    total = sum(ops.values())
    tile_bytes = 2 * args.tile * args.head_dim * (1 if args.kv_dtype == "fp8" else 2)
    print(f"{args.kv_dtype} tile {args.tile} group {args.group} warps {args.num_warps} stages {args.num_stages} "
          f"maxnreg {args.maxnreg}{' int64 offsets' if args.offsets_64 else ''}: {regs} registers, "
          f"spills {spill_st}/{spill_ld} bytes (store/load), "
          f"{kernel.metadata.shared} bytes shared")
    print(f"loop: {total} instructions per warp per tile ({tile_bytes} K/V bytes), "
          f"{tile_bytes / (total * args.num_warps):.1f} bytes per warp instruction")
    for op, n in ops.most_common(args.top):
        print(f"  {n:5d}  {op}")


if __name__ == "__main__":
    main()
