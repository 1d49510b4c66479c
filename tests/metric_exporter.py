"""A small exporter the test controls, standing in for one revision's engines on Prometheus' side.

It serves the engine's own metric names and labels (`governor.contract`) for one (model_name, revision,
namespace): `governor_engine_info`, the TTFT/ITL/E2E histograms with the engine's buckets, finished and error
counters and generated tokens, fed by a background thread with `rate_hz` synthetic requests a second whose
latencies are `ttft_s` (and `itl_s`, `e2e_s`) ± 5%. `silent = True` makes /metrics answer 503, so
Prometheus' scrapes fail and the revision's series go stale, as when its pods stop answering.
On 127.0.0.1 only; the feeding thread stops with `close()`.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from governor import contract

SCOPE = list(contract.SCOPE_LABELS)


@dataclass
class Exporter:
    model: str
    revision: str
    namespace: str = ""
    ttft_s: float = 0.1
    itl_s: float = 0.02
    e2e_s: float = 1.0
    error_rate: float = 0.0
    rate_hz: float = 50.0
    silent: bool = False
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, b = self.registry, contract.LATENCY_BUCKETS
        labels = dict(zip(SCOPE, (self.model, self.revision, self.namespace), strict=True))
        Gauge(contract.ENGINE_INFO, "engine identity", SCOPE, registry=r).labels(**labels).set(1)
        self._ttft = Histogram(contract.TTFT_SECONDS, "ttft", SCOPE, buckets=b, registry=r).labels(**labels)
        self._itl = Histogram(contract.ITL_SECONDS, "itl", SCOPE, buckets=b, registry=r).labels(**labels)
        self._e2e = Histogram(contract.E2E_SECONDS, "e2e", SCOPE, buckets=b, registry=r).labels(**labels)
        self._finished = Counter(contract.REQUESTS_FINISHED.removesuffix("_total"), "finished",
                                 [*SCOPE, "finish_reason"], registry=r).labels(**labels, finish_reason="length")
        self._errors = Counter(contract.REQUEST_ERRORS.removesuffix("_total"), "errors", [*SCOPE, "kind"],
                               registry=r).labels(**labels, kind="internal")
        self._tokens = Counter(contract.GENERATION_TOKENS.removesuffix("_total"), "tokens", SCOPE,
                               registry=r).labels(**labels)
        self._stop = threading.Event()
        self._rng = random.Random(f"{self.namespace}/{self.model}/{self.revision}")
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if exporter.silent or self.path != "/metrics":
                    self.send_response(503 if exporter.silent else 404)
                    self.end_headers()
                    return
                body = generate_latest(exporter.registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        threading.Thread(target=self._feed, daemon=True).start()

    def _jitter(self, value: float) -> float:
        return value * self._rng.uniform(0.95, 1.05)

    def _feed(self) -> None:
        while not self._stop.wait(1.0 / self.rate_hz):
            self._ttft.observe(self._jitter(self.ttft_s))
            self._itl.observe(self._jitter(self.itl_s))
            self._e2e.observe(self._jitter(self.e2e_s))
            self._tokens.inc(16)
            if self._rng.random() < self.error_rate:
                self._errors.inc()
            else:
                self._finished.inc()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
