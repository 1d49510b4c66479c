"""Compile the quantized-weight kernels, decode attention with the rotary folded in, the all-reduce + RMSNorm of tensor
parallelism and the argmax of greedy steps for a Hopper GPU (sm_90) on any machine, GPU or not: Triton's front end,
its TritonGPU passes, LLVM and the ptxas bundled with the triton wheel, down to a cubin.
What the interpreter cannot show (a kernel that Triton cannot lower for the GPU, or that reads a global the GPU
compiler refuses) shows here; whether the cubin computes the right thing is for the GPU tests.

    env -u TRITON_INTERPRET python3 scripts/compile-sm90.py      (PYTHONPATH=engine:kernels:operator)
    env -u TRITON_INTERPRET python3 scripts/compile-sm90.py --sass "packed_split gptq=True bits=4"

Prints one line per kernel and configuration; exits 1 if any fails to compile. `--sass TEXT`: the configurations
whose name holds TEXT, compiled as the JIT compiles them for 16-byte-aligned tensors and sizes (pointers and `n`
divisible by 16), and for each its registers and SASS instructions by opcode, the whole kernel's and every loop
body's (cuobjdump from the triton wheel): what a kernel issues per weight, without a GPU profiler. The
configurations are the shapes of the llama3-8b layers the engine launches them with (K 4,096 or 14,336; AWQ/GPTQ
groups of 128; fp8 blocks of 128 x 128 and per row; the split GEMV with the launch policy's tile; the norm and
SiLU·mul kernels that round a W8A8 layer's input), in bf16, plus the float32 variants the tests use.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from governor.kernels import (
    argmax,
    fp8_gemm,
    fp8_quant,
    gemv,
    packed_gemm,
    packed_gemv,
    paged_attention,
    reduce_norm,
)
from governor.kernels.elementwise import row_warps
from governor.kernels.launch_policy import LaunchPolicy

POLICY = LaunchPolicy()

TARGET = GPUTarget("cuda", 90, 32)


def cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int]]:
    """(name, kernel, signature, constexprs, warps) for every configuration compiled."""
    out: list[tuple[str, Any, dict[str, str], dict[str, Any], int]] = []

    def constexprs(names: str, **values: Any) -> tuple[dict[str, str], dict[str, Any]]:
        return {n: "constexpr" for n in names.split()}, values

    for x, values, out_t, k, g, silu in (("*bf16", False, "*u8", 4096, 0, False),
                                         ("*bf16", True, "*fp32", 4096, 128, False),
                                         ("*fp16", True, "*fp16", 14336, 0, False),
                                         ("*fp32", False, "*u8", 4096, 128, False),
                                         ("*bf16", True, "*fp32", 14336, 0, True),
                                         ("*bf16", True, "*fp32", 14336, 128, True),
                                         ("*bf16", False, "*u8", 20480, 0, False),  # rows longer than a block
                                         ("*bf16", True, "*fp32", 28672, 0, True)):
        sig, consts = constexprs("K G GROUPS BLOCK VALUES SILU_MUL", K=k, G=g or k, GROUPS=k // (g or k),
                                 BLOCK=fp8_quant.quantize_block(g or k), VALUES=values, SILU_MUL=silu)
        out.append((f"fp8_quantize x={x} out={out_t} group={g} silu_mul={silu}", fp8_quant._fp8_quantize_kernel,
                    {"x_ptr": x, "out_ptr": out_t, "scales_ptr": "*fp32", "stride_x": "i32", **sig}, consts,
                    16 if (g or k) >= 2048 else 4))
    for group, residual in ((0, True), (128, True), (128, False)):  # the norm writing a W8A8 layer's rounded input
        sig, consts = constexprs("HAS_RESIDUAL G BLOCK PDL", HAS_RESIDUAL=residual, G=group or 4096, BLOCK=4096,
                                 PDL=True)
        out.append((f"add_rms_norm_fp8 group={group} residual={residual}", fp8_quant._add_rms_norm_fp8_kernel,
                    {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "h_ptr": "*bf16",
                     "n": "i32", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
                     "stride_h": "i32", **sig}, consts, row_warps(LaunchPolicy(), 4096)))
    for x, scale, even in (("*bf16", 0, True), ("*bf16", 1, False), ("*bf16", 2, True), ("*fp32", 1, True),
                           ("*fp32", 2, False)):
        per_row = scale == 1
        sig, consts = constexprs("K BN_SCALE BK_SCALE BLOCK_N BLOCK_K HAS_BIAS EVEN_N EVEN_K SCALE PDL", K=4096,
                                 BN_SCALE=1 if per_row else 128, BK_SCALE=4096 if per_row else 128, BLOCK_N=4,
                                 BLOCK_K=1024, HAS_BIAS=True, EVEN_N=even, EVEN_K=even, SCALE=scale, PDL=True)
        out.append((f"fp8_gemv x={x} scale_mode={scale} even={even}", gemv._fp8_gemv_kernel,
                    {"x_ptr": x, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
                     "n": "i32", "stride_s": "i32", **sig}, consts, 4))
    # The all-reduce + add + RMSNorm of tensor parallelism at TP 2 over 4,096 values, rows and flags or packets.
    for x, packets in (("*bf16", True), ("*fp32", True), ("*bf16", False)):
        sig, consts = constexprs("RANK WORLD HAS_RESIDUAL BLOCK PDL PACKETS VALUES INTERPRET", RANK=0, WORLD=2,
                                 HAS_RESIDUAL=True, BLOCK=4096, PDL=True, PACKETS=packets,
                                 VALUES=2 if x == "*bf16" else 1, INTERPRET=False)
        out.append((f"all_reduce_add_rms_norm x={x} packets={packets}", reduce_norm._all_reduce_add_rms_norm_kernel,
                    {**{name: x for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "h_ptr")}, "buffers": "*i64",
                     "signal_pads": "*i64", "calls": "*i32", "t": "i32", "n": "i32", "eps": "fp32", "stride_x": "i32",
                     "stride_r": "i32", "stride_o": "i32", "stride_h": "i32", "slot_stride": "i64",
                     "packet_base": "i64", "packet_slot": "i64", **sig}, consts, row_warps(POLICY, 4096)))
    # Decode attention with the rotary and K/V write folded in (a step of decodes: llama3-8b at TP 2, 4 query heads a
    # kv head; Qwen3's per-head norms), split and folded as a batch-1 step runs, and unsplit.
    for qk_norm, split in ((False, True), (True, True), (False, False)):
        sig, consts = constexprs(
            "GROUP GROUP_PAD BLOCK_SIZE TILE_N HEAD_DIM SPLIT TILE_ALIGN KV_FP8 FP16_PRODUCTS DOT_PRECISION INTERPRET "
            "OFFSETS_64 SPLITS_PAD FOLD PDL CHAIN_PDL ROTARY QK_NORM", GROUP=4, GROUP_PAD=16, BLOCK_SIZE=16,
            TILE_N=64, HEAD_DIM=128, SPLIT=split, TILE_ALIGN=64, KV_FP8=False, FP16_PRODUCTS=False,
            DOT_PRECISION="tf32", INTERPRET=False, OFFSETS_64=False, SPLITS_PAD=8, FOLD=split, PDL=False,
            CHAIN_PDL=True, ROTARY=True, QK_NORM=qk_norm)
        pointers = {name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "cos_sin_ptr",
                                               "q_norm_ptr", "k_norm_ptr")}
        pointers.update({name: "*fp32" for name in ("part_acc_ptr", "part_m_ptr", "part_l_ptr", "k_scale_ptr",
                                                    "v_scale_ptr")})
        pointers.update({"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32",
                         "pos_ptr": "*i64", "slot_ptr": "*i64", "qk_scale": "fp32", "eps": "fp32"})
        kernel = paged_attention.decode._decode_kernel
        scalars = {name: "i32" for name in kernel.arg_names if name not in pointers and name not in sig}
        out.append((f"rotary_decode qk_norm={qk_norm} split={split}", kernel, {**pointers, **scalars, **sig}, consts,
                    POLICY.decode_num_warps_16))
    for gptq, bits, grouped in ((False, 4, True), (True, 4, True), (True, 8, False)):
        sig, consts = constexprs("K GROUP BITS GPTQ GROUPED ZERO_OFFSET BLOCK_N BLOCK_K HAS_BIAS PDL", K=4096,
                                 GROUP=128, BITS=bits, GPTQ=gptq, GROUPED=grouped, ZERO_OFFSET=1,
                                 BLOCK_N=packed_gemv.PACKED_BLOCK_N, BLOCK_K=packed_gemv.PACKED_BLOCK_K,
                                 HAS_BIAS=False, PDL=True)
        out.append((f"packed_gemv gptq={gptq} bits={bits} grouped={grouped}", packed_gemv._packed_gemv_kernel,
                    {"x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "g_ptr": "*i32",
                     "b_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32", **sig}, consts, 4))
    # (True, 4): AWQ repacked along K (zero points as stored); (True, 8): GPTQ v1 in one split; (False, 4): AWQ's
    # own layout. Each with the tile the engine launches it with (the policy's), all the splits of K = 4,096.
    policy = LaunchPolicy()
    for gptq, bits, one_split, bias in ((False, 4, False, False), (True, 4, False, True), (True, 8, True, False)):
        block_n, max_chunk, warps = ((policy.packed_split_block_n, policy.packed_split_chunk,
                                      policy.packed_split_warps) if gptq else policy.packed_split_awq_tile)
        step, chunk = packed_gemv.packed_split_shape(4096, 128, bits, gptq, max_chunk, policy.packed_split_rows) \
            or (0, 0)
        splits = 1 if one_split else 4096 // chunk
        sig, consts = constexprs("K GROUP BITS GPTQ BLOCK_N BLOCK_K CHUNK SPLITS SPLITS_P2 ZERO_OFFSET HAS_BIAS PDL",
                                 K=4096, GROUP=128, BITS=bits, GPTQ=gptq, BLOCK_N=block_n, BLOCK_K=step,
                                 CHUNK=4096 if one_split else chunk, SPLITS=splits, SPLITS_P2=splits,
                                 ZERO_OFFSET=int(bits == 8), HAS_BIAS=bias, PDL=True)
        out.append((f"packed_split gptq={gptq} bits={bits} splits={splits}", packed_gemv._packed_split_kernel,
                    {"x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "b_ptr": "*bf16",
                     "ws_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16", "n": "i32", **sig}, consts, warps))
    # Steps of a few rows over codes in groups in order (decode batches): the policy's tile, groups of 128 and (bf16,
    # int4) of 32, several a K step.
    block_n, max_chunk, warps = policy.packed_gemm_tiles[0][1]
    for x, bits, group, ieee in (("*bf16", 4, 128, False), ("*bf16", 4, 32, False), ("*fp16", 8, 128, False),
                                 ("*bf16", 8, 128, False), ("*fp32", 4, 128, True)):
        step, chunk = packed_gemm.packed_gemm_split_shape(4096, group, bits, max_chunk) or (0, 0)
        magic = 0 if ieee or (x, bits) == ("*bf16", 8) else 128 if x == "*bf16" else 1024
        sig, consts = constexprs("K GROUP BITS ZERO_OFFSET BLOCK_M BLOCK_N BLOCK_K CHUNK SPLITS SPLITS_P2 HAS_BIAS "
                                 "IEEE MAGIC MAGIC_BITS", K=4096, GROUP=group, BITS=bits, ZERO_OFFSET=0,
                                 BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=step, CHUNK=chunk, SPLITS=4096 // chunk,
                                 SPLITS_P2=4096 // chunk, HAS_BIAS=True, IEEE=ieee, MAGIC=magic,
                                 MAGIC_BITS={0: 0, 128: 0x4300, 1024: 0x6400}[magic])
        out.append((f"packed_gemm_split x={x} bits={bits} group={group}", packed_gemm._packed_gemm_split_kernel,
                    {"x_ptr": x, "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "b_ptr": x, "ws_ptr": "*fp32",
                     "cnt_ptr": "*i32", "out_ptr": x, "m": "i32", "n": "i32", **sig}, consts, warps))
    for dtype, gptq, bits in (("*bf16", False, 4), ("*bf16", True, 4), ("*fp16", True, 8), ("*fp32", True, 4)):
        sig, consts = constexprs("K GROUP BITS GPTQ ZERO_OFFSET BLOCK_K BLOCK_N", K=4096, GROUP=128, BITS=bits,
                                 GPTQ=gptq, ZERO_OFFSET=1, BLOCK_K=packed_gemm._DQ_BLOCK_K,
                                 BLOCK_N=packed_gemm._DQ_BLOCK_N)
        out.append((f"packed_dequantize out={dtype} gptq={gptq} bits={bits}", packed_gemm._packed_dequantize_kernel,
                    {"qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "g_ptr": "*i32", "out_ptr": dtype,
                     "n": "i32", **sig}, consts, 4))
    # W8A8 products of several rows: the split launch (decode steps: the policy's split tile, 16 rows, K 4,096 in
    # chunks) over 128 x 128 blocks with x in 1 x 128 groups, blocks 32 wide, and a scale per output feature (block
    # (1, K), x per token); the tiled one (prefill: the policy's tile over all of K) over 128 x 128 blocks.
    split_n, split_chunk, split_warps, _ = policy.fp8_gemm_split_tile
    tile_m, tile_n, tile_warps, _ = policy.fp8_gemm_tile
    for bn, bk, per_token, split in ((128, 128, False, True), (128, 32, False, True), (1, 4096, True, True),
                                     (128, 128, False, False)):
        step = fp8_gemm.fp8_block_k_step(bk)
        chunk = fp8_gemm.fp8_gemm_split_chunk(4096, step, split_chunk) if split else 4096
        sig, consts = constexprs("K X_GROUPS BN_SCALE BK_SCALE X_PER_TOKEN BLOCK_M BLOCK_N BLOCK_K CHUNK SPLITS "
                                 "SPLITS_P2 HAS_BIAS WIDEN", K=4096, X_GROUPS=1 if per_token else 4096 // bk,
                                 BN_SCALE=bn, BK_SCALE=bk, X_PER_TOKEN=per_token, BLOCK_M=16 if split else tile_m,
                                 BLOCK_N=split_n if split else tile_n, BLOCK_K=step, CHUNK=chunk,
                                 SPLITS=4096 // chunk, SPLITS_P2=4096 // chunk, HAS_BIAS=True, WIDEN=False)
        out.append((f"fp8_block_gemm {'split' if split else 'tiled'} block={bn}x{bk} per_token_x={per_token}",
                    fp8_gemm._fp8_block_gemm_kernel,
                    {"x_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "b_ptr": "*bf16",
                     "ws_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16", "m": "i32", "n": "i32",
                     "stride_sw": "i32", **sig}, consts, split_warps if split else tile_warps))
    # A greedy step's argmax over the llama3 vocabulary (128,256 columns), and over a short row (slices of 2 columns).
    for x, slice_len in (("*bf16", 1024), ("*fp32", 1024), ("*fp16", 2)):
        sig, consts = constexprs("SLICE PROGRAMS BLOCK PDL", SLICE=slice_len, PROGRAMS=128, BLOCK=slice_len, PDL=True)
        out.append((f"argmax slices x={x} slice={slice_len}", argmax._argmax_slice_kernel,
                    {"x_ptr": x, "val_ptr": "*fp32", "idx_ptr": "*i32", "n": "i32", "stride_x": "i32", **sig}, consts,
                    4))
    sig, consts = constexprs("PROGRAMS PDL", PROGRAMS=128, PDL=True)
    out.append(("argmax rows", argmax._argmax_rows_kernel, {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64",
                                                            **sig}, consts, 4))
    return out


def loop_bodies(sass: str) -> list[tuple[int, collections.Counter[str]]]:
    """(instructions, opcode counts) of every loop in a cuobjdump listing: the span from a backward branch's target
    to the branch."""
    ins = [(int(a, 16), op, rest) for a, op, rest in re.findall(
        r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[.A-Z0-9_]*\s*([^;]*);", sass, re.M)]
    loops = []
    for addr, op, rest in ins:
        target = rest.split()[-1] if op == "BRA" and rest.split() else ""
        if target.startswith("0x") and int(target, 16) < addr:
            body = [o for a, o, _ in ins if int(target, 16) <= a <= addr]
            loops.append((len(body), collections.Counter(body)))
    return loops


def show_sass(name: str, compiled: Any) -> None:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    ftz = len(re.findall(r"\.FTZ\b", sass))  # flush-to-zero float instructions (subnormals read as zero)
    print(f"{name}: {regs.group(1) if regs else '?'} registers, {ftz} flush-to-zero, {sum(ops.values())} "
          "instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
    for count, loop_ops in loop_bodies(sass):
        print(f"  loop of {count} instructions: " + ", ".join(f"{op} {n}" for op, n in loop_ops.most_common(12)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", metavar="TEXT", help="only configurations whose name holds TEXT, with their SASS loops")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 makes every kernel an interpreted function: run without it", file=sys.stderr)
        return 2
    failed = 0
    for name, kernel, signature, constexprs, warps in cases():
        if a.sass is not None and a.sass not in name:
            continue
        attrs = {} if a.sass is None else {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]]
                                           for arg, kind in signature.items() if kind.startswith("*") or arg == "n"}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=TARGET, options={"num_warps": warps})
            print(f"ok      {name}")
        except Exception as e:  # every failure is reported, then counted
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if a.sass is not None:
            show_sass(name, compiled)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
