"""Pre-quantized AWQ, GPTQ and block-scaled fp8 checkpoints load and run the same greedy tokens as transformers on
the dequantized weights.

The test packs and unpacks with its own code, written from the formats' definitions (independent of
models/quantization.py): a tiny random checkpoint's decoder linears are quantized, written as an AWQ, GPTQ or fp8
checkpoint, and the packed tensors are unpacked again into an fp32 Hugging Face checkpoint, the oracle.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import governor.engine.models.quantization as quantization
from governor.engine import LLM, SamplingParams
from governor.engine.models.checkpoint import dummy_weights
from governor.engine.models.model_config import UnsupportedModelError, WeightQuantization, load_model_config
from governor.engine.models.quantization import QuantizedLinear, dummy_linear_tensors
from governor.kernels.launch_policy import LaunchPolicy
from tests.conftest import build_hf_checkpoint, count_calls, needs_triton
from tests.test_engine_parity import engine_prompt_logits, greedy, hf_greedy, mixed_prompts

NEW_TOKENS = 12
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Projections that read the same input share one act-order permutation (the quantizer sees the same Hessian).
INPUT_SITE = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
              "up_proj": "mlp", "down_proj": "down"}
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble k of an int32 holds column 8j + this[k]


@dataclass(frozen=True)
class Scheme:
    method: str  # "awq", "gptq" or "fp8"
    bits: int
    group_size: int  # -1: one group
    desc_act: bool = False
    sym: bool = False
    block: tuple[int, int] | None = None  # fp8: weight_block_size; compressed-tensors' block strategy
    strategy: str = ""  # compressed-tensors: channel, tensor or block
    dynamic_activations: bool = True  # compressed-tensors: W8A8 with dynamic per-token scales, or weight-only
    scale_dtype: torch.dtype = torch.float32  # compressed-tensors' weight_scale

    @property
    def activation_group(self) -> int | None:
        """W8A8 input rounding the format asks for: per token (0), per group of the weight's input block, or none."""
        if self.method == "fp8":
            assert self.block is not None
            return self.block[1]  # fp8's dynamic activation scheme: one scale per 1 x block[1] group
        return 0 if self.method == "compressed-tensors" and self.dynamic_activations else None

    def config(self) -> dict[str, Any]:
        if self.method == "compressed-tensors":
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": self.strategy,
                       "group_size": None, "block_structure": list(self.block) if self.block else None,
                       "observer": "minmax", "actorder": None}
            acts = ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
                    if self.dynamic_activations else None)
            return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status":
                    "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None, "config_groups": {
                        "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                    "output_activations": None}}}
        if self.method == "fp8":
            assert self.block is not None
            return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(self.block)}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "version": "gemm",
                    "zero_point": True, "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}


# The tiny shapes' input features are 64 and 128: 64 is the largest group dividing both.
AWQ = Scheme("awq", 4, 64)
GPTQ_CASES = {
    "gptq4-sym": ("llama", Scheme("gptq", 4, 32, sym=True)),
    "gptq4-asym-act-order": ("qwen3", Scheme("gptq", 4, 32, desc_act=True)),
    "gptq4-sym-act-order-one-group": ("mistral", Scheme("gptq", 4, -1, desc_act=True, sym=True)),
    "gptq8-sym": ("qwen2", Scheme("gptq", 8, 64, sym=True)),
    "gptq8-asym-act-order": ("llama3-rope-mqa", Scheme("gptq", 8, 32, desc_act=True)),
}


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 → the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def quantize(w: torch.Tensor, scheme: Scheme, g_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w [out, in] → codes q [in, out], zero points z [G, out], float16 scales s [G, out] (round to nearest)."""
    maxq = 2**scheme.bits - 1
    groups = int(g_idx.max()) + 1
    q = torch.empty(w.shape[1], w.shape[0], dtype=torch.int64)
    z = torch.empty(groups, w.shape[0], dtype=torch.int64)
    s = torch.empty(groups, w.shape[0], dtype=torch.float16)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        wg = w[:, rows].t()  # [rows, out]
        lo, hi = wg.min(0).values.clamp(max=0), wg.max(0).values.clamp(min=0)
        if scheme.sym:
            scale = torch.maximum(-lo, hi) * 2 / maxq
            zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64)
        else:
            scale = (hi - lo) / maxq
            # GPTQ v1 stores zero - 1 unsigned, so its zero points start at 1.
            zero = torch.round(-lo / scale).long().clamp(1 if scheme.method == "gptq" else 0, maxq)
        s[g] = scale.to(torch.float16)
        z[g] = zero
        q[rows] = (torch.round(wg / s[g].float()) + zero).clamp(0, maxq).long()
    return q, z, s


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W [out, in] = (q - z[g]) * s[g], in fp32."""
    g = g_idx.long()
    return ((q - z[g]).float() * s.float()[g]).t().contiguous()


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit → int32 [rows, cols/8], AWQ GEMM's interleaved nibble order."""
    out = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for k, col in enumerate(AWQ_NIBBLE_COLUMN):
        out |= codes[:, col::8] << (4 * k)
    return to_int32(out)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.int64)
    for k, col in enumerate(AWQ_NIBBLE_COLUMN):
        codes[:, col::8] = (packed.long() >> (4 * k)) & 0xF
    return codes


