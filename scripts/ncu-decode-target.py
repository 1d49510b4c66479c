"""One decode-attention call for Nsight Compute to profile, after two warm-up calls.

    ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        -k regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        python3 scripts/ncu-decode-target.py BATCH CONTEXT Q_HEADS KV_HEADS KV_DTYPE [FIELD=VALUE ...]

Inputs as `governor bench attention` builds them (random block table, head_dim 128, bf16 q); KV_DTYPE is a
`bench attention` dtype name (bf16, fp8, ...). Each FIELD=VALUE replaces a field of the device's launch policy
(`governor.kernels.launch_policy.LaunchPolicy`, a Python literal: `gluon_decode=False` profiles the Triton kernel where
the Gluon one runs).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import sys

import torch

from governor.engine.bench.attention import AttentionCase, _inputs
from governor.kernels.launch_policy import policy_for
from governor.kernels.paged_attention import paged_decode_attention


def main() -> None:
    batch, context, hq, hkv = (int(v) for v in sys.argv[1:5])
    case = AttentionCase(batch, context, hq, hkv, 128, sys.argv[5])
    device = torch.device("cuda")
    fields = dict(arg.split("=", 1) for arg in sys.argv[6:])
    policy = dataclasses.replace(policy_for(device), **{k: ast.literal_eval(v) for k, v in fields.items()})
    x = _inputs(case, torch.bfloat16, device, seed=0)
    out = torch.empty_like(x["q"])
    for _ in range(3):
        paged_decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"],
                               1 / math.sqrt(case.head_dim), out, k_scale=x["k_scale"], v_scale=x["v_scale"],
                               policy=policy)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
