"""Judging a canary step: each `rollbackOn` trigger evaluated from Prometheus, canary against stable.

A trigger names a metric, a comparison and a threshold, and a window (`for`). Each metric is the same
PromQL the tuner reads (`governor.tuner.prom.signal_queries`), scoped to the service's served model name,
its namespace and one revision, over `[for]`:

| metric | value | worse when |
| --- | --- | --- |
| ttft_p95, itl_p95, e2e_p95 | p95 latency in seconds (histogram_quantile over the window) | higher |
| error_rate | errors / (finished + errors) over the window | higher |
| throughput | generated tokens/s **per engine** (a canary has fewer pods than stable) | lower |

- `absolute`: fires when the canary's value is above the threshold (below it, for throughput);
- `relative`: the threshold is a ratio to stable: fires when canary > threshold × stable (latency, errors;
  e.g. 1.2 = 20% worse) or canary < threshold × stable (throughput; e.g. 0.8 = 20% less). With a stable
  error rate of 0, any canary error fires a relative error_rate trigger: use `absolute` for error budgets.

A trigger whose values cannot be had — no series, a window without requests (NaN), the revision's engines
not scraped now (no fresh `governor_engine_info` sample), Prometheus unreachable — has no verdict: it is
`missing`, which holds the rollout (SignalsStale) and never promotes it.

The pure part (`evaluate`, `judge`) takes a query function, so it is tested without Prometheus;
`PrometheusQuery` is the I/O edge. Imports no torch and no kopf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from governor import contract
from governor.operator.api import RollbackTrigger, duration_seconds
from governor.tuner.prom import (
    DEFAULT_TIMEOUT_S,
    UNUSABLE,
    connect,
    duration,
    matchers,
    redacted,
    signal_queries,
    single_value,
    window_for,
)

log = logging.getLogger(__name__)

# Trigger metric → (field of the tuner's PromQL table, True when higher is worse).
METRICS: dict[str, tuple[str, bool]] = {
    "ttft_p95": ("ttft_p95_s", True),
    "itl_p95": ("itl_p95_s", True),
    "e2e_p95": ("e2e_p95_s", True),
    "error_rate": ("error_rate", True),
    "throughput": ("throughput_tok_s", False),
}

Query = Callable[[str], float | None]
"""Runs one instant PromQL query that yields a single number; None for no data (or an unusable Prometheus)."""


def engines_query(service: str, revision: str, *, namespace: str) -> str:
    """How many engines of `revision` of `service` in `namespace` Prometheus scraped successfully at its latest
    scrape (one `governor_engine_info` series each; a failed scrape marks the series stale at once)."""
    return f"count({contract.ENGINE_INFO}{{{matchers(service, revision, namespace)}}})"


def metric_query(metric: str, service: str, revision: str, window_s: float, *, namespace: str) -> str:
    """PromQL for one trigger metric of one revision of `service` in `namespace` over the last `window_s`
    seconds."""
    field_name, _ = METRICS[metric]
    query = signal_queries(matchers(service, revision, namespace), duration(window_s))[field_name]
    if metric == "throughput":  # per engine (the canary runs fewer pods), engines averaged over the window
        engines = engines_query(service, revision, namespace=namespace)
        query = f"({query}) / avg_over_time({engines}[{duration(window_s)}:])"
    return query


@dataclass(frozen=True)
class TriggerResult:
    """One trigger's verdict on one step: the values seen, the limit the canary was held to, and whether it
    fired; `missing` says why there is no verdict (then `fired` is False)."""

    index: int
    trigger: RollbackTrigger
    canary: float | None
    stable: float | None
    limit: float | None
    fired: bool
    missing: str | None = None

    @property
    def path(self) -> str:
        return f"spec.rollout.rollbackOn[{self.index}]"

    def describe(self) -> str:
        """One line for Events and status messages."""
        t = self.trigger
        if self.missing:
            return f"{self.path} ({t.metric}): no verdict, {self.missing}"
        worse = ">" if METRICS[t.metric][1] else "<"
        rule = f"{worse} {t.threshold:g}" if t.comparison == "absolute" \
            else f"{worse} {t.threshold:g} × stable {_num(self.stable)} = {_num(self.limit)}"
        verdict = "fired" if self.fired else "ok"
        return f"{self.path} ({t.metric} over {t.for_}): canary {_num(self.canary)} {rule}: {verdict}"

    def to_status(self) -> dict[str, Any]:
        return {"trigger": self.path, "metric": self.trigger.metric, "comparison": self.trigger.comparison,
                "threshold": self.trigger.threshold, "window": self.trigger.for_, "observed": self.canary,
                "stable": self.stable, "limit": self.limit, "fired": self.fired, "missing": self.missing}


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:.4g}"


def evaluate(index: int, trigger: RollbackTrigger, canary: float | None, stable: float | None) -> TriggerResult:
    """The verdict of one trigger on the canary's and stable's values (pure)."""
    _, higher_is_worse = METRICS[trigger.metric]
    if canary is None:
        return TriggerResult(index, trigger, canary, stable, None, False,
                             f"no canary data for {trigger.metric} over {trigger.for_}")
    if trigger.comparison == "absolute":
        limit = trigger.threshold
    elif stable is None:
        return TriggerResult(index, trigger, canary, stable, None, False,
                             f"no stable data for {trigger.metric} over {trigger.for_} to compare with")
    else:
        limit = trigger.threshold * stable
    fired = canary > limit if higher_is_worse else canary < limit
    return TriggerResult(index, trigger, canary, stable, limit, fired)


@dataclass(frozen=True)
class Judgement:
    """All triggers' verdicts on one step. `fired` is the first trigger that fired (in spec order)."""

    results: tuple[TriggerResult, ...] = ()
    stale: tuple[str, ...] = field(default=())  # revisions whose engines are not being scraped now

    @property
    def fired(self) -> TriggerResult | None:
        return next((r for r in self.results if r.fired), None)

    @property
    def missing(self) -> list[str]:
        """Why some verdicts are missing (stale revisions first); empty when every trigger has one."""
        return [f"revision {rev}: no engine scraped now" for rev in self.stale] + \
            [r.describe() for r in self.results if r.missing]

    def to_status(self) -> list[dict[str, Any]]:
        return [r.to_status() for r in self.results]


