"""Loading the checkpoint's own tokenizer (tokenizer.json / tokenizer_config.json, chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face fast tokenizer read from local files only; nothing is downloaded."""
    from transformers import AutoTokenizer  # heavy import, needed only when an engine starts

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