def pack_gptq(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack 32/bits consecutive codes along `dim` into one int32, the first in the lowest bits."""
    per = 32 // bits
    codes = codes.movedim(dim, 0)
    out = torch.zeros(codes.shape[0] // per, *codes.shape[1:], dtype=torch.int64)
    for j in range(per):
        out |= codes[j::per] << (bits * j)
    return to_int32(out).movedim(0, dim).contiguous()


def unpack_gptq(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per = 32 // bits
    packed = packed.long().movedim(dim, 0)
    codes = torch.empty(packed.shape[0] * per, *packed.shape[1:], dtype=torch.int64)
    for j in range(per):
        codes[j::per] = (packed >> (bits * j)) & (2**bits - 1)
    return codes.movedim(0, dim)


def group_index(in_features: int, scheme: Scheme, perm: torch.Tensor) -> torch.Tensor:
    """g_idx: feature i's group; act order assigns groups along `perm` (the features sorted by importance)."""
    group = in_features if scheme.group_size == -1 else scheme.group_size
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm if scheme.desc_act else torch.arange(in_features)] = (
        torch.arange(in_features, dtype=torch.int32) // group)
    return g_idx


# fp8 blocks: ragged input blocks (64 and 128 input features in 48-wide blocks), square ones, and the MQA shape's
# 16-row k/v projections.
FP8_CASES = {
    "llama-16x48-ragged": ("llama", Scheme("fp8", 8, -1, block=(16, 48))),
    "qwen3-32x64": ("qwen3", Scheme("fp8", 8, -1, block=(32, 64))),
    "llama3-rope-mqa-16x16": ("llama3-rope-mqa", Scheme("fp8", 8, -1, block=(16, 16))),
}
E4M3_MAX = 448.0
# compressed-tensors float-quantized, as the "-FP8" checkpoints ship: per channel (bf16 scales, W8A8 dynamic), per
# tensor (weight-only) and per block.
CT_CASES = {
    "channel-w8a8-bf16-scales": ("llama", Scheme("compressed-tensors", 8, -1, strategy="channel",
                                                 scale_dtype=torch.bfloat16)),
    "tensor-weight-only": ("qwen3", Scheme("compressed-tensors", 8, -1, strategy="tensor",
                                           dynamic_activations=False)),
    "block-16x48": ("qwen2", Scheme("compressed-tensors", 8, -1, strategy="block", block=(16, 48))),
}


def fp8_blocks(shape: tuple[int, int], block: tuple[int, int]) -> list[tuple[int, int, slice, slice]]:
    """(block row, block column, rows, columns) of every block of a [out, in] weight, the last ones ragged."""
    bn, bk = block
    return [(r, c, slice(r * bn, (r + 1) * bn), slice(c * bk, (c + 1) * bk))
            for r in range(-(-shape[0] // bn)) for c in range(-(-shape[1] // bk))]


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 weight_scale_inv): each block scaled so that its largest magnitude maps to 448."""
    blocks = fp8_blocks(tuple(w.shape), block)
    scale = torch.zeros(blocks[-1][0] + 1, blocks[-1][1] + 1)
    q = torch.zeros(w.shape, dtype=torch.float8_e4m3fn)
    for r, c, rows, cols in blocks:
        scale[r, c] = w[rows, cols].abs().max().clamp(min=1e-12) / E4M3_MAX
        q[rows, cols] = (w[rows, cols] / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    w = torch.zeros(q.shape)
    for r, c, rows, cols in fp8_blocks(tuple(q.shape), block):
        w[rows, cols] = q[rows, cols].float() * scale[r, c]
    return w


def pack_linear(w: torch.Tensor, scheme: Scheme, perm: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A linear's checkpoint tensors in `scheme`'s format, and the weight unpacked from them (fp32 [out, in])."""
    if scheme.method == "fp8":
        assert scheme.block is not None
        q, scale = quantize_fp8(w, scheme.block)
        return {"weight": q, "weight_scale_inv": scale}, dequantize_fp8(q, scale, scheme.block)
    if scheme.method == "compressed-tensors":
        block = scheme.block or {"channel": (1, w.shape[1]), "tensor": tuple(w.shape)}[scheme.strategy]
        q, scale = quantize_fp8(w, block)
        if scheme.scale_dtype != torch.float32:  # the scale as stored: requantize the codes to it
            scale = scale.to(scheme.scale_dtype)
            q = torch.zeros_like(q)
            for r, c, rows, cols in fp8_blocks(tuple(w.shape), block):
                q[rows, cols] = (w[rows, cols] / scale[r, c].float()).to(torch.float8_e4m3fn)
        stored = scale.reshape(1) if scheme.strategy == "tensor" else scale
        return {"weight": q, "weight_scale": stored}, dequantize_fp8(q, scale.float(), block)
    g_idx = group_index(w.shape[1], scheme, perm)
    q, z, s = quantize(w, scheme, g_idx)
    if scheme.method == "awq":
        packed = {"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": s}
        return packed, dequantize(unpack_awq(packed["qweight"]), unpack_awq(packed["qzeros"]), s, g_idx)
    packed = {"qweight": pack_gptq(q, scheme.bits, 0), "qzeros": pack_gptq(z - 1, scheme.bits, 1), "scales": s,
              "g_idx": g_idx}
    unpacked_q = unpack_gptq(packed["qweight"], scheme.bits, 0)
    unpacked_z = unpack_gptq(packed["qzeros"], scheme.bits, 1) + 1
    return packed, dequantize(unpacked_q, unpacked_z, s, packed["g_idx"])


def write_quantized(src: Path, packed_dir: Path, oracle_dir: Path, scheme: Scheme, seed: int = 0) -> None:
    """`src`'s decoder linears, packed in `scheme` into `packed_dir`, and unpacked into fp32 `oracle_dir`."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    packed_tensors, oracle_tensors = dict(tensors), dict(tensors)
    for layer in range(config["num_hidden_layers"]):
        perms: dict[str, torch.Tensor] = {}
        for name in LINEARS:
            key = f"model.layers.{layer}.{name}"
            w = tensors[f"{key}.weight"]
            site = INPUT_SITE[name.rpartition(".")[2]]
            perm = perms.setdefault(site, torch.randperm(w.shape[1], generator=gen))
            packed, deq = pack_linear(w, scheme, perm)
            del packed_tensors[f"{key}.weight"]
            packed_tensors.update({f"{key}.{k}": v for k, v in packed.items()})
            oracle_tensors[f"{key}.weight"] = deq
    for out, t, cfg in ((packed_dir, packed_tensors, {**config, "quantization_config": scheme.config()}),
                        (oracle_dir, oracle_tensors, config)):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file(t, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory):
    """`quantized(arch, scheme, **config)` → (packed checkpoint, fp32 oracle checkpoint), cached; `config`: fields of
    the tiny architecture's config to override (e.g. wider layers)."""
    cache: dict[tuple[str, Scheme, tuple[tuple[str, Any], ...]], tuple[Path, Path]] = {}

    def get(arch: str, scheme: Scheme, **config: Any) -> tuple[Path, Path]:
        key = (arch, scheme, tuple(sorted(config.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-{scheme.method}{scheme.bits}")
            src = build_hf_checkpoint(root / "src", arch, **config)
            write_quantized(src, root / "packed", root / "oracle", scheme)
            cache[key] = root / "packed", root / "oracle"
        return cache[key]

    return get


def round_e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
    """This file's own W8A8 input rounding: each token's (`group` 0) or each `group` features' largest magnitude
    mapped to 448, the slice cast to e4m3 and scaled back."""
    out = torch.empty_like(x)
    width = group or x.shape[-1]
    for start in range(0, x.shape[-1], width):
        part = x[..., start:start + width]
        scale = (part.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        out[..., start:start + width] = (part / scale).to(torch.float8_e4m3fn).float() * scale
    return out


@contextlib.contextmanager
def w8a8_inputs(model: Any, group: int | None, ranks: int = 1) -> Iterator[None]:
    """While open, transformers' decoder linears multiply their inputs rounded as a W8A8 layer rounds them (`group`
    None: untouched). Under `ranks`-way tensor parallelism the row-parallel ones (o, down) round each rank's share of
    the features on its own, as each rank does."""
    hooks = []
    for name, module in ([] if group is None else model.model.layers.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in INPUT_SITE:
            shares = ranks if leaf in ("o_proj", "down_proj") else 1

            def rounded(_: Any, args: tuple[torch.Tensor, ...], shares: int = shares) -> tuple[torch.Tensor]:
                return (torch.cat([round_e4m3(p, group) for p in args[0].chunk(shares, -1)], -1),)

            hooks.append(module.register_forward_pre_hook(rounded))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


# W8A8 rounds every activation to 3 mantissa bits, so a float32 difference of order 1e-6 (the order of a sum, decode
# attention against transformers' recomputation) now and then moves one activation across a rounding boundary: a
# step of 1/16 of it, which moved a prompt position's logits by up to 0.13 while the others agree to 1e-4
# (`test_w8a8_prompt_logits_match_transformers_with_rounded_inputs`, printed with -s). Greedy parity under W8A8
# therefore holds up to the first step whose two best oracle logits are closer than this, where the engine must pick
# one of the two.
W8A8_MARGIN = 0.25


def assert_greedy_parity(llm: LLM, oracle_model: Any, prompts: list[list[int]], n: int = NEW_TOKENS,
                         w8a8: int | None = None, ranks: int = 1) -> None:
    """The engine's greedy tokens are transformers' on the oracle weights; `w8a8`: with the inputs of its linears
    rounded as W8A8 rounds them (`w8a8_inputs`), up to a near tie (W8A8_MARGIN)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))
    with w8a8_inputs(oracle_model, w8a8, ranks):
        for prompt, out in zip(prompts, outs, strict=True):
            got = out.outputs[0].token_ids
            if w8a8 is None:
                assert got == hf_greedy(oracle_model, prompt, n)
                continue
            ids = list(prompt)
            for token in got:
                with torch.no_grad():
                    logits = oracle_model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                best = logits.topk(2)
                if token != int(best.indices[0]):
                    assert token == int(best.indices[1]) and float(best.values[0] - best.values[1]) < W8A8_MARGIN
                    break
                ids.append(token)


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-mqa", "mistral", "qwen2", "qwen3"])
def test_awq_checkpoint_matches_transformers_on_its_dequantized_weights(quantized, hf_model, arch: str) -> None:
    packed, oracle = quantized(arch, AWQ)
    llm = LLM(str(packed), dtype="float32")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=1))


@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_checkpoint_matches_transformers_on_its_dequantized_weights(quantized, hf_model, case: str) -> None:
    arch, scheme = GPTQ_CASES[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=2))


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_block_scaled_checkpoint_matches_transformers_on_its_dequantized_weights(quantized, hf_model,
                                                                                     case: str) -> None:
    arch, scheme = FP8_CASES[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=7), w8a8=scheme.activation_group)


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(quantized, hf_model,
                                                                                         case: str) -> None:
    arch, scheme = CT_CASES[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32")
    quant = llm.engine.model_config.quantization
    assert quant is not None and quant.method == "compressed-tensors"
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=9), w8a8=scheme.activation_group)


@pytest.mark.parametrize("case", ["fp8-llama3-rope-mqa-16x16", "fp8-llama-16x48-ragged", "ct-channel-w8a8-bf16-scales",
                                  "ct-block-16x48"])
def test_w8a8_prompt_logits_match_transformers_with_rounded_inputs(quantized, hf_model, case: str) -> None:
    """Every prompt position's logits (chunked prefill, so steps of many rows and of one) against transformers on the
    dequantized weights with W8A8's input rounding: float32 agreement at nearly every position (measured: 378 of 380,
    the other two moved by 0.031 and 0.13 where an activation crossed a rounding boundary, W8A8_MARGIN's note), where
    the unrounded inputs put every position off by at least 0.21."""
    method, _, name = case.partition("-")
    arch, scheme = (FP8_CASES if method == "fp8" else CT_CASES)[name]
    packed, oracle = quantized(arch, scheme)
    llm, model = LLM(str(packed), dtype="float32"), hf_model(oracle)
    for prompt, chunk in zip(mixed_prompts(3, seed=15, lo=20), (1, 7, 64), strict=True):
        ours = engine_prompt_logits(llm, prompt, chunk)
        with torch.no_grad():
            plain = model(torch.tensor([prompt]), use_cache=False).logits[0]
            with w8a8_inputs(model, scheme.activation_group):
                rounded = model(torch.tensor([prompt]), use_cache=False).logits[0]
        vocab = rounded.shape[1]
        off = (ours[:, :vocab] - rounded).abs().amax(-1)
        plain_off = float((ours[:, :vocab] - plain).abs().amax(-1).min())
        print(f"{case} chunk {chunk}: {int((off < 1e-4).sum())}/{len(off)} positions within 1e-4, max "
              f"{float(off.max()):.2g}; unrounded oracle off by ≥ {plain_off:.2f}")
        assert float((off < 1e-4).float().mean()) >= 0.9 and float(off.max()) < 0.5, off
        assert plain_off > 0.1  # the rounding is there to see


def test_a_per_tensor_scale_is_held_on_each_row_of_its_projection(quantized) -> None:
    packed, _ = quantized(*CT_CASES["tensor-weight-only"])
    stored = load_file(packed / "model.safetensors")
    qkv = LLM(str(packed), dtype="float32").engine.model.decoder_layers[0].self_attn.qkv_weight
    assert isinstance(qkv, QuantizedLinear)
    rows = qkv.weight_scale_inv[:, 0]
    for name, (start, end) in {"q_proj": (0, 128), "k_proj": (128, 192), "v_proj": (192, 256)}.items():
        assert (rows[start:end] == stored[f"model.layers.0.self_attn.{name}.weight_scale"]).all()


def test_fp8_linears_hold_e4m3_weights_and_a_scale_per_block(quantized) -> None:
    packed, _ = quantized(*FP8_CASES["llama-16x48-ragged"])
    model = LLM(str(packed), dtype="float32").engine.model
    qkv, down = model.decoder_layers[0].self_attn.qkv_weight, model.decoder_layers[0].mlp.down_weight
    assert isinstance(qkv, QuantizedLinear) and isinstance(down, QuantizedLinear)
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.shape == (64 + 32 + 32, 64)
    assert qkv.weight_scale_inv.shape == (128 // 16, 2)  # 64 input features in 48-wide blocks: 2, one ragged
    assert down.weight_scale_inv.shape == (64 // 16, 3)  # 128 in 48-wide blocks: 3


def test_an_fp8_checkpoint_with_a_dense_weight_is_refused_naming_it(quantized, tmp_path: Path) -> None:
    packed, _ = quantized(*FP8_CASES["qwen3-32x64"])
    shutil.copytree(packed, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}' is torch.float32; an fp8 checkpoint stores weight as "
                                         r"torch.float8_e4m3fn"):
        LLM(str(tmp_path / "m"), dtype="float32")


def quantize_fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """What fp8 quantized at load must give: e4m3 codes of each row over its largest magnitude / 448, dequantized."""
    scale = (w.float().abs().amax(dim=1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]


@pytest.fixture(scope="module")
def online_fp8(tmp_path_factory: pytest.TempPathFactory):
    """`online_fp8(arch)` → (unquantized checkpoint, fp32 oracle of its decoder linears quantized per row), cached."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-online-fp8")
            src = build_hf_checkpoint(root / "src", arch)
            tensors = load_file(src / "model.safetensors")
            for name in list(tensors):
                if any(f".{linear}.weight" in name for linear in LINEARS):
                    tensors[name] = quantize_fp8_rows(tensors[name])
            shutil.copytree(src, root / "oracle", ignore=shutil.ignore_patterns("*.safetensors"))
            save_file(tensors, root / "oracle" / "model.safetensors", metadata={"format": "pt"})
            cache[arch] = src, root / "oracle"
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp8_quantized_at_load_matches_transformers_on_the_same_quantization(online_fp8, hf_model, arch: str) -> None:
    src, oracle = online_fp8(arch)
    llm = LLM(str(src), dtype="float32", quantization="fp8")
    qkv = llm.engine.model.decoder_layers[0].self_attn.qkv_weight
    assert isinstance(qkv, QuantizedLinear) and qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.weight_scale_inv.shape == (qkv.out_features, 1)  # one scale per output feature
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=8), w8a8=0)  # W8A8, a scale per token


def test_fp8_quantized_at_load_takes_random_weights_too(online_fp8) -> None:
    src, _ = online_fp8("llama")
    llm = LLM(str(src), dtype="float32", quantization="fp8", load_format="dummy")
    down = llm.engine.model.decoder_layers[1].mlp.down_weight
    assert isinstance(down, QuantizedLinear) and down.weight.float().abs().max() == E4M3_MAX  # each row's max → 448
    assert len(llm.generate([[5, 6, 7]], greedy(4))[0].outputs[0].token_ids) == 4


def test_a_quantization_the_checkpoint_does_not_have_is_refused(quantized, online_fp8) -> None:
    awq, _ = quantized("llama", AWQ)
    src, _ = online_fp8("llama")
    with pytest.raises(UnsupportedModelError, match=r"quantization='fp8', but config\.json's quantization_config "
                                                    r"says the checkpoint is awq"):
        LLM(str(awq), dtype="float32", quantization="fp8")
    with pytest.raises(UnsupportedModelError, match="only 'fp8' quantizes at load"):
        LLM(str(src), dtype="float32", quantization="gptq")
    assert LLM(str(awq), dtype="float32", quantization="awq").engine.model_config.quantization.method == "awq"


def test_quantized_linears_are_packed_and_lm_head_stays_dense(quantized) -> None:
    packed, _ = quantized("llama", AWQ)
    model = LLM(str(packed), dtype="float32").engine.model
    attn, mlp = model.decoder_layers[0].self_attn, model.decoder_layers[0].mlp
    for w in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight):
        assert isinstance(w, QuantizedLinear)
    assert isinstance(attn.qkv_weight, QuantizedLinear) and attn.qkv_weight.out_parts == (64, 32, 32)
    assert attn.qkv_weight.qweight.shape == (64 // 8, 128)  # AWQ's codes repacked along the input features
    assert isinstance(model.lm_head, torch.Tensor) and model.lm_head.dtype == torch.float32


def test_awq_codes_are_repacked_along_the_input_features_with_the_weight_unchanged(quantized) -> None:
    """After load, an AWQ layer holds its codes packed along the inputs (GPTQ's layout, which the one-row kernels read
    fastest) and its zero points in column order as stored; the weight they stand for is the checkpoint's, as this
    test's own AWQ unpacking reads it from the file."""
    packed, _ = quantized("llama", AWQ)
    layer = LLM(str(packed), dtype="float32").engine.model.decoder_layers[0].mlp.down_weight
    stored = load_file(packed / "model.safetensors")
    qweight, qzeros, scales = (stored[f"model.layers.0.mlp.down_proj.{n}"] for n in ("qweight", "qzeros", "scales"))
    k = qweight.shape[0]
    g_idx = torch.arange(k) // AWQ.group_size
    want = dequantize(unpack_awq(qweight), unpack_awq(qzeros), scales, g_idx)
    assert layer.codes_along_k and layer.qweight.shape == (k // 8, qweight.shape[1] * 8)
    assert torch.equal(layer.dequantize().cpu(), want)
    with pytest.raises(RuntimeError, match="repacked already"):
        layer.load(0, "qweight", qweight, "down_proj.qweight")


def test_awq_repack_of_many_input_rows_keeps_the_weight_and_refuses_a_ragged_pack() -> None:
    """Input rows are repacked a slice at a time: a layer of several slices, its weight unchanged (this test's own
    AWQ packing and unpacking). A layer whose input features are not whole eights is refused at build time."""
    k, n, group = 2304, 24, 128  # 2,304 rows: three slices of the repack, the last one partial
    gen = torch.Generator().manual_seed(40)
    q, z = torch.randint(0, 16, (k, n), generator=gen), torch.randint(0, 16, (k // group, n), generator=gen)
    s = (torch.rand(k // group, n, generator=gen) / 10).half()
    layer = QuantizedLinear(WeightQuantization("awq", 4, group), k, (n,), torch.device("cpu"))
    for name, tensor in (("qweight", pack_awq(q)), ("qzeros", pack_awq(z)), ("scales", s)):
        layer.load(0, name, tensor, name)
    assert not layer.missing()
    layer.repack()
    assert layer.codes_along_k
    assert torch.equal(layer.dequantize(), dequantize(q, z, s, torch.arange(k) // group))
    with pytest.raises(UnsupportedModelError, match="multiple of 8"):
        QuantizedLinear(WeightQuantization("awq", 4, 4), 20, (n,), torch.device("cpu"))


def test_prefix_caching_and_ngram_speculation_keep_greedy_tokens(quantized) -> None:
    packed, _ = quantized("qwen3", GPTQ_CASES["gptq4-asym-act-order"][1])
    base = mixed_prompts(1, seed=5, lo=20, hi=20)[0]
    # A shared prefix (prefix-cache hits) and repeated n-grams (speculation proposals).
    prompts = [base + base[:6], [*base, 7, 8, 9, *base[:8]], base[:12] * 2]
    plain = LLM(str(packed), dtype="float32").generate(prompts, greedy(16))
    fast = LLM(str(packed), dtype="float32", enable_prefix_caching=True, block_size=4, async_scheduling=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # proposals every step
    outs = [fast.generate([p], greedy(16))[0] for p in prompts]  # one by one, so later prompts hit the cache
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = fast.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["spec_proposed_tokens"] > 0


def test_w8a8_speculative_verification_keeps_plain_greedy_tokens(trained_llama: Path, monkeypatch) -> None:
    """n-gram drafts verified in steps of several rows per sequence (the e4m3 GEMM) give the tokens of plain decoding
    one prompt at a time (one-row steps: the rounded-input path), on the trained model, whose peaked logits leave no
    near ties for a rounding step to tip."""
    from tests.trained_model import held_out_prompts

    prompts = [{"prompt_token_ids": p} for p in held_out_prompts(3, 48)]
    plain = LLM(str(trained_llama), dtype="float32", quantization="fp8")
    one_by_one = [plain.generate([p], greedy(24))[0].outputs[0].token_ids for p in prompts]
    spec = LLM(str(trained_llama), dtype="float32", quantization="fp8",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    gemms = count_calls(monkeypatch, torch, "_scaled_mm")
    outs = spec.generate(prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == one_by_one
    assert spec.stats()["spec_accepted_tokens"] > 0 and gemms["_scaled_mm"] > 0


def test_fp8_kv_cache_runs_a_quantized_model(quantized) -> None:
    packed, _ = quantized("llama", AWQ)
    out = LLM(str(packed), dtype="float32", kv_cache_dtype="fp8").generate(mixed_prompts(2, seed=3), greedy(6))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_triton_backend_runs_quantized_layers_on_the_reference_path(quantized, hf_model) -> None:
    """The fused path (Triton elementwise kernels, interpreted on CPU) with quantized linears."""
    packed, oracle = quantized("qwen3", GPTQ_CASES["gptq4-asym-act-order"][1])
    llm = LLM(str(packed), dtype="float32", attention_backend="triton")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(2, seed=4, hi=12), n=4)


@pytest.mark.parametrize("case", ["qwen3-32x64", "awq-qwen2", "gptq4-asym-act-order", "gptq8-sym"])
def test_triton_backend_runs_quantized_decode_steps_through_their_gemv(quantized, hf_model, monkeypatch,
                                                                      case: str) -> None:
    """One-row steps of an fp8, AWQ or GPTQ model on the fused path stream the packed weight through `fp8_gemv` or
    `gptq_gemv` (AWQ's codes are repacked into GPTQ's layout at load; interpreted on CPU), with transformers' tokens
    on the dequantized weights."""
    import governor.engine.models.quantization as quantization

    kernel = "gptq_gemv" if case.startswith(("awq", "gptq")) else "fp8_gemv"
    calls = count_calls(monkeypatch, quantization, kernel)
    arch, scheme = {**FP8_CASES, **CT_CASES, **GPTQ_CASES, "awq-qwen2": ("qwen2", AWQ)}[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32", attention_backend="triton")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(1, seed=10, hi=12), n=4, w8a8=scheme.activation_group)
    assert calls[kernel] >= 3 * 4 * 2  # decode steps x (qkv, o, gate_up, down) x layers


WIDE = {"hidden_size": 128, "intermediate_size": 256}  # layers of 128 inputs and more: a 4-bit packed_gemm K step


@pytest.mark.parametrize("case", ["awq-wide", "gptq8-sym", "gptq4-asym-act-order", "qwen3-32x64"])
def test_triton_backend_runs_batched_steps_through_packed_gemms(quantized, hf_model, monkeypatch, case: str) -> None:
    """On the fused path (Triton backend) batched decode steps of an AWQ or GPTQ model with groups in order take
    `packed_gemm` (AWQ's 4-bit groups of 64: two a K step; GPTQ's 8-bit ones of 64: a step's), those of act order
    the dense weight `packed_dequantize` writes, and a block-scaled fp8 model's `fp8_block_gemm` (W8A8); one-row
    steps the GEMVs. The tokens are transformers' on the dequantized weights (fp8: with W8A8's input rounding)."""
    import governor.engine.models.quantization as quantization

    kernel = {"qwen3-32x64": "fp8_block_gemm", "gptq4-asym-act-order": "packed_dequantize"}.get(case, "packed_gemm")
    calls = count_calls(monkeypatch, quantization, kernel)
    arch, scheme = {**GPTQ_CASES, **FP8_CASES, "awq-wide": ("llama", AWQ)}[case]
    packed, oracle = quantized(arch, scheme, **(WIDE if case == "awq-wide" else {}))
    llm = LLM(str(packed), dtype="float32", attention_backend="triton")
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(3, seed=50, lo=2, hi=12), n=4,
                         w8a8=scheme.activation_group)
    assert calls[kernel] >= 4 * 2 * 3  # (qkv, o, gate_up, down) x layers x batched decode steps


@pytest.mark.parametrize("case", ["awq", "gptq4-asym-act-order"])
def test_triton_backend_runs_long_prefill_chunks_through_the_dense_weight(quantized, hf_model, monkeypatch,
                                                                         case: str) -> None:
    """A step of more rows than `packed_gemm` takes (a long prompt's prefill) multiplies the weight `packed_dequantize`
    writes in one kernel; the tokens are transformers' on the dequantized weights."""
    import governor.engine.models.quantization as quantization
    from governor.kernels.packed_gemm import PACKED_GEMM_MAX_ROWS

    calls = count_calls(monkeypatch, quantization, "packed_dequantize")
    arch, scheme = {**GPTQ_CASES, "awq": ("llama", AWQ)}[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32", attention_backend="triton")
    long = PACKED_GEMM_MAX_ROWS + 6
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(1, seed=51, lo=long, hi=long), n=3)
    assert calls["packed_dequantize"] >= 4 * 2  # (qkv, o, gate_up, down) x layers, in the prefill


@pytest.mark.parametrize("case", ["qwen3-32x64", "online-fp8"])
def test_one_row_w8a8_steps_round_their_inputs_in_the_kernels_that_write_them(quantized, online_fp8, monkeypatch,
                                                                               case: str) -> None:
    """On the fused path a one-row step of a W8A8 model rounds qkv's and gate_up's inputs in the add + RMSNorm kernel
    and down's in a SiLU·mul kernel, leaving o_proj the only rounding kernel a layer runs: greedy tokens and their
    logprobs are bit for bit those of the separate kernels."""
    import governor.engine.models.llama as llama

    if case == "online-fp8":
        llm = LLM(str(online_fp8("llama")[0]), dtype="float32", quantization="fp8", attention_backend="triton")
    else:
        llm = LLM(str(quantized(*FP8_CASES[case])[0]), dtype="float32", attention_backend="triton")
    norms = count_calls(monkeypatch, llama, "add_rms_norm_fp8")
    silu_rounds = count_calls(monkeypatch, llama, "fp8_round")
    rounds = count_calls(monkeypatch, quantization, "fp8_round")
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=12, lo=3, hi=9)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    fused = llm.generate([prompt], params)[0].outputs[0]  # a prefill, then two one-row decode steps
    layers, decode_steps = len(llm.engine.model.decoder_layers), 2
    assert norms["add_rms_norm_fp8"] == 2 * layers * decode_steps
    assert silu_rounds["fp8_round"] == layers * decode_steps
    fused_rounds = rounds["fp8_round"]
    monkeypatch.setattr(QuantizedLinear, "one_row_rounding", lambda *_: None)  # the separate kernels
    separate = llm.generate([prompt], params)[0].outputs[0]
    assert norms["add_rms_norm_fp8"] == 2 * layers * decode_steps  # not called again
    # The layers' own rounding kernels: three a layer and decode step fewer (only o_proj's is left).
    assert rounds["fp8_round"] - fused_rounds == fused_rounds + 3 * layers * decode_steps
    assert fused.token_ids == separate.token_ids and fused.logprobs == separate.logprobs


@needs_triton
def test_only_groups_the_norm_kernel_can_form_are_rounded_there() -> None:
    """Groups that are a power of two, or one per token, tile the norm kernel's row; 48 features of 64 do not, and
    that layer rounds its input in its own kernel. Several rows, weight-only layers and the reference path never."""
    kernels, row = LaunchPolicy(), torch.zeros(1, 64)

    def layer(group: int | None, block: tuple[int, int] | None = (16, 16)) -> QuantizedLinear:
        return QuantizedLinear(WeightQuantization("fp8", 8, -1, block_size=block, activation_group=group), 64, (32,),
                               torch.device("cpu"))

    assert layer(16).one_row_rounding(row, kernels) == 16
    assert layer(0, None).one_row_rounding(row, kernels) == 0
    assert layer(48, (16, 48)).one_row_rounding(row, kernels) is None
    assert layer(16).one_row_rounding(torch.zeros(2, 64), kernels) is None  # the e4m3 GEMMs take codes
    assert layer(None).one_row_rounding(row, kernels) is None  # weight-only
    assert layer(16).one_row_rounding(row, None) is None  # the reference path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["awq", "gptq4-asym-act-order", "qwen3-32x64", "channel-w8a8-bf16-scales"])
def test_gpu_quantized_layers_under_cuda_graphs_match_transformers(quantized, hf_model, case: str) -> None:
    """On the GPU (Triton backend, decode steps replayed from CUDA graphs, fp32), the reference path gives the tokens
    transformers gives on the dequantized weights (CPU, fp32)."""
    arch, scheme = ("llama", AWQ) if case == "awq" else {**GPTQ_CASES, **FP8_CASES, **CT_CASES}[case]
    packed, oracle = quantized(arch, scheme)
    llm = LLM(str(packed), dtype="float32", device="cuda")
    assert llm.engine.executor.use_cuda_graphs
    assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(4, seed=6), w8a8=scheme.activation_group)


@pytest.fixture(scope="module")
def tiny_config(quantized) -> dict[str, Any]:
    _, oracle = quantized("llama", AWQ)
    return json.loads((oracle / "config.json").read_text())


REJECTED = {
    "other method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "fp8 per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    "fp8 static activations": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16]},
                               "fp8 activation_scheme 'static'"),
    "fp8 e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 16]}, "fp8 fmt 'e5m2'"),
    "fp8 malformed block": ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size=[128]"),
    "fp8 block rows not dividing": ({"quant_method": "fp8", "weight_block_size": [24, 16]},
                                    "not a multiple of 24"),
    "compressed-tensors int4": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                               "group_size": 128}}}}, "compressed-tensors format 'pack-quantized'"),
    "compressed-tensors static activations": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
        "input activations other than dynamic"),
    "compressed-tensors two groups": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            f"group_{i}": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
            for i in range(2)}}, "2 config groups"),
    "compressed-tensors ignoring a projection": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*down_proj"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                          "strategy": "channel"}}}},
        "ignoring ['re:.*down_proj']"),
    "awq other bits": ({"quant_method": "awq", "bits": 8, "group_size": 64, "version": "gemm", "zero_point": True},
                       "awq with bits=8"),
    "awq gemv layout": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv", "zero_point": True},
                        "awq version 'gemv'"),
    "awq without zero point": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                "zero_point": False}, "awq without zero_point"),
    "gptq other bits": ({"quant_method": "gptq", "bits": 3, "group_size": 64}, "gptq with bits=3"),
    "gptq v2 format": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"},
                       "checkpoint_format 'gptq_v2'"),
    "gptq other packing": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "pack_dtype": "int16"},
                           "pack_dtype 'int16'"),
    "gptq dynamic overrides": ({"quant_method": "gptq", "bits": 4, "group_size": 64,
                                "dynamic": {"-:.*down_proj": {}}}, "'dynamic' overrides"),
    "group not dividing": ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size=48"),
    "unquantized modules": ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                             "zero_point": True, "modules_to_not_convert": ["mlp.down_proj"]},
                            "modules_to_not_convert"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_unsupported_quantization_is_refused_naming_what_is_supported(tmp_path: Path, tiny_config, case: str) -> None:
    quant, what = REJECTED[case]
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config, "quantization_config": quant}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model_config(tmp_path)
    assert what in str(e.value)
    assert "supported pre-quantized checkpoints: awq (bits 4, version 'gemm'" in str(e.value)


