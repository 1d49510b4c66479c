"""The tuner's in-cluster observer: `Signals` of one service from Prometheus, through PromQL.

The counterpart of `governor.tuner.scrape.EngineScraper` (which reads the engines' `/metrics` itself) with
the same meaning for every field. Series are scoped by the engines' scope labels
(`governor.contract.SCOPE_LABELS`): `model_name` is the service's served model name, `revision`, when
given, one rollout revision (left out of the selector, every revision of the service is summed), and
`namespace`, when given, the service's Kubernetes namespace (the operator always gives it: two services of one
name and spec in two namespaces share the other two labels).

One observation is a batch of instant queries evaluated at one time `now`, over the window
`[now - window_s, now]`. A query that returns no series, or NaN (`histogram_quantile` of a window without
requests, 0/0), gives `None` for its field; the policy never guesses a value. Knobs whose effective value
differs across the service's engines (a change half applied, a rollout) are left out of `Signals.knobs`,
which makes the window stale, as with the direct scraper. `age_s` is how old the newest `governor_knob`
sample was at `now` (infinite when there is none). `PrometheusSource.samples` gives one guarded metric as a
range-query series, for the before/after comparison of verification.

A Prometheus that cannot be used (connection error, timeout, HTTP error, a body that is not a query
result) gives `Signals` whose every value is `None` and whose `age_s` is infinite: stale, so the
controller freezes. Nothing here raises for that; a warning is logged, without the URL's credentials.

Imports no torch and no kopf.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from governor import contract
from governor.tuner.scrape import ADMIN_ERROR_KINDS, QUANTILE, failed_signals
from governor.tuner.signals import Signals

log = logging.getLogger(__name__)

SAMPLE_METRICS = ("ttft_p95_s", "itl_p95_s", "e2e_p95_s", "error_rate", "throughput_tok_s")
"""The guarded metrics `PrometheusSource.samples` serves: field names of `Signals`."""

DEFAULT_TIMEOUT_S = 5
# A point of `samples` looks back its step plus this many scrape intervals: every pair of consecutive scrapes
# then lies inside some point's window (rate() sees only increases between samples inside its window).
SAMPLE_EXTRA_SCRAPES = 2

# Anything a query can end in when Prometheus is down, slow, misconfigured or answers something else.
UNUSABLE = (requests.RequestException, PrometheusApiClientException, ValueError, KeyError, TypeError, IndexError)


# --- PromQL -------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """A PromQL duration: whole seconds as `30s`, anything finer in milliseconds (`1500ms`).

    Raises `ValueError` for a duration under 1 ms (Prometheus rejects an empty range).
    """
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"a PromQL window must be at least 1 ms, got {seconds} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def window_for(interval_s: float, scrape_interval_s: float) -> float:
    """The PromQL window of one tuner interval: the interval, but at least two scrapes (rate() needs two
    samples)."""
    return max(interval_s, 2 * scrape_interval_s)


def label_value(value: str) -> str:
    """A PromQL string literal (double-quoted, Go escapes) holding `value`."""
    return json.dumps(value, ensure_ascii=False)


def matchers(service: str, revision: str | None, namespace: str | None = None) -> str:
    """Label matchers scoping a selector to `service` and, each unless None, `revision` and `namespace` (no
    braces). An empty value matches only series without that label (Prometheus stores no empty label)."""
    model_label, revision_label, namespace_label = contract.SCOPE_LABELS
    out = f"{model_label}={label_value(service)}"
    if revision is not None:
        out += f", {revision_label}={label_value(revision)}"
    if namespace is not None:
        out += f", {namespace_label}={label_value(namespace)}"
    return out


def signal_queries(sel: str, window: str) -> dict[str, str]:
    """PromQL for each value field of `Signals` (by field name), scoped by the matchers `sel` over `window`.

    `error_rate` counts a missing errors or finished series as 0 (the error series appear with the first
    error), so the ratio is 0/0 = NaN, i.e. None, only when the window holds no request at all.
    """
    def quantile(histogram: str, q: float = QUANTILE) -> str:
        return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{sel}}}[{window}])))"

    def per_second(counter: str) -> str:
        return f"sum(rate({counter}{{{sel}}}[{window}]))"

    def total(gauge: str) -> str:
        return f"sum({gauge}{{{sel}}})"

    admin_kinds = "|".join(sorted(ADMIN_ERROR_KINDS))
    errors = f'(sum(increase({contract.REQUEST_ERRORS}{{{sel}, kind!~"{admin_kinds}"}}[{window}])) or vector(0))'
    finished = f"(sum(increase({contract.REQUESTS_FINISHED}{{{sel}}}[{window}])) or vector(0))"
    return {
        "ttft_p95_s": quantile(contract.TTFT_SECONDS),
        "itl_p95_s": quantile(contract.ITL_SECONDS),
        "e2e_p95_s": quantile(contract.E2E_SECONDS),
        "queue_len": total(contract.REQUESTS_WAITING),
        "queue_time_p95_s": quantile(contract.QUEUE_SECONDS),
        "kv_usage": f"{total(contract.KV_BLOCKS_USED)} / {total(contract.KV_BLOCKS_TOTAL)}",
        "preemption_rate": per_second(contract.PREEMPTIONS),
        "error_rate": f"{errors} / ({finished} + {errors})",
        "throughput_tok_s": per_second(contract.GENERATION_TOKENS),
        "spec_acceptance": (f"sum(increase({contract.SPEC_ACCEPTED_TOKENS}{{{sel}}}[{window}]))"
                            f" / sum(increase({contract.SPEC_PROPOSED_TOKENS}{{{sel}}}[{window}]))"),
        "running": total(contract.REQUESTS_RUNNING),
        "itl_p50_s": quantile(contract.ITL_SECONDS, 0.5),
        "prompt_tok_s": per_second(contract.PROMPT_TOKENS),
    }


def knob_queries(sel: str) -> dict[str, str]:
    """PromQL for the effective knobs across the service's engines, and for the freshness of the data.

    `min`/`max`/`count` are per knob name; `engines` counts the engines (one `governor_engine_info` series
    each); `newest` is the timestamp of the newest knob sample.
    """
    knob = f"{contract.KNOB}{{{sel}}}"
    return {
        "min": f"min by (name) ({knob})",
        "max": f"max by (name) ({knob})",
        "count": f"count by (name) ({knob})",
        "engines": f"count({contract.ENGINE_INFO}{{{sel}}})",
        "newest": f"max(timestamp({knob}))",
    }


# --- query results ------------------------------------------------------------------------------

Vector = list[dict[str, Any]]
"""An instant query's result: [{"metric": {label: value}, "value": [time, "value"]}, ...]."""


