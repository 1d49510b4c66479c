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
