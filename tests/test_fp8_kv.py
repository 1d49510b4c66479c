"""fp8 (e4m3) KV cache: twice the blocks of bf16 for the same memory, per-head scales, generation with preemption.
Its accuracy against bf16 is measured on a trained model in tests/test_fp8_accuracy.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from governor.engine import LLM
from tests.conftest import build_hf_checkpoint
from tests.test_engine_parity import greedy, mixed_prompts


@pytest.fixture(scope="module")
def unscaled_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Unscaled random weights: attention as soft as a real model's. The ×3 models the parity tests use
    # have near one-hot attention, where e4m3's 3-bit mantissa flips top-1 picks far more often.
    return build_hf_checkpoint(tmp_path_factory.mktemp("fp8"), "qwen3", weight_scale=1.0)


def test_fp8_doubles_the_blocks_of_bf16_for_the_same_memory(tmp_path: Path) -> None:
    path = build_hf_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    bf16 = LLM(str(path), kv_cache_memory_bytes=2**22)
    fp8 = LLM(str(path), kv_cache_memory_bytes=2**22, kv_cache_dtype="fp8")
    assert bf16.engine.kv_dtype == torch.bfloat16 and fp8.engine.kv_dtype == torch.float8_e4m3fn
    assert fp8.stats()["kv_blocks_total"] == 2 * bf16.stats()["kv_blocks_total"]
    assert fp8.engine.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_scales_are_per_layer_and_kv_head_and_deterministic(unscaled_qwen3: Path) -> None:
    a = LLM(str(unscaled_qwen3), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=2**22)
    b = LLM(str(unscaled_qwen3), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=2**22)
    heads = a.engine.model_config.num_kv_heads
    for la, lb in zip(a.engine.model.decoder_layers, b.engine.model.decoder_layers, strict=True):
        for sa, sb in ((la.self_attn.k_scale, lb.self_attn.k_scale), (la.self_attn.v_scale, lb.self_attn.v_scale)):
            assert sa is not None and sb is not None
            assert sa.shape == (heads,) and bool((sa > 0).all())
            assert torch.equal(sa, sb)


def test_fp8_generation_frees_every_block_and_runs_with_preemption(unscaled_qwen3: Path) -> None:
    llm = LLM(str(unscaled_qwen3), dtype="float32", kv_cache_dtype="fp8", block_size=4, num_kv_blocks=24,
              max_model_len=64, enable_prefix_caching=True)
    outs = llm.generate(mixed_prompts(6, seed=8, lo=20, hi=40), greedy(12))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0
