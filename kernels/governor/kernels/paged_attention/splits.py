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

from .tiles import _TILE_N

# Split-KV heuristic: split a decode batch whose (seq, kv head) programs fill too few SMs.
# Splits are chosen from the context bound so that a bound-long context gets partitions of >= 512 tokens
# (smaller ones cost more in the reduce than they gain); a shorter sequence's own partitions are smaller.
_SPLIT_MIN_PARTITION = 512
_SPLIT_MAX = 64
# Target programs per SM, over a 16-bit cache and over an fp8 one. For 16-bit, 3 instead of 4 splits batch 32 x 8
# kv heads two ways (512 programs, one wave of 4 per SM) instead of three (768): on an H200, 78% -> 90% of the copy
# bandwidth at 4K, 89% -> 104% at 32K, batch 16 at 8K 69% -> 90% (docs/design/decode-attention-kernels.md). For
# fp8, 4 is the occupancy of the capped program (`decode._DECODE_MAXNREG_FP8`), and the split count rounds down so
# the programs fit one wave of it (batch 32 x 8 kv heads: 2 splits, 512 programs on 528 slots; rounding up gave 3,
# 1.45 waves).
_PROGRAMS_PER_SM = 3
_PROGRAMS_PER_SM_FP8 = 4


@triton.jit
def _partition_size(seq_len, num_splits, TILE_ALIGN: tl.constexpr):
    # A sequence's split-KV partition: its context over the splits, in whole tiles (at least one), so every
    # split of a short context under a CUDA graph (splits sized for max_model_len) still gets work. The
    # decode kernels and the reduce compute it alike.
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_ALIGN), 1) * TILE_ALIGN


def decode_num_splits(programs: int, context_bound: int, device: torch.device, num_splits: int | None = None,
                      fp8: bool = False) -> int:
    """The split-KV partitions the decode kernel runs for `programs` (sequence, KV head) pairs over contexts of
    at most `context_bound` tokens: `num_splits` (default: the automatic choice), less any split that would
    be empty for a `context_bound`-token sequence once partitions are whole _TILE_N tiles. Each sequence's
    partitions are sized from its own length (`_partition_size`), so a shorter one spreads over every split
    in smaller partitions. `fp8`: the cache is fp8 (its program has its own target per SM)."""
    if num_splits is None:
        num_splits = _choose_num_splits(programs, context_bound, device, fp8)
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    partition_size = _round_up(-(-context_bound // num_splits), _TILE_N)
    return -(-context_bound // partition_size)


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200) elsewhere, so that CPU runs take the same decisions."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _choose_num_splits(num_programs: int, context_bound: int, device: torch.device, fp8: bool = False) -> int:
    """Split until the (seq, kv head, split) grid fills the GPU, keeping a context_bound-long sequence's
    partitions >= _SPLIT_MIN_PARTITION tokens."""
    slots = (_PROGRAMS_PER_SM_FP8 if fp8 else _PROGRAMS_PER_SM) * _sm_count(device)
    # fp8: as many splits as fit one wave (at least one); 16-bit: enough to fill the target.
    wanted = max(1, slots // num_programs) if fp8 else -(-slots // num_programs)
    by_length = context_bound // _SPLIT_MIN_PARTITION
    return max(1, min(wanted, by_length, _SPLIT_MAX))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
