"""The tuner's Prometheus source: PromQL over a real Prometheus scraping a real engine.

Pure tests for the PromQL it writes and how it reads results; then one `governor serve` process (tiny
Qwen3, admin token, revision r1, namespace team-a) and one Prometheus (Debian's binary) scraping it every
second, both on 127.0.0.1, beside an exporter of the same model name and revision in namespace team-b
(another team's service of the same name and spec), whose signals must not mix with team-a's. The traffic
fixture drives a few greedy completions between a scrape it waits for and one it waits for after, so the
window holds exactly that traffic, as does the direct scraper's. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from governor import contract
from governor.tuner.actuate import apply_knobs
from governor.tuner.cli import add_run_arguments, build_tuner
from governor.tuner.prom import (
    SAMPLE_METRICS,
    PrometheusSource,
    agreed_knobs,
    duration,
    matchers,
    redacted,
    signal_queries,
    single_value,
)
from governor.tuner.records import FanOut
from governor.tuner.scrape import EngineScraper
from governor.tuner.signals import Signals, is_stale
from tests import prometheus_server
from tests.metric_exporter import Exporter
from tests.prometheus_server import PromServer, start_prometheus
from tests.test_server import Server, admin, free_port, greedy_completions, start_server, wait_until

TOKEN = "tuner-prom-secret"
MODEL = "tuner-prom"
REVISION = "r1"
NAMESPACE = "team-a"
OTHER_NAMESPACE = "team-b"
SCRAPE_S = 1.0
WINDOW_S = 60.0
SIGNAL_FIELDS = {f.name for f in dataclasses.fields(Signals)} - {"time", "knobs", "age_s"}


# --- pure ---------------------------------------------------------------------------------------


def test_durations_are_whole_seconds_or_milliseconds() -> None:
    assert duration(30) == "30s"
    assert duration(1.5) == "1500ms"
    assert duration(0.25) == "250ms"
    with pytest.raises(ValueError):
        duration(0.0)


def test_the_selector_scopes_to_service_and_optional_revision_and_namespace_with_escaped_values() -> None:
    assert matchers("llama", "r7") == 'model_name="llama", revision="r7"'
    assert matchers("llama", None) == 'model_name="llama"'
    assert matchers("llama", "") == 'model_name="llama", revision=""'  # an engine without a revision
    assert matchers("llama", "r7", "team-a") == 'model_name="llama", revision="r7", namespace="team-a"'
    assert matchers("llama", None, namespace="team-a") == 'model_name="llama", namespace="team-a"'
    assert matchers('a"b\\c', None) == 'model_name="a\\"b\\\\c"'


def test_a_source_given_a_namespace_scopes_every_query_to_it() -> None:
    source = PrometheusSource("http://prom.invalid", "m", "r", window_s=30, scrape_interval_s=5, namespace="ns")
    for field, query in source.queries().items():
        assert query.count("{") == query.count('model_name="m", revision="r", namespace="ns"') > 0, field


@pytest.mark.parametrize(("flags", "sel"), [
    ([], 'model_name="chat", revision="r1"'),  # standalone engines: no namespace label to match
    (["--namespace", "team-a"], 'model_name="chat", revision="r1", namespace="team-a"'),
])
def test_tune_run_scopes_its_prometheus_queries_to_the_namespace_it_is_given(
        flags: list[str], sel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ADMIN_TOKEN_ENV, "t")
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--engine", "http://e0", "--service", "chat", "--revision", "r1", "--ttft-p95", "1",
                              "--itl-p95", "0.1", "--prometheus", "http://prom.invalid", *flags])
    source = build_tuner(args, FanOut([])).source
    assert isinstance(source, PrometheusSource) and source.sel == sel


def test_every_signal_has_a_query_and_p95_is_the_documented_histogram_quantile() -> None:
    q = signal_queries('model_name="m"', "30s")
    assert set(q) == SIGNAL_FIELDS
    assert q["ttft_p95_s"] == ('histogram_quantile(0.95, sum by (le) '
                               '(rate(governor_time_to_first_token_seconds_bucket{model_name="m"}[30s])))')
    assert q["throughput_tok_s"] == 'sum(rate(governor_generation_tokens_total{model_name="m"}[30s]))'
    assert q["queue_len"] == 'sum(governor_requests_waiting{model_name="m"})'


def test_the_error_rate_excludes_admin_api_refusals_and_unknown_routes_and_counts_absent_series_as_zero() -> None:
    q = signal_queries('model_name="m"', "30s")["error_rate"]
    kinds = "bad_knob|method_not_allowed|unauthorized|unknown_route"
    errors = f'(sum(increase(governor_request_errors_total{{model_name="m", kind!~"{kinds}"}}[30s])) or vector(0))'
    finished = '(sum(increase(governor_requests_finished_total{model_name="m"}[30s])) or vector(0))'
    assert q == f"{errors} / ({finished} + {errors})"


def test_results_without_a_finite_value_read_as_none() -> None:
    def vector(text: str) -> list[dict[str, Any]]:
        return [{"metric": {}, "value": [1700000000.0, text]}]

    assert single_value([]) is None
    assert single_value(vector("NaN")) is None
    assert single_value(vector("+Inf")) is None
    assert single_value(vector("0.25")) == 0.25


def test_knobs_that_engines_disagree_on_are_left_out() -> None:
    mins = {"max_num_seqs": 8.0, "max_num_batched_tokens": 128.0, "num_speculative_tokens": 0.0}
    maxs = {"max_num_seqs": 12.0, "max_num_batched_tokens": 128.0, "num_speculative_tokens": 0.0}
    counts = {"max_num_seqs": 2.0, "max_num_batched_tokens": 2.0, "num_speculative_tokens": 1.0}
    assert agreed_knobs(mins, maxs, counts, engines=2.0) == {"max_num_batched_tokens": 128}
    assert agreed_knobs(mins, maxs, counts, engines=None) == {"max_num_batched_tokens": 128,
                                                             "num_speculative_tokens": 0}
    assert agreed_knobs(mins, mins, counts, engines=2.0) == {"max_num_seqs": 8, "max_num_batched_tokens": 128}


def test_log_urls_lose_their_credentials() -> None:
    assert redacted("http://user:pw@prom.monitoring:9090/prometheus") == "http://prom.monitoring:9090/prometheus"
    assert redacted("https://prom") == "https://prom"


class CannedPrometheus:
    """Answers each instant query from a table (unknown query: no series), recording the evaluation times."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.times: list[float] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.times.append((params or {})["time"])
        return self.answers.get(query, [])


