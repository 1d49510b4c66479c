"""One decode-attention call to profile (2 warm-up calls first), the landed kernel or `pa_vt` at 168 registers:

    python3 docs/experiments/issue9-sixth-pass/ncu_target.py {landed,vt} BATCH CTX HQ HKV KV_DTYPE
"""

import math
import sys

import torch

sys.path.insert(0, ".exp")
import pa_vt  # (881e1d6's paged_attention.py with v-transposed-881e1d6.patch applied)

import governor.kernels.paged_attention as pa
from governor.engine.bench_attention import AttentionCase, _inputs

variant, kv = sys.argv[1], sys.argv[6]
batch, ctx, hq, hkv = (int(a) for a in sys.argv[2:6])
case = AttentionCase(batch, ctx, hq, hkv, 128, kv)
x = _inputs(case, torch.bfloat16, torch.device("cuda"), seed=0)
mod, vc = (pa, x["v_cache"]) if variant == "landed" else (pa_vt, x["v_cache"].permute(0, 2, 3, 1).contiguous())
pa_vt._DECODE_MAXNREG_FP8 = 168
out = torch.empty_like(x["q"])
for _ in range(3):
    mod.paged_decode_attention(x["q"], x["k_cache"], vc, x["block_tables"], x["seq_lens"], 1 / math.sqrt(128), out,
                               k_scale=x["k_scale"], v_scale=x["v_scale"])
torch.cuda.synchronize()
