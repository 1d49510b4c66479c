"""What a request's own sampling parameters do to its logits before a token is drawn.

Per row, in this order:
  1. logit_bias: `bias[t]` is added to `logits[t]`.
  2. min_tokens: while the request has fewer than `min_tokens` output tokens, the tokens that would end it
     (its stop_token_ids, and EOS unless ignore_eos) are masked to -inf.
  3. penalties, over `count[t]`, how often t occurs in the request's output so far (the prompt does not count):
     repetition (r != 1) divides a positive logit by r and multiplies a negative one by r, for every t in the
     prompt or the output; then `logits[t] -= frequency * count[t] + presence * (count[t] > 0)`.
  4. structured outputs: the tokens the request's grammar does not allow now are masked to -inf.
Then the sampler applies temperature, top-k, top-p and min-p (`sampler.filtered_logits`) and draws.

Logprobs handed to users are those of the raw logits, before any of this (vLLM's default logprobs mode,
`raw_logprobs`): processing changes which token is drawn, not the probabilities reported for it.

A request with a grammar is left out of step 2: the grammar decides where the output may end, and masking
its end token when it is the only one allowed would leave nothing to draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from governor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from governor.engine.structured import GrammarState


def needs_processing(params: SamplingParams) -> bool:
    """Whether a request's logits change before sampling (any of logit_bias, min_tokens, the penalties or
    structured outputs)."""
    return bool(params.logit_bias or params.min_tokens > 0 or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
                or params.structured_outputs is not None)


class LogitsProcessor:
    """One request's logits processing, fixed at admission. It reads the request's token lists as they grow
    (the very lists of its Sequence, which are appended to, never replaced) and holds its grammar matcher."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
                 min_tokens_ids: Sequence[int] = (), grammar: GrammarState | None = None) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        # The tokens masked while the output is shorter than min_tokens (none with a grammar: see the module).
        self.min_tokens_ids = tuple(min_tokens_ids) if params.min_tokens > 0 and grammar is None else ()
        self.grammar = grammar
        self.penalized = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                          or params.repetition_penalty != 1.0)
        self._prompt_seen: torch.Tensor | None = None  # bool [vocab] on the logits' device, once needed

    def prompt_seen(self, vocab: int, device: torch.device) -> torch.Tensor:
        """bool [vocab]: which tokens occur in the prompt (for the repetition penalty); built once."""
        seen = self._prompt_seen
        if seen is None or seen.device != device or seen.shape[0] != vocab:
            ids = torch.tensor([t for t in set(self.prompt_token_ids) if t < vocab], dtype=torch.int64)
            seen = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True).to(device)
            self._prompt_seen = seen
        return seen


def process_logits(logits: torch.Tensor, processors: Sequence[LogitsProcessor | None]) -> torch.Tensor:
    """fp32 logits [B, V] after each row's processing (the module's order); row i is processed by
    `processors[i]`, left as it is where that is None. Returns `logits` itself when no row has a processor;
    otherwise a new tensor, `logits` unchanged (its raw rows give the logprobs)."""
    rows = [i for i, p in enumerate(processors) if p is not None]
    if not rows:
        return logits
    procs: list[LogitsProcessor] = [p for p in processors if p is not None]
    x = logits.clone()
    vocab = x.shape[1]
    _add_bias(x, rows, procs)
    _mask_min_tokens(x, rows, procs)
    _apply_penalties(x, [(i, p) for i, p in zip(rows, procs, strict=True) if p.penalized])
    _mask_grammar(x, [(i, g) for i, p in zip(rows, procs, strict=True) if (g := p.grammar) is not None], vocab)
    return x


def _upload(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; to a GPU through pinned memory without waiting, so the host goes on
    preparing the step's processing while the GPU still runs the forward."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return _upload(rows, torch.int64, device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[len(values), 1] on `like`'s device and in its dtype: one value per row."""
    return _upload(values, like.dtype, like.device).unsqueeze(1)


def _add_bias(x: torch.Tensor, rows: list[int], procs: list[LogitsProcessor]) -> None:
    r: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in zip(rows, procs, strict=True):
        bias = p.params.logit_bias
        if bias:
            r += [i] * len(bias)
            cols += bias.keys()
            vals += bias.values()
    if r:  # one (row, token) pair per entry: a dict has each token once, so no two entries collide
        x.index_put_((_index(r, x.device), _index(cols, x.device)), _upload(vals, x.dtype, x.device),
                     accumulate=True)


def _mask_min_tokens(x: torch.Tensor, rows: list[int], procs: list[LogitsProcessor]) -> None:
    vocab = x.shape[1]
    r: list[int] = []
    cols: list[int] = []
    for i, p in zip(rows, procs, strict=True):
        if p.min_tokens_ids and len(p.output_token_ids) < p.params.min_tokens:
            ids = [t for t in p.min_tokens_ids if t < vocab]
            r += [i] * len(ids)
            cols += ids
    if r:
        x[_index(r, x.device), _index(cols, x.device)] = float("-inf")


def output_counts(outputs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """fp32 [len(outputs), vocab]: how often each token occurs in each token list, counted on the device
    with one scatter_add over the lists padded to the longest (padding lands in a column past the end)."""
    width = max((len(o) for o in outputs), default=0)
    counts = torch.zeros(len(outputs), vocab + 1, dtype=torch.float32, device=device)
    if width:
        ids = _upload([[*o, *([vocab] * (width - len(o)))] for o in outputs], torch.int64, device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _apply_penalties(x: torch.Tensor, penalized: list[tuple[int, LogitsProcessor]]) -> None:
    if not penalized:
        return
    device, vocab = x.device, x.shape[1]
    procs = [p for _, p in penalized]
    every_row = len(penalized) == x.shape[0]
    idx = None if every_row else _index([i for i, _ in penalized], device)
    sub = x if idx is None else x[idx]  # [P, V]; a copy unless every row, written back below
    counts = output_counts([p.output_token_ids for p in procs], vocab, device)
    seen = counts > 0
    if any(p.params.repetition_penalty != 1.0 for p in procs):
        rep = _column([p.params.repetition_penalty for p in procs], x)
        in_prompt_or_output = seen | torch.stack([p.prompt_seen(vocab, device) for p in procs])
        sub = torch.where(in_prompt_or_output, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.params.frequency_penalty != 0.0 for p in procs):
        sub = sub - _column([p.params.frequency_penalty for p in procs], x) * counts
    if any(p.params.presence_penalty != 0.0 for p in procs):
        sub = sub - _column([p.params.presence_penalty for p in procs], x) * seen
    if idx is None:
        x.copy_(sub)
    else:
        x[idx] = sub


def _mask_grammar(x: torch.Tensor, grammars: list[tuple[int, GrammarState]], vocab: int) -> None:
    if not grammars:
        return
    from governor.engine.structured import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(grammars), vocab)  # on the host, where the matchers write it
    for j, (_, grammar) in enumerate(grammars):
        grammar.fill_mask(bitmask, j)
    if len(grammars) == x.shape[0]:
        apply_bitmask(x, bitmask)
        return
    idx = _index([i for i, _ in grammars], x.device)
    sub = x[idx]
    apply_bitmask(sub, bitmask)
    x[idx] = sub
