"""One request's position in its grammar: which tokens may come next, and advancing by the token sampled."""

from __future__ import annotations

from typing import Any

import torch


class GrammarState:
    """Wraps an xgrammar GrammarMatcher. Invariant: once `is_terminated()`, the only token a mask allows is a stop
    token, and `accept` refuses every token."""

    def __init__(self, matcher: Any, stop_row: torch.Tensor) -> None:
        self._matcher = matcher
        self._stop_row = stop_row  # the mask row that allows the stop tokens alone

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 [rows, ceil(vocab / 32)] on CPU, bit set = allowed;
        tokens past the tokenizer's vocabulary and special tokens other than the stop tokens are never allowed)."""
        if self._matcher.is_terminated():
            # The matcher has no next-token mask once it accepted a stop token; a caller a step behind gets one.
            bitmask[row].copy_(self._stop_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it here."""
        return bool(self._matcher.accept_token(token))

    def is_terminated(self) -> bool:
        """The output is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


_batch_matcher: Any = None  # xgrammar's BatchGrammarMatcher, made at the first batch fill


def fill_masks(states: list[GrammarState], bitmask: torch.Tensor) -> None:
    """Row j of `bitmask` for states[j], as `states[j].fill_mask(bitmask, j)` writes it, the rows of live grammars
    filled together by xgrammar's batch matcher on several threads (it releases the GIL): at 64 requests this is the
    host's largest cost of a structured step."""
    global _batch_matcher
    live = []
    for j, state in enumerate(states):
        if state._matcher.is_terminated():
            bitmask[j].copy_(state._stop_row)
        else:
            live.append(j)
    if len(live) == 1:
        states[live[0]].fill_mask(bitmask, live[0])
    elif live:
        if _batch_matcher is None:
            import xgrammar

            _batch_matcher = xgrammar.BatchGrammarMatcher()
        _batch_matcher.batch_fill_next_token_bitmask([states[j]._matcher for j in live], bitmask, live)
