"""One observation window of a service, and the SLO it is held to.

Plain data: the observer fills `Signals` from PromQL (or the engine's own `/metrics`); the policy reads it.
A field is `None` when its series was missing in the window; the policy never guesses a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from governor.contract import KNOB_NAMES

# A window older than this many scrape intervals no longer describes the running engine.
STALE_AFTER_INTERVALS = 2.0


@dataclass(frozen=True)
class Signals:
    """What the tuner saw over one window, scoped to one service and revision.

    Latencies are p95 in seconds; `kv_usage` is the used fraction of KV blocks (0..1);
    `preemption_rate` and `throughput_tok_s` are per second; `error_rate` is the fraction of requests that
    ended in an error (errors / (finished + errors)), like the rollout triggers' error_rate.
    `knobs` holds the effective value of each live knob (the `governor_knob` gauge). `time` is
    when the window ended (epoch seconds) and `age_s` how old its newest sample was when read.
    """

    time: float
    ttft_p95_s: float | None
    itl_p95_s: float | None
    e2e_p95_s: float | None
    queue_len: float | None
    queue_time_p95_s: float | None
    kv_usage: float | None
    preemption_rate: float | None
    error_rate: float | None
    throughput_tok_s: float | None
    spec_acceptance: float | None
    running: float | None
    knobs: dict[str, int] = field(default_factory=dict)
    age_s: float = 0.0
    itl_p50_s: float | None = None  # with itl_p95_s, tells spiky ITL (prefill chunks) from uniformly slow
    prompt_tok_s: float | None = None  # prompt tokens prefilled per second


@dataclass(frozen=True)
class SLO:
    """Targets for one service: p95 latencies in seconds and, optionally, a ceiling on the fraction of
    requests that end in an error."""

    ttft_p95_s: float
    itl_p95_s: float
    e2e_p95_s: float | None = None
    error_rate: float | None = None


def is_stale(signals: Signals, scrape_interval_s: float) -> bool:
    """True when the tuner must not act on `signals`.

    Stale means older than two scrape intervals, or missing a signal every decision needs: TTFT p95,
    ITL p95, or the effective value of any live knob (`governor.contract.KNOB_NAMES`).
    """
    if signals.age_s > STALE_AFTER_INTERVALS * scrape_interval_s:
        return True
    if signals.ttft_p95_s is None or signals.itl_p95_s is None:
        return True
    return any(name not in signals.knobs for name in KNOB_NAMES)
