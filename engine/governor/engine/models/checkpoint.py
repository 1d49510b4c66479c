"""Reading a local Hugging Face checkpoint: safetensors (single or sharded) and content digests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

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
                                "only safetensors checkpoints are supported")
    return files


def iter_weights(model_dir: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the checkpoint, one shard open at a time."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def model_digest(model_dir: str | Path) -> str:
    """Digest of the weights' contents and config.json: the model's identity."""
    model_dir = Path(model_dir)
    return _digest([model_dir / "config.json", *weight_files(model_dir)])


def tokenizer_digest(tokenizer_dir: str | Path) -> str:
    """Digest of the tokenizer files' contents (chat template included)."""
    tokenizer_dir = Path(tokenizer_dir)
    return _digest([tokenizer_dir / f for f in TOKENIZER_FILES if (tokenizer_dir / f).exists()])
