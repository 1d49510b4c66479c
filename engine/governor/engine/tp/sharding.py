"""Which part of the model a tensor-parallel rank holds (Megatron-style).

Column-parallel (output features split, rank r holds block r): q/k/v projections by head, their
biases, and the MLP's gate and up projections. Row-parallel (input features split, partial outputs
summed by an all-reduce): o_proj and down_proj. Vocabulary-parallel: the embedding and lm_head rows, ceil(V/size)
per rank (the model splits them: `CausalLM.vocab_rows`). Replicated: every norm (Qwen3's q/k norms are per
head_dim, so they are the same on every rank).
"""

from __future__ import annotations

from dataclasses import replace

from governor.engine.models.model_config import ModelConfig


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as one of `size` ranks sees it: num_heads/size query heads, num_kv_heads/size KV heads
    and intermediate_size/size MLP columns. ValueError when `size` does not divide them."""
    if size == 1:
        return cfg
    parts = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "intermediate_size": cfg.intermediate_size}
    bad = [f"{name}={value}" for name, value in parts.items() if value % size]
    if bad:
        raise ValueError(f"tensor_parallel_size={size} does not divide {', '.join(bad)} of this "
                         f"{cfg.architecture}; it must divide " + ", ".join(f"{k}={v}" for k, v in parts.items())
                         + " (every rank holds whole heads and an equal share of the MLP): choose a size "
                         "that divides all three")
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                   intermediate_size=cfg.intermediate_size // size)
