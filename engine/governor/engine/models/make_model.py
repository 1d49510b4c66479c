"""`governor make-model`: a random-weight checkpoint in Hugging Face format, of real or tiny shapes.

The directory it writes is what a downloaded Llama / Qwen2 / Qwen3 checkpoint holds — config.json,
generation_config.json, safetensors (sharded past `max_shard_bytes`, with an index) and a real
tokenizer with a chat template — so the engine, transformers and benchmarks load it the same way.
Nothing here needs transformers: the config is written as a plain dict, and tests check that
transformers reads it back as meant.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from governor.engine.models import tokenizer_builder

log = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "qwen3")
PRESETS = ("tiny", "small", "qwen3-0.6b", "llama3.2-1b", "llama3-8b", "llama3-70b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Llama 3.1's long-context RoPE, given to arch llama at the llama3-8b and llama3-70b presets (llama3.2-1b: factor 32).
_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
INIT_STD = 0.02
_SMALL_PRESET_VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class _Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int | None  # None: the tokenizer's size, rounded up to a multiple of 64
    tie_word_embeddings: bool | None  # None: untied for llama, tied for qwen2/qwen3


_PRESETS = {
    "tiny": _Preset(64, 2, 4, 2, 16, 128, 2048, 10000.0, 1e-6, None, None),
    "small": _Preset(256, 4, 8, 2, 32, 512, 4096, 10000.0, 1e-6, None, None),
    "qwen3-0.6b": _Preset(1024, 28, 16, 8, 128, 3072, 40960, 1_000_000.0, 1e-6, 151936, True),
    # Llama 3.2 1B: llama3's vocabulary at an eighth of llama3-8b's weights, a draft model for it.
    "llama3.2-1b": _Preset(2048, 16, 32, 8, 64, 8192, 131072, 500_000.0, 1e-5, 128256, True),
    "llama3-8b": _Preset(4096, 32, 32, 8, 128, 14336, 131072, 500_000.0, 1e-5, 128256, False),
    # 140 GB in bf16: meant for config-only directories (weights=False) run with load_format "dummy".
    "llama3-70b": _Preset(8192, 80, 64, 8, 128, 28672, 131072, 500_000.0, 1e-5, 128256, False),
}
assert tuple(_PRESETS) == PRESETS


def _check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(allowed)}")


def preset_config(arch: str, preset: str, vocab_size: int, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a checkpoint of family `arch` with the shapes of `preset`.

    `vocab_size` is the tokenizer's size: tiny/small round it up to a multiple of 64 (padding rows,
    as real models have); the big presets keep their real vocabulary, which must hold it.
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("preset", preset, PRESETS)
    _check_choice("dtype", dtype, tuple(DTYPES))
    p = _PRESETS[preset]
    if p.vocab_size is None:
        config_vocab = -(-vocab_size // _SMALL_PRESET_VOCAB_MULTIPLE) * _SMALL_PRESET_VOCAB_MULTIPLE
    elif vocab_size > p.vocab_size:
        raise ValueError(f"a tokenizer of {vocab_size} tokens does not fit preset {preset!r}, "
                         f"whose vocabulary is {p.vocab_size}")
    else:
        config_vocab = p.vocab_size
    tie = arch != "llama" if p.tie_word_embeddings is None else p.tie_word_embeddings
    rope_scaling = None
    if arch == "llama" and preset in ("llama3-8b", "llama3-70b"):
        rope_scaling = _LLAMA3_ROPE_SCALING
    elif arch == "llama" and preset == "llama3.2-1b":  # Llama 3.2 stretches its RoPE by 32, not 8
        rope_scaling = {**_LLAMA3_ROPE_SCALING, "factor": 32.0}
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURE[arch]],
        "model_type": arch,
        "vocab_size": config_vocab,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        # Explicit: qwen3-0.6b's head_dim (128) is not hidden_size / num_heads (64).
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": INIT_STD,
        "rms_norm_eps": p.rms_norm_eps,
        # Both RoPE spellings: rope_theta + rope_scaling for transformers 4 and other engines,
        # rope_parameters for transformers 5 (which reads either and writes only this one).
        "rope_theta": p.rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "rope_parameters": {"rope_type": "default", **(rope_scaling or {}), "rope_theta": p.rope_theta},
        # Qwen2 always has q/k/v biases (transformers ignores this key for it; engines read it).
        "attention_bias": arch == "qwen2",
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie,
        "bos_token_id": tokenizer_builder.BOS_ID,
        "eos_token_id": tokenizer_builder.EOS_ID,
        "pad_token_id": tokenizer_builder.PAD_ID,
        # transformers 5 reads `dtype`, transformers 4 `torch_dtype`.
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
    return config


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint `config` (a `preset_config`) describes, named as Hugging Face
    names it, in module order."""
    return hf_tensor_shapes(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
                            num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                            head_dim=config["head_dim"], qkv_bias=config["model_type"] == "qwen2",
                            qk_norm=config["model_type"] == "qwen3",
                            tie_word_embeddings=config["tie_word_embeddings"])


