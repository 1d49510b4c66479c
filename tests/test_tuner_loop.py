"""The tuner loop (observe → decide → actuate → verify → keep or roll back) against scripted windows.

The source replays windows the test writes; the actuator records every call and answers like engines
whose gauge confirms (or not). No servers, no clock: `step(now)` takes the time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from governor.tuner.actuate import ActuationResult, EngineActuation, EngineStatus
from governor.tuner.loop import Tuner, TunerSettings
from governor.tuner.policy import Controller, Hold
from governor.tuner.records import (
    DecisionRecord,
    FanOut,
    HistorySink,
    JsonlSink,
    MetricsSink,
    Outcome,
    record_schema,
)
from governor.tuner.signals import SLO, Signals

SLO_ = SLO(ttft_p95_s=1.0, itl_p95_s=0.05)
BOUNDS = {"max_num_seqs": (4, 256), "max_num_batched_tokens": (256, 8192), "num_speculative_tokens": (0, 4)}
INTERVAL = 15.0
SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "decision-record.schema.json"


def window(**changes: object) -> Signals:
    """A fresh, healthy window: inside every band, batch with room, no queue."""
    base = Signals(time=0.0, ttft_p95_s=0.5, itl_p95_s=0.03, e2e_p95_s=3.0, queue_len=0.0, queue_time_p95_s=0.0,
                   kv_usage=0.3, preemption_rate=0.0, error_rate=0.0, throughput_tok_s=1000.0, spec_acceptance=None,
                   running=10.0, knobs={"max_num_seqs": 32, "max_num_batched_tokens": 2048,
                                        "num_speculative_tokens": 0}, age_s=1.0)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def queueing(ttft: float = 3.0, **changes: object) -> Signals:
    return window(ttft_p95_s=ttft, queue_len=20.0, **changes)


class Engines:
    """Source and actuator in one: knob values follow what was applied; `confirm` False refuses changes."""

    def __init__(self, windows: list[Signals]) -> None:
        self.windows = list(windows)
        self.knobs = dict(windows[0].knobs)
        self.calls: list[dict[str, int]] = []
        self.confirm = True

    def observe(self, now: float) -> Signals:
        w = self.windows.pop(0)
        return dataclasses.replace(w, time=now, knobs=dict(self.knobs) if w.knobs else {})

    def apply(self, changes: dict[str, int]) -> ActuationResult:
        self.calls.append(dict(changes))
        if self.confirm:
            self.knobs.update(changes)
            return ActuationResult(changes, (EngineActuation("http://e0", EngineStatus.OK, 200, "", dict(self.knobs)),))
        return ActuationResult(changes, (EngineActuation("http://e0", EngineStatus.HTTP_ERROR, 503, "draining"),))


def make_tuner(engines: Engines, **settings: object) -> tuple[Tuner, HistorySink]:
    controller = Controller(slo=SLO_, bounds=BOUNDS, consecutive=4, cooldown_s=60.0, max_actions_per_hour=10,
                            scrape_interval_s=INTERVAL, window="15s")
    sink = HistorySink(limit=100)
    tuner = Tuner("chat", "rev-1", controller, engines, engines, sink,
                  TunerSettings(**{"interval_s": INTERVAL, "settle_intervals": 2, "verify_intervals": 6,
                                   "backoff_s": 600.0, **settings}))  # type: ignore[arg-type]
    return tuner, sink


def run(tuner: Tuner, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        tuner.step(INTERVAL * (i + 1))


def outcomes(sink: HistorySink) -> list[tuple[int, str]]:
    return [(r.id, r.outcome.value) for r in sink.records]


def test_no_decision_before_a_full_baseline() -> None:
    engines = Engines([queueing()] * 5)
    tuner, sink = make_tuner(engines)
    run(tuner, 5)
    assert engines.calls == [] and list(sink.records) == []
    assert tuner.controller.hold is Hold.NO_BASELINE


def test_a_change_that_helps_is_applied_then_kept() -> None:
    engines = Engines([queueing()] * 6 + [window()] * 8)
    tuner, sink = make_tuner(engines)
    run(tuner, 6)
    assert engines.calls == [{"max_num_seqs": 48}]
    assert outcomes(sink) == [(1, "applied")]
    assert tuner.pending is not None and tuner.pending.id == 1
    assert (tuner.pending.decision.from_value, tuner.pending.decision.to_value) == (32, 48)
    run(tuner, 7, start=6)  # 2 settling + 5 of 6 verification windows
    assert outcomes(sink) == [(1, "applied")] and tuner.controller.hold is Hold.VERIFYING
    run(tuner, 1, start=13)
    assert outcomes(sink) == [(1, "applied"), (1, "kept")]
    kept = sink.records[-1]
    assert (kept.knob, kept.from_, kept.to, kept.reason) == ("max_num_seqs", 32, 48, "Queueing")
    ttft = next(e for e in kept.evidence if e.metric == "ttft_p95_s")
    assert ttft.value == pytest.approx(0.5)
    assert engines.knobs["max_num_seqs"] == 48


def test_a_regression_on_an_untargeted_metric_rolls_back_and_blocks_the_value() -> None:
    # TTFT improves, but ITL goes from 0.03 to 0.07: beyond its SLO band and significantly worse.
    engines = Engines([queueing()] * 6 + [window(itl_p95_s=0.07)] * 8 + [queueing()] * 12)
    tuner, sink = make_tuner(engines)
    run(tuner, 14)
    assert outcomes(sink) == [(1, "applied"), (1, "rolled_back")]
    rolled = sink.records[-1]
    assert [e.metric for e in rolled.evidence] == ["itl_p95_s"]
    assert rolled.evidence[0].value == pytest.approx(0.07)
    assert "restored max_num_seqs=32" in rolled.detail and "48 blocked until" in rolled.detail
    assert engines.calls == [{"max_num_seqs": 48}, {"max_num_seqs": 32}]
    # Queueing again: 48 and beyond are blocked, so the next step goes halfway (40), never to 48 again.
    run(tuner, 12, start=14)
    assert engines.calls[2] == {"max_num_seqs": 40}
    assert all(call["max_num_seqs"] < 48 for call in engines.calls[2:])


def test_a_change_that_wrecks_itl_is_rolled_back_before_the_window_ends() -> None:
    engines = Engines([queueing()] * 6 + [queueing(itl_p95_s=0.2)] * 8)
    tuner, sink = make_tuner(engines)
    run(tuner, 6)
    run(tuner, 4, start=6)  # 2 settling, then 2 windows with ITL 6x the before-median
    assert outcomes(sink) == [(1, "applied"), (1, "rolled_back")]
    assert "2 consecutive windows" in sink.records[-1].detail
    assert engines.knobs["max_num_seqs"] == 32


def test_a_lagging_ttft_rise_waits_for_the_full_window() -> None:
    # TTFT keeps rising for a while after a queueing fix (the backlog drains first): no fast rollback.
    engines = Engines([queueing(ttft=1.5)] * 6 + [queueing(ttft=9.0)] * 3 + [window()] * 5)
    tuner, sink = make_tuner(engines)
    run(tuner, 13)
    assert outcomes(sink) == [(1, "applied")]
    run(tuner, 1, start=13)
    assert outcomes(sink) == [(1, "applied"), (1, "kept")]  # the after-median is the drained queue


def test_a_tradeoff_inside_the_slos_is_not_a_regression() -> None:
    # ITL rises 0.02 → 0.03, significant and 50% worse, but still comfortably under 0.05·0.9: kept.
    engines = Engines([queueing(itl_p95_s=0.02)] * 6 + [window(itl_p95_s=0.03)] * 8)
    tuner, sink = make_tuner(engines)
    run(tuner, 14)
    assert outcomes(sink) == [(1, "applied"), (1, "kept")]


def test_throughput_is_judged_only_when_requests_queue() -> None:
    # Throughput halves after the change, but nothing queued afterwards: that is the offered load falling.
    engines = Engines([queueing()] * 6 + [window(throughput_tok_s=500.0)] * 8)
    tuner, sink = make_tuner(engines)
    run(tuner, 14)
    assert outcomes(sink) == [(1, "applied"), (1, "kept")]
    assert "throughput_tok_s" not in [e.metric for e in sink.records[-1].evidence]
    # With a queue on both sides, the same drop is a regression.
    engines = Engines([queueing()] * 6 + [queueing(ttft=2.0, throughput_tok_s=500.0)] * 8)
    tuner, sink = make_tuner(engines)
    run(tuner, 14)
    assert outcomes(sink) == [(1, "applied"), (1, "rolled_back")]
    assert [e.metric for e in sink.records[-1].evidence] == ["throughput_tok_s"]


def test_a_change_an_engine_does_not_confirm_is_reverted_and_not_counted() -> None:
    engines = Engines([queueing()] * 6)
    engines.confirm = False
    tuner, sink = make_tuner(engines)
    run(tuner, 6)
    assert outcomes(sink) == [(1, "not_confirmed")]
    assert engines.calls == [{"max_num_seqs": 48}, {"max_num_seqs": 32}]
    assert "http_error 503 (draining)" in sink.records[0].detail
    assert tuner.controller.action_times == [] and tuner.pending is None


def test_stale_signals_freeze_once_and_hold_verification() -> None:
    stale = window(ttft_p95_s=None, itl_p95_s=None, knobs={})
    engines = Engines([queueing()] * 6 + [window()] * 2 + [stale] * 5 + [window()] * 6)
    tuner, sink = make_tuner(engines)
    run(tuner, 8)  # the change is applied at window 6, then 2 settling windows
    run(tuner, 5, start=8)
    assert outcomes(sink) == [(1, "applied"), (2, "frozen")]
    frozen = sink.records[-1]
    assert (frozen.knob, frozen.reason) == (None, "SignalsStale")
    assert "verification of decision 1 waits" in frozen.detail
    assert tuner.frozen
    assert engines.calls == [{"max_num_seqs": 48}]
    run(tuner, 6, start=13)  # the 6 verification windows come only from fresh windows
    assert outcomes(sink) == [(1, "applied"), (2, "frozen"), (1, "kept")]
    assert not tuner.frozen


def test_settings_that_cannot_reach_significance_are_refused() -> None:
    engines = Engines([window()])
    controller = Controller(slo=SLO_, bounds=BOUNDS, consecutive=2, scrape_interval_s=INTERVAL)
    with pytest.raises(ValueError, match="raise the controller's `consecutive`"):
        Tuner("chat", "r", controller, engines, engines, HistorySink(),
              TunerSettings(interval_s=INTERVAL, verify_intervals=3))


def test_records_are_json_lines_matching_the_published_schema(tmp_path: Path) -> None:
    engines = Engines([queueing()] * 6 + [window(itl_p95_s=0.07)] * 8)
    tuner, _ = make_tuner(engines)
    tuner.sink = JsonlSink(tmp_path / "decisions.jsonl")
    run(tuner, 14)
    lines = (tmp_path / "decisions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["outcome"] for r in records] == ["applied", "rolled_back"]
    assert set(records[0]) == {"id", "time", "service", "revision", "knob", "from", "to", "reason", "evidence",
                               "outcome", "detail", "envelope"}
    assert records[0]["time"] == "1970-01-01T00:01:30Z"
    assert records[0]["envelope"] == {}  # this tuner was given no engine set-up
    for r in records:
        DecisionRecord.model_validate(r)


def test_the_schema_in_docs_matches_the_model() -> None:
    assert SCHEMA.exists(), "docs/decision-record.schema.json is missing: run `python -m governor.tuner.records`"
    on_disk = json.loads(SCHEMA.read_text())
    assert on_disk == record_schema(), "docs/decision-record.schema.json is stale: python -m governor.tuner.records"
    assert set(on_disk["properties"]["outcome"]["$ref"].split("/")[-1:]) == {"Outcome"}
    assert set(on_disk["$defs"]["Outcome"]["enum"]) == {o.value for o in Outcome}


def test_records_are_counted_in_metrics_and_a_failing_sink_does_not_stop_the_others() -> None:
    class Broken:
        def emit(self, record: DecisionRecord) -> None:
            raise OSError("disk full")

    registry = CollectorRegistry()
    history = HistorySink()
    engines = Engines([queueing()] * 6 + [window(itl_p95_s=0.07)] * 8)
    tuner, _ = make_tuner(engines)
    tuner.sink = FanOut([Broken(), MetricsSink(registry), history])
    run(tuner, 14)
    assert [r.outcome.value for r in history.records] == ["applied", "rolled_back"]
    for outcome in ("applied", "rolled_back"):
        labels = {"service": "chat", "knob": "max_num_seqs", "outcome": outcome}
        assert registry.get_sample_value("governor_tuner_decisions_total", labels) == 1.0
