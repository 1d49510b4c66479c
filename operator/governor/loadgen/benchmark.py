"""The load loop: release requests on the arrival schedule, cap how many are in flight, gather records.

Bounded by construction: at most `num_prompts` requests are sent, none is sent after `duration_s`,
and each one ends within `timeout_s`; so a run ends within duration + timeout (or, without a
duration, after the last arrival plus the queue the concurrency cap builds, each request ≤ timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field

import httpx

from governor.loadgen.client import ENDPOINTS, RequestRecord, endpoint_url, request_body, send_request
from governor.loadgen.report import SLO, BenchResult, build_result
from governor.loadgen.workload import RequestSpec, Workload, arrival_offsets

KEEPALIVE_EXPIRY_S = 2.0


@dataclass
class BenchConfig:
    """One `governor bench serve` run. Lengths are (a, b) ranges, uniform per request; `input_len` is in
    words (about one token each for the built-in word list) after `shared_prefix_len` shared words."""

    base_url: str
    model: str
    endpoint: str = "completions"  # "completions" or "chat"
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends every request at once
    max_concurrency: int | None = None  # most requests in flight; None for no cap
    num_prompts: int = 1000
    duration_s: float | None = None  # no request is sent after this many seconds
    input_len: tuple[int, int] = (1024, 1024)
    output_len: tuple[int, int] = (128, 128)
    shared_prefix_len: int = 0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    api_key: str | None = None
    timeout_s: float = 300.0  # per request, from send to [DONE]
    ignore_eos: bool = True
    return_token_ids: bool = False  # vLLM's extension: time chunks carrying token ids, not only text

    def __post_init__(self) -> None:
        problems = []
        if not self.base_url.startswith(("http://", "https://")):
            problems.append(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            problems.append(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            problems.append(f"request_rate must be > 0 requests/s (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"max_concurrency must be >= 1 (or unset), got {self.max_concurrency}")
        if self.num_prompts < 1:
            problems.append(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            problems.append(f"duration must be a finite number of seconds > 0, got {self.duration_s}")
        if self.shared_prefix_len < 0:
            problems.append(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if not 0 < self.timeout_s < math.inf:
            problems.append(f"timeout must be a finite number of seconds > 0, got {self.timeout_s}")
        for name, (a, b) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not 1 <= a <= b:
                problems.append(f"{name} must be (a, b) with 1 <= a <= b, got {(a, b)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def url(self) -> str:
        return endpoint_url(self.base_url, self.endpoint)

    @property
    def workload(self) -> Workload:
        return Workload(self.input_len, self.output_len, self.shared_prefix_len, self.seed)


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Drive `config.url` with the configured workload and return the aggregated result."""
    url = config.url
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    in_flight = peak = 0

    # The semaphore is the only concurrency limit: an unbounded pool keeps httpx from queueing
    # requests itself (that wait would be counted as TTFT). trust_env=False: never measure a proxy.
    # Idle connections expire after 2 s, before a server's own keep-alive timeout (uvicorn's default, and
    # so `governor serve`'s and vLLM's, is 5 s): with both at 5 s a request can be written to a connection
    # the server is closing, and fails with a ReadError that is the client's doing, not the server's.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        deadline = t0 + config.duration_s if config.duration_s is not None else math.inf

        async def issue(spec: RequestSpec, scheduled: float) -> RequestRecord | None:
            nonlocal in_flight, peak
            async with slots or contextlib.nullcontext():
                if time.perf_counter() >= deadline:
                    return None  # waited for a slot past the end: never sent, so not counted
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    record = RequestRecord(spec.index, spec.prompt_words, spec.max_tokens, scheduled - t0)
                    body = request_body(spec, config.model, config.endpoint, config.ignore_eos,
                                        config.return_token_ids)
                    return await send_request(client, url, body, headers, record, t0, config.timeout_s)
                finally:
                    in_flight -= 1

        tasks = []
        arrivals = arrival_offsets(config.num_prompts, config.request_rate, config.seed)
        for spec, offset in zip(config.workload.requests(config.num_prompts), arrivals, strict=True):
            at = t0 + offset
            if at >= deadline:
                break
            if (delay := at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(issue(spec, at)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    records = [r for r in results if r is not None]
    return build_result(records, duration, config.slo, peak)


def run(config: BenchConfig) -> BenchResult:
    """Synchronous `run_benchmark` (runs its own event loop; call it from code that has none running)."""
    return asyncio.run(run_benchmark(config))
