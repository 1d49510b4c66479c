"""Split-KV for decode: how many partitions a launch splits each context into, and where a partition starts.

A decode launch whose (seq, kv head) programs fill too few SMs also splits every context into partitions, one
program each, whose partial softmax results are merged afterwards (`decode`). The host chooses the count
(`decode_num_splits`, from a bound on the context and never from the device's lengths, so it holds under CUDA
graphs); the kernels size each sequence's partitions from its own length (`_partition_size`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.launch_policy import LaunchPolicy, policy_for


@triton.jit
def _partition_size(seq_len, num_splits, TILE_ALIGN: tl.constexpr):
    # A sequence's split-KV partition: its context over the splits, in whole tiles (at least one), so every
    # split of a short context under a CUDA graph (splits sized for max_model_len) still gets work. The
    # decode kernels and the reduce compute it alike.
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_ALIGN), 1) * TILE_ALIGN


def decode_num_splits(programs: int, context_bound: int, device: torch.device, num_splits: int | None = None,
                      fp8: bool = False, *, policy: LaunchPolicy | None = None) -> int:
    """The split-KV partitions the decode kernel runs for `programs` (sequence, KV head) pairs over contexts of
    at most `context_bound` tokens: `num_splits` (default: the automatic choice), less any split that would
    be empty for a `context_bound`-token sequence once partitions are whole `policy.tile_n` tiles. Each sequence's
    partitions are sized from its own length (`_partition_size`), so a shorter one spreads over every split
    in smaller partitions. `fp8`: the cache is fp8 (its program has its own target per SM). `policy`: the launch
    settings (None: the device's)."""
    if policy is None:
        policy = policy_for(device)
    if num_splits is None:
        num_splits = _choose_num_splits(policy, programs, context_bound, device, fp8)
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    partition_size = _round_up(-(-context_bound // num_splits), policy.tile_n)
    return -(-context_bound // partition_size)


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200) elsewhere, so that CPU runs take the same decisions."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _choose_num_splits(policy: LaunchPolicy, num_programs: int, context_bound: int, device: torch.device,
                       fp8: bool = False) -> int:
    """Split until the (seq, kv head, split) grid fills the GPU, keeping a context_bound-long sequence's
    partitions >= policy.split_min_partition tokens."""
    slots = (policy.programs_per_sm_fp8 if fp8 else policy.programs_per_sm) * _sm_count(device)
    # fp8: as many splits as fit one wave (at least one); 16-bit: enough to fill the target.
    wanted = max(1, slots // num_programs) if fp8 else -(-slots // num_programs)
    by_length = context_bound // policy.split_min_partition
    return max(1, min(wanted, by_length, policy.split_max))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