def judge(triggers: Sequence[RollbackTrigger], query: Query, service: str, stable: str, canary: str, *,
          namespace: str, scrape_interval_s: float = 0.0) -> Judgement:
    """Evaluate every trigger, canary revision against stable, through `query`, on the engines of `service`
    (served model name) in `namespace`: another namespace's service of the same name and spec has the same
    model_name and revisions.

    A trigger that fires counts even when another has no data: a clear regression rolls back at once. Data
    of a revision that is not being scraped now is not judged at all (its windows may be old). A trigger's
    window is its `for`, widened to two scrapes when shorter (`prom.window_for`: rate() needs two samples)."""
    if not triggers:
        return Judgement()
    compared = (canary, stable) if any(t.comparison == "relative" for t in triggers) else (canary,)
    stale = tuple(rev for rev in compared if not query(engines_query(service, rev, namespace=namespace)))
    results = []
    for i, trigger in enumerate(triggers):
        window_s = window_for(duration_seconds(trigger.for_), scrape_interval_s)
        canary_value = None if canary in stale else \
            query(metric_query(trigger.metric, service, canary, window_s, namespace=namespace))
        stable_value = None
        if trigger.comparison == "relative" and stable not in stale:
            stable_value = query(metric_query(trigger.metric, service, stable, window_s, namespace=namespace))
        results.append(evaluate(i, trigger, canary_value, stable_value))
    return Judgement(tuple(results), stale)


class PrometheusQuery:
    """`Query` through the Prometheus HTTP API at `url` (prometheus-api-client); an unusable Prometheus
    gives None (logged without the URL's credentials), never an exception."""

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._client = connect(self.url, timeout_s)

    def __call__(self, promql: str) -> float | None:
        try:
            return single_value(self._client.custom_query(promql))
        except UNUSABLE as e:
            log.warning("Prometheus at %s unusable for a rollout query (%s)", redacted(self.url), type(e).__name__)
            return None


def no_prometheus(_: str) -> float | None:
    """The `Query` when the operator has no Prometheus URL: every trigger is missing (rollouts with triggers
    hold as SignalsStale until GOVERNOR_PROMETHEUS_URL is set)."""
    return None
