"""A reconcile pass's decisions as a pure function: spec, status and a snapshot of the cluster in, writes, the
rollout's step, status and Events out. No cluster and no Prometheus: the canary's judgement is a plain function."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from governor.operator.analysis import Judgement, evaluate
from governor.operator.api import InferenceServiceSpec, RollbackTrigger
from governor.operator.children import Apply, CreateAdminSecret, Delete, NameConflict, Patch, Write
from governor.operator.reconcile_plan import ReconcilePlan, Snapshot, plan_reconcile
from governor.operator.reconcile_status import report
from governor.operator.render import admin_secret, render, revision_hash
from governor.operator.rollout import PROGRESSING, PROMOTED, ROLLED_BACK
from governor.operator.validation import parse_spec

NAME, NS, UID = "chat", "llm", "uid-1"
NOW = 1_800_000_000.0
TTFT = {"metric": "ttft_p95", "comparison": "relative", "threshold": 1.2, "for": "1m"}


def raw(image: str = "img:1", **changes: Any) -> dict[str, Any]:
    spec = {"model": {"uri": "/models/chat"}, "engine": {"image": image}, "replicas": 2,
            "slo": {"ttftP95": "500ms", "itlP95": "50ms"},
            "rollout": {"steps": [{"weight": 25, "pause": "1m"}, {"weight": 50, "pause": "1m"}],
                        "rollbackOn": [TTFT]}}
    spec["rollout"].update(changes.pop("rollout", {}))
    return {**spec, **changes}


OLD, NEW = raw("img:1"), raw("img:2")


def spec_of(raw_spec: dict[str, Any]) -> InferenceServiceSpec:
    parsed = parse_spec(raw_spec)
    assert isinstance(parsed, InferenceServiceSpec), parsed
    return parsed


def rev(raw_spec: dict[str, Any]) -> str:
    return revision_hash(spec_of(raw_spec))


def running(raw_spec: dict[str, Any], ready: int, replicas: int | None = None) -> list[dict[str, Any]]:
    """The Deployment (with `ready` pods ready, `replicas` wanted) and ConfigMap of `raw_spec`'s revision, as
    served."""
    children = render(NAME, NS, UID, 1, spec_of(raw_spec), {}, pod_monitor=False, replicas=replicas)
    dep = next(o for o in children if o["kind"] == "Deployment")
    cm = next(o for o in children if o["kind"] == "ConfigMap")
    return [{**dep, "status": {"replicas": ready, "readyReplicas": ready}}, cm]


OURS = admin_secret(NAME, NS, UID, "token")


def snapshot(*revisions: list[dict[str, Any]], secret: Mapping[str, Any] | None = OURS, **rest: Any) -> Snapshot:
    children = [c for r in revisions for c in r]
    return Snapshot(admin_secret=secret, deployments=tuple(c for c in children if c["kind"] == "Deployment"),
                    config_maps=tuple(c for c in children if c["kind"] == "ConfigMap"), **rest)


def never_judged(stable: str, canary: str) -> Judgement:
    raise AssertionError(f"canary {canary} was judged")


def plan(raw_spec: dict[str, Any], status: Mapping[str, Any], snap: Snapshot, *,
         annotations: Mapping[str, Any] | None = None, judge_canary: Any = never_judged,
         now: float = NOW) -> ReconcilePlan:
    return plan_reconcile(NAME, NS, UID, 3, spec_of(raw_spec), status, annotations or {}, snap, now=now,
                          pod_monitor=False, judge_canary=judge_canary)


def described(writes: list[Write]) -> list[str]:
    """Each write in one line: `apply Kind/name` (replicas for a Deployment), or what a Patch or Delete says."""
    out = []
    for w in writes:
        if isinstance(w, Apply):
            replicas = f" x{w.obj['spec']['replicas']}" if w.obj["kind"] == "Deployment" else ""
            out.append(f"apply {w.obj['kind']}/{w.obj['metadata']['name']}{replicas}")
        elif isinstance(w, CreateAdminSecret):
            out.append("create admin Secret")
        else:
            assert isinstance(w, Patch | Delete)
            out.append(w.done)
    return out


def stable_status(raw_spec: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"revision": rev(raw_spec), "phase": "Ready", **more}


def rolling(ready: int, now: float = NOW) -> tuple[dict[str, Any], Snapshot]:
    """Status and snapshot of a rollout of NEW over OLD started at `now` - 1, its canary with `ready` pods."""
    started = plan(NEW, stable_status(OLD), snapshot(running(OLD, 2)), now=now - 1)
    assert started.rollout is not None
    status = stable_status(OLD, rollout=started.rollout.to_status())
    return status, snapshot(running(OLD, 2), running(NEW, ready, replicas=1))


def condition(status: Mapping[str, Any], type_: str) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == type_)
    return c["status"], c["reason"]


def test_a_first_deployment_creates_the_admin_secret_and_every_rendered_child() -> None:
    p = plan(OLD, {}, snapshot(secret=None))
    assert described(p.writes) == ["create admin Secret", f"apply Deployment/chat-{rev(OLD)} x2", "apply Service/chat",
                                   f"apply ConfigMap/chat-{rev(OLD)}-config", "apply PodDisruptionBudget/chat"]
    assert (p.stable, p.rollout, p.transitions) == (rev(OLD), None, [])


def test_a_settled_service_plans_only_the_applies_of_what_it_renders() -> None:
    p = plan(OLD, stable_status(OLD), snapshot(running(OLD, 2)))
    assert all(isinstance(w, Apply) for w in p.writes)
    assert (p.keep, p.events, p.transitions) == (frozenset({rev(OLD)}), [], [])


def test_a_new_revision_starts_a_canary_beside_the_untouched_stable() -> None:
    p = plan(NEW, stable_status(OLD), snapshot(running(OLD, 2)))
    assert p.rollout is not None
    assert (p.rollout.phase, p.rollout.reason, p.rollout.step) == (PROGRESSING, "CanaryStarting", 0)
    assert (p.rollout.stable_revision, p.rollout.canary_revision) == (rev(OLD), rev(NEW))
    assert [t.reason for t in p.transitions] == ["RolloutStarted"]
    # Stable already runs its 2 pods: nothing of it is written; the canary gets 1 pod (25% of 3).
    assert described(p.writes) == [f"apply Deployment/chat-{rev(NEW)} x1", "apply Service/chat",
                                   f"apply ConfigMap/chat-{rev(NEW)}-config", "apply PodDisruptionBudget/chat"]
    assert (p.stable, p.keep, p.canary_weight) == (rev(OLD), frozenset({rev(OLD), rev(NEW)}), 33)


def test_a_stable_deployment_scaled_by_hand_is_held_at_spec_replicas_during_a_rollout() -> None:
    p = plan(NEW, stable_status(OLD), snapshot(running(OLD, 1, replicas=1)))
    assert described(p.writes)[0] == f"scaled Deployment/chat-{rev(OLD)} to 2"


def test_a_canary_is_not_judged_until_its_pods_are_ready() -> None:
    status, snap = rolling(ready=0)
    p = plan(NEW, status, snap)  # never_judged fails the test if it is called
    assert p.rollout is not None and (p.rollout.phase, p.rollout.reason) == (PROGRESSING, "CanaryStarting")


def test_a_ready_canary_is_judged_and_a_fired_trigger_rolls_it_back() -> None:
    status, snap = rolling(ready=1)
    judged: list[tuple[str, str]] = []

    def slow_canary(stable: str, canary: str) -> Judgement:
        judged.append((stable, canary))
        return Judgement((evaluate(0, RollbackTrigger.model_validate(TTFT), canary=0.9, stable=0.3),))

    p = plan(NEW, status, snap, judge_canary=slow_canary)
    assert judged == [(rev(OLD), rev(NEW))]
    assert p.rollout is not None and (p.rollout.phase, p.rollout.reason) == (ROLLED_BACK, "TriggerFired")
    assert [t.reason for t in p.transitions] == ["RolloutRolledBack"]
    assert p.degraded is not None and p.degraded[0] == ROLLED_BACK
    assert described(p.writes) == ["apply Service/chat", "apply PodDisruptionBudget/chat",
                                   f"deleted Deployment/chat-{rev(NEW)} (revision {rev(NEW)})",
                                   f"deleted ConfigMap/chat-{rev(NEW)}-config (revision {rev(NEW)})"]


def test_the_spec_still_naming_a_rolled_back_revision_is_degraded_and_not_retried() -> None:
    status, snap = rolling(ready=1)
    rolled_back = plan(NEW, status, snap, judge_canary=lambda s, c: Judgement(
        (evaluate(0, RollbackTrigger.model_validate(TTFT), canary=0.9, stable=0.3),)))
    assert rolled_back.rollout is not None
    status = stable_status(OLD, rollout=rolled_back.rollout.to_status())
    p = plan(NEW, status, snapshot(running(OLD, 2)))
    assert p.rollout == rolled_back.rollout and p.transitions == []
    assert not any(isinstance(w, Apply) and w.obj["kind"] == "Deployment" for w in p.writes)
    assert p.degraded is not None
    assert p.degraded[1].startswith(f"the spec names revision {rev(NEW)}, which was rolled back (")
    assert p.degraded[1].endswith("It is not retried: change the spec to roll out again, or back to the stable "
                                  "revision.")
    result = report(p, NAME, 3, spec_of(NEW), status, running(OLD, 2)[0], [], NOW)
    assert result.status["phase"] == "Degraded"
    assert condition(result.status, "Degraded") == ("True", ROLLED_BACK)


def promoted(new_ready: int) -> tuple[dict[str, Any], ReconcilePlan]:
    status, snap = rolling(ready=1)
    by_hand = plan(NEW, status, snap, annotations={"governor.dev/rollout-action": "promote"})
    assert by_hand.rollout is not None and by_hand.rollout.phase == PROMOTED
    status = stable_status(OLD, rollout=by_hand.rollout.to_status())
    return status, plan(NEW, status, snapshot(running(OLD, 2), running(NEW, new_ready)))


def test_a_promoted_revision_keeps_the_old_stable_until_its_pods_are_ready() -> None:
    status, p = promoted(new_ready=1)
    assert (p.promoting, p.stable, p.keep) == (True, rev(OLD), frozenset({rev(OLD), rev(NEW)}))
    assert described(p.writes)[0] == f"apply Deployment/chat-{rev(NEW)} x2"
    result = report(p, NAME, 3, spec_of(NEW), status, running(OLD, 2)[0], [], NOW)
    assert result.status["phase"] == "Progressing"
    assert condition(result.status, "Progressing") == ("True", "Promoting")


def test_a_promoted_revision_with_its_pods_ready_replaces_the_old_stable() -> None:
    _, p = promoted(new_ready=2)
    assert (p.promoting, p.stable, p.keep) == (False, rev(NEW), frozenset({rev(NEW)}))
    assert described(p.writes)[-2:] == [f"deleted Deployment/chat-{rev(OLD)} (revision {rev(OLD)})",
                                        f"deleted ConfigMap/chat-{rev(OLD)}-config (revision {rev(OLD)})"]


def test_returning_the_spec_to_the_stable_revision_aborts_the_rollout() -> None:
    status, snap = rolling(ready=1)
    p = plan(OLD, status, snap)
    assert p.rollout is not None and (p.rollout.phase, p.rollout.reason) == ("Aborted", "SpecReverted")
    assert [t.reason for t in p.transitions] == ["RolloutEnded"]
    assert (p.stable, p.canary_weight) == (rev(OLD), 0)
    assert described(p.writes)[-2:] == [f"deleted Deployment/chat-{rev(NEW)} (revision {rev(NEW)})",
                                        f"deleted ConfigMap/chat-{rev(NEW)}-config (revision {rev(NEW)})"]


ROUTE = {"metadata": {"name": "web", "namespace": NS, "resourceVersion": "7"},
         "spec": {"rules": [{"backendRefs": [{"name": "chat", "port": 8000}]}]}}


def test_an_http_route_is_weighted_between_the_role_services_of_stable_and_canary() -> None:
    routed = raw("img:2", rollout={"httpRoute": "web"})
    p = plan(routed, stable_status(OLD), snapshot(running(OLD, 2), route=ROUTE))
    role_services = [w.obj for w in p.writes if isinstance(w, Apply) and w.obj["metadata"]["name"] != "chat"
                     and w.obj["kind"] == "Service"]
    assert [(s["metadata"]["name"], s["spec"]["selector"]["governor.dev/revision"]) for s in role_services] == [
        ("chat-stable", rev(OLD)), ("chat-canary", rev(routed))]
    weighted = next(w for w in p.writes if isinstance(w, Patch) and w.kind == "HTTPRoute")
    assert weighted.body == {"metadata": {"resourceVersion": "7"}, "spec": {"rules": [{"backendRefs": [
        {"name": "chat-stable", "port": 8000, "weight": 75}, {"name": "chat-canary", "port": 8000, "weight": 25}]}]}}
    assert weighted.done == f"weighted HTTPRoute/web 75/25 ({rev(OLD)}/{rev(routed)})"
    assert p.traffic_routing == {"httpRoute": "web", "problem": None}


def test_a_missing_http_route_holds_the_canary_and_warns_once() -> None:
    routed = raw("img:2", rollout={"httpRoute": "web"})
    started = plan(routed, stable_status(OLD), snapshot(running(OLD, 2)))
    assert started.rollout is not None
    problem = f"HTTPRoute web not found in namespace {NS}"
    assert started.events == [("HTTPRouteUnusable", f"{problem}; the canary's step waits until the route "
                                                    "references the service", "Warning")]
    status = stable_status(OLD, rollout=started.rollout.to_status(), trafficRouting=started.traffic_routing)
    p = plan(routed, status, snapshot(running(OLD, 2), running(routed, 1, replicas=1)))  # pods ready, not judged
    assert p.events == [] and p.traffic_routing == {"httpRoute": "web", "problem": problem}


def test_removing_the_http_route_points_it_back_at_the_service_and_deletes_the_role_services() -> None:
    weighted = {**ROUTE, "spec": {"rules": [{"backendRefs": [{"name": "chat-stable", "port": 8000, "weight": 100},
                                                             {"name": "chat-canary", "port": 8000, "weight": 0}]}]}}
    status = stable_status(OLD, trafficRouting={"httpRoute": "web", "problem": None})
    p = plan(OLD, status, snapshot(running(OLD, 2), old_route=weighted))
    assert described(p.writes)[-3:] == ["pointed HTTPRoute/web back at Service/chat", "deleted Service/chat-stable",
                                        "deleted Service/chat-canary"]
    back = next(w for w in p.writes if isinstance(w, Patch))
    assert back.body == {"spec": {"rules": [{"backendRefs": [{"name": "chat", "port": 8000}]}]}}
    assert p.traffic_routing is None


def budget(controller_uid: str) -> dict[str, Any]:
    return {"metadata": {"name": NAME, "namespace": NS, "ownerReferences": [
        {"kind": "InferenceService", "name": NAME, "uid": controller_uid, "controller": True}]}}


def test_one_replica_deletes_the_disruption_budget_this_service_controls() -> None:
    one = raw("img:1", replicas=1)
    p = plan(one, stable_status(one), snapshot(running(one, 1), disruption_budget=budget(UID)))
    assert described(p.writes)[-1] == "deleted PodDisruptionBudget/chat (spec.replicas ≤ 1)"
    assert not any(isinstance(w, Apply) and w.obj["kind"] == "PodDisruptionBudget" for w in p.writes)


def test_one_replica_leaves_a_disruption_budget_another_object_controls() -> None:
    one = raw("img:1", replicas=1)
    p = plan(one, stable_status(one), snapshot(running(one, 1), disruption_budget=budget("someone-else")))
    assert not any(isinstance(w, Delete) for w in p.writes)


def test_an_admin_secret_controlled_by_another_object_is_a_name_conflict() -> None:
    theirs = admin_secret("other", NS, "uid-2", "token")
    with pytest.raises(NameConflict, match="Secret/chat-admin-token already exists and is controlled by "
                                           "InferenceService/other"):
        plan(OLD, {}, snapshot(secret={**theirs, "metadata": {**theirs["metadata"], "name": "chat-admin-token"}}))


def test_an_admin_secret_made_by_the_user_beforehand_is_used_as_it_is() -> None:
    p = plan(OLD, {}, snapshot(secret={"metadata": {"name": "chat-admin-token", "namespace": NS}}))
    assert not any(isinstance(w, CreateAdminSecret) for w in p.writes)


def test_a_rollout_action_with_no_rollout_to_act_on_is_consumed_and_reported() -> None:
    p = plan(OLD, stable_status(OLD), snapshot(running(OLD, 2)), annotations={"governor.dev/rollout-action": "pause"})
    assert p.consumed_action
    assert p.events == [("RolloutActionIgnored", "governor.dev/rollout-action=pause: no rollout in progress that it "
                                                 "applies to", "Normal")]


def test_an_unknown_rollout_action_is_consumed_with_a_warning() -> None:
    p = plan(OLD, stable_status(OLD), snapshot(running(OLD, 2)), annotations={"governor.dev/rollout-action": "go"})
    assert p.consumed_action
    assert p.events == [("UnknownRolloutAction", "annotation governor.dev/rollout-action='go' ignored: expected one "
                                                 "of pause, resume, abort, promote", "Warning")]


def test_the_reconciled_event_lists_what_the_writes_changed_before_the_rollout_s_events() -> None:
    p = plan(NEW, stable_status(OLD), snapshot(running(OLD, 2)))
    result = report(p, NAME, 3, spec_of(NEW), stable_status(OLD), running(OLD, 2)[0],
                    ["created Deployment/chat-x"], NOW)
    assert [reason for reason, _, _ in result.events] == ["Reconciled", "RolloutStarted", "Progressing"]
    assert result.events[0][1] == "created Deployment/chat-x"
    assert (result.status["revision"], result.status["readyReplicas"], result.status["canaryWeight"]) == (
        rev(OLD), 2, 33)
