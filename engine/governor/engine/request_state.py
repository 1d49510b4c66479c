"""What the engine keeps for a live request beside its Sequence: the stop conditions fixed at admission, the text
handed out so far, and the final RequestOutput built from them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from governor.engine.detokenizer import IncrementalDetokenizer
from governor.engine.outputs import CompletionOutput, RequestOutput
from governor.engine.sequence import Sequence


@dataclass
class RequestState:
    seq: Sequence
    prompt: str | None
    arrival: float  # time.monotonic() at add_request
    # From the sampling parameters, once, for the per-token stop checks:
    stop_ids: frozenset[int]  # token ids that end it: its stop_token_ids, and EOS unless ignore_eos
    stop_strings: list[str]
    max_output: int  # output tokens at which it ends with "length": max_tokens, or what max_model_len leaves
    argmax_only: bool  # greedy without logprobs (sampler.argmax_only)
    detok: IncrementalDetokenizer | None = None
    emitted: int = 0  # characters of detok.text already handed out as deltas
    final_text: str | None = None

    def check_stop(self, token: int) -> str | None:
        """The finish reason once `token` (just appended) ends the request, else None; sets the stop reason and,
        for a stop string, the final text (cut before it)."""
        seq = self.seq
        if self.stop_strings and self.detok is not None:
            text = self.detok.text
            hits = [(i, s) for s in self.stop_strings if (i := text.find(s)) >= 0]
            if hits:
                cut, stop = min(hits)
                seq.stop_reason = stop
                self.final_text = text[:cut]
                return "stop"
        if token in self.stop_ids:
            if token in seq.params.stop_token_ids:  # EOS ends it too, but with no stop_reason
                seq.stop_reason = token
            return "stop"
        if len(seq.output_token_ids) >= self.max_output:
            return "length"
        return None

    def text_delta(self) -> str:
        """New text to hand out; while a stop string could still be forming, its possible start is held back."""
        if self.detok is None:
            return ""
        text = self.final_text if self.final_text is not None else self.detok.text
        end = len(text)
        if not self.seq.is_finished and self.stop_strings:
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
