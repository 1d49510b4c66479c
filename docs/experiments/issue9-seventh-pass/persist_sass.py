"""The persistent decode kernel's sm_90 code without a GPU (registers, spills, shared memory, loop instructions).

    # with persistent-06a5e05.patch applied, from the repository root:
    PYTHONPATH=kernels:engine python3 docs/experiments/issue9-seventh-pass/persist_sass.py [--group 2] \
        [--maxnreg 128] [--num-stages 3] [--kv fp8|bf16]

Reuses scripts/decode-sass.py's ptxas and nvdisasm helpers on `_decode_persistent_kernel`.
"""

from __future__ import annotations

import argparse
import importlib.util

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import governor.kernels.paged_attention as pa

_spec = importlib.util.spec_from_file_location("decode_sass", "scripts/decode-sass.py")
assert _spec is not None and _spec.loader is not None
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, default=128, help="0: the compiler's choice")
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--kv", default="fp8", choices=["fp8", "bf16"])
    a = ap.parse_args()
    fn = pa.__dict__["_decode_persistent_kernel"]  # defined by the patch
    fp8 = a.kv == "fp8"
    kv = "fp8e4nv" if fp8 else "bf16"
    sig = {"q_ptr": "*bf16", "k_cache_ptr": f"*{kv}", "v_cache_ptr": f"*{kv}", "block_tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
           "qk_scale_base": "fp32"}
    for name in fn.arg_names:
        sig.setdefault(name, "i32")
    consts = {"GROUP": a.group, "GROUP_PAD": 16, "BLOCK_SIZE": 16, "TILE_N": 128 if fp8 else 64, "HEAD_DIM": 128,
              "KV_FP8": fp8, "FP16_PRODUCTS": fp8, "DOT_PRECISION": "tf32", "INTERPRET": False, "OFFSETS_64": False}
    for name in consts:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t not in ("constexpr", "fp32") and n not in ("num_items", "num_kv_heads")}
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs)
    options = {"num_warps": 4, "num_stages": a.num_stages}
    if a.maxnreg:
        options["maxnreg"] = a.maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    regs, spill_st, spill_ld = ds.ptxas_usage(kernel.asm["ptx"], a.maxnreg or None)
    ops = ds.loop_histogram(kernel.asm["cubin"])
    print(f"{regs} registers, spills {spill_st}/{spill_ld} bytes, {kernel.metadata.shared} bytes shared; "
          f"loop {sum(ops.values())} instructions per warp per tile")
    print(ops.most_common(12))


if __name__ == "__main__":
    main()
