"""The KV tensors: one (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from governor.engine.models.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # Zeroed so that never-written slots hold finite values (they are masked, but NaN * 0 is NaN).
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]
