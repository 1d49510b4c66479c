"""The engine's grammar compiler: the tokenizer as xgrammar sees it, and compiled grammars cached by content."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from governor.engine.sampling_params import StructuredOutputsParams
from governor.engine.structured.bitmask import bitmask_row
from governor.engine.structured.grammar_state import GrammarState
from governor.engine.structured.languages import JSON_KINDS, LanguageKey, compile_language, language_key

# Compiled grammars kept (least recently used go first). A typical JSON schema compiles to about 0.25 MB at a 128k
# vocabulary, so a full cache holds tens of megabytes of host memory.
CACHE_ENTRIES = 256


class StructuredOutputs:
    """Compiles requests' structured-output params into grammars and hands out matchers. One per engine.

    `vocab_size` is the model's (the logits' width); ids from the tokenizer's length up to it are never allowed.
    The output may end with a stop token, by default the tokenizer's EOS, once the structure is complete.
    Thread-safe: `compile` runs in a thread pool and on the engine's step thread; one compile per content.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None) -> None:
        import xgrammar  # here, not at import: an engine without structured requests starts without it

        self._xgr = xgrammar
        stops = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
        if not stops or any(s is None or not 0 <= s < vocab_size for s in stops):
            raise ValueError(f"structured outputs need stop token ids in [0, {vocab_size}), got {stops}: pass "
                             "stop_token_ids (the default, the tokenizer's eos_token_id, is missing or out of range)")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        any_info, json_info = _tokenizer_infos(xgrammar, tokenizer, vocab_size, stops)
        # Our cache holds the grammars (keyed by content, bounded); xgrammar's own would be a second copy.
        self._compilers = {"any": xgrammar.GrammarCompiler(any_info, cache_enabled=False),
                           "json": xgrammar.GrammarCompiler(json_info, cache_enabled=False)}
        self._stop_row = bitmask_row(stops, vocab_size)
        self._lock = threading.Lock()
        # Invariant: a key maps to one Future, set once by the thread that compiles it; failed compiles are dropped.
        self._cache: OrderedDict[LanguageKey, Future[Any]] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for `params`, the same object for the same content while cached.

        ValueError naming the problem for an invalid schema, regex or grammar."""
        key = language_key(params)
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                future = self._cache[key] = Future()
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                compiler = self._compilers["json" if key[0] in JSON_KINDS else "any"]
                future.set_result(compile_language(compiler, key))
            except BaseException as e:
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]
                future.set_exception(e)
                raise
        return future.result()

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh GrammarState at the start of `params`' language (compiling it unless cached)."""
        return GrammarState(self._xgr.GrammarMatcher(self.compile(params)), self._stop_row)


def _tokenizer_infos(xgrammar: Any, tokenizer: Any, vocab_size: int, stops: list[int]) -> tuple[Any, Any]:
    """xgrammar's views of the vocabulary, for any language and for JSON: tokens a view never allows are left empty.

    Neither allows special tokens other than the stops: xgrammar reads an added token such as <|im_end|> as its
    literal text, so a JSON string could contain it. The JSON view also never allows a token holding a control
    character (U+0000-U+001F): JSON text without free whitespace has none, but xgrammar's grammar for a string with
    minLength/maxLength admits them raw, which makes invalid JSON."""
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    control = {i for i, text in enumerate(detected.decoded_vocab) if any(b < 0x20 for b in text)}
    vocab = tokenizer.get_vocab()

    def view(never: set[int]) -> Any:
        encoded = [""] * vocab_size
        for text, idx in vocab.items():
            if idx < vocab_size and (idx not in never or idx in stops):
                encoded[idx] = text
        return xgrammar.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                                      add_prefix_space=detected.add_prefix_space)

    return view(special), view(special | control)
