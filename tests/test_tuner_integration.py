"""The whole loop on CPU: a real engine, a real Prometheus scraping it, the tuner reading PromQL and
actuating through the admin API. A load step (8 closed-loop clients against max_num_seqs 1) queues
requests; the tuner must raise max_num_seqs, and Prometheus must show the new value.

Bounded: the clients stop with the test (120 s at most); the tuner has 90 s to act.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from governor import contract
from governor.tuner.loop import EngineActuator, Tuner, TunerSettings
from governor.tuner.policy import Controller
from governor.tuner.prom import PrometheusSource
from governor.tuner.records import HistorySink, Outcome
from governor.tuner.signals import SLO
from tests.prometheus_server import PromServer, start_prometheus
from tests.test_server import Server, start_server

TOKEN = "integration-secret"
MODEL = "tuned"
REVISION = "r1"
SCRAPE_S = 1.0
INTERVAL_S = 2.0
BOUNDS = {"max_num_seqs": (1, 8), "max_num_batched_tokens": (64, 512), "num_speculative_tokens": (0, 0)}


@pytest.fixture(scope="module")
def engine(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--revision", REVISION,
                      "--max-model-len", "256", "--num-kv-blocks", "256", "--max-num-seqs", "1",
                      "--max-num-seqs-cap", "8", "--max-num-batched-tokens", "256",
                      "--max-num-batched-tokens-cap", "512", log_dir=tmp_path_factory.mktemp("logs"),
                      env={contract.ADMIN_TOKEN_ENV: TOKEN}) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(engine: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromServer]:
    with start_prometheus([engine.url.removeprefix("http://")], tmp_path_factory.mktemp("prom"),
                          scrape_interval_s=SCRAPE_S) as p:
        yield p


def load(url: str, clients: int, stop: threading.Event, deadline_s: float = 120.0, model: str = MODEL,
         max_tokens: int = 64) -> None:
    """`clients` closed-loop senders of greedy `max_tokens`-token completions to `model` until `stop` (or
    `deadline_s`)."""
    end = time.monotonic() + deadline_s

    def sender(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set() and time.monotonic() < end:
                with contextlib.suppress(httpx.HTTPError):  # the test ends while some are still queued
                    client.post(f"{url}/v1/completions", json={"model": model, "prompt": f"client {i} says",
                                                               "max_tokens": max_tokens, "temperature": 0.0,
                                                               "ignore_eos": True})

    for i in range(clients):
        threading.Thread(target=sender, args=(i,), daemon=True).start()


def test_a_load_step_makes_the_tuner_raise_max_num_seqs_visible_in_prometheus(engine: Server,
                                                                              prometheus: PromServer) -> None:
    source = PrometheusSource(prometheus.url, MODEL, REVISION, window_s=4.0, scrape_interval_s=SCRAPE_S)
    controller = Controller(slo=SLO(ttft_p95_s=0.3, itl_p95_s=10.0), bounds=BOUNDS, consecutive=4, cooldown_s=5.0,
                            max_actions_per_hour=60, scrape_interval_s=INTERVAL_S, window="4s")
    sink = HistorySink(limit=100)
    tuner = Tuner(MODEL, REVISION, controller, source, EngineActuator([engine.url], TOKEN), sink,
                  TunerSettings(interval_s=INTERVAL_S, settle_intervals=1, verify_intervals=5, backoff_s=600.0))
    stop = threading.Event()
    load(engine.url, 8, stop)
    time.sleep(2 * INTERVAL_S)  # the queue forms before the first window
    try:
        deadline = time.monotonic() + 90
        applied = []
        while time.monotonic() < deadline and not applied:
            time.sleep(INTERVAL_S)
            tuner.step(time.time())
            applied = [r for r in sink.records if r.outcome is Outcome.APPLIED]
        assert applied, f"no action within 90 s; records: {[r.to_json() for r in sink.records]}, " \
                        f"hold: {controller.hold}"
        first = applied[0]
        assert (first.knob, first.from_, first.to, first.reason) == ("max_num_seqs", 1, 2, "Queueing")
        ttft = next(e for e in first.evidence if e.metric == "ttft_p95_s")
        assert ttft.value is not None and ttft.value > 0.3
        # The engines' gauge, as Prometheus scraped it, shows the new value.
        query = f'governor_knob{{name="max_num_seqs",model_name="{MODEL}",revision="{REVISION}"}}'
        seen: list[float] = []
        for _ in range(20):
            seen = [float(r["value"][1]) for r in prometheus.query(query)]  # type: ignore[index]
            if seen == [2.0]:
                break
            time.sleep(0.5)
        assert seen == [2.0]
    finally:
        stop.set()
