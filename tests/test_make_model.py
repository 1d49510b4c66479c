"""`governor make-model`: random-weight checkpoints that transformers loads as real ones.

transformers is the oracle: if it reads our config, finds exactly the tensors it expects and runs
a forward, the engine's loader sees a checkpoint shaped like a downloaded one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from governor.engine.models import tokenizer_builder as tb
from governor.engine.models.make_model import ARCHS, PRESETS, make_model, preset_config, tensor_shapes
from governor.engine.models.model_config import load_model_config

transformers = pytest.importorskip("transformers")


def _tensor_shapes_on_disk(model_dir: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch, "tiny", dtype="float32", seed=0) for arch in ARCHS}


# --- transformers loads what we write --------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_tiny_model_with_exactly_the_expected_tensors(
        tiny_models: dict[str, Path], arch: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_models[arch], dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert _tensor_shapes_on_disk(tiny_models[arch]) == expected

    logits = model(torch.tensor([[tb.BOS_ID, 10, 20, 30]])).logits
    assert logits.shape == (1, 4, 2048)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama3.2-1b", "llama3-8b", "llama3-70b"])
def test_big_preset_tensor_shapes_match_transformers_model(arch: str, preset: str) -> None:
    # Built on the meta device: real shapes, no memory, no weights written.
    config = preset_config(arch, preset, tb.VOCAB_SIZE)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    assert tensor_shapes(config) == expected


def test_family_specific_tensors(tiny_models: dict[str, Path]) -> None:
    llama, qwen2, qwen3 = (_tensor_shapes_on_disk(tiny_models[a]) for a in ("llama", "qwen2", "qwen3"))
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert "model.layers.0.self_attn.q_proj.bias" not in llama | qwen3
    assert qwen3["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert qwen3["model.layers.1.self_attn.k_norm.weight"] == (16,)
    # tiny: llama untied, qwen tied, so both code paths get a checkpoint.
    assert llama["lm_head.weight"] == (2048, 64)
    assert "lm_head.weight" not in qwen2 | qwen3


def test_weight_values_follow_the_init_recipe(tiny_models: dict[str, Path]) -> None:
    with safe_open(str(tiny_models["qwen3"] / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").eq(1).all()
        assert f.get_tensor("model.norm.weight").eq(1).all()
        assert f.metadata() == {"format": "pt"}
    assert embed.dtype == torch.float32
    assert embed.std().item() == pytest.approx(0.02, rel=0.05)


# --- config.json -----------------------------------------------------------------------------------

def test_llama3_rope_scaling_is_read_back_by_transformers() -> None:
    config = transformers.AutoConfig.for_model(**preset_config("llama", "llama3-8b", tb.VOCAB_SIZE))
    assert config.rope_parameters == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_tiny_config_is_read_back_by_transformers(tiny_models: dict[str, Path]) -> None:
    config = transformers.AutoConfig.from_pretrained(tiny_models["qwen3"])
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (16, 2, 2048)
    assert config.dtype == torch.float32
    assert config.eos_token_id == tb.EOS_ID


def test_qwen3_0_6b_config_numbers() -> None:
    config = preset_config("qwen3", "qwen3-0.6b", tb.VOCAB_SIZE)
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta", "max_position_embeddings",
                                   "rms_norm_eps", "attention_bias")} == {
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1e6, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "attention_bias": False}
    assert config["rope_scaling"] is None


def test_llama3_8b_config_numbers() -> None:
    config = preset_config("llama", "llama3-8b", tb.VOCAB_SIZE, dtype="bfloat16")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta", "max_position_embeddings",
                                   "rms_norm_eps", "dtype")} == {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "dtype": "bfloat16"}
    assert config["rope_scaling"]["rope_type"] == "llama3"
    # The llama3 RoPE belongs to the llama family; other archs at this preset keep plain RoPE.
    assert preset_config("qwen3", "llama3-8b", tb.VOCAB_SIZE)["rope_scaling"] is None


def test_llama3_70b_config_numbers() -> None:
    config = preset_config("llama", "llama3-70b", tb.VOCAB_SIZE, dtype="bfloat16")
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta", "max_position_embeddings")} == {
        "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "max_position_embeddings": 131072}
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    params = sum(math.prod(shape) for shape in tensor_shapes(config).values())
    assert 70.5e9 < params < 70.6e9  # Llama 3 70B: 70.55 B parameters


def test_a_config_only_directory_has_config_and_tokenizer_but_no_weights(tmp_path: Path) -> None:
    make_model(tmp_path, "llama", "tiny", dtype="float32")
    make_model(tmp_path, "llama", "llama3-70b", weights=False)  # replaces the tiny model's weights too
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 80
    assert (tmp_path / "tokenizer.json").exists()
    assert not list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize(("quantization", "bits"), [("awq", 4), ("gptq", 4), ("fp8", 8)])
def test_a_config_only_directory_can_name_a_quantized_format(tmp_path: Path, quantization: str, bits: int) -> None:
    """The 8B shape's config.json with a pre-quantized format the engine reads (load_format 'dummy' draws its packed
    tensors); dense weights with a quantized config.json are refused."""
    make_model(tmp_path, "llama", "llama3-8b", weights=False, quantization=quantization)
    quant = load_model_config(tmp_path).quantization
    assert quant is not None and (quant.method, quant.bits) == (quantization, bits)
    if quantization == "fp8":
        assert quant.block_size == (128, 128)
    else:
        assert quant.group_size == 128
    with pytest.raises(ValueError, match="config-only directory"):
        make_model(tmp_path / "w", "llama", "tiny", quantization=quantization)
    with pytest.raises(ValueError, match="make-model writes one of awq, gptq, fp8"):
        make_model(tmp_path / "w", "llama", "tiny", weights=False, quantization="int3")


def test_small_presets_round_the_tokenizer_vocab_up_to_64() -> None:
    assert preset_config("llama", "small", 2000)["vocab_size"] == 2048
    assert preset_config("llama", "tiny", 2048)["vocab_size"] == 2048
    assert preset_config("llama", "tiny", 2049)["vocab_size"] == 2112


def test_tie_word_embeddings_by_arch_at_small_presets() -> None:
    assert [preset_config(a, "small", 2000)["tie_word_embeddings"] for a in ARCHS] == [False, True, True]


def test_generation_config_stops_at_end_of_text_and_im_end(tiny_models: dict[str, Path]) -> None:
    gen = json.loads((tiny_models["llama"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tb.EOS_ID, tb.IM_END_ID]
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tb.BOS_ID, tb.EOS_ID)


# --- determinism and sharding ----------------------------------------------------------------------

def test_same_seed_writes_identical_files(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", "qwen2", "tiny", dtype="bfloat16", seed=7)
    b = make_model(tmp_path / "b", "qwen2", "tiny", dtype="bfloat16", seed=7)
    c = make_model(tmp_path / "c", "qwen2", "tiny", dtype="bfloat16", seed=8)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for path in a.iterdir():
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_sharded_checkpoint_has_valid_index_and_same_logits(tmp_path: Path) -> None:
    whole = make_model(tmp_path / "whole", "llama", "tiny", dtype="float32")
    sharded = make_model(tmp_path / "sharded", "llama", "tiny", dtype="float32", max_shard_bytes=200_000)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    on_disk = _tensor_shapes_on_disk(sharded)
    assert set(index["weight_map"]) == set(on_disk)
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in on_disk.values())

    ids = torch.tensor([[tb.BOS_ID, 5, 500, 1500]])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        sharded, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    reference = transformers.AutoModelForCausalLM.from_pretrained(whole, dtype=torch.float32)
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_rewriting_a_directory_removes_stale_shards(tmp_path: Path) -> None:
    make_model(tmp_path, "qwen3", "tiny", max_shard_bytes=50_000)
    make_model(tmp_path, "qwen3", "tiny")
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


# --- argument errors -------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "allowed"), [
    ({"arch": "mistral"}, ", ".join(ARCHS)),
    ({"preset": "huge"}, ", ".join(PRESETS)),
    ({"dtype": "int8"}, "float32, bfloat16, float16"),
])
def test_bad_arguments_raise_value_error_naming_allowed_values(
        tmp_path: Path, kwargs: dict[str, str], allowed: str) -> None:
    args = {"arch": "llama", "preset": "tiny", "dtype": "bfloat16", **kwargs}
    with pytest.raises(ValueError, match=allowed):
        make_model(tmp_path, args["arch"], args["preset"], dtype=args["dtype"])
    assert not any(tmp_path.iterdir())


# --- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_size_and_special_token_ids(tiny_models: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])
    assert len(tokenizer) == tb.VOCAB_SIZE == 2000
    assert tokenizer.convert_tokens_to_ids(list(tb.SPECIAL_TOKENS)) == [1995, 1996, 1997, 1998, 1999]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1995, 1996, 1999)


def test_tokenizer_training_is_deterministic() -> None:
    # Each training uses fresh hash seeds inside `tokenizers`, so equal output means a stable order.
    assert tb._trained_json.__wrapped__() == tb._trained_json()


def test_common_words_are_single_tokens() -> None:
    tokenizer = tb.build_tokenizer()
    encoding = tokenizer.encode("The model would answer the question about the world", add_special_tokens=False)
    assert encoding.tokens == ["The", "Ġmodel", "Ġwould", "Ġanswer", "Ġthe", "Ġquestion", "Ġabout", "Ġthe",
                               "Ġworld"]


def test_encoding_prepends_bos_once() -> None:
    ids = tb.build_tokenizer().encode("hello").ids
    assert ids[0] == tb.BOS_ID
    assert tb.BOS_ID not in ids[1:]


_TOKENIZER = tb.build_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_string_round_trips(text: str) -> None:
    # Special-token text (e.g. "<|im_end|>") encodes to its special id and decodes back when kept.
    ids = _TOKENIZER.encode(text, add_special_tokens=False).ids
    assert _TOKENIZER.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", ["", " ", "  two  spaces ,then . punct", "tab\tnew\nline\r\n",
                                  "naïve café 你好 🙂 \u200b\U0010ffff", "<|im_start|>user\nhi<|im_end|>"])
def test_transformers_tokenizer_round_trips(tiny_models: dict[str, Path], text: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(tiny_models: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
                      "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == prompt.removesuffix("<|im_start|>assistant\n")


def test_chat_template_accepts_text_parts_and_rejects_unknown_roles(tiny_models: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == \
        "<|begin_of_text|><|im_start|>user\nab<|im_end|>\n"
    with pytest.raises(Exception, match="role must be system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenized_chat_prompt_has_one_bos(tiny_models: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert ids[:2] == [tb.BOS_ID, tb.IM_START_ID]
    assert ids.count(tb.BOS_ID) == 1
