"""Speculative decoding on the engine's side, in the order a step runs it: propose drafts into the slots the
scheduler reserved (`Scheduler._spec_slots`), verify them against the target's logits (`spec.verifier`), settle
the accepted drafts' KV and the proposer's state, count.

A request whose logits are processed before sampling (`logits_processing`: penalties, logit bias, min_tokens,
a grammar) gets no drafts: verifying them would need its processing at every draft position, as if the drafts
before it were already output (penalty counts, min_tokens, a grammar advanced through them and back). It samples
one token a step, as without speculation; its reserved slots go unused."""

from __future__ import annotations

import itertools

import torch

from governor.engine.config import EngineConfig
from governor.engine.models.model_config import ModelConfig
from governor.engine.sampler import sample, token_logprobs
from governor.engine.scheduler import ScheduledSeq, Scheduler
from governor.engine.sequence import Sequence
from governor.engine.spec.draft_model import DeviceDrafts, DraftModelProposer
from governor.engine.spec.proposer import NgramProposer, Proposer
from governor.engine.spec.verifier import accept_greedy, accept_sampled, target_distributions
from governor.kernels.argmax import argmax_rows

Verified = list[tuple[list[int], list[dict[int, float] | None]]]  # per sampling sequence: (tokens, logprobs)
_COUNTERS = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verification_steps")
# The most steps in a row an n-gram proposer that keeps finding nothing sits out (`SpeculativeDecoding.may_skip`).
NGRAM_BACKOFF_CAP = 8


