"""Canary rollouts end to end: the real operator (kopf) against KMock's emulator, judging triggers through
real PromQL on a real Prometheus (Debian's binary) that scrapes small exporters the test controls — one per
revision, with the engine's metric names and labels (tests/metric_exporter.py). Beside them a same-named
service in another namespace, with the same revisions, has a slow canary: the operator must not see it.

The emulator runs no controllers: a stand-in for the Deployment controller and kubelets marks every
Deployment's pods ready (status.readyReplicas = spec.replicas), so a canary's step clock can start.
Steps pause a few seconds and the operator checks every second; every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from governor.operator.analysis import PrometheusQuery, judge
from governor.operator.api import InferenceServiceSpec, RollbackTrigger
from governor.operator.render import revision_hash
from governor.operator.validation import parse_spec
from tests.chart import operator_bindings
from tests.kube_emulator import Cluster, Grants, start_emulator
from tests.metric_exporter import Exporter
from tests.prometheus_server import PromServer, start_prometheus
from tests.test_operator_kopf import IS_PATH, NS, Operator, create_service, get, status_of, wait_for

MERGE = {"Content-Type": "application/merge-patch+json"}
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
TTFT_TRIGGER = {"metric": "ttft_p95", "comparison": "relative", "threshold": 1.2, "for": "4s"}


def spec_with(image: str, pause: str = "3s", route: str | None = None) -> dict[str, Any]:
    spec = {"model": {"uri": "/models/chat"}, "engine": {"image": image}, "replicas": 2,
            "slo": {"ttftP95": "500ms", "itlP95": "50ms"},
            "rollout": {"steps": [{"weight": 25, "pause": pause}, {"weight": 50, "pause": pause}],
                        "rollbackOn": [TTFT_TRIGGER,
                                       {"metric": "error_rate", "comparison": "absolute", "threshold": 0.05,
                                        "for": "4s"}]}}
    if route:
        spec["rollout"]["httpRoute"] = route
    return spec


def revision_of(spec: dict[str, Any]) -> str:
    parsed = parse_spec(spec)
    assert isinstance(parsed, InferenceServiceSpec), parsed
    return revision_hash(parsed)


def mark_pods_ready(cluster: Cluster, stop: threading.Event, ready_cap: dict[str, int]) -> None:
    """The Deployment controller and kubelets of a real cluster, reduced to: every pod becomes ready (at most
    `ready_cap[revision]` pods of a revision listed there, for pods that are slow to load their model)."""
    with httpx.Client(timeout=5) as http:
        while not stop.wait(0.3):
            try:
                for dep in http.get(cluster.url + DEPLOYMENTS).json().get("items", []):
                    revision = dep["metadata"]["labels"]["governor.dev/revision"]
                    want = min(dep["spec"].get("replicas", 1), ready_cap.get(revision, 1 << 30))
                    if (dep.get("status") or {}).get("readyReplicas") != want:
                        http.patch(f"{cluster.url}{DEPLOYMENTS}/{dep['metadata']['name']}", headers=MERGE,
                                   json={"status": {"replicas": want, "readyReplicas": want}})
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # a Deployment deleted between list and patch


@dataclass
class World:
    cluster: Cluster
    prometheus: PromServer
    stable: Exporter
    canary: Exporter
    operator: Operator
    tmp: Path
    v1: dict[str, Any]
    v2: dict[str, Any]
    ready_cap: dict[str, int]

    def restart_operator(self, log_name: str) -> None:
        self.operator.stop()
        self.operator = Operator(self.cluster, self.tmp / log_name, env=self.operator_env())

    def operator_env(self) -> dict[str, str]:
        return {"GOVERNOR_PROMETHEUS_URL": self.prometheus.url, "GOVERNOR_RECONCILE_INTERVAL_S": "1"}

    def status(self) -> dict[str, Any]:
        return status_of(self.cluster, "chat")

    def rollout(self) -> dict[str, Any]:
        return dict(self.status().get("rollout") or {})

    def deployments(self) -> dict[str, dict[str, Any]]:
        items = (get(self.cluster, DEPLOYMENTS) or {}).get("items", [])
        return {d["metadata"]["labels"]["governor.dev/revision"]: d for d in items}

    def wait(self, what: Any, message: str, timeout_s: float = 60) -> Any:
        return wait_for(what, timeout_s, self.operator.log, message)

    def patch_spec(self, spec: dict[str, Any]) -> None:
        r = httpx.patch(self.cluster.url + f"{IS_PATH}/chat", json={"spec": spec}, headers=MERGE, timeout=5)
        assert r.status_code == 200, r.text

    def annotate(self, action: str) -> None:
        body = {"metadata": {"annotations": {"governor.dev/rollout-action": action}}}
        r = httpx.patch(self.cluster.url + f"{IS_PATH}/chat", json=body, headers=MERGE, timeout=5)
        assert r.status_code == 200, r.text

    def events(self) -> list[dict[str, Any]]:
        items = (get(self.cluster, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
        return [e for e in items if e.get("involvedObject", {}).get("name") == "chat"]

    def event(self, reason: str) -> dict[str, Any]:
        """The first event with this reason, waited for: kopf posts events from a queue, after the status patch."""
        return self.wait(lambda: next((e for e in self.events() if e["reason"] == reason), None),
                         f"no {reason} event")

    def start_rollout(self) -> None:
        """v1 deployed and stable, then the spec moves to v2: the rollout begins."""
        stable_rev = revision_of(self.v1)
        create_service(self.cluster, "chat", self.v1)
        self.wait(lambda: self.status().get("revision") == stable_rev and self.status().get("phase") == "Ready",
                  "v1 did not become the ready stable revision")
        self.patch_spec(self.v2)
        self.wait(lambda: self.rollout().get("canaryRevision") == revision_of(self.v2), "no rollout of v2 began")


@pytest.fixture()
def world(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[World]:
    canary_ttft = getattr(request, "param", {}).get("canary_ttft", 0.1)
    pause = getattr(request, "param", {}).get("pause", "3s")
    route = getattr(request, "param", {}).get("route")
    v1, v2 = spec_with("ghcr.io/example/engine:1", pause, route), spec_with("ghcr.io/example/engine:2", pause, route)
    with ExitStack() as stack:
        cluster = stack.enter_context(start_emulator(tmp_path, Grants(operator_bindings())))
        stack.callback(cluster.assert_nothing_denied)
        stable = Exporter("chat", revision_of(v1), NS, ttft_s=0.1)
        stack.callback(stable.close)
        canary = Exporter("chat", revision_of(v2), NS, ttft_s=canary_ttft)
        stack.callback(canary.close)
        # Another team's `chat` with the same spec: same model_name and revision, another namespace, a slow
        # canary. Mixed in, it would fire the TTFT trigger of a healthy canary and hide a silent one.
        neighbour = Exporter("chat", revision_of(v2), f"{NS}-other-team", ttft_s=1.0)
        stack.callback(neighbour.close)
        (tmp_path / "prom").mkdir()
        prometheus = stack.enter_context(start_prometheus([stable.target, canary.target, neighbour.target],
                                                          tmp_path / "prom"))
        stop = threading.Event()
        ready_cap: dict[str, int] = {}
        threading.Thread(target=mark_pods_ready, args=(cluster, stop, ready_cap), daemon=True).start()
        stack.callback(stop.set)
        w = World(cluster, prometheus, stable, canary, None, tmp_path, v1, v2, ready_cap)  # type: ignore[arg-type]
        w.operator = Operator(cluster, tmp_path / "operator.log", env=w.operator_env())
        stack.callback(lambda: w.operator.stop())
        yield w


def test_a_healthy_canary_walks_its_steps_and_is_promoted(world: World) -> None:
    world.start_rollout()
    v1, v2 = revision_of(world.v1), revision_of(world.v2)
    progressing = world.wait(lambda: (r := world.rollout()).get("phase") == "Progressing" and len(world.deployments())
                             == 2 and r, "the canary Deployment did not appear beside the stable one")
    assert (progressing["stableRevision"], progressing["canaryRevision"], progressing["steps"]) == (v1, v2, 2)
    deployments = world.deployments()
    assert progressing["stableTemplateHash"] == \
        deployments[v1]["metadata"]["annotations"]["governor.dev/template-hash"]
    assert len(progressing["canaryTemplateHash"]) == 64
    assert deployments[v1]["spec"]["replicas"] == 2  # stable keeps its capacity while the canary is judged
    assert deployments[v2]["spec"]["replicas"] == 1 and progressing["canaryWeight"] == 33  # 1 of 3 pods ≈ 25%

    seen_step_2 = world.wait(lambda: (r := world.rollout()).get("step") == 1 and r, "step 2 never began")
    assert seen_step_2["requestedWeight"] == 50 and world.deployments()[v2]["spec"]["replicas"] == 2
    promoted = world.wait(lambda: (r := world.rollout()).get("phase") == "Promoted" and r, "no promotion")
    assert promoted["reason"] == "AllStepsPassed"
    verdicts = {a["metric"]: a for a in promoted["analysis"]}
    assert verdicts["ttft_p95"]["fired"] is False and 0.05 < verdicts["ttft_p95"]["observed"] < 0.2
    world.wait(lambda: set(world.deployments()) == {v2} and world.status().get("revision") == v2,
               "the old stable Deployment was not removed after promotion")
    assert world.deployments()[v2]["spec"]["replicas"] == 2
    reasons = [e["reason"] for e in world.events()]
    assert {"RolloutStarted", "RolloutStepPassed", "RolloutPromoted"} <= set(reasons)
    conditions = {c["type"]: (c["status"], c["reason"]) for c in world.status()["conditions"]}
    assert conditions["Degraded"] == ("False", "AsSpecified")


@pytest.mark.parametrize("world", [{"canary_ttft": 0.15}], indirect=True)
def test_a_canary_with_ttft_one_and_a_half_times_stable_is_rolled_back(world: World) -> None:
    world.start_rollout()
    v1, v2 = revision_of(world.v1), revision_of(world.v2)
    stable_before = world.deployments()[v1]
    rolled = world.wait(lambda: (r := world.rollout()).get("phase") == "RolledBack" and r, "no rollback")
    last = rolled["lastRollback"]
    assert (last["trigger"], last["metric"], last["comparison"], last["threshold"], last["window"]) == \
        ("spec.rollout.rollbackOn[0]", "ttft_p95", "relative", 1.2, "4s")
    assert last["observed"] > last["limit"] and last["observed"] / last["stable"] > 1.2
    assert last["revision"] == v2 and last["at"].endswith("Z")
    world.wait(lambda: set(world.deployments()) == {v1}, "the canary was not removed")
    stable_after = world.deployments()[v1]
    assert stable_after["spec"]["template"] == stable_before["spec"]["template"]  # stable untouched
    assert stable_after["metadata"]["uid"] == stable_before["metadata"]["uid"]
    status = world.status()
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (status["phase"], status["revision"], degraded["status"], degraded["reason"]) == \
        ("Degraded", v1, "True", "RolledBack")
    assert v2 in degraded["message"] and "not retried" in degraded["message"]
    event = world.event("RolloutRolledBack")
    assert event["type"] == "Warning" and "ttft_p95" in event["message"]

    time.sleep(4)  # GitOps: the spec still names v2, and the operator does not try it again
    assert set(world.deployments()) == {v1} and world.rollout()["phase"] == "RolledBack"
    assert sum(e["reason"] == "RolloutStarted" for e in world.events()) == 1
    world.patch_spec(world.v1)  # back to the stable revision: the divergence is gone
    world.wait(lambda: next(c for c in world.status()["conditions"] if c["type"] == "Degraded")["status"] == "False",
               "going back to the stable revision did not clear Degraded")
    world.patch_spec(world.v2)  # and forward again: the spec changed, so the revision is tried again
    world.wait(lambda: world.rollout().get("phase") in ("Progressing", "Paused") and len(world.deployments()) == 2,
               "the revision was not retried after the spec changed away and back")


def test_missing_canary_metrics_pause_the_rollout_until_they_return(world: World) -> None:
    world.canary.silent = True  # the canary's engines are not scraped: its series go stale
    world.start_rollout()
    paused = world.wait(lambda: (r := world.rollout()).get("phase") == "Paused" and r, "no SignalsStale pause")
    assert paused["reason"] == "SignalsStale" and "no engine scraped now" in paused["message"]
    time.sleep(8)  # well past both steps' pauses: still held, never promoted
    held = world.rollout()
    assert (held["phase"], held["step"]) == ("Paused", 0)
    world.event("RolloutSignalsStale")
    world.canary.silent = False
    world.wait(lambda: world.rollout().get("phase") == "Promoted", "the rollout did not go on when metrics returned")


@pytest.mark.parametrize("world", [{"pause": "12s"}], indirect=True)
def test_an_operator_restart_mid_rollout_resumes_where_it_was(world: World) -> None:
    world.start_rollout()
    v2 = revision_of(world.v2)
    before = world.wait(lambda: (r := world.rollout()).get("stepStartedAt") and r, "step 1 was never judged")
    canary_uid = world.deployments()[v2]["metadata"]["uid"]
    world.restart_operator("operator-2.log")
    world.wait(lambda: "Timer 'on_timer' succeeded" in world.operator.log.read_text(), "the new operator never ran")
    resumed = world.rollout()
    assert (resumed["step"], resumed["stepStartedAt"]) == (0, before["stepStartedAt"])  # the step's clock ran on
    after = world.wait(lambda: (r := world.rollout()).get("step") == 1 and r, "the rollout did not go on")
    assert after["startedAt"] == before["startedAt"]  # the same rollout, not a new one
    assert world.deployments()[v2]["metadata"]["uid"] == canary_uid  # the canary was not recreated
    world.wait(lambda: world.rollout().get("phase") == "Promoted", "no promotion after the restart", timeout_s=60)
    assert sum(e["reason"] == "RolloutStarted" for e in world.events()) == 1


@pytest.mark.parametrize("world", [{"pause": "60s"}], indirect=True)
def test_the_abort_annotation_rolls_back_now(world: World) -> None:
    world.start_rollout()
    v1 = revision_of(world.v1)
    world.wait(lambda: world.rollout().get("stepStartedAt"), "step 1 was never judged")
    world.patch_spec({"rollout": {"steps": [{"weight": 50, "pause": "60s"}]}})  # steps edited mid-rollout
    world.wait(lambda: (r := world.rollout()).get("plan") == "50%/60s" and r.get("step") == 0
               and r.get("requestedWeight") == 50, "the rollout did not restart on the new steps")
    world.event("RolloutSuperseded")
    world.wait(lambda: world.rollout().get("stepStartedAt"), "the new step 1 was never judged")
    world.annotate("pause")
    world.wait(lambda: world.rollout().get("reason") == "ManualPause", "the pause annotation was not obeyed")
    world.annotate("abort")
    aborted = world.wait(lambda: (r := world.rollout()).get("phase") == "Aborted" and r, "no abort")
    assert aborted["lastRollback"]["trigger"] == "manual-abort"
    world.wait(lambda: set(world.deployments()) == {v1}, "the canary was not removed")
    degraded = next(c for c in world.status()["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Aborted")
    meta = (get(world.cluster, f"{IS_PATH}/chat") or {})["metadata"]
    assert not (meta.get("annotations") or {}).get("governor.dev/rollout-action")  # one-shot: removed


@pytest.mark.parametrize("world", [{"route": "chat-route"}], indirect=True)
def test_with_an_http_route_the_canary_share_is_set_by_route_weights(world: World) -> None:
    routes = f"/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes"
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "chat-route", "namespace": NS},
             "spec": {"parentRefs": [{"name": "gateway"}],
                      "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                                 "backendRefs": [{"name": "chat", "port": 8000}]}]}}
    r = httpx.post(world.cluster.url + routes, json=route, timeout=5)
    assert r.status_code in (200, 201), r.text
    v1, v2 = revision_of(world.v1), revision_of(world.v2)

    def weights() -> list[tuple[str, int]]:
        rules = ((get(world.cluster, f"{routes}/chat-route") or {}).get("spec") or {}).get("rules") or [{}]
        return [(ref["name"], ref.get("weight")) for ref in rules[0].get("backendRefs") or []]

    def selects(role: str) -> str:
        svc = get(world.cluster, f"/api/v1/namespaces/{NS}/services/chat-{role}") or {}
        return str((svc.get("spec") or {}).get("selector", {}).get("governor.dev/revision"))

    world.start_rollout()
    world.wait(lambda: weights() == [("chat-stable", 75), ("chat-canary", 25)], "the route was not weighted 75/25")
    assert (selects("stable"), selects("canary")) == (v1, v2)
    rollout = world.rollout()
    assert (rollout["traffic"], rollout["canaryWeight"]) == ("httpRoute", 25)  # exact: the route splits
    assert world.deployments()[v2]["spec"]["replicas"] == 1  # pods for its 25% share of 2 replicas' load
    world.ready_cap[v2] = 1  # the new revision's second pod is slow to load
    world.wait(lambda: weights() == [("chat-stable", 50), ("chat-canary", 50)], "step 2 did not reweight")
    world.wait(lambda: world.rollout().get("phase") == "Promoted", "no promotion")
    time.sleep(3)  # promoted, but only 1 of 2 pods of the new revision is ready: the old stable stays
    progressing = next(c for c in world.status()["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Promoting")
    assert set(world.deployments()) == {v1, v2} and world.status()["revision"] == v1
    assert weights() == [("chat-stable", 50), ("chat-canary", 50)]  # capacity never drops at promotion
    del world.ready_cap[v2]
    world.wait(lambda: weights() == [("chat-stable", 100), ("chat-canary", 0)] and selects("stable") == v2,
               "after promotion the route did not send everything to the new stable revision")
    rule = ((get(world.cluster, f"{routes}/chat-route") or {})["spec"])["rules"][0]
    assert rule["matches"] == route["spec"]["rules"][0]["matches"]  # the user's parts of the route are kept


def test_judging_reads_only_the_service_s_own_namespace(tmp_path: Path) -> None:
    """team-a/chat and team-b/chat have the same served name and spec, so the same model_name and revisions;
    only team-b's canary is slow. Each namespace's canary is judged on its own engines."""
    trigger = RollbackTrigger.model_validate(TTFT_TRIGGER)
    with ExitStack() as stack:
        exporters = {(ns, rev): Exporter("chat", rev, ns, ttft_s=0.3 if (ns, rev) == ("team-b", "c2") else 0.1)
                     for ns in ("team-a", "team-b") for rev in ("s1", "c2")}
        for exporter in exporters.values():
            stack.callback(exporter.close)
        (tmp_path / "prom").mkdir()
        prometheus = stack.enter_context(start_prometheus([e.target for e in exporters.values()], tmp_path / "prom"))
        query = PrometheusQuery(prometheus.url)

        def judged(namespace: str) -> Any:
            judgement = judge([trigger], query, "chat", stable="s1", canary="c2", namespace=namespace,
                              scrape_interval_s=1.0)
            return judgement if not judgement.missing else None

        wait_for(lambda: judged("team-a") and judged("team-b"), 30, prometheus.log, "no verdict for both teams")
        healthy, slow = judged("team-a"), judged("team-b")
        assert healthy.fired is None and 0.05 < healthy.results[0].canary < 0.2, healthy.to_status()
        assert slow.fired is not None and slow.fired.canary > 0.2, slow.to_status()

        exporters["team-a", "c2"].silent = True  # team-a's canary goes unscraped; team-b's is still there
        stale = wait_for(lambda: (j := judge([trigger], query, "chat", stable="s1", canary="c2", namespace="team-a",
                                             scrape_interval_s=1.0)).stale and j, 15, prometheus.log,
                         "team-a's silent canary was not seen as unscraped")
        assert stale.stale == ("c2",) and stale.fired is None
