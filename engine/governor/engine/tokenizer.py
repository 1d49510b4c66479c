"""Loading the checkpoint's own tokenizer (tokenizer.json / tokenizer_config.json, chat template)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# Words whose BPE split a fast tokenizer remembers. Its own default is 10,000, kept for the life of the process and
# never evicted: a server whose prompts keep bringing words it has not seen grows by a few hundred bytes a word until
# then (about 4 MB, ~1.4 KB a request for prompts with a few new words each), which reads as a leak for the first
# thousands of requests. The words met first, the common ones, keep their cached splits.
WORD_CACHE_CAPACITY = 1024


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face fast tokenizer read from local files only; nothing is downloaded. Its word cache holds at
    most `WORD_CACHE_CAPACITY` words."""
    from transformers import AutoTokenizer  # heavy import, needed only when an engine starts

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    bound_word_cache(tokenizer, WORD_CACHE_CAPACITY)
    return tokenizer


def bound_word_cache(tokenizer: Any, capacity: int) -> bool:
    """Cap the word cache of a fast tokenizer's model (BPE, Unigram) at `capacity` words; False when it has none
    to cap (a slow tokenizer, a model without a cache, or a `tokenizers` release without `_resize_cache`)."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    resize = getattr(model, "_resize_cache", None)
    if resize is None:
        return False
    resize(capacity)
    return True


def decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`(ids, skip_special_tokens) -> tokenizer.decode(ids, skip_special_tokens=...)`, the same strings.

    For a plain fast tokenizer (its class keeps PreTrainedTokenizerFast's `decode` and `_decode`) that does not clean
    up tokenization spaces, `decode` is its Rust tokenizer's `decode` and nothing else, so that is called directly:
    it skips transformers' check of each id's type, most of the host's time when 256 requests of 1,024 tokens end
    (docs/design/step-pipeline.md), and a few microseconds of each streamed token's incremental decode.
    Any other tokenizer goes through `decode`."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer.backend_tokenizer

        def rust(ids: list[int], skip_special_tokens: bool) -> str:
            return str(backend.decode(ids, skip_special_tokens=skip_special_tokens))

        return rust

    def python(ids: list[int], skip_special_tokens: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    return python