def _finite(text: Any) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def single_value(result: Vector) -> float | None:
    """The value of a one-series result (an aggregation without `by`); None for no series, NaN or ±Inf."""
    if not result:
        return None
    return _finite(result[0]["value"][1])


def by_name(result: Vector) -> dict[str, float]:
    """A `... by (name)` result as name → value (non-finite values dropped)."""
    out: dict[str, float] = {}
    for series in result:
        value = _finite(series["value"][1])
        if value is not None:
            out[str(series["metric"]["name"])] = value
    return out


def agreed_knobs(mins: Mapping[str, float], maxs: Mapping[str, float], counts: Mapping[str, float],
                 engines: float | None) -> dict[str, int]:
    """The live knobs every engine reports with one value: min == max across the series and, when the number
    of engines is known, one series per engine (an engine lacking the gauge is a disagreement too)."""
    out: dict[str, int] = {}
    for name in contract.KNOB_NAMES:
        low, high = mins.get(name), maxs.get(name)
        if low is None or high is None or low != high:
            continue
        if engines is not None and counts.get(name) != engines:
            continue
        out[name] = int(low)
    return out


# --- the source ---------------------------------------------------------------------------------


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> PrometheusConnect:
    """A client for the Prometheus at `url`: no retries (the caller's next interval is the retry), queries
    failing after `timeout_s` (rounded up to whole seconds, the client's unit)."""
    return PrometheusConnect(url=url, disable_ssl=urlsplit(url).scheme == "http", retry=Retry(total=0),
                             timeout=max(1, math.ceil(timeout_s)))