def test_an_unquantized_config_has_no_quantization(tiny_config, quantized) -> None:
    _, oracle = quantized("llama", AWQ)
    assert load_model_config(oracle).quantization is None


# Two ranks (gloo): every format cut along each layer's split, group and block sizes that the tiny shapes keep whole
# at TP 2 (the o_proj of llama has 64 input features, 32 a rank: AWQ's group of 64 would be split, so group 32 here).
TP_CASES = {
    "awq-llama": ("llama", Scheme("awq", 4, 32)),
    "gptq4-sym": GPTQ_CASES["gptq4-sym"],  # row-parallel: the rank's groups, g_idx renumbered from 0
    "gptq4-asym-act-order": GPTQ_CASES["gptq4-asym-act-order"],  # row-parallel: every group's zeros and scales
    "gptq4-sym-act-order-one-group": GPTQ_CASES["gptq4-sym-act-order-one-group"],
    "fp8-qwen3-32x64": FP8_CASES["qwen3-32x64"],  # scale rows and columns by whole blocks
    "ct-channel": CT_CASES["channel-w8a8-bf16-scales"],  # row-parallel: every output feature's scale
    "ct-tensor": CT_CASES["tensor-weight-only"],
}


@pytest.mark.parametrize("case", TP_CASES)
def test_two_ranks_run_a_quantized_checkpoint_as_transformers_does(quantized, hf_model, case: str) -> None:
    arch, scheme = TP_CASES[case]
    packed, oracle = quantized(arch, scheme)
    with LLM(str(packed), dtype="float32", tensor_parallel_size=2) as llm:
        assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(3, seed=11), w8a8=scheme.activation_group, ranks=2)


