"""Incremental detokenization: text deltas for streamed tokens without re-decoding the whole output."""

from __future__ import annotations

from typing import Any

from governor.engine.tokenizer import decoder

# Tokens of left context decoded with each delta, so tokenizers that merge a leading space into the
# next piece (sentencepiece) render the boundary the same way a full decode does.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Accumulates `text` as tokens arrive; `add(token)` returns the newly completed characters.

    A token that ends inside a multi-byte character yields "" until the character completes.
    Invariant: `text` equals the decode of all added tokens, up to characters still incomplete.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = decoder(tokenizer)
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta
