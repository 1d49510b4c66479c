"""The tuner's I/O edges: scraping engines' `/metrics` into `Signals`, and applying knobs through the admin API.

Pure unit tests for the parser and quantiles, and one real `governor serve` process (tiny Qwen3, admin
token) on 127.0.0.1 for scrapes and knob changes. Every wait is bounded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from governor import contract
from governor.tuner.actuate import EngineStatus, apply_knobs
from governor.tuner.scrape import (
    EngineScrape,
    EngineScraper,
    Snapshot,
    histogram_quantile,
    parse_metrics,
    quantile_from_buckets,
    snapshot_of,
)
from governor.tuner.signals import is_stale
from tests.test_server import Server, free_port, greedy_completions, start_server

TOKEN = "tuner-io-secret"
MODEL = "tuner-io"
INF = math.inf


# --- pure ---------------------------------------------------------------------------------------


def test_quantile_interpolates_linearly_inside_the_bucket() -> None:
    # 10 observations: 2 in (0, 0.1], 6 in (0.1, 0.2], 2 in (0.2, 0.4]. Rank 0.95·10 = 9.5 lies in the
    # third bucket, 1.5 of its 2 observations in: 0.2 + 0.2·1.5/2 = 0.35.
    before = {0.1: 5.0, 0.2: 5.0, 0.4: 5.0, INF: 5.0}
    after = {0.1: 7.0, 0.2: 13.0, 0.4: 15.0, INF: 15.0}
    assert histogram_quantile(0.95, before, after) == pytest.approx(0.35)
    # Median: rank 5 lies in the second bucket, 3 of 6 in: 0.1 + 0.1·3/6 = 0.15.
    assert histogram_quantile(0.5, before, after) == pytest.approx(0.15)
    # The lowest bucket starts at 0: rank 1 of 2 → 0.05.
    assert histogram_quantile(0.1, before, after) == pytest.approx(0.05)


def test_quantile_edge_cases_follow_prometheus() -> None:
    # The rank falls in +Inf: the highest finite upper bound.
    assert quantile_from_buckets(0.95, {0.1: 1.0, 0.2: 1.0, INF: 10.0}) == 0.2
    # No observations in the window (Prometheus' NaN), or no +Inf bucket: None.
    same = {0.1: 3.0, INF: 4.0}
    assert histogram_quantile(0.95, same, same) is None
    assert quantile_from_buckets(0.5, {0.1: 3.0}) is None
    assert quantile_from_buckets(0.5, {}) is None
    # A counter reset (engine restart): the new counts are the delta.
    assert histogram_quantile(0.5, {0.1: 50.0, 1.0: 90.0, INF: 90.0}, {0.1: 0.0, 1.0: 4.0, INF: 4.0}) \
        == pytest.approx(0.1 + 0.9 * 2 / 4)
    with pytest.raises(ValueError):
        quantile_from_buckets(1.5, same)


EXPOSITION = """\
# HELP governor_knob Effective knob.
# TYPE governor_knob gauge
governor_knob{model_name="m",namespace="ns",revision="r",name="max_num_seqs"} {mns}
governor_knob{model_name="m",namespace="ns",revision="r",name="max_num_batched_tokens"} 128.0
governor_knob{model_name="m",namespace="ns",revision="r",name="num_speculative_tokens"} 0.0
# TYPE governor_generation_tokens_total counter
governor_generation_tokens_total{model_name="m",namespace="ns",revision="r"} {gen}
# TYPE governor_time_to_first_token_seconds histogram
governor_time_to_first_token_seconds_bucket{model_name="m",namespace="ns",revision="r",le="0.1"} {b1}
governor_time_to_first_token_seconds_bucket{model_name="m",namespace="ns",revision="r",le="+Inf"} {b2}
governor_time_to_first_token_seconds_count{model_name="m",namespace="ns",revision="r"} {b2}
governor_time_to_first_token_seconds_sum{model_name="m",namespace="ns",revision="r"} 1.0
# TYPE other_metric gauge
other_metric 3.0
"""


def exposition(mns: int = 8, gen: float = 0.0, b1: float = 0.0, b2: float = 0.0) -> str:
    return EXPOSITION.replace("{mns}", str(mns)).replace("{gen}", str(gen)).replace("{b1}", str(b1)) \
        .replace("{b2}", str(b2))


def test_parse_metrics_keeps_the_needed_samples_by_wire_name() -> None:
    m = parse_metrics(exposition(gen=42, b1=1, b2=2))
    assert "other_metric" not in m
    assert m[contract.GENERATION_TOKENS] == [({"model_name": "m", "namespace": "ns", "revision": "r"}, 42.0)]
    les = {lab["le"] for lab, _ in m[f"{contract.TTFT_SECONDS}_bucket"]}
    assert les == {"0.1", "+Inf"}


def test_signals_sum_engines_and_freeze_when_knobs_disagree() -> None:
    scraper = EngineScraper(["http://a", "http://b"], scrape_interval_s=5.0)

    def snap(t: float, mns_b: int, gen: float, b1: float, b2: float) -> Snapshot:
        return snapshot_of(t, [EngineScrape("http://a", parse_metrics(exposition(8, gen, b1, b2))),
                               EngineScrape("http://b", parse_metrics(exposition(mns_b, gen, b1, b2)))])

    prev, cur = snap(100.0, 8, 10, 0, 0), snap(110.0, 8, 60, 1, 2)
    s = scraper.signals(prev, cur, now=111.0)
    assert s.throughput_tok_s == pytest.approx(2 * 50 / 10)
    assert s.ttft_p95_s == pytest.approx(0.1)  # rank 3.8 of 4 lies in +Inf → highest finite bound
    assert s.knobs == {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_speculative_tokens": 0}
    assert s.age_s == pytest.approx(1.0)
    assert s.spec_acceptance is None  # no proposal series at all
    assert s.itl_p95_s is None and is_stale(s, 5.0)  # ITL is absent from this exposition: the tuner holds

    split = snap(110.0, 12, 60, 1, 2)
    assert split.knob_disagreement == {"max_num_seqs": {"http://a": 8, "http://b": 12}}
    s = scraper.signals(prev, split, now=111.0)
    assert "max_num_seqs" not in s.knobs and is_stale(s, 5.0)


def test_unknown_or_negative_knobs_are_refused_before_any_request() -> None:
    with pytest.raises(ValueError):
        apply_knobs(["http://127.0.0.1:9"], {"bogus": 1}, TOKEN)
    with pytest.raises(ValueError):
        apply_knobs(["http://127.0.0.1:9"], {"max_num_seqs": 0}, TOKEN)


def test_a_dead_engine_gives_a_failed_snapshot_and_stale_signals() -> None:
    scraper = EngineScraper([f"http://127.0.0.1:{free_port()}"], scrape_interval_s=1.0, timeout_s=1.0)
    prev = scraper.scrape(now=0.0)
    cur = scraper.scrape(now=1.0)
    assert cur.failed and next(iter(cur.errors.values())).startswith("Connect")
    s = scraper.signals(prev, cur, now=1.0)
    assert is_stale(s, 1.0) and s.age_s == math.inf and s.knobs == {}


# --- against a real engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--max-model-len", "256",
                      "--num-kv-blocks", "128", "--max-num-seqs", "8", "--max-num-seqs-cap", "16",
                      "--max-num-batched-tokens", "128", "--max-num-batched-tokens-cap", "512",
                      log_dir=tmp_path_factory.mktemp("logs"), env={contract.ADMIN_TOKEN_ENV: TOKEN}) as s:
        yield s


def effective_knobs(engine: Server) -> dict[str, int]:
    r = httpx.get(f"{engine.url}{contract.ADMIN_KNOBS_PATH}", headers={"Authorization": f"Bearer {TOKEN}"},
                  timeout=10)
    assert r.status_code == 200
    return {k: int(r.json()[k]) for k in contract.KNOB_NAMES}


def test_signals_over_known_traffic(engine: Server) -> None:
    scraper = EngineScraper([engine.url], scrape_interval_s=5.0)
    prev = scraper.scrape()
    assert not prev.failed
    greedy_completions(engine.url, MODEL, 4, "tuner window")
    cur = scraper.scrape()
    s = scraper.signals(prev, cur)
    assert s.throughput_tok_s is not None and s.throughput_tok_s > 0
    assert s.knobs == effective_knobs(engine)
    assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0
    assert s.ttft_p95_s is not None and s.ttft_p95_s > 0
    assert s.itl_p95_s is not None and s.e2e_p95_s is not None
    assert s.error_rate == 0.0 and s.preemption_rate == 0.0 and s.spec_acceptance is None
    assert s.queue_len == 0 and s.running == 0
    assert 0.0 <= s.age_s < 5.0 and not is_stale(s, 5.0)


def test_apply_knobs_changes_and_confirms_through_the_gauge(engine: Server,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    before = effective_knobs(engine)
    caplog.set_level(logging.DEBUG)
    try:
        result = apply_knobs([engine.url], {"max_num_seqs": 5}, TOKEN, timeout_s=10)
        assert result.applied, result.summary()
        (e,) = result.engines
        assert e.status is EngineStatus.OK and e.confirmed["max_num_seqs"] == 5
        assert effective_knobs(engine)["max_num_seqs"] == 5
        assert engine.metric(contract.KNOB, name="max_num_seqs") == 5
    finally:
        assert apply_knobs([engine.url], {"max_num_seqs": before["max_num_seqs"]}, TOKEN).applied
    assert TOKEN not in caplog.text and TOKEN not in repr(result)


def test_a_wrong_token_is_not_applied_and_reports_401(engine: Server) -> None:
    before = effective_knobs(engine)
    result = apply_knobs([engine.url], {"max_num_seqs": 3}, "not-the-token")
    assert not result.applied
    (e,) = result.engines
    assert e.status is EngineStatus.HTTP_ERROR and e.http_status == 401
    assert effective_knobs(engine) == before


def test_an_out_of_bounds_value_is_not_applied_and_reports_the_422_message(engine: Server) -> None:
    before = effective_knobs(engine)
    result = apply_knobs([engine.url], {"max_num_seqs": 17}, TOKEN)
    assert not result.applied
    (e,) = result.engines
    assert e.status is EngineStatus.HTTP_ERROR and e.http_status == 422 and "[1, 16]" in e.detail
    assert effective_knobs(engine) == before


def test_one_dead_engine_makes_the_change_not_applied(engine: Server) -> None:
    before = effective_knobs(engine)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        result = apply_knobs([engine.url, dead], {"max_num_seqs": 6}, TOKEN, timeout_s=2)
        assert not result.applied
        assert [e.status for e in result.engines] == [EngineStatus.OK, EngineStatus.UNREACHABLE]
    finally:
        assert apply_knobs([engine.url], {"max_num_seqs": before["max_num_seqs"]}, TOKEN).applied
