"""The real operator (`governor operator`, kopf) against KMock's Kubernetes emulator over HTTP.

Create → children with owners; invalid spec → InvalidSpec and nothing created; replicas update →
Deployment follows; manual drift → corrected by the periodic reconcile; operator restart → no writes;
a new revision without rollout steps replaces the old one (canary rollouts: tests/test_operator_rollouts.py).
Deletion's garbage collection is the API server's (ownerReferences); the emulator has none, so it is
left to e2e/. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chart import operator_bindings
from tests.kube_emulator import Cluster, Grants, start_emulator

NS = "default"
IS_PATH = f"/apis/governor.dev/v1alpha1/namespaces/{NS}/inferenceservices"
SPEC = {"model": {"uri": "/models/chat"}, "engine": {"image": "ghcr.io/example/governor-engine:1"},
        "slo": {"ttftP95": "500ms", "itlP95": "50ms"}, "replicas": 2}


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """The emulator, granting the operator exactly what the chart's ClusterRole grants (all namespaces)."""
    with start_emulator(tmp_path, Grants(operator_bindings())) as c:
        yield c
        c.assert_nothing_denied()


class Operator:
    """`governor operator -A` (or `--namespace NS` for each of `namespaces`) against the emulator; PodMonitors are
    rendered when the emulator serves their API group (it does: `monitoring.coreos.com/v1/podmonitors` is
    declared), as in a cluster with the CRD."""

    def __init__(self, cluster: Cluster, log: Path, env: dict[str, str] | None = None,
                 namespaces: tuple[str, ...] = ()) -> None:
        self.log = log
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "GOVERNOR_RECONCILE_INTERVAL_S": "2",
               **(env or {})}
        self.out = log.open("w")
        scope = [f"--namespace={ns}" for ns in namespaces] or ["-A"]
        self.proc = subprocess.Popen([sys.executable, "-m", "governor.cli", "operator", *scope], env=env,
                                     stdout=self.out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.out.close()


@pytest.fixture()
def operator(cluster: Cluster, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path / "operator.log")
    yield op
    op.stop()


def get(cluster: Cluster, path: str) -> dict[str, Any] | None:
    r = httpx.get(cluster.url + path, timeout=5)
    return r.json() if r.status_code == 200 else None


def create_service(cluster: Cluster, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "governor.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}
    r = httpx.post(cluster.url + IS_PATH, json=body, timeout=5)
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def wait_for(what: Callable[[], Any], timeout_s: float, log: Path, message: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.3)
    pytest.fail(f"{message} within {timeout_s} s; operator log tail:\n{log.read_text()[-3000:]}")


def events(cluster: Cluster) -> list[dict[str, Any]]:
    """The namespace's events; kopf posts them from a queue, after the status patch, so tests wait for them."""
    return list((get(cluster, f"/api/v1/namespaces/{NS}/events") or {}).get("items", []))


def children(cluster: Cluster) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind, path in (("Deployment", f"/apis/apps/v1/namespaces/{NS}/deployments"),
                       ("Service", f"/api/v1/namespaces/{NS}/services"),
                       ("ConfigMap", f"/api/v1/namespaces/{NS}/configmaps"),
                       ("Secret", f"/api/v1/namespaces/{NS}/secrets"),
                       ("PodDisruptionBudget", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets")):
        for item in (get(cluster, path) or {}).get("items", []):
            out[f"{kind}/{item['metadata']['name']}"] = item
    return out


def status_of(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict((get(cluster, f"{IS_PATH}/{name}") or {}).get("status") or {})


def test_create_renders_owned_children_and_reports_status(cluster: Cluster, operator: Operator) -> None:
    owner = create_service(cluster, "chat", SPEC)
    kids = wait_for(lambda: (c := children(cluster)) and any(k.startswith("Deployment/") for k in c) and c,
                    60, operator.log, "no Deployment")
    deployment = next(v for k, v in kids.items() if k.startswith("Deployment/"))
    config = f"ConfigMap/{deployment['metadata']['name']}-config"
    assert {"Service/chat", config, "Secret/chat-admin-token", "PodDisruptionBudget/chat"} <= set(kids)
    owned = [deployment, kids["Service/chat"], kids[config], kids["Secret/chat-admin-token"],
             kids["PodDisruptionBudget/chat"]]
    for obj in owned:
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"]) for r in refs] == [("InferenceService", "chat",
                                                                     owner["metadata"]["uid"])]
    assert deployment["spec"]["replicas"] == 2
    status = wait_for(lambda: (s := status_of(cluster, "chat")).get("observedGeneration") and s, 30, operator.log,
                      "no status")
    assert status["phase"] == "Progressing"  # the emulator runs no pods: 0/2 ready
    monitors = (get(cluster, f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/podmonitors") or {}).get("items", [])
    assert [m["metadata"]["name"] for m in monitors] == ["chat"]
    wait_for(lambda: any(e.get("reason") == "Reconciled" and e.get("involvedObject", {}).get("name") == "chat"
                         for e in events(cluster)), 30, operator.log, "no Reconciled event")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasStarting")
    assert status["revision"] in deployment["metadata"]["name"]
    # What the scale subresource reads: the stable revision's pods and their selector.
    assert (status["replicas"], status["readyReplicas"], status["canaryWeight"]) == (0, 0, 0)
    assert status["selector"] == f"governor.dev/service=chat,governor.dev/revision={status['revision']}"
    secret = kids["Secret/chat-admin-token"]
    token = (secret.get("stringData") or {}).get("token") or (secret.get("data") or {}).get("token")
    assert token and len(token) >= 32
    assert token not in operator.log.read_text()  # the operator never logs the admin token


def test_an_invalid_spec_is_reported_and_creates_nothing(cluster: Cluster, operator: Operator) -> None:
    bad = {**SPEC, "autotune": {"enabled": True, "bounds": {"maxNumSeqs": {"min": 64, "max": 8}}}}
    create_service(cluster, "broken", bad)
    status = wait_for(lambda: (s := status_of(cluster, "broken")).get("conditions") and s, 60, operator.log,
                      "no status")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (status["phase"], ready["status"], ready["reason"]) == ("Failed", "False", "InvalidSpec")
    assert "spec.autotune.bounds.maxNumSeqs" in ready["message"]
    wait_for(lambda: any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning"
                         and "spec.autotune.bounds.maxNumSeqs" in e.get("message", "") for e in events(cluster)),
             30, operator.log, "no InvalidSpec event")
    time.sleep(3)
    assert not [k for k in children(cluster) if "broken" in k]
    assert operator.proc.poll() is None  # no crash loop


def test_updates_follow_and_drift_is_corrected_and_a_restart_writes_nothing(cluster: Cluster, operator: Operator,
                                                                            tmp_path: Path) -> None:
    create_service(cluster, "chat", SPEC)
    wait_for(lambda: any(k.startswith("Deployment/") for k in children(cluster)), 60, operator.log, "no Deployment")
    name = next(k for k in children(cluster) if k.startswith("Deployment/")).split("/", 1)[1]
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    merge = {"Content-Type": "application/merge-patch+json"}

    r = httpx.patch(cluster.url + f"{IS_PATH}/chat", json={"spec": {"replicas": 3}}, headers=merge, timeout=5)
    assert r.status_code == 200, r.text
    wait_for(lambda: (get(cluster, path) or {}).get("spec", {}).get("replicas") == 3, 30, operator.log,
             "replicas did not follow the spec")

    r = httpx.patch(cluster.url + path, json={"spec": {"replicas": 9}}, headers=merge, timeout=5)
    assert r.status_code == 200, r.text
    wait_for(lambda: (get(cluster, path) or {}).get("spec", {}).get("replicas") == 3, 30, operator.log,
             "manual drift was not corrected")

    # Scaled to one pod (as `kubectl scale` through the scale subresource writes spec.replicas): the disruption
    # budget goes: over one pod it would either protect nothing or block node drains for good.
    assert "PodDisruptionBudget/chat" in children(cluster)
    r = httpx.patch(cluster.url + f"{IS_PATH}/chat", json={"spec": {"replicas": 1}}, headers=merge, timeout=5)
    assert r.status_code == 200, r.text
    wait_for(lambda: "PodDisruptionBudget/chat" not in children(cluster)
             and (get(cluster, path) or {}).get("spec", {}).get("replicas") == 1, 30, operator.log,
             "the budget stayed after scaling to one pod")

    # Settled: the periodic passes (every 2 s) write nothing, not even an unchanged status.
    service_path = f"{IS_PATH}/chat"
    time.sleep(3)
    settled = (get(cluster, service_path) or {})["metadata"]["resourceVersion"]
    time.sleep(5)
    assert (get(cluster, service_path) or {})["metadata"]["resourceVersion"] == settled

    operator.stop()
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster).items()}
    again = Operator(cluster, tmp_path / "operator-again.log")
    try:
        time.sleep(8)  # start-up, resume, and at least two timer passes (2 s)
        assert "Handler 'on_change' succeeded" in again.log.read_text() or "on_timer" in again.log.read_text()
        after = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster).items()}
        assert after == before  # nothing rewritten, nothing duplicated
    finally:
        again.stop()


