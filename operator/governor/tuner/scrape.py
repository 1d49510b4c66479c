"""The tuner's embedded observer: direct scrapes of the engines' own `/metrics`, no Prometheus.

Two snapshots make one window; `EngineScraper.signals` turns a window into `Signals`, summed across
the engines of one service. Counters and histograms are differenced per engine (a counter that went
down means the engine restarted: its new value is the whole delta), then summed.

A scrape that fails on any engine (connection error, timeout, non-200, unparsable text) gives a
snapshot with `failed` set; a window with a failed end gives `Signals` whose every value is `None` and
whose `age_s` is infinite, so `governor.tuner.signals.is_stale` is True and the controller freezes.
Knob values that disagree across engines (a change half applied, a rollout) are left out of
`Signals.knobs`, which also makes the window stale; the disagreement is kept on the snapshot.

Imports no torch and no kopf.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from governor import contract
from governor.tuner.signals import Signals

Labels = dict[str, str]
Series = list[tuple[Labels, float]]
Metrics = dict[str, Series]
"""Parsed `/metrics`: sample name (as on the wire, e.g. `..._bucket`, `..._total`) → (labels, value) list."""

Buckets = dict[float, float]
"""One histogram's cumulative buckets: upper bound `le` (`math.inf` for `+Inf`) → observations ≤ le."""

HISTOGRAMS = (contract.TTFT_SECONDS, contract.ITL_SECONDS, contract.E2E_SECONDS, contract.QUEUE_SECONDS)
GAUGES = (contract.REQUESTS_RUNNING, contract.REQUESTS_WAITING, contract.KV_BLOCKS_USED, contract.KV_BLOCKS_TOTAL,
          contract.KNOB)
COUNTERS = (contract.GENERATION_TOKENS, contract.PROMPT_TOKENS, contract.PREEMPTIONS, contract.REQUESTS_FINISHED,
            contract.REQUEST_ERRORS, contract.SPEC_PROPOSED_TOKENS, contract.SPEC_ACCEPTED_TOKENS)
NEEDED_SAMPLES = frozenset({f"{h}_bucket" for h in HISTOGRAMS} | set(GAUGES) | set(COUNTERS))
"""The sample names `parse_metrics` keeps."""

# Error kinds of the admin API itself (the tuner's own calls, a wrong token): not the service failing.
# Errors that say nothing of how the model serves: the admin API's, and requests for paths or methods the server does
# not have (health checks of a load balancer, scanners). Left out of the error rate.
ADMIN_ERROR_KINDS = frozenset({"unauthorized", "bad_knob", "unknown_route", "method_not_allowed"})
QUANTILE = 0.95


# --- parsing and quantiles ----------------------------------------------------------------------


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus text exposition into the samples the tuner needs (`NEEDED_SAMPLES`).

    Raises `ValueError` on text the Prometheus parser rejects.
    """
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in NEEDED_SAMPLES:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(metrics: Mapping[str, Series], name: str, **labels: str) -> float | None:
    """Sum of the `name` samples whose labels include `labels`; None when no such series exists."""
    values = [v for lab, v in metrics.get(name, []) if labels.items() <= lab.items()]
    return sum(values) if values else None


def buckets_of(metrics: Mapping[str, Series], histogram: str) -> Buckets:
    """Cumulative buckets of `histogram` (summed by `le` over its series); empty when it is not exported."""
    out: Buckets = {}
    for lab, v in metrics.get(f"{histogram}_bucket", []):
        le = float(lab["le"])  # float("+Inf") == inf
        out[le] = out.get(le, 0.0) + v
    return out


def counter_delta(before: float | None, after: float | None) -> float | None:
    """Increase of a counter between two reads; a decrease means a restart, so the new value is the increase."""
    if after is None:
        return None
    if before is None or after < before:
        return after
    return after - before


def bucket_delta(before: Buckets, after: Buckets) -> Buckets:
    """Per-bucket increase between two reads of one histogram (a reset in any bucket: `after` is the delta)."""
    if any(after.get(le, 0.0) < v for le, v in before.items()):
        return dict(after)
    return {le: v - before.get(le, 0.0) for le, v in after.items()}


def quantile_from_buckets(q: float, buckets: Buckets) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative `buckets`: linear interpolation inside the bucket
    holding rank q·count, the lowest bucket starting at 0, and the upper bound of the highest finite bucket
    when the rank falls in `+Inf`. None when the buckets hold no observation (Prometheus' NaN) or lack `+Inf`.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if math.inf not in buckets or len(buckets) < 2:
        return None
    bounds = sorted(buckets)
    # Cumulative counts must not decrease; smooth out scrape races the way Prometheus does.
    counts: list[float] = []
    for le in bounds:
        counts.append(max(buckets[le], counts[-1] if counts else 0.0))
    count = counts[-1]
    if count <= 0:
        return None
    rank = q * count
    i = next(j for j, c in enumerate(counts) if c >= rank)
    if bounds[i] == math.inf:
        return bounds[-2]
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[i - 1] if i > 0 else 0.0
    below = counts[i - 1] if i > 0 else 0.0
    in_bucket = counts[i] - below
    if in_bucket <= 0:
        return bounds[i]
    return start + (bounds[i] - start) * (rank - below) / in_bucket


def histogram_quantile(q: float, buckets_before: Buckets, buckets_after: Buckets) -> float | None:
    """The q-quantile of the observations made between two reads of one histogram's cumulative buckets."""
    return quantile_from_buckets(q, bucket_delta(buckets_before, buckets_after))


