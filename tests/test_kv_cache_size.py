"""How many KV blocks the engine allocates: the memory budget, capped where the kernels' int32 offsets end."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from governor.engine.kv.cache import bytes_per_block, max_blocks_for_int32_offsets
from governor.engine.worker import Worker
from governor.kernels.paged_attention import checks as pa_checks

FP8 = torch.float8_e4m3fn
QWEN3_KV = SimpleNamespace(num_layers=28, num_kv_heads=8, head_dim=128)  # qwen3-0.6b's KV shape


def worker(budget: int | None = None, num_kv_blocks: int | None = None) -> Any:
    """What `Worker._num_kv_blocks` reads of a worker, without building one (the sizes here are GiBs)."""
    config = SimpleNamespace(num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=budget)
    return SimpleNamespace(spec=SimpleNamespace(config=config, draft_bytes_per_block=0), local_config=QWEN3_KV,
                           block_size=16, kv_dtype=FP8, tp=SimpleNamespace(rank=0), device=torch.device("cpu"))


def test_the_cap_is_the_last_block_count_the_kernels_address_in_int32() -> None:
    cap = max_blocks_for_int32_offsets(QWEN3_KV, 16)  # type: ignore[arg-type]
    assert cap == 2**17  # 16 tokens x 8 heads x 128 = 2^14 elements a block
    assert not pa_checks._needs_int64_offsets(torch.empty(cap, 16, 8, 128, dtype=FP8, device="meta"))
    assert pa_checks._needs_int64_offsets(torch.empty(cap + 1, 16, 8, 128, dtype=FP8, device="meta"))


def test_a_budget_past_the_cap_gets_the_cap_and_one_below_it_is_untouched() -> None:
    per_block = bytes_per_block(QWEN3_KV, 16, FP8)  # type: ignore[arg-type]
    assert Worker._num_kv_blocks(worker(budget=140 * 2**30)) == 2**17  # an H200's worth for qwen3-0.6b
    assert Worker._num_kv_blocks(worker(budget=1000 * per_block + 7)) == 1000


def test_an_explicit_block_count_is_kept_even_past_the_cap() -> None:
    assert Worker._num_kv_blocks(worker(num_kv_blocks=2**17 + 5)) == 2**17 + 5
