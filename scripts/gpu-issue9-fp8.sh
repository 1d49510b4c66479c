#!/usr/bin/env bash
# Issue 9, fp8-KV decode attention: the original kernel (paged_attention.py at e8f448a, copied to the
# git-ignored build/issue9/pa_orig.py before the change) against the working tree's, in one call on one GPU:
#   run(command="bash scripts/gpu-issue9-fp8.sh", carry=[".whl", "build/issue9"], timeout_s=480)
# first, on this machine: mkdir -p build/issue9 && git show e8f448a:kernels/governor/kernels/paged_attention.py \
#   > build/issue9/pa_orig.py   (e8f448a: the kernel before the change)
# 1. the GPU kernel tests (-m gpu) of the attention kernels and the fp8 KV cache;
# 2. the fp8 decode GPU tests again with the fp8 decode tile forced to 128 keys (module constants patched);
# 3. side by side, interleaved, same inputs: original vs new (its own fp8 tile choice, then 64 and 128 keys
#    forced, at the automatic split count and a few others), batch 32, heads 32:8, head_dim 128, block 16,
#    contexts 4K and 32K, bf16 and fp8 KV (bench_attention's inputs and timing);
# 4. `governor bench attention` as issue 9 ran it, on the original kernel, then on the new one.
set -uo pipefail
. scripts/gpu-env.sh
exec > >(tee -a "$OUT/run.log") 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "=== 1. GPU tests $(date -u +%T)"
timeout -k 5 200 python3 -m pytest -q -m gpu tests/test_kernels_paged_attention.py tests/test_fp8_kv.py \
  -p no:cacheprovider 2>&1 | tail -n 15
echo "=== 2. fp8 decode GPU tests, fp8 tile 128 $(date -u +%T)"
timeout -k 5 60 python3 - <<'PY' 2>&1 | tail -n 4
import sys, pytest
import governor.kernels.paged_attention as pa
pa._DECODE_TILE_N_FP8 = pa._DECODE_TILE_N_FP8_LONG = 128
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", "fp8 and decode",
                      "tests/test_kernels_paged_attention.py"]))
PY
echo "=== 3. side by side $(date -u +%T)"
timeout -k 5 200 python3 - "$OUT/side-by-side.json" <<'PY'
import importlib.util, json, math, statistics, sys
import torch
import governor.kernels.paged_attention as new
from governor.engine.bench_attention import AttentionCase, _inputs, kv_bytes, time_call
from governor.engine.bench_latency import hbm_bandwidth_gb_per_s
spec = importlib.util.spec_from_file_location("pa_orig", "build/issue9/pa_orig.py")
orig = importlib.util.module_from_spec(spec); spec.loader.exec_module(orig)
dev = torch.device("cuda")
hbm = hbm_bandwidth_gb_per_s()
print(torch.cuda.get_device_name(), f"HBM copy {hbm:.0f} GB/s")
# (name, module, fp8 tile forced or None for the module's own choice, num_splits)
defaults = (new._DECODE_TILE_N_FP8, new._DECODE_TILE_N_FP8_LONG)
rows = []
for ctx, sweep_splits in ((4096, (2, 1)), (32768, (16, 8, 1))):
    for kv in ("bf16", "fp8"):
        case = AttentionCase(32, ctx, 32, 8, 128, kv)
        x = _inputs(case, torch.bfloat16, dev, 0)
        scale = 1 / math.sqrt(128)
        variants = [("orig", orig, None, None), ("new", new, None, None)]
        if kv == "fp8":
            variants += [(f"new-t{t}", new, t, None) for t in (64, 128)]
            variants += [(f"new-t{t}-s{s}", new, t, s) for s in sweep_splits for t in (64, 128)]
        times, outs = {}, {}
        for rnd in range(2):  # interleaved rounds; median over both
            for name, mod, tile, splits in variants:
                if tile:
                    new._DECODE_TILE_N_FP8 = new._DECODE_TILE_N_FP8_LONG = tile
                out = torch.empty_like(x["q"])
                def call():
                    mod.paged_decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                                               scale, out, num_splits=splits, k_scale=x["k_scale"],
                                               v_scale=x["v_scale"])
                times.setdefault(name, []).extend(time_call(call, dev, 10, 50))
                new._DECODE_TILE_N_FP8, new._DECODE_TILE_N_FP8_LONG = defaults
                outs[name] = out.float()
        for name, t in times.items():
            ms = statistics.median(t)
            gbs = kv_bytes(case) / (ms * 1e-3) / 1e9
            diff = float((outs[name] - outs["orig"]).abs().max())
            r = {"context": ctx, "kv": kv, "variant": name, "us_p50": ms * 1e3, "kv_gb_per_s": gbs,
                 "fraction_of_hbm": gbs / hbm, "max_abs_diff_vs_orig": diff}
            rows.append(r)
            print(f"ctx {ctx:6} {kv:4} {name:13}: {ms*1e3:8.1f} us {gbs:6.0f} GB/s {100*gbs/hbm:4.0f}%  "
                  f"max|diff vs orig| {diff:.2e}", flush=True)
        del x
        torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "hbm_copy_gb_per_s": hbm, "rows": rows},
          open(sys.argv[1], "w"), indent=1)
PY
ATT=(bench attention --batches 32 --contexts 4096,32768 --heads 32:8 --head-dim 128 --kv-dtypes bf16,fp8)
for which in orig new; do
  echo "=== 4. governor ${ATT[*]} ($which) $(date -u +%T)"
  timeout -k 5 60 python3 - "$which" "${ATT[@]}" --output-json "$OUT/attention-$which.json" <<'PY' 2>&1 | tail -n 8
import importlib.util, runpy, sys
if sys.argv[1] == "orig":  # the CLI imports the kernel module by name: the original stands in for it
    import governor.kernels
    spec = importlib.util.spec_from_file_location("governor.kernels.paged_attention", "build/issue9/pa_orig.py")
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    governor.kernels.paged_attention = mod  # type: ignore[attr-defined]
sys.argv = ["governor"] + sys.argv[2:]
runpy.run_module("governor.engine", run_name="__main__")
PY
done
echo "=== done $(date -u +%T)"