def test_two_ranks_quantize_at_load_as_one_does(online_fp8, hf_model) -> None:
    """Online fp8 scales each output feature by its whole row, also where a rank holds half the row (o, down)."""
    src, oracle = online_fp8("llama")
    with LLM(str(src), dtype="float32", quantization="fp8", tensor_parallel_size=2) as llm:
        assert_greedy_parity(llm, hf_model(oracle), mixed_prompts(3, seed=12), w8a8=0, ranks=2)


def test_a_rank_share_that_splits_a_group_is_refused_naming_the_sizes(quantized) -> None:
    from governor.engine.attention import PagedAttention
    from governor.engine.models.llama import CausalLM
    from governor.engine.tp.group import TPGroup
    from governor.engine.tp.sharding import shard_config

    packed, _ = quantized("llama", AWQ)  # group 64; o_proj's 64 input features are 32 a rank at TP 2
    cfg = shard_config(load_model_config(packed), 2)
    with pytest.raises(UnsupportedModelError, match=r"tensor_parallel_size=2 gives each rank 32 input features of "
                                                    r"a awq layer, not a multiple of group_size \(64\)"):
        CausalLM(cfg, torch.float32, torch.device("cpu"), 64, PagedAttention("torch", 0.125), TPGroup(0, 2))


DUMMY_CASES = {"awq": ("llama", AWQ), "gptq4-sym": GPTQ_CASES["gptq4-sym"], "gptq8-sym": GPTQ_CASES["gptq8-sym"],
               "fp8-qwen3-32x64": FP8_CASES["qwen3-32x64"], "ct-tensor": CT_CASES["tensor-weight-only"],
               "ct-block": CT_CASES["block-16x48"]}


