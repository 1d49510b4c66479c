"""What the engine keeps for a live request beside its Sequence: the stop conditions fixed at admission, its
grammar, the text handed out so far, and the final RequestOutput built from them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from governor.engine.detokenizer import IncrementalDetokenizer
from governor.engine.outputs import CompletionOutput, RequestOutput
from governor.engine.sequence import Sequence

if TYPE_CHECKING:
    from governor.engine.structured import GrammarState

log = logging.getLogger("governor.engine")


@dataclass
class RequestState:
    seq: Sequence
    prompt: str | None
    arrival: float  # time.monotonic() at add_request
    # From the sampling parameters, once, for the per-token stop checks:
    stop_ids: frozenset[int]  # token ids that end it: its stop_token_ids, and EOS unless ignore_eos
    stop_strings: list[str]
    max_output: int  # output tokens at which it ends with "length": max_tokens, or what max_model_len leaves
    argmax_only: bool  # greedy without logprobs or logits processing (sampler.argmax_only)
    # Kept when it streams text, has stop strings, or has a grammar and keeps special tokens in its text.
    detok: IncrementalDetokenizer | None = None
    emitted: int = 0  # characters of detok.text already handed out as deltas
    final_text: str | None = None
    # Before min_tokens output tokens, neither its stop_ids nor its stop strings end it (nor does the text of
    # those first tokens hold a stop string later); the sampler masks the stop_ids meanwhile.
    min_tokens: int = 0
    include_stop_str: bool = False  # a stop string that ends it stays in the text
    grammar: GrammarState | None = None  # its structured-output matcher (also its LogitsProcessor's)
    # Characters of detok.text already searched for stop strings (the text of its first min_tokens tokens counts
    # as searched): a stop string found later must end after them.
    stop_searched: int = 0

    def append(self, token: int, lp: dict[int, float] | None) -> str | None:
        """Append a new token: advance the grammar and the text, then check the stop conditions; the finish
        reason when the request ends with this token, else None."""
        seq = self.seq
        seq.output_token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        if self.grammar is not None:
            reason = self._advance_grammar(token)
            if reason is not None:
                return reason
        if self.detok is not None:
            self.detok.add(token)
        return self.check_stop(token)

    def _advance_grammar(self, token: int) -> str | None:
        """The finish reason once the grammar has taken `token`: "stop" when it ends the grammar (that end token,
        EOS, stays out of the text, as a stop token does), "abort" when the grammar refuses it (the mask should
        have: a defect, not the client's), else None."""
        assert self.grammar is not None
        seq = self.seq
        if not self.grammar.accept(token):
            log.error("request %s: its grammar refused token %d after %d output tokens; ending it", seq.request_id,
                      token, len(seq.output_token_ids) - 1)
            return "abort"
        if not self.grammar.is_terminated():
            return None
        if token in seq.params.stop_token_ids:
            seq.stop_reason = token
        return "stop"

    def check_stop(self, token: int) -> str | None:
        """The finish reason once `token` (just appended) ends the request, else None; sets the stop reason and,
        for a stop string, the final text (cut before it, or after it with include_stop_str)."""
        seq = self.seq
        n = len(seq.output_token_ids)
        if self.stop_strings and self.detok is not None:
            text = self.detok.text
            if n > self.min_tokens:
                # A stop string ending in text searched before was found then: search only where a new one can be.
                hits = [(i, s) for s in self.stop_strings
                        if (i := text.find(s, max(0, self.stop_searched - len(s) + 1))) >= 0]
                if hits:
                    cut, stop = min(hits)
                    seq.stop_reason = stop
                    self.final_text = text[:cut + len(stop)] if self.include_stop_str else text[:cut]
                    return "stop"
            self.stop_searched = len(text)
        # A request with a grammar ends where its grammar does (`_advance_grammar`), or on a stop_token_ids of its
        # own: an EOS id that is also text (a byte token, in some checkpoints) is then just text.
        grammar_ends_it = self.grammar is not None and token not in seq.params.stop_token_ids
        if token in self.stop_ids and n >= self.min_tokens and not grammar_ends_it:
            if token in seq.params.stop_token_ids:  # EOS ends it too, but with no stop_reason
                seq.stop_reason = token
            return "stop"
        if n >= self.max_output:
            return "length"
        return None

    def text_delta(self) -> str:
        """New text to hand out; while a stop string could still be forming, its possible start is held back."""
        if self.detok is None:
            return ""
        text = self.final_text if self.final_text is not None else self.detok.text
        end = len(text)
        if not self.seq.is_finished and self.stop_strings and not self.include_stop_str:
            # With include_stop_str a stop string stays in the text: one that is forming needs no holding back.
            end -= max(len(s) for s in self.stop_strings) - 1
        if end <= self.emitted:
            return ""
        delta = text[self.emitted:end]
        self.emitted = end
        return delta

    def output(self, detokenize: Callable[[Sequence], str]) -> RequestOutput:
        """The final output of the ended request; `detokenize` gives its text when no detokenizer kept it."""
        seq = self.seq
        if self.final_text is not None:
            text = self.final_text
        elif self.detok is not None:
            text = self.detok.text
        else:
            text = detokenize(seq)
        cumulative = None
        if seq.logprobs:
            cumulative = sum(lp[t] for lp, t in zip(seq.logprobs, seq.output_token_ids, strict=False))
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
                                      list(seq.logprobs) if seq.params.logprobs is not None else None, cumulative)
        now = time.monotonic()
        metrics = {"arrival": self.arrival, "finished": now, "e2e_s": now - self.arrival,
                   "preemptions": float(seq.num_preemptions)}
        if seq.first_scheduled_at is not None:
            metrics["queue_s"] = seq.first_scheduled_at - self.arrival
        return RequestOutput(seq.request_id, self.prompt, list(seq.prompt_token_ids), [completion], True, metrics)