def test_observe_reads_every_field_at_one_time_and_ages_by_the_newest_knob_sample() -> None:
    source = PrometheusSource("http://prom.invalid", "m", "r", window_s=30, scrape_interval_s=5)
    q = source.queries()
    knob = {"metric": {"name": "max_num_seqs"}, "value": [995.0, "8"]}
    canned = CannedPrometheus({
        q["ttft_p95_s"]: [{"metric": {}, "value": [1000.0, "0.125"]}],
        q["itl_p95_s"]: [{"metric": {}, "value": [1000.0, "NaN"]}],
        q["knob_min"]: [knob], q["knob_max"]: [knob],
        q["knob_count"]: [{"metric": {"name": "max_num_seqs"}, "value": [995.0, "1"]}],
        q["knob_engines"]: [{"metric": {}, "value": [995.0, "1"]}],
        q["knob_newest"]: [{"metric": {}, "value": [1000.0, "997.5"]}],
    })
    source._client = canned
    s = source.observe(now=1000.0)
    assert set(canned.times) == {1000.0} and len(canned.times) == len(q)
    assert s.time == 1000.0 and s.age_s == 2.5
    assert s.ttft_p95_s == 0.125 and s.itl_p95_s is None and s.throughput_tok_s is None
    assert s.knobs == {"max_num_seqs": 8}


def test_a_missing_prometheus_fails_the_test_saying_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(prometheus_server.shutil, "which", lambda name: None)
    monkeypatch.setattr(prometheus_server, "DEBIAN_BINARY", tmp_path / "prometheus")
    with pytest.raises(pytest.fail.Exception, match=r"scripts/setup\.sh.*apt-get install -y prometheus"):
        prometheus_server.prometheus_binary()


# --- against a real engine and Prometheus -------------------------------------------------------


@pytest.fixture(scope="module")
def engine(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--revision", REVISION,
                      "--namespace", NAMESPACE,
                      "--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "8",
                      "--max-num-seqs-cap", "16", "--max-num-batched-tokens", "128",
                      "--max-num-batched-tokens-cap", "512", log_dir=tmp_path_factory.mktemp("logs"),
                      env={contract.ADMIN_TOKEN_ENV: TOKEN}) as s:
        yield s


@pytest.fixture(scope="module")
def other_team() -> Iterator[Exporter]:
    """Team-b's service of the same name and spec: slow, failing half its requests, and without knob gauges."""
    exporter = Exporter(MODEL, REVISION, OTHER_NAMESPACE, ttft_s=5.0, e2e_s=20.0, error_rate=0.5)
    yield exporter
    exporter.close()


