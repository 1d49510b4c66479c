"""The quantized-weight kernels compile for a Hopper GPU (sm_90) here, without one: `scripts/compile-sm90.py` runs
Triton's whole GPU pipeline down to a cubin with the ptxas the triton wheel bundles. The interpreter, which runs every
other kernel test on a CPU, accepts programs the GPU compiler refuses (an early return in a function another calls
once passed every interpreter test of `fp8_gemv` and failed here); this catches that before a GPU run does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quantized_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile-sm90.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("ok ") >= 19 and "FAILED" not in run.stdout
