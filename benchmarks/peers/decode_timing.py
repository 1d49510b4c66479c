"""Per-token decode latency of a peer, reported as `governor bench latency` reports the engine's.

The engine's definition (governor.engine.bench.latency): every step ends with the sampled token ids on the host,
so the wall time between two steps is one step's time; the first step that gives every request a token ends the
time to first token (TTFT), and each later step that gives every request a token is a decode step whose time is
the latency of one output token. A peer's runner records the host time of its prompt's admission and of every step
that brought tokens; a step that brought k tokens at once (a peer whose host fell behind) counts as k steps of
dt / k each.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from itertools import pairwise
from typing import Any


def decode_steps(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """Seconds per output token of each decode step, from (host time, tokens the step brought) of each step, the
    first being the one that ended TTFT."""
    steps: list[float] = []
    for (before, _), (now, tokens) in pairwise(arrivals):
        if tokens < 1:
            raise ValueError(f"a step at {now} brought {tokens} tokens; record only steps that bring tokens")
        steps += [(now - before) / tokens] * tokens
    return steps


def latency_row(batch: int, context: int, new_tokens: int, ttft_s: float, steps_s: Sequence[float]) -> dict[str, Any]:
    """One row of `governor bench latency`'s result, same keys and statistics, from TTFT and the decode steps'
    seconds per token."""
    if not steps_s:
        raise ValueError(f"new_tokens={new_tokens} leaves no decode step to time; ask for at least 2")
    decode = sorted(steps_s)
    return {"batch": batch, "context": context, "new_tokens": new_tokens, "ttft_ms": 1e3 * ttft_s,
            "decode_steps": len(decode), "ms_per_token_mean": 1e3 * statistics.fmean(decode),
            "ms_per_token_p50": 1e3 * decode[len(decode) // 2],
            "ms_per_token_p90": 1e3 * decode[int(0.9 * (len(decode) - 1))],
            "decode_tok_s": batch * len(decode) / sum(decode)}


def check_new_tokens(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    """A parser error unless `new_tokens` leaves a decode step to time (the first token is the prefill's)."""
    if new_tokens < 2:
        parser.error(f"--new-tokens {new_tokens} leaves no decode step to time; ask for at least 2")
