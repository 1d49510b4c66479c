"""Which proposer a speculative engine uses, behind one small interface."""

from __future__ import annotations

from typing import Protocol

import torch

from governor.engine.config import SpeculativeConfig
from governor.engine.scheduler import ScheduledSeq
from governor.engine.sequence import Sequence
from governor.engine.spec.ngram import propose_ngram


class Proposer(Protocol):
    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to `s.num_spec` draft tokens per scheduled decode, with the draft distributions [k, V]
        when the proposer has them (None: a deterministic proposal, q one-hot)."""
        ...

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None: ...

    def release(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup over the request's own prompt and output; needs no model and no state."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(propose_ngram(s.seq.token_ids(0, s.seq.num_tokens), s.num_spec, self.min_n, self.max_n), None)
                for s in scheduled]

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
