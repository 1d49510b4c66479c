"""From request records to results: percentiles, throughput, goodput, the table and the JSON envelope.

Pure functions of data; nothing here touches the network.
"""

from __future__ import annotations

import math
import platform
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from governor.loadgen.client import RequestRecord

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99 in milliseconds of durations given in seconds (all None when there are none)."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys, None)
    ms = [s * 1000.0 for s in seconds]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None means not set. A request meets them when it succeeded,
    its TTFT and E2E are within bounds, and the mean of its inter-token gaps is within the ITL bound
    (vLLM judges TPOT the same way; a single-token request has no gaps and meets any ITL bound)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {value}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def met_by(self, r: RequestRecord) -> bool:
        """Whether `r` succeeded and met every objective that is set."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > self.ttft_ms):
            return False  # a request that delivered no text cannot meet a TTFT objective
        if self.itl_ms is not None and r.itl and sum(r.itl) / len(r.itl) * 1000 > self.itl_ms:
            return False
        return not (self.e2e_ms is not None and (r.e2e is None or r.e2e * 1000 > self.e2e_ms))


@dataclass
class BenchResult:
    """The outcome of one benchmark run. Latencies are dicts of mean/p50/p95/p99 in ms.

    Throughputs divide by `duration_s` (first send to last completion) and count completed requests
    only. Input tokens are the server's `usage.prompt_tokens` where it reported usage and the prompt's
    word count (an estimate) where it did not; `usage_reported` says for how many requests it did.
    ITL samples are the gaps between chunks carrying text, pooled over requests (as vLLM): a server that
    puts several tokens in one chunk shows fewer, longer gaps.
    """

    completed: int
    failed: int
    failures: dict[str, int]  # error kind → count: "http_429", "http_500", "timeout", "ConnectError", ...
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    usage_reported: int
    peak_in_flight: int  # most requests the client had outstanding at once
    # What TTFT and ITL time: "token_ids" when every completed stream carried token ids (a chunk per token,
    # even one with empty text), else "text_chunks" (only chunks with text; a token of no text waits for one)
    timing: str
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    slo: SLO
    good_requests: int | None  # requests meeting every given SLO; None when no SLO is given
    goodput: float | None  # good_requests / duration_s
    slo_attainment: float | None  # good_requests / (completed + failed): failed requests miss every SLO
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_dict(self, include_requests: bool = False) -> dict[str, Any]:
        """JSON-ready results; per-request records under "requests" only when asked for."""
        out = {k: v for k, v in asdict(self).items() if k != "records"}
        if include_requests:
            out["requests"] = [asdict(r) for r in self.records]
        return out


def build_result(records: Sequence[RequestRecord], duration_s: float, slo: SLO, peak_in_flight: int = 0
                 ) -> BenchResult:
    """Aggregate the records of the requests that were sent (completed or failed) over `duration_s`."""
    ok = [r for r in records if r.ok]
    failures = Counter(r.error_kind for r in records if r.error_kind is not None)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_words for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(slo.met_by(r) for r in records) if slo.given else None
    by_token_ids = bool(ok) and all(r.token_ids_received is not None for r in ok)
    return BenchResult(
        completed=len(ok),
        failed=len(records) - len(ok),
        failures=dict(sorted(failures.items())),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_token_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        usage_reported=sum(r.usage_reported for r in ok),
        peak_in_flight=peak_in_flight,
        timing="token_ids" if by_token_ids else "text_chunks",
        ttft_ms=summarize_ms([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=summarize_ms([gap for r in ok for gap in r.itl]),
        e2e_ms=summarize_ms([r.e2e for r in ok if r.e2e is not None]),
        slo=slo,
        good_requests=good,
        goodput=None if good is None else good * per_s,
        slo_attainment=None if good is None or not records else good / len(records),
        records=list(records),
    )


def format_table(result: BenchResult, title: str = "Serving benchmark") -> str:
    """A readable plain-text table of the results."""
    rows: list[tuple[str, Any]] = [
        ("Completed requests", result.completed),
        ("Failed requests", result.failed),
        *((f"  {kind}", n) for kind, n in result.failures.items()),
        ("Duration (s)", result.duration_s),
        ("Request throughput (req/s)", result.request_throughput),
        ("Output token throughput (tok/s)", result.output_token_throughput),
        ("Total token throughput (tok/s)", result.total_token_throughput),
        ("Input tokens" + ("" if result.usage_reported == result.completed else " (partly estimated)"),
         result.total_input_tokens),
        ("Output tokens", result.total_output_tokens),
        ("Peak requests in flight", result.peak_in_flight),
        ("TTFT/ITL timed at", result.timing),
    ]
    for name, stats in (("TTFT", result.ttft_ms), ("ITL", result.itl_ms), ("E2E", result.e2e_ms)):
        rows += [(f"{name} {stat} (ms)", value) for stat, value in stats.items()]
    if result.good_requests is not None:
        bounds = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in asdict(result.slo).items()
                           if v is not None)
        rows += [(f"SLO ({bounds})", ""), ("  Requests meeting SLO", result.good_requests),
                 ("  Goodput (req/s)", result.goodput), ("  SLO attainment", result.slo_attainment)]
    width = max(len(name) for name, _ in rows) + 2
    rule = "=" * (width + 14)
    lines = [f" {title} ".center(len(rule), "="),
             *(f"{name:<{width}}{_fmt(value):>14}" for name, value in rows), rule]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def client_info() -> dict[str, Any]:
    """The host the load came from (a loaded client inflates latencies; record where it ran)."""
    import httpx

    return {"host": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "httpx": httpx.__version__}


def make_envelope(args: dict[str, Any], base_url: str, url: str, model: str, result: BenchResult,
                  include_requests: bool = False) -> dict[str, Any]:
    """The experiment envelope: when, with which arguments, from which client, against which server and
    model, and the results (per-request records under "requests" when asked for). JSON-safe: an
    infinite rate is written as the string "inf"; the caller redacts secrets from `args`."""
    results = result.to_dict(include_requests)
    requests = results.pop("requests", None)
    envelope: dict[str, Any] = {
        "benchmark": "serve",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": {k: _json_safe(v) for k, v in args.items()},
        "client": client_info(),
        "server": {"base_url": base_url, "url": url},
        "model": model,
        "results": results,
    }
    if requests is not None:
        envelope["requests"] = requests
    return envelope


def _json_safe(value: Any) -> Any:
    # json.dumps would write Infinity, which strict JSON parsers (jq, Go) reject.
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value