@pytest.fixture(scope="module")
def prometheus(engine: Server, other_team: Exporter, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[PromServer]:
    with start_prometheus([engine.url.removeprefix("http://"), other_team.target],
                          tmp_path_factory.mktemp("prometheus"), scrape_interval_s=SCRAPE_S) as p:
        yield p


def source(prometheus: PromServer, service: str = MODEL, revision: str | None = REVISION,
           namespace: str | None = NAMESPACE) -> PrometheusSource:
    return PrometheusSource(prometheus.url, service, revision, window_s=WINDOW_S, scrape_interval_s=SCRAPE_S,
                            namespace=namespace)


def effective_knobs(engine: Server) -> dict[str, int]:
    r = admin(engine, "GET", token=TOKEN)
    assert r.status_code == 200, r.text
    return {k: int(r.json()[k]) for k in contract.KNOB_NAMES}


def scraped_total(prometheus: PromServer, metric: str) -> float | None:
    """What Prometheus last scraped of `metric` for the test's service (None before the first scrape)."""
    return single_value(prometheus.query(f"sum({metric}{{{matchers(MODEL, REVISION, NAMESPACE)}}})"))


@dataclasses.dataclass(frozen=True)
class Window:
    """The traffic fixture's window: wall-clock bounds, the direct scraper's signals and Prometheus'."""

    start: float
    end: float
    scraped: Signals
    observed: Signals


@pytest.fixture(scope="module")
def traffic(engine: Server, prometheus: PromServer) -> Window:
    # rate() needs a sample from before the traffic: wait for Prometheus' first scrape of the engine.
    wait_until(lambda: scraped_total(prometheus, contract.GENERATION_TOKENS) is not None,
               "Prometheus' first scrape of the engine", timeout=15)
    scraper = EngineScraper([engine.url], scrape_interval_s=SCRAPE_S)
    prev = scraper.scrape()
    start = time.time()
    greedy_completions(engine.url, MODEL, 6, "prometheus window")
    cur = scraper.scrape()
    end = time.time()
    generated = engine.metric(contract.GENERATION_TOKENS)
    assert generated >= 6 * 8
    wait_until(lambda: scraped_total(prometheus, contract.GENERATION_TOKENS) == generated,
               "a Prometheus scrape after the traffic", timeout=15)
    return Window(start, end, scraper.signals(prev, cur), source(prometheus).observe())


def bucket_index(seconds: float) -> int:
    """Index of the latency bucket holding `seconds` (its upper bound is LATENCY_BUCKETS[index])."""
    return bisect.bisect_left(contract.LATENCY_BUCKETS, seconds)


def test_observe_over_known_traffic(engine: Server, traffic: Window) -> None:
    s = traffic.observed
    for quantile in (s.ttft_p95_s, s.itl_p95_s, s.itl_p50_s, s.e2e_p95_s, s.queue_time_p95_s):
        assert quantile is not None and 0 < quantile < math.inf
    assert s.itl_p50_s is not None and s.itl_p95_s is not None and s.itl_p50_s <= s.itl_p95_s
    assert s.throughput_tok_s is not None and s.throughput_tok_s > 0
    assert s.prompt_tok_s is not None and s.prompt_tok_s > 0
    assert s.knobs == effective_knobs(engine)
    assert s.error_rate == 0.0 and s.preemption_rate == 0.0 and s.spec_acceptance is None
    assert s.queue_len == 0 and s.running == 0
    assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0
    assert 0.0 <= s.age_s < 2 * SCRAPE_S and not is_stale(s, SCRAPE_S)


def test_observe_agrees_with_the_direct_scraper(traffic: Window) -> None:
    prom, direct = traffic.observed, traffic.scraped
    assert prom.knobs == direct.knobs
    for name in ("queue_len", "running", "kv_usage", "preemption_rate", "error_rate", "spec_acceptance"):
        assert getattr(prom, name) == getattr(direct, name), name
    for name in ("ttft_p95_s", "itl_p95_s", "itl_p50_s", "e2e_p95_s", "queue_time_p95_s"):
        p, d = getattr(prom, name), getattr(direct, name)
        assert p is not None and d is not None, name
        # Same observations, same buckets: the interpolated quantile lies in the same bucket (or the next one).
        assert abs(bucket_index(p) - bucket_index(d)) <= 1, f"{name}: prometheus {p}, direct {d}"


def test_samples_cover_the_traffic(prometheus: PromServer, traffic: Window) -> None:
    src = source(prometheus)
    # A point sees the traffic once its look-back (step + 2 scrapes) holds the scrapes before and after it.
    end = traffic.end + 4 * SCRAPE_S
    time.sleep(max(0.0, end - time.time()))
    start = traffic.start - 2 * SCRAPE_S
    for metric in SAMPLE_METRICS:
        values = src.samples(metric, start, end, step=SCRAPE_S)
        assert values, metric
        assert all(math.isfinite(v) and v >= 0 for v in values), (metric, values)
    assert max(src.samples("ttft_p95_s", start, end, step=SCRAPE_S)) > 0
    assert set(src.samples("error_rate", start, end, step=SCRAPE_S)) == {0.0}
    with pytest.raises(ValueError, match="queue_len"):
        src.samples("queue_len", start, end, step=SCRAPE_S)


def test_a_knob_change_shows_through_prometheus(engine: Server, prometheus: PromServer) -> None:
    src = source(prometheus)
    before = effective_knobs(engine)["max_num_seqs"]
    try:
        assert apply_knobs([engine.url], {"max_num_seqs": 5}, TOKEN).applied
        wait_until(lambda: src.observe().knobs.get("max_num_seqs") == 5, "max_num_seqs=5 in Prometheus",
                   timeout=10)
    finally:
        assert apply_knobs([engine.url], {"max_num_seqs": before}, TOKEN).applied
    wait_until(lambda: src.observe().knobs.get("max_num_seqs") == before, "the restored max_num_seqs",
               timeout=10)


def test_another_service_revision_or_namespace_has_no_series_and_is_stale(prometheus: PromServer,
                                                                         traffic: Window) -> None:
    assert source(prometheus, revision=None).observe().knobs == traffic.observed.knobs  # every revision
    for src in (source(prometheus, service="no-such-service"), source(prometheus, revision="r2"),
                source(prometheus, namespace="team-c")):
        s = src.observe()
        assert s.knobs == {} and s.age_s == math.inf and is_stale(s, SCRAPE_S)
        assert all(getattr(s, name) is None for name in SIGNAL_FIELDS), s


def test_the_same_service_and_revision_in_another_namespace_is_not_mixed_in(engine: Server, prometheus: PromServer,
                                                                            traffic: Window) -> None:
    # Team-a's window (traffic.observed) agrees with the direct scraper of team-a's engine alone, and so does
    # an observation now: one engine, whose knobs count as agreed, and none of team-b's errors.
    ours = source(prometheus).observe()
    assert ours.knobs == effective_knobs(engine) and ours.error_rate in (0.0, None)
    theirs = source(prometheus, namespace=OTHER_NAMESPACE).observe()
    assert theirs.error_rate is not None and 0.3 < theirs.error_rate < 0.7
    assert theirs.ttft_p95_s is not None and 4.0 < theirs.ttft_p95_s <= 6.0  # the buckets around 5 s
    assert theirs.knobs == {}  # team-b exports no knob gauges: team-a's are not counted as theirs
    # Unscoped, two engines of which one has no knob gauges: no knob is agreed on, and team-b's errors count.
    both = source(prometheus, namespace=None).observe()
    assert both.knobs == {} and both.error_rate is not None and both.error_rate > 0


def test_an_unreachable_prometheus_gives_stale_signals_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://admin:hunter2@127.0.0.1:{free_port()}"
    src = PrometheusSource(url, MODEL, REVISION, window_s=WINDOW_S, scrape_interval_s=SCRAPE_S, timeout_s=2)
    caplog.set_level(logging.WARNING, logger="governor.tuner.prom")
    began = time.monotonic()
    s = src.observe()
    assert time.monotonic() - began < 2  # one refused connection ends the observation: no retries
    assert is_stale(s, SCRAPE_S) and s.age_s == math.inf and s.knobs == {}
    assert all(getattr(s, name) is None for name in SIGNAL_FIELDS)
    assert src.samples("ttft_p95_s", time.time() - 10, time.time(), 1.0) == []
    assert "ConnectionError" in caplog.text and "127.0.0.1" in caplog.text
    assert "hunter2" not in caplog.text


def test_a_server_that_is_not_prometheus_gives_stale_signals(engine: Server) -> None:
    s = PrometheusSource(engine.url, MODEL, REVISION, window_s=WINDOW_S, scrape_interval_s=SCRAPE_S).observe()
    assert is_stale(s, SCRAPE_S) and s.age_s == math.inf and s.ttft_p95_s is None
