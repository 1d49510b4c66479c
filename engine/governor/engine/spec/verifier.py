"""Verifies draft tokens against the target model so the output has exactly the target's distribution."""

from __future__ import annotations

import torch

from governor.engine.sampler import filtered_logits
from governor.engine.sampling_params import SamplingParams


def target_distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 probabilities [N, V] that the sampler draws row i of `logits` [N, V] from under `params[i]`.

    A sampled row is softmax of the sampler's filtered logits (temperature, top-k, top-p, min-p), so
    target and draft rows built here are filtered identically. A greedy row (temperature 0) is the point
    mass on argmax(logits), the token `sample` would return; `accept_sampled` on such rows reduces to
    `accept_greedy`.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [N, V] with one SamplingParams per row, got shape {tuple(logits.shape)} "
                         f"and {len(params)} params")
    logits = logits.float()
    probs = filtered_logits(logits, params).softmax(dim=1)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """The tokens greedy decoding emits for this step: d_1..d_a then target_argmax[a].

    target_argmax[j] is the target's argmax after the last known token and the drafts d_1..d_j
    (len(draft) + 1 entries). a is the length of the longest prefix with d_j == target_argmax[j-1];
    each accepted draft is what greedy would have picked, and target_argmax[a] is greedy's next pick
    given them, so the output equals plain greedy decoding by construction (1 to k+1 tokens).
    """
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"target_argmax needs len(draft) + 1 = {len(draft) + 1} entries, got {len(target_argmax)}")
    a = 0
    while a < len(draft) and draft[a] == target_argmax[a]:
        a += 1
    return [*draft[:a], target_argmax[a]]


def accept_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): 1 to k+1 tokens distributed as the target.

    target_probs [k+1, V]: p_j, the target's filtered, normalised distribution at draft position j
    (row k is the position after the last draft). draft_probs [k, V]: q_j, the distribution d_j was
    drawn from, or None for a deterministic proposer (n-gram), where q_j is one-hot on d_j.

    For j = 1..k, accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (q_j(d_j) == 0: reject).
    At the first rejection emit x ~ max(p_j - q_j, 0) / Z and stop; Z == 0 means p_j == q_j, where
    rejection has probability 0, so draw from p_j. If all k are accepted, emit a bonus x ~ p_{k+1}.
    Each emitted token is then distributed as p_j given the tokens before it:
    P(x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) * max(p(x) - q(x), 0) / Z = p(x).

    Random draws come only from `generator` (None: torch's default generator for the tensors' device):
    k uniforms, then one categorical draw; host syncs: the first rejection and the emitted token.
    """
    k = len(draft)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [len(draft) + 1, V] = [{k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [len(draft), V] = [{k}, {target_probs.shape[1]}] or None, "
                         f"got {tuple(draft_probs.shape)}")
    device = target_probs.device
    a = 0  # number of accepted drafts
    if k > 0:
        rows = torch.arange(k, device=device)
        cols = torch.tensor(draft, device=device)
        p_draft = target_probs[rows, cols]
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[rows, cols]
        u = torch.rand(k, generator=generator, device=device, dtype=p_draft.dtype)
        # u < p/q, written without the division; u * q < p would accept a q == 0 draft, hence the guard.
        accepted = (q_draft > 0) & (u * q_draft < p_draft)
        a = int(accepted.int().cumprod(dim=0).sum())  # leading accepts; the one host sync before the draw
    if a == k:
        dist = target_probs[k]
    else:
        p = target_probs[a]
        if draft_probs is None:
            residual = p.clone()
            residual[draft[a]] = 0.0  # max(p - onehot(d), 0): p(d) <= 1 cancels, the rest is unchanged
        else:
            residual = (p - draft_probs[a]).clamp_(min=0.0)
        dist = torch.where(residual.sum() > 0, residual, p)
    token = torch.multinomial(dist, 1, generator=generator)
    return [*draft[:a], int(token)]
