"""Which proposer a speculative engine uses, behind one small interface."""

from __future__ import annotations

from typing import Protocol

import torch

from governor.engine.config import SpeculativeConfig
from governor.engine.scheduler import ScheduledSeq
from governor.engine.sequence import Sequence
from governor.engine.spec.ngram import NgramIndex


class Proposer(Protocol):
    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to `s.num_spec` draft tokens per scheduled decode, with the draft distributions [k, V]
        when the proposer has them (None: a deterministic proposal, q one-hot)."""
        ...

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None: ...

    def release(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup over the request's own prompt and output, through an `NgramIndex` per sequence that takes each
    token once (a proposal costs O(prompt_lookup_max), not a search of the context)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}  # by request id, until `release`

    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(self._propose(s.seq, s.num_spec), None) for s in scheduled]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        index = self.indexes.get(seq.request_id)
        if index is None or index.length > seq.num_tokens:  # new (or, were it ever to shrink, rebuilt)
            index = self.indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(seq.token_ids(index.length, seq.num_tokens))
        end = index.match()
        if k == 0 or end is None:
            return []
        return seq.token_ids(end + 1, min(end + 1 + k, seq.num_tokens))

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.request_id, None)