def test_without_rollout_steps_a_new_revision_replaces_the_old_deployment(cluster: Cluster,
                                                                          operator: Operator) -> None:
    create_service(cluster, "chat", {**SPEC, "rollout": {"steps": []}})  # canaries: tests/test_operator_rollouts.py
    first = wait_for(lambda: [k for k in children(cluster) if k.startswith("Deployment/")], 60, operator.log,
                     "no Deployment")
    merge = {"Content-Type": "application/merge-patch+json"}
    r = httpx.patch(cluster.url + f"{IS_PATH}/chat", json={"spec": {"engine": {"image": "ghcr.io/example/e:2"}}},
                    headers=merge, timeout=5)
    assert r.status_code == 200, r.text
    second = wait_for(lambda: (d := [k for k in children(cluster) if k.startswith("Deployment/")]) and d != first
                      and len(d) == 1 and d, 30, operator.log, "the new revision did not replace the old one")
    deployment = children(cluster)[second[0]]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/example/e:2"
    status = wait_for(lambda: (s := status_of(cluster, "chat")).get("revision") and s["revision"] in second[0] and s,
                      30, operator.log, "status did not name the new revision")
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types == {"Ready": "False", "Progressing": "True", "Degraded": "False", "Tuning": "False"}


def test_knob_bounds_change_the_engine_caps_and_delete_releases_the_service(cluster: Cluster,
                                                                            operator: Operator) -> None:
    create_service(cluster, "chat", SPEC)
    wait_for(lambda: any(k.startswith("Deployment/") for k in children(cluster)), 60, operator.log, "no Deployment")
    merge = {"Content-Type": "application/merge-patch+json"}
    bounds = {"autotune": {"bounds": {"maxNumSeqs": {"min": 2, "max": 48}}}, "rollout": {"steps": []}}
    r = httpx.patch(cluster.url + f"{IS_PATH}/chat", json={"spec": bounds}, headers=merge, timeout=5)
    assert r.status_code == 200, r.text

    def capped() -> bool:
        deps = [v for k, v in children(cluster).items() if k.startswith("Deployment/")]
        args = deps[0]["spec"]["template"]["spec"]["containers"][0]["args"] if len(deps) == 1 else []
        return "--max-num-seqs-cap" in args and args[args.index("--max-num-seqs-cap") + 1] == "48"

    wait_for(capped, 30, operator.log, "the new max_num_seqs bound did not reach the engine's cap")
    # Every child is owned by the service with controller=true, so the API server's garbage collector would
    # remove them; the operator also deletes them itself (the emulator has no collector).
    for obj in children(cluster).values():
        refs = obj["metadata"]["ownerReferences"]
        assert len(refs) == 1 and refs[0]["controller"] is True and refs[0]["kind"] == "InferenceService"
    r = httpx.delete(cluster.url + f"{IS_PATH}/chat", timeout=5)
    assert r.status_code in (200, 202), r.text
    wait_for(lambda: get(cluster, f"{IS_PATH}/chat") is None, 30, operator.log,
             "the InferenceService was not released (finalizer) after delete")
    assert children(cluster) == {}  # the operator's delete handler removed them (and GC would have)
    assert operator.proc.poll() is None


