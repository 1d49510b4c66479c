"""The quantized-weight kernels and the argmax compile for a Hopper GPU (sm_90) here, without one:
`scripts/compile-sm90.py` runs Triton's whole GPU pipeline down to a cubin with the ptxas the triton wheel bundles.
The interpreter, which runs every other kernel test on a CPU, accepts programs the GPU compiler refuses (an early
return in a function another calls once passed every interpreter test of `fp8_gemv` and failed here, as did a module
global the argmax kernels read before it was a constexpr); this catches that before a GPU run does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from governor.kernels.launch_policy import LaunchPolicy

ROOT = Path(__file__).resolve().parents[1]


def test_the_quantized_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile-sm90.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("ok ") >= 33 and "FAILED" not in run.stdout


def test_the_split_gemv_issues_one_and_and_one_ffma_a_code(tmp_path: Path) -> None:
    """`--sass` counts the cubin's instructions. The GPTQ-layout split GEMV reads each 4-bit code as an exact
    subnormal: one mask (LOP3, or SGXT where ptxas extracts the low bits) and one FFMA a code, no conversion, and no
    flush-to-zero instruction, which would read every code as zero. On the policy's tile (256 x 128 on 64 threads:
    512 codes a thread, one K step) the kernel has an FFMA a code and, all included (loads, the zero-point
    correction, the split's epilogue over 32 splits), fewer than 5 instructions a code; the same tile with the
    arithmetic before (2^23 added to each code and subtracted again) issued 6.75 (3,456)."""
    policy = LaunchPolicy()
    step = 8 * (1 << (policy.packed_split_rows.bit_length() - 1))  # 4-bit codes a K step, as packed_split_shape
    codes = policy.packed_split_block_n * min(policy.packed_split_chunk, step) // (32 * policy.packed_split_warps)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile-sm90.py"), "--sass",
                          "packed_split gptq=True bits=4"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if "instructions:" in ln)
    head, counts = line.split(" instructions: ")
    total, ftz = int(head.rsplit(" ", 1)[1]), int(head.split(" flush-to-zero")[0].rsplit(" ", 1)[1])
    ops = {op: int(n) for op, n in (item.strip().split(" ") for item in counts.split(","))}
    assert ftz == 0 and ops["FFMA"] >= codes and ops.get("I2F", 0) == 0 and ops.get("I2FP", 0) < 16, line
    assert total < 5 * codes, line
