"""The KV tensors: one (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from governor.engine.models.model_config import ModelConfig
from governor.kernels.paged_attention import INT32_OFFSET_ELEMENTS


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def max_blocks_for_int32_offsets(cfg: ModelConfig, block_size: int) -> int:
    """The most blocks for which each layer's K (and V) tensor stays within `INT32_OFFSET_ELEMENTS`, so the attention
    kernels address it with int32 offsets (on an H200, fp8 decode attention at batch 256 ran 12% faster than with
    the int64 offsets larger caches need; docs/design/decode-attention-kernels.md)."""
    return INT32_OFFSET_ELEMENTS // (block_size * cfg.num_kv_heads * cfg.head_dim)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # Zeroed so that never-written slots hold finite values (they are masked, but NaN * 0 is NaN).
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]
