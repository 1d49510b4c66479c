"""Turns a step's logits into next tokens: each request's logits processing (`logits_processing`: logit bias,
min_tokens, penalties, structured outputs), then greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from governor.engine.logits_processing import LogitsProcessor, needs_processing, process_logits
from governor.engine.sampling_params import SamplingParams
from governor.kernels.argmax import argmax_rows


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the chosen token and the top-n, or None when not requested.
    logprobs: list[dict[int, float] | None]


def argmax_only(params: SamplingParams) -> bool:
    """Whether a request's tokens are a plain argmax of its logits: greedy, without logprobs, and without
    logits processing (`logits_processing.needs_processing`)."""
    return params.greedy and params.logprobs is None and not needs_processing(params)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of `logits` [B, V] (lowest id among ties), on the host: one sync."""
    return argmax_rows(logits).tolist()


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits scaled by temperature with top-k, top-p and min-p applied (masked to -inf)."""
    return LogitFilter(params, logits.device, logits.shape[1])(logits)


class LogitFilter:
    """`filtered_logits`'s per-row parameters, copied to the device once: for rows that keep their parameters over
    several calls (a draft model's rounds), so that each call copies nothing from the host. Applied to logits of
    the first `rows` of those rows (any prefix)."""

    def __init__(self, params: list[SamplingParams], device: torch.device, vocab: int) -> None:
        self.temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                  device=device).unsqueeze(1)
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        self.top_k = torch.tensor(top_ks, device=device).clamp(max=vocab) if min(top_ks) < vocab else None
        self.top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1) \
            if any(p.top_p < 1.0 for p in params) else None
        self.min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1) \
            if any(p.min_p > 0.0 for p in params) else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        x = logits / self.temps[:n]
        if self.top_k is not None:
            kth = x.sort(dim=1, descending=True).values.gather(1, (self.top_k[:n] - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None:
            sorted_x, order = x.sort(dim=1, descending=True)
            probs = sorted_x.softmax(dim=1)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            drop_sorted = (probs.cumsum(dim=1) - probs) >= self.top_p[:n]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        if self.min_p is not None:
            probs = x.softmax(dim=1)
            x = x.masked_fill(probs < self.min_p[:n] * probs.max(dim=1, keepdim=True).values, float("-inf"))
        return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None,
           processors: Sequence[LogitsProcessor | None] | None = None) -> SampleResult:
    """Sample one token per row of fp32 `logits` [B, V].

    Row i's logits are first processed by `processors[i]` when there is one (`logits_processing`); the
    logprobs are those of the raw rows. Random rows use the exponential-race trick (argmax of p / E,
    E ~ Exp(1)), which draws exactly from p; a row with its own generator (a request seed) draws only
    from it, so its output does not depend on what else shares the batch.
    """
    x = logits if processors is None else process_logits(logits, processors)
    if all(p.greedy for p in params):
        token_list = greedy_tokens(x)
    else:
        probs = filtered_logits(x, params).softmax(dim=1)
        noise = torch.empty_like(probs).exponential_(generator=default_generator)
        for i, g in enumerate(generators):
            if g is not None and not params[i].greedy:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        token_list = torch.where(is_greedy, argmax_rows(x), sampled).tolist()  # the one host sync

    return SampleResult(token_list, token_logprobs(logits, token_list, [p.logprobs for p in params]))


def token_logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]
                   ) -> list[dict[int, float] | None]:
    """Per row, {token: logprob} of the chosen token and the top-n (n = wanted[row]; None = not asked)."""
    out: list[dict[int, float] | None] = [None] * len(tokens)
    if all(n is None for n in wanted):
        return out
    lp = logits.log_softmax(dim=1)
    n_max = max(n or 0 for n in wanted)
    top_vals, top_ids = lp.topk(max(n_max, 1), dim=1)
    chosen = lp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    for i, n in enumerate(wanted):
        if n is None:
            continue
        row = {tokens[i]: chosen[i]}
        for tid, val in zip(top_ids_l[i][:n], top_vals_l[i][:n], strict=True):
            row.setdefault(tid, val)
        out[i] = row
    return out
