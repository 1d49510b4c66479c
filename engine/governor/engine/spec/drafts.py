"""A step's drafts on the engine's side: filling the slots the scheduler reserved from the proposer, and the tokens
of a step that carries drafts (each sequence's accepted drafts, then one token of its own).

A request whose logits are processed before sampling (`logits_processing`: penalties, logit bias, min_tokens,
a grammar) gets no drafts: verifying them would need its processing at every draft position, as if the drafts
before it were already output (penalty counts, min_tokens, a grammar advanced through them and back). It samples
one token a step, as without speculation; its reserved slots go unused."""

from __future__ import annotations

import itertools

import torch

from governor.engine.sampler import sample, token_logprobs
from governor.engine.scheduler import ScheduledSeq
from governor.engine.spec.proposer import Proposer
from governor.engine.spec.verifier import accept_greedy, accept_sampled, target_distributions


def propose_drafts(proposer: Proposer | None, scheduled: list[ScheduledSeq]) -> dict[int, torch.Tensor]:
    """Fill each speculative decode's draft slots (none without a proposer); returns draft distributions by
    id(seq) (draft model, sampled requests only)."""
    probs: dict[int, torch.Tensor] = {}
    spec = []
    for s in scheduled:
        if s.num_spec > 0:
            if s.seq.logits_processor is None:
                spec.append(s)
            else:
                s.set_drafts([])  # a request with logits processing gets no drafts (see the module)
    if not spec or proposer is None:
        for s in spec:
            s.set_drafts([])
        return probs
    for s, (drafts, q) in zip(spec, proposer.propose(spec), strict=True):
        s.set_drafts(drafts)
        if q is not None:
            probs[id(s.seq)] = q[:len(drafts)]
    return probs


def sample_with_drafts(sampling: list[ScheduledSeq], logits: torch.Tensor, draft_probs: dict[int, torch.Tensor],
                       generator: torch.Generator) -> list[tuple[list[int], list[dict[int, float] | None]]]:
    """(tokens, logprobs) of each sampling sequence of a step with drafts: one sampled token for a sequence
    without drafts, its accepted drafts + one for a sequence with them. Sequence i's logits rows are its last
    known token's and its drafts', in order; `generator` samples for requests without a seed of their own."""
    rows = list(itertools.accumulate((1 + len(s.draft_tokens) for s in sampling), initial=0))
    plain = [i for i, s in enumerate(sampling) if not s.draft_tokens]
    out: list[tuple[list[int], list[dict[int, float] | None]]] = [([], []) for _ in sampling]
    if plain:
        seqs = [sampling[i].seq for i in plain]
        sampled = sample(logits[[rows[i] for i in plain]], [q.params for q in seqs], [q.generator for q in seqs],
                         generator, [q.logits_processor for q in seqs])
        for i, tok, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
            out[i] = ([tok], [lp])
    for i, s in enumerate(sampling):
        if not s.draft_tokens:
            continue
        seq, block = s.seq, logits[rows[i]:rows[i + 1]]
        assert seq.logits_processor is None, "a request with logits processing is given no drafts"
        if seq.params.greedy:
            tokens = accept_greedy(block.argmax(dim=1).tolist(), s.draft_tokens)
        else:
            p = target_distributions(block, [seq.params] * block.shape[0])
            tokens = accept_sampled(p, s.draft_tokens, draft_probs.get(id(seq)), seq.generator)
        lps = token_logprobs(block[:len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
        out[i] = (tokens, lps)
    return out
