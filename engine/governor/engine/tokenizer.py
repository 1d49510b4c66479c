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


def decode_batch(tokenizer: Any, id_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`[tokenizer.decode(ids, skip_special_tokens=...) for ids in id_lists]`, in one call where that is the same.

    A plain fast tokenizer (its class keeps PreTrainedTokenizerFast's `decode` and `_decode`) that does not clean up
    tokenization spaces decodes each list with its Rust tokenizer and nothing else; `decode_batch` of that tokenizer
    gives the same strings, on several threads, and skips transformers' per-token type check of each list (most of
    the time of 256 decodes of 1,024 tokens on an H200's host: docs/benchmarks.md, issue 9, ninth pass). Any other
    tokenizer decodes one list at a time through `decode`."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
             and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces)
    if plain and len(id_lists) > 1:
        return list(tokenizer.backend_tokenizer.decode_batch(id_lists, skip_special_tokens=skip_special_tokens))
    return [str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)) for ids in id_lists]
