"""What the engine needs to know about a checkpoint, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# architectures entry → family flags. Mistral is the Llama graph; Qwen2 adds qkv bias; Qwen3 adds q/k norm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class WeightQuantization:
    """A pre-quantized checkpoint's weight format, from config.json's `quantization_config`
    (models/quantization.py reads the tensors). Only the decoder layers' linear weights are quantized."""

    # "awq" (GEMM layout), "gptq" (checkpoint format v1), "fp8" (block-scaled e4m3) or "compressed-tensors" (e4m3,
    # float-quantized: per channel, per tensor or per block)
    method: str
    bits: int  # 4 (AWQ, GPTQ) or 8 (GPTQ, fp8)
    group_size: int  # input features sharing one scale and zero; -1: one group over all of them (fp8: unused)
    desc_act: bool = False  # GPTQ act-order: g_idx assigns each input feature its group
    # fp8: (output rows, input columns) of the weight blocks that share one scale (`weight_block_size`); None: one
    # scale per output feature
    block_size: tuple[int, int] | None = None
    # fp8 computed at load from the checkpoint's dense weights (`quantization='fp8'` on an unquantized checkpoint)
    online: bool = False
    # compressed-tensors: one scale per projection (q, k and v each have theirs), not per output feature
    per_tensor: bool = False
    # fp8 W8A8: the input features sharing one dynamic activation scale per token (block-scaled fp8: a block's
    # columns), 0 for one scale per token, None when the checkpoint keeps activations in the model dtype
    activation_group: int | None = None
    # GPTQ's `sym` needs no field: a symmetric checkpoint stores its (constant) zero points like any other.


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: WeightQuantization | None = None


class UnsupportedModelError(ValueError):
    """The checkpoint is not one the engine can run; the message names what is supported."""


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


SUPPORTED_QUANTIZATION = ("awq (bits 4, version 'gemm', zero_point true), gptq (bits 4 or 8, "
                          "checkpoint_format 'gptq', i.e. v1; desc_act and sym either way), fp8 (block-scaled: "
                          "weight_block_size [rows, columns], e4m3 weights with weight_scale_inv, dynamic activations) "
                          "and compressed-tensors (format 'float-quantized': 8-bit float weights, symmetric, per "
                          "channel, tensor or block; activations dynamic or not quantized; one config group)")


def _unsupported_quantization(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config: {what} is not supported; supported pre-quantized "
                                 f"checkpoints: {SUPPORTED_QUANTIZATION}; other checkpoints must be unquantized "
                                 f"({', '.join(SUPPORTED_DTYPES)})")


