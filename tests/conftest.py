"""Shared fixtures: tiny random Hugging Face checkpoints built with transformers (the oracle).

Triton kernels run on CPU through the interpreter when no GPU is present.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from governor.engine.models.tokenizer_builder import VOCAB_SIZE, write_tokenizer
from governor.kernels.elementwise import INTERPRET  # imported after TRITON_INTERPRET is set above

# Where the kernel tests run: the GPU, else the CPU under Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET),
    reason="no CUDA and TRITON_INTERPRET is not 1 (it was set to something else before import)",
)


def seeded_randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Normal values * scale on DEVICE in `dtype`, the same for the same seed."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def rotary_setup(num_kv_heads: int, head_dim: int, max_positions: int, dtype: torch.dtype, qk_norm: bool, fp8: bool,
                 seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], dict[str, torch.Tensor]]:
    """A rotary table [max_positions, 2, head_dim] of random angles (cos, then sin with its first half negated, as
    `Rotary.table` lays it out) on DEVICE, Qwen3's per-head norm weights when `qk_norm`, and an fp8 cache's per-head
    scales when `fp8`: the keyword arguments of the rotary kernels."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(max_positions, head_dim, generator=gen) * 6.3
    sin = angles.sin()
    sin[:, :head_dim // 2] *= -1
    cos_sin = torch.stack((angles.cos(), sin), dim=1).to(dtype).to(DEVICE)
    norms: dict[str, torch.Tensor | float] = {}
    if qk_norm:
        norms = {"q_norm": seeded_randn(head_dim, dtype=dtype, seed=seed + 1),
                 "k_norm": seeded_randn(head_dim, dtype=dtype, seed=seed + 2), "eps": 1e-6}
    scales: dict[str, torch.Tensor] = {}
    if fp8:
        scales = {"k_scale": torch.rand(num_kv_heads, generator=gen).to(DEVICE) * 0.02 + 0.005,
                  "v_scale": torch.rand(num_kv_heads, generator=gen).to(DEVICE) * 0.02 + 0.005}
    return cos_sin, norms, scales


# Each entry: transformers config class name and its kwargs. Shapes are tiny; the variants cover
# GQA and MQA, tied and untied embeddings, qkv bias (Qwen2), q/k norm with explicit head_dim (Qwen3),
# and Llama 3 rope scaling with a short original context so the scaling matters at test lengths.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, vocab_size=VOCAB_SIZE + 48)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(TINY, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3-rope-mqa": ("LlamaConfig", dict(
        TINY, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(TINY, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(TINY, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(TINY, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def build_hf_checkpoint(out_dir: Path, arch: str, seed: int = 0, weight_scale: float = 3.0,
                        dtype: torch.dtype = torch.float32, vocab_size: int | None = None,
                        **overrides: Any) -> Path:
    """Build a random transformers model of `arch`, scale its weights (so greedy picks are not near-ties),
    save it with a real tokenizer, and return the directory. `vocab_size` overrides the model's (a tiny
    vocabulary for distribution tests; the tokenizer stays the same); `overrides`, other config fields."""
    import transformers

    cls_name, kwargs = ARCHS[arch]
    kwargs = {**kwargs, **overrides}
    if vocab_size is not None:
        kwargs = {**kwargs, "vocab_size": vocab_size}
    config = getattr(transformers, cls_name)(**kwargs, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(weight_scale)
    model.to(dtype).save_pretrained(out_dir)
    write_tokenizer(out_dir, model_max_length=kwargs["max_position_embeddings"])
    return out_dir


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`hf_checkpoint(arch)` → directory of a cached tiny checkpoint for that architecture."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_hf_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def trained_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~4M-parameter Llama trained for about a minute on the standard library's sources (tests/trained_model.py):
    peaked logits, for accuracy tests. Built once per session."""
    from tests.trained_model import train_llama

    return train_llama(tmp_path_factory.mktemp("trained-llama"))


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    """`hf_model(dir)` → the transformers model (fp32, eval) loaded from a checkpoint directory, cached."""
    import transformers

    cache: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in cache:
            cache[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint: Callable[[str], Path]) -> Path:
    """The tiny Qwen3 checkpoint (test modules that name another `qwen3` fixture use theirs)."""
    return hf_checkpoint("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3: Path) -> Any:
    """An fp32 CPU engine over the tiny Qwen3 checkpoint, max_model_len 256, shared by a test module."""
    from governor.engine import LLM

    return LLM(str(qwen3), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `governor make-model` tiny Qwen3 (a 2,048-token context, room for long prompts), for servers."""
    from governor.cli import main as governor_main

    path = tmp_path_factory.mktemp("serve") / "qwen3-tiny"
    assert governor_main(["make-model", str(path), "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32"]) == 0
    return path


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> dict[str, int]:
    """Wrap `owner.name` (a module's function or an object's method) so each call is counted, in the returned
    {name: calls} from now on; the wrapped call runs as before."""
    calls = {name: 0}
    inner = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return inner(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture
def sample_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times the engine's step calls the general sampler (`sampler.sample`), counted from now."""
    from governor.engine import llm_engine

    return count_calls(monkeypatch, llm_engine, "sample")
