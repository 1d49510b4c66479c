"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from governor.engine.logits_processing import LogitsProcessor
from governor.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request: its tokens, its KV blocks and how far its KV has been computed.

    Invariant: `num_computed_tokens <= num_tokens`, and the sequence's block table holds exactly
    ceil(num_computed_tokens / block_size) blocks after each step (more only while a step is in flight).
    With async scheduling, between steps a sequence may have `num_computed_tokens == num_tokens`: a step
    in flight computes the KV of its next token, which the host does not know yet; and within a step,
    one more, until that token is appended (`LLMEngine._complete`).
    """

    request_id: str
    arrival: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    # Per generated token: {token_id: logprob} for the chosen token and the top-n alternatives.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_at: float | None = None  # time.monotonic() when first scheduled (end of queueing)
    # Prefix caching: the hash chain's seed (identity + cache salt), hashes of the full blocks of the
    # known tokens, and how many leading blocks of block_table are registered in the prefix index.
    cache_seed: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Parallel sampling (n > 1): the sibling whose prompt KV this sequence starts from, until it is admitted.
    prompt_source: Sequence | None = None
    # What its sampling parameters do to its logits before sampling; None when nothing (most requests).
    logits_processor: LogitsProcessor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when exactly the last sampled token still needs its KV (a decode step)."""
        return self.num_uncomputed_tokens == 1 and bool(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (a decode reads one)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