# --- snapshots ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineScrape:
    """One engine's `/metrics` at one moment; `error` (and no metrics) when the scrape failed."""

    url: str
    metrics: Metrics | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.metrics is not None


@dataclass(frozen=True)
class Snapshot:
    """Every engine's `/metrics` at `time` (epoch seconds). `failed` when any engine could not be read.

    `knob_disagreement` maps each knob whose effective value differs across engines to its value per URL
    (a URL missing the gauge maps to None); such knobs are left out of `knobs`.
    """

    time: float
    engines: tuple[EngineScrape, ...]
    knobs: dict[str, int] = field(default_factory=dict)
    knob_disagreement: dict[str, dict[str, int | None]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return not self.engines or not all(e.ok for e in self.engines)

    @property
    def errors(self) -> dict[str, str]:
        """URL → why its scrape failed."""
        return {e.url: e.error or "no metrics" for e in self.engines if not e.ok}


def knob_values(metrics: Mapping[str, Series]) -> dict[str, int]:
    """The effective value of each live knob, from the `governor_knob{name=...}` gauge."""
    out: dict[str, int] = {}
    for lab, v in metrics.get(contract.KNOB, []):
        name = lab.get("name")
        if name in contract.KNOB_NAMES:
            out[name] = int(v)
    return out


def snapshot_of(time_s: float, engines: Iterable[EngineScrape]) -> Snapshot:
    """Assemble a snapshot: agreed knobs, and the knobs the engines disagree on."""
    engines = tuple(engines)
    per_engine = {e.url: knob_values(e.metrics) for e in engines if e.metrics is not None}
    knobs: dict[str, int] = {}
    disagreement: dict[str, dict[str, int | None]] = {}
    if per_engine:
        for name in contract.KNOB_NAMES:
            values = {url: kv.get(name) for url, kv in per_engine.items()}
            distinct = set(values.values())
            if len(distinct) == 1 and None not in distinct:
                knobs[name] = next(v for v in distinct if v is not None)
            elif distinct != {None}:
                disagreement[name] = values
    return Snapshot(time_s, engines, knobs, disagreement)


def failed_signals(time_s: float) -> Signals:
    return Signals(time=time_s, ttft_p95_s=None, itl_p95_s=None, e2e_p95_s=None, queue_len=None,
                   queue_time_p95_s=None, kv_usage=None, preemption_rate=None, error_rate=None,
                   throughput_tok_s=None, spec_acceptance=None, running=None, knobs={}, age_s=math.inf)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


class EngineScraper:
    """Scrapes `/metrics` of every engine URL of one service and builds `Signals` over a window.

    `urls` are base URLs (`http://host:port`); `scrape_interval_s` is the tuner's interval, also the scrape
    timeout bound. Not thread-safe; one scraper per service loop.
    """

    def __init__(self, urls: list[str], scrape_interval_s: float, timeout_s: float | None = None) -> None:
        if not urls:
            raise ValueError("EngineScraper needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.scrape_interval_s = scrape_interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(0.5, min(10.0, scrape_interval_s / 2))

    def _scrape_one(self, client: httpx.Client, url: str) -> EngineScrape:
        try:
            r = client.get(f"{url}/metrics")
        except httpx.HTTPError as e:
            return EngineScrape(url, None, f"{type(e).__name__}: {e}")
        if r.status_code != 200:
            return EngineScrape(url, None, f"HTTP {r.status_code}: {r.text[:200]}")
        try:
            return EngineScrape(url, parse_metrics(r.text))
        except ValueError as e:
            return EngineScrape(url, None, f"unparsable /metrics: {e}")

    def scrape(self, now: float | None = None) -> Snapshot:
        """Read every engine's `/metrics` (concurrently) into a snapshot stamped `now` (default: the clock)."""
        stamp = time.time() if now is None else now
        with httpx.Client(timeout=self.timeout_s) as client, \
                ThreadPoolExecutor(max_workers=min(16, len(self.urls))) as pool:
            engines = list(pool.map(lambda u: self._scrape_one(client, u), self.urls))
        return snapshot_of(stamp, engines)

    def signals(self, prev: Snapshot, cur: Snapshot, now: float | None = None) -> Signals:
        """`Signals` over the window from `prev` to `cur`, summed across engines.

        Latencies are p95 (ITL also p50) of the histogram deltas; `queue_len`, `running`, `kv_usage` are read at `cur`;
        rates are per second over the window; `error_rate` is the fraction errors / (finished + errors)
        (admin-API refusals excluded). `age_s` is `now` (default: the clock) − `cur.time`. A failed snapshot
        at either end, or a window of no positive length, gives all-None signals with `age_s` = inf (stale).
        """
        now_s = time.time() if now is None else now
        seconds = cur.time - prev.time
        if prev.failed or cur.failed or seconds <= 0:
            return failed_signals(cur.time)
        before = {e.url: e.metrics for e in prev.engines if e.metrics is not None}
        after = [(e.url, e.metrics) for e in cur.engines if e.metrics is not None]

        def quantile(histogram: str, q: float = QUANTILE) -> float | None:
            summed: Buckets = {}
            for url, m in after:
                delta = bucket_delta(buckets_of(before.get(url, {}), histogram), buckets_of(m, histogram))
                for le, v in delta.items():
                    summed[le] = summed.get(le, 0.0) + v
            return quantile_from_buckets(q, summed)

        def increase(name: str, **labels: str) -> float | None:
            parts = [counter_delta(total(before.get(url, {}), name, **labels), total(m, name, **labels))
                     for url, m in after]
            present = [p for p in parts if p is not None]
            return sum(present) if present else None

        def gauge(name: str) -> float | None:
            parts = [v for _, m in after if (v := total(m, name)) is not None]
            return sum(parts) if parts else None

        def errors() -> float:
            parts: list[float] = []
            for url, m in after:
                kinds = {lab.get("kind", "") for lab, _ in m.get(contract.REQUEST_ERRORS, [])}
                for kind in kinds - ADMIN_ERROR_KINDS:
                    d = counter_delta(total(before.get(url, {}), contract.REQUEST_ERRORS, kind=kind),
                                      total(m, contract.REQUEST_ERRORS, kind=kind))
                    if d is not None:
                        parts.append(d)
            return sum(parts)  # the series appear with the first error: none yet means 0

        finished = increase(contract.REQUESTS_FINISHED)
        err = errors()
        generated = increase(contract.GENERATION_TOKENS)
        prompted = increase(contract.PROMPT_TOKENS)
        preempted = increase(contract.PREEMPTIONS)
        proposed = increase(contract.SPEC_PROPOSED_TOKENS)
        accepted = increase(contract.SPEC_ACCEPTED_TOKENS)
        return Signals(
            time=cur.time,
            ttft_p95_s=quantile(contract.TTFT_SECONDS),
            itl_p95_s=quantile(contract.ITL_SECONDS),
            e2e_p95_s=quantile(contract.E2E_SECONDS),
            queue_len=gauge(contract.REQUESTS_WAITING),
            queue_time_p95_s=quantile(contract.QUEUE_SECONDS),
            kv_usage=_ratio(gauge(contract.KV_BLOCKS_USED), gauge(contract.KV_BLOCKS_TOTAL)),
            preemption_rate=None if preempted is None else preempted / seconds,
            error_rate=_ratio(err, (finished or 0.0) + err),
            throughput_tok_s=None if generated is None else generated / seconds,
            spec_acceptance=_ratio(accepted, proposed),
            running=gauge(contract.REQUESTS_RUNNING),
            knobs=dict(cur.knobs),
            age_s=max(0.0, now_s - cur.time),
            itl_p50_s=quantile(contract.ITL_SECONDS, 0.5),
            prompt_tok_s=None if prompted is None else prompted / seconds,
        )
