"""Reading a local Hugging Face checkpoint: safetensors (single or sharded) and content digests."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from governor.engine.models.make_model import hf_tensor_shapes, init_tensor
from governor.engine.models.model_config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: from model.safetensors.index.json, else *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}; "
                                "only safetensors checkpoints are supported (load_format 'dummy' runs random "
                                "weights of config.json's shapes instead)")
    return files


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: its shape, and indexing reads only the part asked for (a
    tensor-parallel rank reads just its shard). Valid until the iterator that yielded it moves on."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def read_share(tensor: LazyTensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Share `rank` of `size` equal shares of `tensor` along `dim` (the caller checks that `size` divides it): what a
    tensor-parallel rank reads of a split checkpoint tensor, and nothing more."""
    step = tensor.get_shape()[dim] // size
    return tensor[(slice(None),) * dim + (slice(rank * step, (rank + 1) * step),)]


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, LazyTensor]]:
    """Yield (name, lazy tensor) for every tensor in the checkpoint, one shard file open at a time."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


class _InMemory:
    """A LazyTensor over a tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


# A decoder layer's linear weight, as Hugging Face names it: what a pre-quantized checkpoint stores packed.
DECODER_LINEAR = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.weight$")

# Stands in for a decoder linear's weight: (its name less ".weight", out features, in features) -> the tensors a
# checkpoint stores for it instead, by their names.
LinearTensors = Callable[[str, int, int], Iterator[tuple[str, torch.Tensor]]]


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int,
                  linear: LinearTensors | None = None) -> Iterator[tuple[str, LazyTensor]]:
    """Random weights with the checkpoint's tensor names and shapes, one tensor at a time, drawn by
    `governor make-model`'s recipe (N(0, 0.02), norms 1): the same seed on the same device type gives
    the values `make-model --seed` writes, and every tensor-parallel size sees the same full tensors.
    `linear` draws each decoder linear's tensors instead (a pre-quantized checkpoint's packed ones)."""
    shapes = hf_tensor_shapes(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                              intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                              num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm,
                              tie_word_embeddings=cfg.tie_word_embeddings)
    for name, shape in shapes.items():
        match = DECODER_LINEAR.match(name)
        if linear is not None and match is not None:
            for stored, tensor in linear(match.group(1), *shape):
                yield stored, _InMemory(tensor)
        else:
            yield name, _InMemory(init_tensor(name, shape, dtype, str(device), seed))


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def model_digest(model_dir: str | Path, dummy_seed: int | None = None) -> str:
    """Digest of the weights' contents and config.json: the model's identity. With `dummy_seed` (load
    format "dummy") the weights are drawn from that seed instead of read, so the seed stands in for them."""
    model_dir = Path(model_dir)
    if dummy_seed is not None:
        h = hashlib.sha256(f"dummy-weights:{dummy_seed}\0".encode())
        h.update((model_dir / "config.json").read_bytes())
        return "sha256:" + h.hexdigest()
    return _digest([model_dir / "config.json", *weight_files(model_dir)])


def tokenizer_digest(tokenizer_dir: str | Path) -> str:
    """Digest of the tokenizer files' contents (chat template included)."""
    tokenizer_dir = Path(tokenizer_dir)
    return _digest([tokenizer_dir / f for f in TOKENIZER_FILES if (tokenizer_dir / f).exists()])