def _quantization(raw: dict[str, Any], linear_shapes: dict[str, tuple[int, int]]) -> WeightQuantization | None:
    """config.json's `quantization_config` checked against what models/quantization.py reads; None when absent.
    `linear_shapes`: (out, in) features of every quantized linear, which the packing and groups must divide."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 0)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise _unsupported_quantization(f"awq with bits={bits}")
        if version != "gemm":
            raise _unsupported_quantization(f"awq version {version!r} (a different packed layout)")
        if not qc.get("zero_point", True):
            raise _unsupported_quantization("awq without zero_point")
        quant = WeightQuantization("awq", 4, group_size)
    elif method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8):
            raise _unsupported_quantization(f"gptq with bits={bits}")
        if fmt != "gptq":
            raise _unsupported_quantization(f"gptq checkpoint_format {fmt!r}")
        pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise _unsupported_quantization(f"gptq with pack_dtype {pack_dtype!r} (codes are read from int32s)")
        if qc.get("dynamic"):
            raise _unsupported_quantization("gptq with per-module 'dynamic' overrides")
        if qc.get("lm_head"):
            raise _unsupported_quantization("gptq with a quantized lm_head")
        quant = WeightQuantization("gptq", bits, group_size, bool(qc.get("desc_act", False)))
    elif method == "fp8":
        return _fp8_quantization(qc, linear_shapes)
    elif method == "compressed-tensors":
        return _compressed_tensors_quantization(qc, linear_shapes)
    else:
        raise _unsupported_quantization(f"quant_method {method or qc!r}")
    skipped = [m for m in qc.get("modules_to_not_convert") or [] if m != "lm_head"]
    if skipped:
        raise _unsupported_quantization(f"modules_to_not_convert={skipped} (every decoder linear must be quantized)")
    pack = 32 // bits
    for name, (out_f, in_f) in linear_shapes.items():
        group = in_f if group_size == -1 else group_size
        if group <= 0 or in_f % group:
            raise _unsupported_quantization(f"group_size={group_size}, which does not divide {name}'s {in_f} input "
                                            "features (it must divide every linear's, or be -1)")
        if in_f % pack or out_f % pack:
            raise _unsupported_quantization(f"{bits}-bit packing of {name} ({out_f}x{in_f}: both must be "
                                            f"multiples of {pack})")
    return quant


def _fp8_quantization(qc: dict[str, Any], linear_shapes: dict[str, tuple[int, int]]) -> WeightQuantization:
    """`quant_method: fp8` as Qwen3-FP8 and DeepSeek checkpoints ship it: each decoder linear's weight in e4m3 and a
    float32 `weight_scale_inv` per `weight_block_size` block (ragged blocks at the input edge allowed), activations
    quantized at run time ('dynamic')."""
    block = qc.get("weight_block_size")
    if block is None:
        raise _unsupported_quantization("fp8 without weight_block_size (per-tensor or per-channel fp8 scales)")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _unsupported_quantization(f"fp8 weight_block_size={block!r} (two positive integers: rows, columns)")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _unsupported_quantization(f"fp8 activation_scheme {scheme!r} (static activation scales)")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _unsupported_quantization(f"fp8 fmt {fmt!r}")
    skipped = [m for m in (qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []) if m != "lm_head"]
    if skipped:
        raise _unsupported_quantization(f"fp8 with ignored_layers={skipped} (every decoder linear must be quantized)")
    rows = int(block[0])
    for name, (out_f, _) in linear_shapes.items():
        if out_f % rows:
            raise _unsupported_quantization(f"fp8 weight_block_size={list(block)} with {name}'s {out_f} output "
                                            f"features, not a multiple of {rows} (fused projections stack their "
                                            "scale rows)")
    return WeightQuantization("fp8", 8, -1, block_size=(rows, int(block[1])), activation_group=int(block[1]))


def _compressed_tensors_quantization(qc: dict[str, Any], linear_shapes: dict[str, tuple[int, int]]
                                     ) -> WeightQuantization:
    """A compressed-tensors checkpoint ('float-quantized': the widely used "-FP8" checkpoints), read through the
    compressed-tensors package's own config types: e4m3 weights with a `weight_scale` per output feature ('channel'),
    per projection ('tensor') or per block ('block'), activations quantized at run time or not at all."""
    from compressed_tensors.quantization import QuantizationConfig  # imports transformers: only when needed

    try:
        config = QuantizationConfig.model_validate(qc)
    except ValueError as e:
        raise _unsupported_quantization(f"compressed-tensors config that does not parse "
                                        f"({str(e).splitlines()[0]})") from None
    fmt = str(config.format)
    if fmt != "float-quantized":
        raise _unsupported_quantization(f"compressed-tensors format {fmt!r}")
    groups = list(config.config_groups.values())
    if len(groups) != 1:
        raise _unsupported_quantization(f"compressed-tensors with {len(groups)} config groups (one for every linear)")
    scheme = groups[0]
    if list(scheme.targets) != ["Linear"]:
        raise _unsupported_quantization(f"compressed-tensors targets {list(scheme.targets)} (['Linear'])")
    skipped = [m for m in config.ignore or [] if m not in ("lm_head", "re:.*lm_head")]
    if skipped:
        raise _unsupported_quantization(f"compressed-tensors ignoring {skipped} (every decoder linear must be "
                                        "quantized)")
    w = scheme.weights
    if w is None or w.num_bits != 8 or str(w.type) != "float" or not w.symmetric or w.dynamic:
        raise _unsupported_quantization("compressed-tensors weights other than static symmetric 8-bit float"
                                        + ("" if w is None else f" ({w.num_bits}-bit {w.type}, symmetric "
                                                                f"{w.symmetric}, dynamic {w.dynamic})"))
    strategy = str(w.strategy)
    if strategy not in ("channel", "tensor", "block"):
        raise _unsupported_quantization(f"compressed-tensors weight strategy {strategy!r} (channel, tensor, block)")
    act = scheme.input_activations
    if act is not None and not (act.dynamic is True and act.num_bits == 8 and str(act.type) == "float"
                                and str(act.strategy) == "token"):
        raise _unsupported_quantization("compressed-tensors input activations other than dynamic 8-bit float per "
                                        f"token (dynamic {act.dynamic}, strategy {act.strategy})")
    if scheme.output_activations is not None:
        raise _unsupported_quantization("compressed-tensors output activation quantization")
    block = None
    if strategy == "block":
        bs = w.block_structure
        if not (isinstance(bs, list | tuple) and len(bs) == 2):
            raise _unsupported_quantization(f"compressed-tensors block strategy with block_structure {bs!r}")
        block = (int(bs[0]), int(bs[1]))
        for name, (out_f, _) in linear_shapes.items():
            if out_f % block[0]:
                raise _unsupported_quantization(f"compressed-tensors block_structure {list(bs)} with {name}'s "
                                                f"{out_f} output features, not a multiple of {block[0]}")
    return WeightQuantization("compressed-tensors", 8, -1, block_size=block, per_tensor=strategy == "tensor",
                              activation_group=None if act is None else 0)


ONLINE_FP8 = WeightQuantization("fp8", 8, -1, online=True, activation_group=0)


def with_quantization(cfg: ModelConfig, asked: str | None) -> ModelConfig:
    """The model as the engine runs it under `asked` (EngineConfig.quantization): the checkpoint's own format when
    `asked` is None or names it; fp8 computed at load, one scale per output feature, when `asked` is 'fp8' and the
    checkpoint is unquantized. UnsupportedModelError for anything else."""
    have = cfg.quantization
    if asked is None or (have is not None and have.method == asked):
        return cfg
    if have is not None:
        raise UnsupportedModelError(f"quantization={asked!r}, but config.json's quantization_config says the "
                                    f"checkpoint is {have.method}: leave quantization unset to run it as stored")
    if asked != "fp8":
        raise UnsupportedModelError(f"quantization={asked!r} needs a checkpoint stored that way (config.json's "
                                    "quantization_config); on an unquantized checkpoint only 'fp8' quantizes at load")
    return replace(cfg, quantization=ONLINE_FP8)


def _eos_ids(raw: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw, _read_json(model_dir / "generation_config.json")):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate config.json of a Hugging Face checkpoint directory."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the model must be a local Hugging Face checkpoint directory "
                                "(config.json + safetensors + tokenizer files)")
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, Mistral, Qwen2/2.5, Qwen3)")
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={num_heads} is not a multiple of "
                                    f"num_key_value_heads={num_kv_heads}")
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    sliding = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding = None
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    attention_bias = True if family == "qwen2" else bool(raw.get("attention_bias", False))
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw.get('hidden_act')!r} is not supported; supported: silu")
    head_dim_total, kv_total = num_heads * head_dim, num_kv_heads * head_dim
    inter = int(raw["intermediate_size"])
    quantization = _quantization(raw, {"q_proj": (head_dim_total, hidden), "k_proj": (kv_total, hidden),
                                       "o_proj": (hidden, head_dim_total), "gate_proj": (inter, hidden),
                                       "down_proj": (hidden, inter)})
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=dtype if dtype in SUPPORTED_DTYPES else "float32",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw, model_dir),
        quantization=quantization,
    )