def hf_tensor_shapes(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, qkv_bias: bool, qk_norm: bool,
                     tie_word_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama-family checkpoint of these shapes, named as Hugging Face names it, in
    module order (also the engine's load format "dummy")."""
    hidden, q_size, kv_size = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        for proj, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            shapes[f"{layer}.self_attn.{proj}.weight"] = (size, hidden)
            if qkv_bias:
                shapes[f"{layer}.self_attn.{proj}.bias"] = (size,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_size)
        if qk_norm:
            shapes[f"{layer}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{layer}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (intermediate_size, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (intermediate_size, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, intermediate_size)
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    # Greedy in module order, as transformers' save_pretrained does; a tensor larger than the
    # limit gets a shard of its own.
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """The value make-model gives tensor `name`: ones for norms, else N(0, 0.02) drawn from (seed, name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    # Drawing in float32 then rounding makes a bf16 model the rounded fp32 one.
    values = torch.randn(shape, generator=tensor_generator(name, device, seed), dtype=torch.float32, device=device)
    return values.mul_(INIT_STD).to(dtype)


def tensor_generator(name: str, device: str | torch.device, seed: int) -> torch.Generator:
    """The generator tensor `name` is drawn from, seeded from (seed, name): a tensor's values do not depend on the
    shard layout or the other tensors."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


def _remove_old_weights(out_dir: Path) -> None:
    # A loader that finds both model.safetensors and stale shards (or the reverse) would mix models.
    stale = [out_dir / "model.safetensors", out_dir / "model.safetensors.index.json",
             *out_dir.glob("model-*-of-*.safetensors")]
    for path in stale:
        path.unlink(missing_ok=True)


def _write_weights(out_dir: Path, config: dict[str, Any], dtype: torch.dtype, device: str, seed: int,
                   max_shard_bytes: int) -> None:
    shapes = tensor_shapes(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: itemsize * math.prod(shape) for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    _remove_old_weights(out_dir)
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        log.info("writing %s (%d tensors, %.2f GB)", filename, len(names),
                 sum(sizes[n] for n in names) / 1e9)
        # Only this shard's tensors live in host memory at once.
        tensors = {name: init_tensor(name, shapes[name], dtype, device, seed).cpu() for name in names}
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        # safetensors creates files owner-only; an engine pod running as another user must read them.
        (out_dir / filename).chmod(0o644)
        del tensors
        weight_map.update(dict.fromkeys(names, filename))
    if len(shards) > 1:
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


# `quantization_config` of the pre-quantized formats a config-only directory can name (`make_model(quantization=)`):
# the layouts the widely used checkpoints ship (int4 with groups of 128; fp8 in blocks of 128 x 128).
QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def make_model(
    out_dir: str | Path,
    arch: str,
    preset: str,
    dtype: str = "bfloat16",
    seed: int = 0,
    device: str = "cpu",
    max_shard_bytes: int = 5 * 2**30,
    weights: bool = True,
    quantization: str | None = None,
) -> Path:
    """Write a random-weight Hugging Face checkpoint of family `arch` and shapes `preset` to `out_dir`.

    arch: one of `ARCHS` (llama, qwen2, qwen3); preset: one of `PRESETS`; dtype: float32, bfloat16
    or float16. Weights are drawn on `device` (e.g. "cuda" for the big presets) from `seed`: the same
    arguments write byte-identical files. Past `max_shard_bytes` the weights are split into
    model-0000k-of-0000N.safetensors shards with model.safetensors.index.json, written one shard at
    a time. Also writes config.json, generation_config.json and the tokenizer files
    (`tokenizer_builder`). Existing weight files in `out_dir` are replaced. With `weights=False` no
    weights are written (a config-only directory for the engine's load_format "dummy"). Returns `out_dir`.
    `quantization` (one of `QUANTIZATION_CONFIGS`, config-only directories alone) names a pre-quantized format in
    config.json, whose packed tensors load_format "dummy" then draws.
    """
    config = preset_config(arch, preset, tokenizer_builder.VOCAB_SIZE, dtype)
    if quantization is not None:
        if quantization not in QUANTIZATION_CONFIGS:
            raise ValueError(f"quantization {quantization!r}: make-model writes one of "
                             f"{', '.join(QUANTIZATION_CONFIGS)}")
        if weights:
            raise ValueError("make-model writes dense weights; a quantized format goes in a config-only directory "
                             "(no weights), whose packed tensors the engine's load_format 'dummy' draws")
        config["quantization_config"] = dict(QUANTIZATION_CONFIGS[quantization])
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    tokenizer_builder.write_tokenizer(out, model_max_length=config["max_position_embeddings"])
    if weights:
        _write_weights(out, config, DTYPES[dtype], device, seed, max_shard_bytes)
    else:
        _remove_old_weights(out)
    # config.json last: a directory left by an interrupted run is not taken for a checkpoint.
    _write_json(out / "generation_config.json", {
        "bos_token_id": tokenizer_builder.BOS_ID,
        # A chat turn ends at <|im_end|>, a plain completion at <|end_of_text|>.
        "eos_token_id": [tokenizer_builder.EOS_ID, tokenizer_builder.IM_END_ID],
        "pad_token_id": tokenizer_builder.PAD_ID,
    })
    _write_json(out / "config.json", config)
    return out