def unpack_linear(stored: dict[str, torch.Tensor], scheme: Scheme, out_f: int, in_f: int) -> torch.Tensor:
    """One linear's fp32 weight [out, in] from the tensors a `scheme` checkpoint stores for it, by this file's own
    unpacking."""
    if scheme.method == "fp8":
        assert scheme.block is not None
        return dequantize_fp8(stored["weight"], stored["weight_scale_inv"], scheme.block)
    if scheme.method == "compressed-tensors":
        block = scheme.block or {"channel": (1, in_f), "tensor": (out_f, in_f)}[scheme.strategy]
        scale = stored["weight_scale"].float().reshape(-(-out_f // block[0]), -(-in_f // block[1]))
        return dequantize_fp8(stored["weight"], scale, block)
    if scheme.method == "awq":
        g_idx = torch.arange(in_f) // (in_f if scheme.group_size == -1 else scheme.group_size)
        return dequantize(unpack_awq(stored["qweight"]), unpack_awq(stored["qzeros"]), stored["scales"], g_idx)
    return dequantize(unpack_gptq(stored["qweight"], scheme.bits, 0), unpack_gptq(stored["qzeros"], scheme.bits, 1) + 1,
                      stored["scales"], stored["g_idx"])


@pytest.mark.parametrize("case", DUMMY_CASES)
def test_dummy_weights_of_a_quantized_config_are_a_checkpoint_of_its_format(quantized, hf_model, tmp_path: Path,
                                                                            case: str) -> None:
    """load_format 'dummy' on a pre-quantized config.json draws packed tensors of its format (to measure the kernels
    without the checkpoint): written to a file they are a checkpoint that loads to the same tokens, and unpacked by
    this file's own code they are weights transformers gives the same tokens on."""
    arch, scheme = DUMMY_CASES[case]
    packed, _ = quantized(arch, scheme)
    cfg = load_model_config(packed)
    assert cfg.quantization is not None
    drawn = {name: t[:] for name, t in dummy_weights(
        cfg, torch.float32, "cpu", 5, functools.partial(dummy_linear_tensors, cfg.quantization, "cpu", 5))}
    config = json.loads((packed / "config.json").read_text())
    oracle = dict(drawn)
    for layer in range(cfg.num_layers):
        for name in LINEARS:
            key = f"model.layers.{layer}.{name}"
            stored = {k.removeprefix(key + "."): oracle.pop(k) for k in list(oracle) if k.startswith(key + ".")}
            out_f = stored["scales"].shape[1] if "scales" in stored else stored["weight"].shape[0]
            in_f = (stored["weight"].shape[1] if "weight" in stored
                    else stored["qweight"].shape[0] * (1 if scheme.method == "awq" else 32 // scheme.bits))
            oracle[f"{key}.weight"] = unpack_linear(stored, scheme, out_f, in_f)
    for out, tensors, cfg_json in ((tmp_path / "ckpt", drawn, config),
                                   (tmp_path / "oracle", oracle, {k: v for k, v in config.items()
                                                                  if k != "quantization_config"})):
        shutil.copytree(packed, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg_json))
    prompts = mixed_prompts(3, seed=13)
    with LLM(str(packed), dtype="float32", load_format="dummy", seed=5) as llm:
        assert_greedy_parity(llm, hf_model(tmp_path / "oracle"), prompts, w8a8=scheme.activation_group)
    with LLM(str(tmp_path / "ckpt"), dtype="float32") as llm:
        assert_greedy_parity(llm, hf_model(tmp_path / "oracle"), prompts, w8a8=scheme.activation_group)


def test_two_ranks_draw_the_dummy_quantized_weights_one_does(quantized) -> None:
    packed, _ = quantized(*GPTQ_CASES["gptq4-sym"])
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(3, seed=14)]
    outs = {}
    for size in (1, 2):
        with LLM(str(packed), dtype="float32", load_format="dummy", tensor_parallel_size=size) as llm:
            outs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
    assert outs[1] == outs[2]


def test_fused_projections_with_different_g_idx_are_refused(quantized, tmp_path: Path) -> None:
    packed, _ = quantized("qwen3", GPTQ_CASES["gptq4-asym-act-order"][1])
    shutil.copytree(packed, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="must share one g_idx"):
        LLM(str(tmp_path / "m"), dtype="float32")
