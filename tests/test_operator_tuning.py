"""The tuner inside the operator (`governor.operator.tuning`).

Pure pieces first (pod → engine URL, the admin token, Events, the status document, the per-service loop
with scripted windows), then the real operator (`governor operator -A`, kopf) against KMock's emulator:

- with a real CPU engine and a real Prometheus scraping it every second, the tuner raises max_num_seqs
  under load through the engine's admin API and records the decision in status.tuning and an Event, and
  the spec is never written. The emulator has no kubelet, so the test creates the engine's Pod object
  itself (service and revision labels, phase Running, Ready=True, podIP 127.0.0.1, container `engine` with
  port `http` = the engine's port), and pre-creates the admin-token Secret the engine was started with
  (the operator keeps an existing Secret);
- during a real rollout (a changed image starts a canary, which never gets ready pods here) the tuner holds
  still, and starts afresh when the rollout ends;
- without GOVERNOR_PROMETHEUS_URL it reports NoPrometheus.

Every wait is bounded; servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from governor import contract
from governor.operator.api import InferenceServiceSpec
from governor.operator.render import ADMIN_TOKEN_KEY, LABEL_REVISION, LABEL_SERVICE, PORT, revision_hash
from governor.operator.tuning import (
    ACTIVE,
    NO_PROMETHEUS,
    PROMETHEUS_URL_ENV,
    ROLLOUT_IN_PROGRESS,
    SCRAPE_INTERVAL_ENV,
    SIGNALS_STALE,
    ServiceTuning,
    StatusSink,
    TuningConfig,
    admin_token,
    engine_urls,
    prometheus_source,
    record_event,
    tuner_bounds,
)
from governor.operator.validation import parse_spec
from governor.tuner.prom import PrometheusSource
from governor.tuner.records import DecisionRecord, Outcome
from tests.chart import operator_bindings
from tests.kube_emulator import Cluster, Grants, start_emulator
from tests.prometheus_server import PromServer, start_prometheus
from tests.test_operator_kopf import IS_PATH, NS, Operator, create_service, get, status_of, wait_for
from tests.test_server import Server, free_port, start_server
from tests.test_tuner_integration import MODEL, load
from tests.test_tuner_loop import Engines, queueing, window

# --- pure pieces ------------------------------------------------------------------------------------


def pod(name: str, *, ip: str | None = "10.0.0.7", phase: str = "Running", ready: str = "True",
        labels: dict[str, str] | None = None, port: int | None = 9000) -> dict[str, Any]:
    ports = [] if port is None else [{"name": "metrics", "containerPort": 9999},
                                     {"name": "http", "containerPort": port}]
    return {"metadata": {"name": name, "labels": {LABEL_SERVICE: "chat", LABEL_REVISION: "r1"} if labels is None
                         else labels},
            "spec": {"containers": [{"name": "sidecar", "ports": [{"name": "http", "containerPort": 1}]},
                                    {"name": "engine", "ports": ports}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}


def test_only_ready_running_engines_of_the_revision_are_actuated() -> None:
    pods = [pod("a", ip="10.0.0.2"), pod("b", ip="10.0.0.1", port=None), pod("c", ready="False"),
            pod("d", phase="Pending"), pod("e", ip=None),
            pod("f", labels={LABEL_SERVICE: "chat", LABEL_REVISION: "r0"}),
            pod("g", labels={LABEL_SERVICE: "other", LABEL_REVISION: "r1"})]
    assert engine_urls(pods, "chat", "r1") == [f"http://10.0.0.1:{PORT}", "http://10.0.0.2:9000"]


def test_the_admin_token_is_read_from_data_or_string_data() -> None:
    assert admin_token({"data": {ADMIN_TOKEN_KEY: base64.b64encode(b"s3cret").decode()}}) == "s3cret"
    assert admin_token({"stringData": {ADMIN_TOKEN_KEY: "given"}}) == "given"
    with pytest.raises(ValueError, match="no 'token' key"):
        admin_token({"metadata": {"name": "chat-admin-token"}, "data": {}})


def record(id_: int, outcome: Outcome, knob: str | None = "max_num_seqs", detail: str = "") -> DecisionRecord:
    return DecisionRecord.model_validate({
        "id": id_, "time": "2026-01-01T00:00:00Z", "service": "chat", "revision": "r1", "knob": knob,
        "from": None if knob is None else 4, "to": None if knob is None else 6,
        "reason": "SignalsStale" if knob is None else "Queueing", "evidence": [], "outcome": outcome,
        "detail": detail})


def test_each_record_becomes_an_event_named_for_its_outcome() -> None:
    assert record_event(record(3, Outcome.APPLIED, detail="http://e0: ok 200")) == (
        "Normal", "TunerApplied", "decision 3: max_num_seqs 4→6 (Queueing); http://e0: ok 200")
    assert record_event(record(3, Outcome.KEPT))[:2] == ("Normal", "TunerKept")
    assert record_event(record(3, Outcome.ROLLED_BACK))[:2] == ("Warning", "TunerRolledBack")
    assert record_event(record(3, Outcome.NOT_CONFIRMED))[:2] == ("Warning", "TunerNotConfirmed")
    assert record_event(record(4, Outcome.FROZEN, knob=None, detail="signals stale")) == (
        "Warning", "TunerFrozen", "decision 4: SignalsStale; signals stale")


def test_the_status_history_is_bounded_and_keeps_what_status_held() -> None:
    sink = StatusSink([{"id": 0, "outcome": "kept"}], limit=20)
    for i in range(1, 25):
        sink.emit(record(i, Outcome.APPLIED))
    assert [h["id"] for h in sink.history] == list(range(5, 25))
    assert sink.history[-1]["from"] == 4 and "from_" not in sink.history[-1]  # the schema's JSON form
    assert [r.id for r in sink.take()] == list(range(1, 25)) and sink.take() == []


SPEC: dict[str, Any] = {"model": {"uri": "/models/chat"}, "engine": {"image": "ghcr.io/example/governor-engine:1"},
                        "slo": {"ttftP95": "1s", "itlP95": "50ms"}, "autotune": {"enabled": True}}
ENV = {PROMETHEUS_URL_ENV: "http://prometheus.monitoring:9090"}


def test_bounds_are_the_spec_s_over_the_defaults_and_k_is_capped_by_speculation() -> None:
    spec = parse_spec({**SPEC, "autotune": {"enabled": True, "bounds": {"maxNumSeqs": {"min": 2, "max": 48}}}})
    assert isinstance(spec, InferenceServiceSpec)
    assert tuner_bounds(spec) == {"max_num_seqs": (2, 48), "max_num_batched_tokens": (256, 8192),
                                  "num_speculative_tokens": (0, 0)}  # no speculation: K stays 0
    spec = parse_spec({**SPEC, "engine": {**SPEC["engine"], "speculative": {"method": "ngram",
                                                                             "numSpeculativeTokens": 3}}})
    assert isinstance(spec, InferenceServiceSpec) and tuner_bounds(spec)["num_speculative_tokens"] == (0, 3)


class Loop:
    """A `ServiceTuning` with scripted engines (`tests.test_tuner_loop.Engines`) as source and actuator; it
    records every status write (with the interval it happened in), every Event and every Tuner built."""

    def __init__(self, windows: list[Any], previous: dict[str, Any] | None = None, namespace: str = NS) -> None:
        self.engines = Engines(windows)
        self.writes: list[tuple[int, dict[str, Any]]] = []
        self.events: list[tuple[str, str, str]] = []
        self.built: list[TuningConfig] = []
        self.n = 0
        self.tuning = ServiceTuning("chat", namespace, previous,
                                    write_status=lambda doc: self.writes.append((self.n, doc)),
                                    post_event=lambda *e: self.events.append(e),
                                    make_actuator=lambda revision: self.engines, make_source=self._source,
                                    clock=lambda: 15.0 * self.n)

    def _source(self, config: TuningConfig) -> Engines:
        self.built.append(config)
        return self.engines

    def run(self, intervals: int, spec: dict[str, Any] = SPEC, status: dict[str, Any] | None = None,
            env: dict[str, str] = ENV) -> None:
        for _ in range(intervals):
            self.n += 1
            assert self.tuning.interval(spec, {"revision": "r1"} if status is None else status, env) == 15.0

    @property
    def doc(self) -> dict[str, Any]:
        return self.writes[-1][1]


def test_a_decision_reaches_status_and_an_event_and_status_is_written_only_on_change() -> None:
    loop = Loop([queueing()] * 6 + [window()] * 2)
    loop.run(7)
    assert loop.engines.calls == [{"max_num_seqs": 48}]
    assert loop.events == [("Normal", "TunerApplied", "decision 1: max_num_seqs 32→48 (Queueing); http://e0: ok 200")]
    doc = loop.doc
    last = doc["lastDecision"]
    assert (last["outcome"], last["from"], last["to"]) == ("applied", 32, 48)
    assert doc["history"] == [doc["lastDecision"]]
    assert doc["knobs"] == {"max_num_seqs": 48, "max_num_batched_tokens": 2048, "num_speculative_tokens": 0}
    assert doc["baseline"] == {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "num_speculative_tokens": 0}
    assert doc["state"] == {"frozen": False, "reason": ACTIVE, "hold": "Verifying", "revision": "r1",
                            "message": "tuning revision r1 on fresh signals"}
    # Written when something changed: the first window, the hold moving on, the decision, the new knob value.
    assert [(n, w["state"]["hold"]) for n, w in loop.writes] == [(1, "Settling"), (4, "NoBaseline"), (6, None),
                                                                 (7, "Verifying")]
    assert loop.built == loop.built[:1]  # one Tuner throughout


def test_the_tuner_reads_the_signals_of_its_service_s_namespace_only() -> None:
    loop = Loop([queueing()], namespace="team-a")
    loop.run(1)
    (config,) = loop.built
    source = prometheus_source(config)
    assert isinstance(source, PrometheusSource)
    assert source.sel == 'model_name="chat", revision="r1", namespace="team-a"'


def test_a_rollout_holds_the_tuner_still_and_a_fresh_one_starts_after_it() -> None:
    loop = Loop([queueing()] * 5)
    loop.run(3)
    rolling = {"revision": "r1", "rollout": {"phase": "Progressing", "canaryRevision": "r2"}}
    loop.run(3, status=rolling)
    assert len(loop.engines.windows) == 2  # nothing observed while rolling out
    held = [w for n, w in loop.writes if n > 3]
    assert [w["state"]["reason"] for w in held] == [ROLLOUT_IN_PROGRESS]  # written once
    assert held[0]["state"]["frozen"] is True and "history" not in held[0]
    loop.run(2, status={"revision": "r1", "rollout": {"phase": "Promoted"}})
    assert len(loop.built) == 2 and loop.tuning.tuner is not None and loop.tuning.tuner.windows == 2
    assert loop.doc["state"]["reason"] == ACTIVE and loop.engines.calls == []


def test_without_prometheus_the_tuner_reports_it_once_and_starts_when_it_is_set() -> None:
    loop = Loop([queueing()] * 2)
    loop.run(3, env={})
    assert [w["state"]["reason"] for _, w in loop.writes] == [NO_PROMETHEUS]
    assert PROMETHEUS_URL_ENV in loop.doc["state"]["message"] and loop.built == []
    loop.run(1)
    assert loop.doc["state"]["reason"] == ACTIVE and len(loop.built) == 1


def test_the_tuner_is_rebuilt_when_its_settings_or_revision_change_and_not_otherwise() -> None:
    loop = Loop([queueing()] * 8)
    loop.run(2)
    loop.run(2, spec={**SPEC, "replicas": 3})  # not a tuner setting
    assert len(loop.built) == 1
    loop.run(1, spec={**SPEC, "slo": {"ttftP95": "2s", "itlP95": "50ms"}})
    loop.run(1, spec={**SPEC, "slo": {"ttftP95": "2s", "itlP95": "50ms"}}, status={"revision": "r2"})
    assert [(c.slo.ttft_p95_s, c.revision) for c in loop.built] == [(1.0, "r1"), (2.0, "r1"), (2.0, "r2")]


def test_an_unchanged_status_found_at_start_is_not_rewritten() -> None:
    first = Loop([queueing()] * 2)
    first.run(1)
    again = Loop([queueing()] * 2, previous=copy.deepcopy(first.doc))
    again.run(1)
    assert again.writes == []


def test_a_knob_the_tuner_no_longer_reports_is_removed_from_status() -> None:
    first = Loop([queueing()] * 2)
    first.run(1)
    previous = copy.deepcopy(first.doc)
    previous["knobs"]["retired_knob"] = 7  # e.g. written by an older operator
    previous["baseline"]["retired_knob"] = 7
    again = Loop([queueing()] * 2, previous=previous)
    again.run(1)
    (_, patch), = again.writes
    assert patch["knobs"] == {**first.doc["knobs"], "retired_knob": None}  # null deletes it in a merge patch
    assert patch["baseline"] == {**first.doc["baseline"], "retired_knob": None}
    assert again.tuning.written is not None and "retired_knob" not in again.tuning.written["knobs"]
    again.run(1)
    assert len(again.writes) == 1  # the next interval writes nothing: its status is what was meant
    held = Loop([queueing()], previous=previous)
    held.run(1, env={})  # no Prometheus: the tuner holds, and still drops the knob it does not know
    (_, patch), = held.writes
    assert patch["knobs"]["retired_knob"] is None and patch["baseline"]["retired_knob"] is None


# --- the operator against the emulator ----------------------------------------------------------------

TOKEN = "operator-tuning-secret"
MERGE = {"Content-Type": "application/merge-patch+json"}
# Prometheus scrapes every 1 s. With a 2 s interval the PromQL window is max(2 s, 2 scrapes) = 2 s, and under
# load at max_num_seqs 1 a first token comes only when a 64-token request ends: on a busy machine whole 2 s
# windows go by without one, TTFT is missing, and the tuner rightly freezes. The load test therefore tunes
# every 4 s (the window of tests/test_tuner_integration.py); the hold test, with no load, every 2 s.
TUNED_SPEC: dict[str, Any] = {
    "model": {"uri": "/models/tiny"}, "engine": {"image": "ghcr.io/example/governor-engine:1", "resources": {"gpus": 0},
                                                 "knobs": {"maxNumSeqs": 1, "maxNumBatchedTokens": 256}},
    "slo": {"ttftP95": "300ms", "itlP95": "10s"}, "replicas": 1,
    "autotune": {"enabled": True, "interval": "4s", "cooldown": "5s",
                 "bounds": {"maxNumSeqs": {"min": 1, "max": 8}, "maxNumBatchedTokens": {"min": 64, "max": 512}}}}
INTERVAL_S = 2.0
FAST_SPEC = {**TUNED_SPEC, "autotune": {**TUNED_SPEC["autotune"], "interval": f"{INTERVAL_S:g}s"}}


def tuning_of(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(status_of(cluster, name).get("tuning") or {})


def events_of(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    items = (get(cluster, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
    return [e for e in items if e.get("involvedObject", {}).get("name") == name]


def start_operator(cluster: Cluster, log: Path, monkeypatch: pytest.MonkeyPatch,
                   prometheus_url: str | None) -> Operator:
    # `Operator` copies this process's environment.
    if prometheus_url is None:
        monkeypatch.delenv(PROMETHEUS_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(PROMETHEUS_URL_ENV, prometheus_url)
    monkeypatch.setenv(SCRAPE_INTERVAL_ENV, "1")
    return Operator(cluster, log)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with start_emulator(tmp_path, Grants(operator_bindings())) as c:
        yield c
        c.assert_nothing_denied()


def test_without_prometheus_the_operator_reports_no_prometheus(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    op = start_operator(cluster, tmp_path / "operator.log", monkeypatch, None)
    try:
        create_service(cluster, "chat", FAST_SPEC)
        state = wait_for(lambda: tuning_of(cluster, "chat").get("state"), 30, op.log, "no status.tuning.state")
        assert (state["frozen"], state["reason"]) == (True, NO_PROMETHEUS)
        # kopf can respawn the daemon for an event it still handles after SIGTERM, once it stopped the daemons;
        # that thread then holds the exit until `Operator.stop` kills it (20 s). Stop when the events settled.
        wait_for(lambda: "Creation is processed" in op.log.read_text(), 30, op.log, "creation not processed")
    finally:
        op.stop()


def test_the_operator_s_tuner_holds_during_a_rollout_and_starts_afresh_after(cluster: Cluster, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A Prometheus that does not answer: signals are stale, which the tuner records as a `frozen` decision.
    op = start_operator(cluster, tmp_path / "operator.log", monkeypatch, f"http://127.0.0.1:{free_port()}")
    try:
        create_service(cluster, "chat", FAST_SPEC)
        tuning = wait_for(lambda: (t := tuning_of(cluster, "chat")).get("lastDecision") and t, 60, op.log,
                          "no frozen decision on stale signals")
        assert (tuning["state"]["reason"], tuning["lastDecision"]["outcome"]) == (SIGNALS_STALE, "frozen")
        stable = tuning["state"]["revision"]
        # kopf posts Events from a queue, after the fact.
        frozen = wait_for(lambda: [e for e in events_of(cluster, "chat") if e["reason"] == "TunerFrozen"], 30, op.log,
                          "no TunerFrozen Event")
        assert frozen[0]["type"] == "Warning"

        image = {"spec": {"engine": {"image": "ghcr.io/example/governor-engine:2"}}}
        assert httpx.patch(cluster.url + f"{IS_PATH}/chat", json=image, headers=MERGE, timeout=5).status_code == 200
        held = wait_for(lambda: (t := tuning_of(cluster, "chat"))["state"]["reason"] == ROLLOUT_IN_PROGRESS and t,
                        60, op.log, "the tuner did not hold during the rollout")
        assert status_of(cluster, "chat")["rollout"]["phase"] == "Progressing"  # the canary never gets ready here
        time.sleep(3 * INTERVAL_S)
        assert tuning_of(cluster, "chat")["history"] == held["history"]  # no decision while rolling out

        back = {"spec": {"engine": {"image": "ghcr.io/example/governor-engine:1"}}}  # ends the rollout
        assert httpx.patch(cluster.url + f"{IS_PATH}/chat", json=back, headers=MERGE, timeout=5).status_code == 200
        after = wait_for(lambda: len((t := tuning_of(cluster, "chat"))["history"]) > len(held["history"]) and t,
                         60, op.log, "no fresh tuner after the rollout")
        assert (after["state"]["reason"], after["state"]["revision"]) == (SIGNALS_STALE, stable)
        # a new Tuner (it froze anew on the stale stable revision); its decision ids go on from the history
        assert after["lastDecision"]["id"] == held["lastDecision"]["id"] + 1
    finally:
        op.stop()


@pytest.fixture()
def engine(hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> Iterator[tuple[Server, str]]:
    spec = parse_spec(TUNED_SPEC)
    assert isinstance(spec, InferenceServiceSpec)
    revision = revision_hash(spec)
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--revision", revision,
                      "--max-model-len", "256", "--num-kv-blocks", "256", "--max-num-seqs", "1",
                      "--max-num-seqs-cap", "8", "--max-num-batched-tokens", "256",
                      "--max-num-batched-tokens-cap", "512", log_dir=tmp_path,
                      env={contract.ADMIN_TOKEN_ENV: TOKEN, contract.NAMESPACE_ENV: NS}) as s:  # as rendered
        yield s, revision


@pytest.fixture()
def prometheus(engine: tuple[Server, str], tmp_path: Path) -> Iterator[PromServer]:
    with start_prometheus([engine[0].url.removeprefix("http://")], tmp_path, scrape_interval_s=1.0) as p:
        yield p


def test_the_operator_s_tuner_raises_max_num_seqs_under_load_and_records_it(
        cluster: Cluster, engine: tuple[Server, str], prometheus: PromServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server, revision = engine
    name = MODEL  # the service's name is the engines' served model name
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-admin-token", "namespace": NS},
              "stringData": {ADMIN_TOKEN_KEY: TOKEN}}
    r = httpx.post(cluster.url + f"/api/v1/namespaces/{NS}/secrets", json=secret, timeout=5)
    assert r.status_code in (200, 201), r.text
    op = start_operator(cluster, tmp_path / "operator.log", monkeypatch, prometheus.url)
    stop = threading.Event()
    try:
        created = create_service(cluster, name, TUNED_SPEC)
        wait_for(lambda: status_of(cluster, name).get("revision") == revision, 30, op.log,
                 f"status.revision is not {revision}")
        port = int(server.url.rsplit(":", 1)[1])
        engine_pod = {"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"{name}-{revision}-0", "namespace": NS,
                                   "labels": {LABEL_SERVICE: name, LABEL_REVISION: revision}},
                      "spec": {"containers": [{"name": "engine", "image": TUNED_SPEC["engine"]["image"],
                                               "ports": [{"name": "http", "containerPort": port}]}]},
                      "status": {"phase": "Running", "podIP": "127.0.0.1",
                                 "conditions": [{"type": "Ready", "status": "True"}]}}
        r = httpx.post(cluster.url + f"/api/v1/namespaces/{NS}/pods", json=engine_pod, timeout=5)
        assert r.status_code in (200, 201), r.text

        load(server.url, 8, stop)

        def raised() -> dict[str, Any] | None:
            tuning = tuning_of(cluster, name)
            applied = [h for h in tuning.get("history", []) if h["outcome"] == "applied"]
            return tuning if applied and (tuning.get("knobs") or {}).get("max_num_seqs", 1) > 1 else None

        tuning = wait_for(raised, 120, op.log, "no applied decision with the raised knob in status.tuning")
        first = next(h for h in tuning["history"] if h["outcome"] == "applied")
        assert (first["knob"], first["from"], first["reason"], first["revision"]) == ("max_num_seqs", 1, "Queueing",
                                                                                      revision)
        assert first["to"] > 1 and tuning["knobs"]["max_num_seqs"] == first["to"]
        assert first["envelope"] == {"dtype": "auto", "kvCacheDtype": "auto", "quantization": "auto",
                                     "tensorParallelSize": "1"}  # the engine set-up, from the spec
        assert tuning["baseline"]["max_num_seqs"] == 1
        assert tuning["state"]["frozen"] is False and tuning["state"]["revision"] == revision
        knobs = httpx.get(f"{server.url}{contract.ADMIN_KNOBS_PATH}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=10).json()
        assert knobs["max_num_seqs"] == first["to"]
        applied = wait_for(lambda: [e for e in events_of(cluster, name) if e["reason"] == "TunerApplied"], 30, op.log,
                           "no TunerApplied Event")
        assert applied[0]["type"] == "Normal" and "max_num_seqs 1→" in applied[0]["message"]
        stored = get(cluster, f"{IS_PATH}/{name}") or {}
        assert stored["spec"] == created["spec"] and stored["metadata"]["generation"] == 1  # the spec is never written
        assert TOKEN not in op.log.read_text()
    finally:
        stop.set()
        op.stop()