def test_a_reconcile_of_a_service_being_deleted_changes_nothing(cluster: Cluster) -> None:
    """kopf runs the periodic reconcile beside the delete handler. A reconcile that finds the service being
    deleted (deletionTimestamp set, a finalizer still holding it) must neither recreate children the delete
    handler removed nor write status to an object on its way out (the race CI once caught: a timer recreated
    a Deployment after on_delete, and the service was not released)."""
    import kopf
    import kubernetes

    from governor.operator import handlers

    body = {"apiVersion": "governor.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": NS, "finalizers": ["example.com/hold"]}, "spec": SPEC}
    r = httpx.post(cluster.url + IS_PATH, json=body, timeout=5)
    assert r.status_code in (200, 201), r.text
    r = httpx.delete(cluster.url + f"{IS_PATH}/chat", timeout=5)
    assert r.status_code in (200, 202), r.text
    held = get(cluster, f"{IS_PATH}/chat")
    assert held is not None and held["metadata"].get("deletionTimestamp")

    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig))
    handlers._run(kopf.Body(held), kopf.LocalObjectLogger(body=kopf.Body(held), settings=kopf.OperatorSettings()))
    assert children(cluster) == {}
    assert status_of(cluster, "chat") == {}


def test_a_name_taken_by_an_object_the_service_does_not_control_is_reported_and_left_alone(
        cluster: Cluster, operator: Operator) -> None:
    """A Service named like the InferenceService, made by hand beforehand: the operator neither adopts nor
    changes it, reports Ready=False / NameConflict naming it, keeps running, and carries on once it is gone."""
    svc_path = f"/api/v1/namespaces/{NS}/services"
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat", "namespace": NS},
              "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    r = httpx.post(cluster.url + svc_path, json=theirs, timeout=5)
    assert r.status_code in (200, 201), r.text
    create_service(cluster, "chat", SPEC)

    def conflict() -> dict[str, Any] | None:
        ready = next((c for c in status_of(cluster, "chat").get("conditions") or [] if c["type"] == "Ready"), None)
        return ready if ready is not None and ready["reason"] == "NameConflict" else None

    ready = wait_for(conflict, 60, operator.log, "no NameConflict condition")
    assert ready["status"] == "False" and "Service/chat" in ready["message"] and "no controller" in ready["message"]
    assert status_of(cluster, "chat")["phase"] == "Failed"
    time.sleep(5)  # two more periodic passes: still nothing written to their Service
    kept = get(cluster, f"{svc_path}/chat")
    assert kept is not None and kept["spec"]["selector"] == {"app": "theirs"}
    assert not kept["metadata"].get("ownerReferences")
    assert operator.proc.poll() is None

    r = httpx.delete(cluster.url + f"{svc_path}/chat", timeout=5)
    assert r.status_code in (200, 202), r.text
    wait_for(lambda: ((get(cluster, f"{svc_path}/chat") or {}).get("metadata") or {}).get("ownerReferences"), 30,
             operator.log, "the operator did not create its own Service once the name was free")
    wait_for(lambda: conflict() is None, 30, operator.log, "the NameConflict condition stayed")


