"""What the load generator sends and when: random-word prompts, output lengths, Poisson arrivals.

Pure and deterministic from a seed. Request i's prompt and lengths come from their own RNG stream, so
they are the same whatever the rate, the concurrency or how many requests precede it; arrivals come
from a separate stream, so changing the rate never changes the prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

# Common English words that BPE tokenizers (Llama, Qwen, GPT) keep whole after a space, so a prompt of
# n words is about n tokens (at most ~2n on small vocabularies). The server's own count is reported.
_WORD_TEXT = """
the of and to in is was for on are with as be at by this had not but from or have an they which one
you were her all she there would their we him been has when who will more no if out so said what up its
about into than them can only other new some could time these two may then do first any my now such like
our over man me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three states himself few house use during
without again place around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end why called
eyes find going look asked later knew point next city program give group toward young days let room
president side social given present several order national possible rather second face per among form
important often things looked early white case john become large big need four within felt along children
saw best church ever least power development light thing family interest want members mind country area
others done turned although open god service certain kind problem began different door thus help sense means
whole matter perhaps itself york times law human line above name example action company hands local show
whether five history gave today either act feet across taken past quite anything seen having death week
experience body word half really field am car words already themselves information tell together college
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def parse_range(text: str) -> tuple[int, int]:
    """'100:1024' → (100, 1024); '128' → (128, 128)."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"a length range must be 'a:b' or 'n' with integers, got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"a length range must be 'a:b' with 1 <= a <= b, got {text!r}")
    return a, b


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its index in the workload, prompt text and output budget."""

    index: int
    prompt: str
    prompt_words: int  # words in the prompt including any shared prefix; the client's length estimate
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """Random-word prompts of `input_len` words (uniform in [a, b]) after an optional `shared_prefix_len`-word
    prefix common to every prompt (as vLLM's random dataset: total = prefix + input), and `output_len`
    output tokens (uniform in [a, b]). Request i is the same for a given seed whatever else changes."""

    input_len: tuple[int, int]
    output_len: tuple[int, int]
    shared_prefix_len: int = 0
    seed: int = 0

    def prefix(self) -> list[str]:
        """The shared prefix words (empty when `shared_prefix_len` is 0)."""
        rng = random.Random(f"{self.seed}:prefix")
        return rng.choices(WORDS, k=self.shared_prefix_len)

    def request(self, index: int, prefix: list[str] | None = None) -> RequestSpec:
        """Request `index` of the workload; pass `prefix()` when building many to avoid recomputing it."""
        rng = random.Random(f"{self.seed}:request:{index}")
        words = (self.prefix() if prefix is None else prefix) + rng.choices(WORDS, k=rng.randint(*self.input_len))
        return RequestSpec(index, " ".join(words), len(words), rng.randint(*self.output_len))

    def requests(self, count: int) -> Iterator[RequestSpec]:
        """The first `count` requests, built lazily (a long --duration run need not hold them all)."""
        prefix = self.prefix()
        for i in range(count):
            yield self.request(i, prefix)


def arrival_offsets(count: int, rate: float, seed: int = 0) -> Iterator[float]:
    """Send times in seconds from the start for `count` requests: a Poisson process of `rate` requests/s
    (exponential gaps, the first request at 0), or all at 0 when the rate is infinite."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 requests/s (or inf), got {rate}")
    rng = random.Random(f"{seed}:arrivals")
    t = 0.0
    for i in range(count):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        yield t