class SpeculativeDecoding:
    """The proposer, the verification of each step that carries drafts, and the acceptance counters."""

    def __init__(self, proposer: Proposer, scheduler: Scheduler, spec_cap: int, drafts_on_device: bool = False
                 ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.accepted_by_position = [0] * spec_cap
        # A draft model's drafts stay on the device until the verification is queued (`DeviceDrafts`); the
        # engine asks for it with one rank, whose runner alone can take token ids from the device.
        self.drafts_on_device = drafts_on_device and isinstance(proposer, DraftModelProposer)
        self.pending: tuple[list[ScheduledSeq], DeviceDrafts] | None = None
        # Prompt lookup that finds nothing still costs its step the overlap of async scheduling (a step that may
        # carry drafts is scheduled once the tokens before it are on the host). So after a proposal round in
        # which it found no draft for any sequence, the proposer sits out the next `skips_left` steps, which run
        # as plain decodes launched ahead (`LLMEngine._launch_continuation`): 1 step, then 2, 4, ... up to
        # NGRAM_BACKOFF_CAP while it keeps finding nothing; any draft found resets it, and a sequence admitted or
        # a change of K resets it with one more round (`reset_backoff`: the new sequence's first decode, or the
        # new depth, is tried whatever the round of the admitting step found). Outputs are unchanged (greedy
        # tokens do not depend on the drafts); a repetition that starts while it sits out is drafted at most
        # NGRAM_BACKOFF_CAP steps late.
        self.backoff = 0
        self.skips_left = 0
        self.fresh = False  # reset since the last round that found nothing: that round does not back off

    def propose(self, scheduled: list[ScheduledSeq]) -> dict[int, torch.Tensor]:
        """Fill each speculative decode's draft slots; the draft distributions by id(seq) (draft model, sampled
        requests only). With drafts on the device the slots hold placeholders, `ScheduledSeq.draft_src` says where
        each sequence's drafts are in `device_drafts`, and `resolve` writes their values once the verification
        is queued."""
        probs: dict[int, torch.Tensor] = {}
        self.pending = None
        spec = []
        for s in scheduled:
            if s.num_spec > 0:
                if s.seq.logits_processor is None:
                    spec.append(s)
                else:
                    s.set_drafts([])  # a request with logits processing gets no drafts (see the module)
        if not spec:
            return probs
        if self.drafts_on_device:
            assert isinstance(self.proposer, DraftModelProposer)
            launched = self.proposer.launch(spec)
            for i, s in enumerate(spec):
                s.set_drafts([0] * (launched.counts[i] if launched is not None else 0))
                if launched is not None and launched.counts[i]:
                    s.draft_src = launched.offsets[i]
                    q = launched.q[i]
                    if q is not None:
                        probs[id(s.seq)] = q[:launched.counts[i]]
            if launched is not None:
                self.pending = (spec, launched)
            return probs
        found = False
        for s, (drafts, q) in zip(spec, self.proposer.propose(spec), strict=True):
            found = found or bool(drafts)
            s.set_drafts(drafts)
            if q is not None:
                probs[id(s.seq)] = q[:len(drafts)]
        if isinstance(self.proposer, NgramProposer):
            self._back_off(found)
        return probs

    def _back_off(self, found: bool) -> None:
        """After an n-gram proposal round: reset the backoff when it found a draft, else double it (see __init__)."""
        fresh, self.fresh = self.fresh, False
        self.backoff = 0 if found or fresh else min(max(1, 2 * self.backoff), NGRAM_BACKOFF_CAP)
        self.skips_left = self.backoff

    def reset_backoff(self) -> None:
        """Sequences joined the batch, or K changed: the proposer tries again from now on, at least two rounds
        (see __init__)."""
        self.backoff = self.skips_left = 0
        self.fresh = True

    def may_skip(self) -> bool:
        """Whether the next step may run without drafts (the n-gram proposer is sitting out steps)."""
        return self.skips_left > 0

    def skip_step(self) -> None:
        """A step ran without drafts while the proposer sat out."""
        self.skips_left -= 1

    @property
    def device_drafts(self) -> torch.Tensor | None:
        """The drafts the step's verification takes its draft token ids from, while they are on the device."""
        return self.pending[1].tokens if self.pending is not None else None

    def resolve(self) -> None:
        """Write the values of the step's drafts into their slots (`ScheduledSeq.draft_tokens`): the host's one
        wait for the drafts, called once the verification is queued. A no-op without drafts on the device."""
        if self.pending is None:
            return
        spec, launched = self.pending
        self.pending = None
        for s, drafts in zip(spec, launched.resolve(), strict=True):
            if s.draft_src is not None:
                s.draft_tokens = drafts
                s.draft_src = None

    def verify(self, sampling: list[ScheduledSeq], logits: torch.Tensor, draft_probs: dict[int, torch.Tensor],
               generator: torch.Generator) -> Verified:
        """(tokens, logprobs) of each sampling sequence of a step with drafts: one sampled token for a sequence
        without drafts, its accepted drafts + one for a sequence with them (`spec.verifier`: exact for greedy,
        rejection sampling otherwise). Sequence i's logits rows are its last known token's and its drafts', in
        order; `generator` samples for requests without a seed of their own."""
        rows = list(itertools.accumulate((1 + len(s.draft_tokens) for s in sampling), initial=0))
        plain = [i for i, s in enumerate(sampling) if not s.draft_tokens]
        out: Verified = [([], []) for _ in sampling]
        if plain:
            seqs = [sampling[i].seq for i in plain]
            sampled = sample(logits[[rows[i] for i in plain]], [q.params for q in seqs], [q.generator for q in seqs],
                             generator, [q.logits_processor for q in seqs])
            for i, tok, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                out[i] = ([tok], [lp])
        # Every greedy verification's argmaxes in one read from the device (not one per sequence).
        argmax = argmax_rows(logits).tolist() if any(s.draft_tokens and s.seq.params.greedy for s in sampling) \
            else []
        for i, s in enumerate(sampling):
            if not s.draft_tokens:
                continue
            seq, block = s.seq, logits[rows[i]:rows[i + 1]]
            assert seq.logits_processor is None, "a request with logits processing is given no drafts"
            if seq.params.greedy:
                tokens = accept_greedy(argmax[rows[i]:rows[i + 1]], s.draft_tokens)
            else:
                p = target_distributions(block, [seq.params] * block.shape[0])
                tokens = accept_sampled(p, s.draft_tokens, draft_probs.get(id(seq)), seq.generator)
            lps = token_logprobs(block[:len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
            out[i] = (tokens, lps)
        return out

    def settle(self, s: ScheduledSeq, num_accepted: int) -> None:
        """Keep the KV of accepted drafts, release the slots of rejected ones (target and draft), and count."""
        k = len(s.draft_tokens)
        self.scheduler.accept_drafts(s.seq, num_accepted)
        self.proposer.accepted(s.seq, k, num_accepted)
        self.counters["spec_proposed_tokens"] += k
        self.counters["spec_accepted_tokens"] += num_accepted
        self.counters["spec_verification_steps"] += 1
        for j in range(num_accepted):
            self.accepted_by_position[j] += 1

    def release(self, seq: Sequence) -> None:
        """The sequence ended: drop the proposer's state of it."""
        self.proposer.release(seq)

    def stats(self) -> dict[str, object]:
        return _stats(self.counters, self.accepted_by_position)

    @staticmethod
    def idle_stats() -> dict[str, object]:
        """`stats()` of an engine that does not speculate."""
        return _stats(dict.fromkeys(_COUNTERS, 0), [])


def _stats(counters: dict[str, int], accepted_by_position: list[int]) -> dict[str, object]:
    steps = counters["spec_verification_steps"]
    return {**counters, "spec_acceptance_by_position": list(accepted_by_position),
            "spec_mean_accepted_length": counters["spec_accepted_tokens"] / steps if steps else 0.0}


def make_proposer(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                  num_blocks: int, block_size: int, max_model_len: int, attention_backend: str) -> Proposer | None:
    """The proposer `config.speculative_config` asks for; None without speculation."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    assert spec.model is not None
    # The draft's cache has a block for every target block plus room for each sequence's lookahead.
    # Under tensor parallelism the draft runs whole on rank 0 (it is small; workers never see it).
    extra = config.seqs_cap * (-(-spec.num_speculative_tokens // block_size) + 1)
    return DraftModelProposer(spec.model, target, dtype, device, num_blocks + extra, block_size, max_model_len,
                              config.seqs_cap, config.tokens_cap, attention_backend, config.spec_cap,
                              spec.quantization)