def test_a_namespaced_operator_works_with_only_the_chart_s_roles_in_its_namespace(tmp_path: Path) -> None:
    """With watchedNamespaces, the chart binds namespaced Roles only (no ClusterRole): the operator, serving that
    namespace, still creates, reconciles and deletes a service, and never asks for anything else (the emulator
    refuses what the Roles do not grant, and the fixture-free check below fails on any refusal)."""
    bindings = operator_bindings("--set", f"watchedNamespaces={{{NS}}}")
    assert bindings and all(scope == NS for scope, _ in bindings)  # no cluster-wide grant at all
    with start_emulator(tmp_path, Grants(bindings)) as cluster:
        op = Operator(cluster, tmp_path / "operator.log", namespaces=(NS,))
        try:
            create_service(cluster, "chat", SPEC)
            wait_for(lambda: {"Service/chat", "Secret/chat-admin-token", "PodDisruptionBudget/chat"}
                     <= set(children(cluster)), 60, op.log, "no children")
            wait_for(lambda: status_of(cluster, "chat").get("observedGeneration"), 30, op.log, "no status")
            r = httpx.delete(cluster.url + f"{IS_PATH}/chat", timeout=5)
            assert r.status_code in (200, 202), r.text
            wait_for(lambda: get(cluster, f"{IS_PATH}/chat") is None, 30, op.log, "the service was not released")
            assert children(cluster) == {}
            assert op.proc.poll() is None
        finally:
            op.stop()
        cluster.assert_nothing_denied()
