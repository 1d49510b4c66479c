"""Greedy outputs and prompt logits identical to Hugging Face transformers (fp32, CPU), the oracle."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from governor.engine import LLM, SamplingParams
from tests.conftest import ARCHS

NEW_TOKENS = 24


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers by full recomputation, EOS included like any token
    (generate's min_new_tokens would mask EOS, which ignore_eos does not)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def mixed_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 45) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


ENGINE_SETUPS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 7},
    "queued": {"max_num_seqs": 2, "max_num_batched_tokens": 16},
    # 10 blocks of 8 tokens for 6 sequences of up to 45+24 tokens: preemption is certain.
    "preempting": {"block_size": 8, "num_kv_blocks": 10, "max_model_len": 80, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(hf_checkpoint, hf_model, arch: str, setup: str) -> None:
    path = hf_checkpoint(arch)
    prompts = mixed_prompts(6, seed=sorted(ARCHS).index(arch))
    llm = LLM(str(path), dtype="float32", **ENGINE_SETUPS[setup])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    model = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if setup == "preempting":
        assert stats["preemptions"] > 0


def engine_prompt_logits(llm: LLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits at every prompt position, computed through the paged cache in chunks of `chunk` tokens."""
    return llm.engine.prompt_logits(prompt, chunk)


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(hf_checkpoint, hf_model, arch: str, chunk: int) -> None:
    path = hf_checkpoint(arch)
    prompt = mixed_prompts(1, seed=7, lo=37, hi=37)[0]
    llm = LLM(str(path), dtype="float32")
    ours = engine_prompt_logits(llm, prompt, chunk)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_triton_backend_matches_transformers_on_cpu(hf_checkpoint, hf_model) -> None:
    """The Triton kernels (interpreted on CPU) give the same greedy tokens through the whole engine."""
    path = hf_checkpoint("qwen3")
    prompts = mixed_prompts(3, seed=3, hi=20)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", max_num_batched_tokens=9)
    outs = llm.generate(prompts, greedy(8))
    model = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


def test_decode_steps_fold_the_rotary_into_attention_and_give_the_two_kernel_tokens(
        hf_checkpoint, hf_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of decodes only run `rotary_decode_attention` (the policy's `decode_rotary`); with it off they run
    `rotary_write_kv` and `paged_decode_attention` as before, and both give transformers' greedy tokens. (Qwen3's
    per-head norms in the folded kernel: `test_triton_backend_matches_transformers_on_cpu`.)"""
    from governor.engine.models import llama
    from governor.kernels import paged_attention

    path = hf_checkpoint("llama")
    prompts = mixed_prompts(2, seed=5, hi=12)
    calls: list[int] = []
    real = paged_attention.rotary_decode_attention

    def spy(qkv: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(qkv.shape[0])
        return real(qkv, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_attention, "rotary_decode_attention", spy)
    runs = {}
    real_policy = llama.policy_for
    for fold in (True, False):
        monkeypatch.setattr(llama, "policy_for",
                            lambda device, fold=fold: dataclasses.replace(real_policy(device), decode_rotary=fold))
        calls.clear()
        llm = LLM(str(path), dtype="float32", attention_backend="triton")
        runs[fold] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5))]
        monkeypatch.setattr(llama, "policy_for", real_policy)
        layers = llm.engine.model_config.num_layers
        # 5 tokens: the prefill step samples the first, then 4 steps of decodes of both sequences.
        assert calls == ([2] * 4 * layers if fold else [])
    model = hf_model(path)
    assert runs[True] == runs[False] == [hf_greedy(model, p, 5) for p in prompts]


def test_sharded_checkpoint_loads_identically(hf_checkpoint, tmp_path: Path) -> None:
    import transformers

    src = hf_checkpoint("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            (tmp_path / f).write_bytes((src / f).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompts = mixed_prompts(2, seed=11)
    a = LLM(str(src), dtype="float32").generate(prompts, greedy(8))
    b = LLM(str(tmp_path), dtype="float32").generate(prompts, greedy(8))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_agree_with_transformers_on_the_first_token(tmp_path: Path, dtype) -> None:
    """bf16/fp16 load and run on CPU; one forward's greedy pick matches transformers in the same dtype."""
    import transformers

    from tests.conftest import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path, "llama", dtype=dtype)
    llm = LLM(str(path))  # dtype "auto" reads the checkpoint's
    assert llm.engine.dtype == dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompts = mixed_prompts(8, seed=17)
    outs = llm.generate(prompts, greedy(1))
    with torch.no_grad():
        refs = [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    agree = sum(o.outputs[0].token_ids[0] == r for o, r in zip(outs, refs, strict=True))
    assert agree >= 7, f"{agree}/8 first tokens agree"
