"""One decode-attention call for Nsight Compute to profile, after two warm-up calls.

    ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        -k regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        python3 scripts/ncu-decode-target.py BATCH CONTEXT Q_HEADS KV_HEADS KV_DTYPE

Inputs as `governor bench attention` builds them (random block table, head_dim 128, bf16 q); KV_DTYPE is a
`bench attention` dtype name (bf16, fp8, ...).
"""

from __future__ import annotations

import math
import sys

import torch

from governor.engine.bench.attention import AttentionCase, _inputs
from governor.kernels.paged_attention import paged_decode_attention


def main() -> None:
    batch, context, hq, hkv = (int(v) for v in sys.argv[1:5])
    case = AttentionCase(batch, context, hq, hkv, 128, sys.argv[5])
    x = _inputs(case, torch.bfloat16, torch.device("cuda"), seed=0)
    out = torch.empty_like(x["q"])
    for _ in range(3):
        paged_decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                               1 / math.sqrt(case.head_dim), out, k_scale=x["k_scale"], v_scale=x["v_scale"])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
