"""Prompt intake off the event loop: tokenizing text, rendering chat templates, decoding token texts.

Every call runs on a small thread pool, so a request of any size never stalls `/health`, other streams or the
step thread's hand-offs: Hugging Face fast tokenizers release the GIL while they encode, so even a tokenization
of megabytes leaves the event loop free (docs/performance/server.md has the measured bound).

A text far longer than the model can take is refused without tokenizing it whole, in one of two ways:
- by length alone: every token covers at most `longest_token` characters of text, so a text of more than
  `2 * longest_token * max_model_len` characters has more than max_model_len tokens (the 2 is margin for
  normalization composing characters, e.g. NFC);
- by a probe of its head: a text of more than `PROBE_CHARS_PER_TOKEN * max_model_len` characters whose head, cut
  before a whitespace, already holds more than `max_model_len` tokens is longer than the model's context whatever
  follows. Cut before a whitespace, the head's pre-tokens (words, for the byte-level BPE and SentencePiece
  tokenizers of the models served) are those of the whole text up to the cut, so the head cannot have more tokens
  than that part of the whole text (`_CUT_SLACK` is margin). A head without whitespace is cut where it ends and
  must hold twice max_model_len tokens (a cut inside a word changes only the merges near it).
So refusing a 50 MB prompt costs about what a prompt of the model's context costs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

PROBE_CHARS_PER_TOKEN = 8
_CUT_SLACK = 4


class PromptTooLong(ValueError):
    """A prompt with more tokens than max_model_len."""


class PromptEncoder:
    """The server's tokenizer, used only from its own threads."""

    def __init__(self, tokenizer: Any, max_model_len: int, workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.longest_token = max(len(str(t)) for t in tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
        self._pool = ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1),
                                        thread_name_prefix="governor-prompts")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._count: Callable[[str, bool], int]
        if backend is not None:  # length of the Rust encoding, without building a Python list of its ids
            self._count = lambda text, special: len(backend.encode_batch([text], add_special_tokens=special)[0])
        else:
            self._count = lambda text, special: len(tokenizer.encode(text, add_special_tokens=special))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; PromptTooLong when they cannot fit max_model_len."""
        return await self.run(self.encode_sync, text, add_special_tokens)

    def encode_sync(self, text: str, add_special_tokens: bool = True) -> list[int]:
        mml = self.max_model_len
        if len(text) > 2 * self.longest_token * mml:
            raise PromptTooLong(f"the prompt ({len(text)} characters) has more than {mml} tokens (no token of this "
                                f"tokenizer is longer than {self.longest_token} characters): it cannot fit "
                                f"max_model_len={mml}")
        probe = PROBE_CHARS_PER_TOKEN * mml
        if len(text) > probe:
            cut = max(text.rfind(c, probe // 2, probe) for c in " \n\t")
            limit = mml + _CUT_SLACK if cut > 0 else 2 * mml
            cut = cut if cut > 0 else probe
            n = self._count(text[:cut], add_special_tokens)
            if n > limit:
                raise PromptTooLong(f"the prompt ({len(text)} characters) has more than {mml} tokens (its first "
                                    f"{cut} characters alone are {n} tokens): it cannot fit max_model_len={mml}")
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if len(ids) > self.max_model_len:
            raise PromptTooLong(f"the prompt ({len(ids)} tokens) cannot fit max_model_len={self.max_model_len}")
        return ids

    async def render_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The chat template applied to `messages` (jinja errors propagate: they are the caller's input problem)."""
        return await self.run(self._render, messages, template_kwargs)

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's own text (a logprobs entry's `token`)."""
        return [str(self.tokenizer.decode([t])) for t in ids]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