def redacted(url: str) -> str:
    """`url` without user and password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class PrometheusSource:
    """Observes one service (and optionally one revision, and one namespace) through the Prometheus at `url`.

    `window_s` is the length of each observation window; `scrape_interval_s` is Prometheus' scrape interval
    for the engines (what freshness is judged against, see `governor.tuner.signals.is_stale`, and part of the
    window of `samples`). Queries fail after `timeout_s` (rounded up to whole seconds, the client's unit) and
    are not retried: the next tuner interval is the retry. Not thread-safe; one source per service loop.
    """

    def __init__(self, url: str, service: str, revision: str | None, window_s: float, scrape_interval_s: float,
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, namespace: str | None = None) -> None:
        if not service:
            raise ValueError("PrometheusSource needs the service's served model name (the model_name label)")
        self.url = url.rstrip("/")
        self.service = service
        self.revision = revision
        self.namespace = namespace
        self.window_s = window_s
        self.scrape_interval_s = scrape_interval_s
        self.sel = matchers(service, revision, namespace)
        self.window = duration(window_s)
        self._client = connect(self.url, timeout_s)

    def queries(self) -> dict[str, str]:
        """Every instant query of one observation: the `Signals` fields, then the knob and freshness queries
        (prefixed `knob_`)."""
        return signal_queries(self.sel, self.window) | {f"knob_{k}": q for k, q in knob_queries(self.sel).items()}

    def _warn(self, what: str, error: BaseException) -> None:
        # The type and Prometheus' own message; never the credentials a URL may carry.
        message = str(error)
        password = urlsplit(self.url).password
        if password:
            message = message.replace(password, "***")
        scope = self.service if self.namespace is None else f"{self.namespace}/{self.service}"
        log.warning("Prometheus at %s unusable for %s of %s (%s: %s)", redacted(self.url), what, scope,
                    type(error).__name__, message[:300])

    def observe(self, now: float | None = None) -> Signals:
        """`Signals` over `[now - window_s, now]` (default `now`: the clock), every query evaluated at `now`.

        Never raises for an unusable Prometheus: that gives all-None signals with `age_s` = inf (stale).
        """
        now_s = time.time() if now is None else now
        try:
            results = {field: self._client.custom_query(q, params={"time": now_s})
                       for field, q in self.queries().items()}
            values = {field: single_value(results[field]) for field in signal_queries(self.sel, self.window)}
            knobs = agreed_knobs(by_name(results["knob_min"]), by_name(results["knob_max"]),
                                 by_name(results["knob_count"]), single_value(results["knob_engines"]))
            newest = single_value(results["knob_newest"])
        except UNUSABLE as e:
            self._warn("an observation", e)
            return failed_signals(now_s)
        return Signals(
            time=now_s,
            ttft_p95_s=values["ttft_p95_s"],
            itl_p95_s=values["itl_p95_s"],
            e2e_p95_s=values["e2e_p95_s"],
            queue_len=values["queue_len"],
            queue_time_p95_s=values["queue_time_p95_s"],
            kv_usage=values["kv_usage"],
            preemption_rate=values["preemption_rate"],
            error_rate=values["error_rate"],
            throughput_tok_s=values["throughput_tok_s"],
            spec_acceptance=values["spec_acceptance"],
            running=values["running"],
            knobs=knobs,
            age_s=math.inf if newest is None else max(0.0, now_s - newest),
            itl_p50_s=values["itl_p50_s"],
            prompt_tok_s=values["prompt_tok_s"],
        )

    def samples(self, metric: str, start: float, end: float, step: float) -> list[float]:
        """The values of one guarded metric (a name in `SAMPLE_METRICS`) every `step` seconds from `start` to
        `end` (epoch seconds), for comparing the windows before and after a change.

        Each value summarizes the `step + 2 × scrape interval` before its time: every observation counts in
        some value, and values a step apart share only the observations of those two scrape intervals. Points
        without data (no request in that stretch) are left out; `start` and `end` are rounded to whole seconds.
        An unusable Prometheus gives an empty list (and a warning). Raises `ValueError` for an unknown metric.
        """
        if metric not in SAMPLE_METRICS:
            raise ValueError(f"no samples for {metric!r}: expected one of {', '.join(SAMPLE_METRICS)}")
        window = duration(step + SAMPLE_EXTRA_SCRAPES * self.scrape_interval_s)
        query = signal_queries(self.sel, window)[metric]
        try:
            result = self._client.custom_query_range(
                query, start_time=datetime.fromtimestamp(start, timezone.utc),
                end_time=datetime.fromtimestamp(end, timezone.utc), step=duration(step))
            points = sorted((float(t), v) for series in result for t, text in series["values"]
                            if (v := _finite(text)) is not None)
        except UNUSABLE as e:
            self._warn(f"samples of {metric}", e)
            return []
        return [v for _, v in points]
