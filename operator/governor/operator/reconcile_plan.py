"""What one reconcile pass should do, decided from data: no cluster, no clock, no Prometheus of its own.

`plan_reconcile` takes the spec, the status, the annotations and a `Snapshot` of the cluster (read by
`reconcile.observe`) and returns a `ReconcilePlan`: the writes in the order they are made, the rollout's new
state and the Events it caused; `reconcile_status.report` turns it into status once the writes are made.

The canary is judged through `judge_canary`, a function the plan calls only when the rollout needs a verdict
(its pods ready, no abort or promote asked for): the PromQL it runs is the costliest read of a pass, and whether
it is needed follows from the plan's own decisions, so it is not read up front like the rest of the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from governor.operator.analysis import Judgement
from governor.operator.api import InferenceServiceSpec
from governor.operator.children import (
    Apply,
    CreateAdminSecret,
    Delete,
    Event,
    Patch,
    Write,
    by_revision,
    check_controller,
    controller_of,
    ready_replicas,
)
from governor.operator.render import (
    LABEL_REVISION,
    PORT,
    TEMPLATE_HASH_ANNOTATION,
    admin_secret,
    config_map_name,
    disruption_budget,
    render,
    revision_hash,
    role_services,
    synced_knobs,
)
from governor.operator.rollout import (
    ABORTED,
    ACTION_ANNOTATION,
    ENDED_WITHOUT_PROMOTION,
    PROMOTED,
    ROLLED_BACK,
    ROLLOUT_ACTIONS,
    Rollout,
    Transition,
    advance,
    plan_of,
    replicas_during,
    stamp,
    start,
)
from governor.operator.traffic import HTTP_ROUTE, REPLICAS, role_service_name, routed_rules, unrouted_rules

CanaryJudge = Callable[[str, str], Judgement]
"""The verdicts of spec.rollout.rollbackOn on a canary: (stable revision, canary revision) → judgement."""


@dataclass(frozen=True)
class Snapshot:
    """What a pass reads of the cluster before it decides anything. Children are JSON dicts as served.
    `disruption_budget` is read only when the spec renders none (spec.replicas ≤ 1): one this service controls
    is then deleted."""

    admin_secret: Mapping[str, Any] | None  # the admin-token Secret; None when there is none yet
    deployments: tuple[Mapping[str, Any], ...] = ()  # the service's Deployments (by its label)
    config_maps: tuple[Mapping[str, Any], ...] = ()  # the service's ConfigMaps (by its label)
    route: Mapping[str, Any] | None = None  # spec.rollout.httpRoute's HTTPRoute; None when unset or not found
    old_route: Mapping[str, Any] | None = None  # the route in status.trafficRouting once httpRoute is unset
    disruption_budget: Mapping[str, Any] | None = None  # PodDisruptionBudget `<name>`


@dataclass(frozen=True)
class ReconcilePlan:
    """The decisions of one pass. Invariant: `keep` holds `stable` and the revision of every Deployment `writes`
    applies, so nothing a pass writes is pruned by it."""

    writes: list[Write]
    revision: str  # the spec's revision
    stable: str  # the revision status reports as stable after the pass
    keep: frozenset[str]  # revisions whose Deployment and ConfigMap stay; the others' are in `writes` as Deletes
    rollout: Rollout | None
    transitions: list[Transition]
    events: list[Event]  # Events of the pass other than the rollout's transitions and Reconciled
    degraded: tuple[str, str] | None = None  # (reason, message) of Degraded=True: the spec names a revision not run
    promoting: bool = False  # promoted, and the new revision's pods are not all ready yet: the old stable stays
    canary_weight: int = 0  # the canary's share of traffic now
    traffic_routing: dict[str, Any] | None = None  # status.trafficRouting; None clears it
    consumed_action: bool = False


def read_action(annotations: Mapping[str, Any]) -> tuple[str | None, list[Event]]:
    """The rollout action asked for by annotation (None if none) and a Warning for an unknown one."""
    value = annotations.get(ACTION_ANNOTATION)
    if value is None:
        return None, []
    if value in ROLLOUT_ACTIONS:
        return str(value), []
    return None, [("UnknownRolloutAction", f"annotation {ACTION_ANNOTATION}={value!r} ignored: expected one of "
                                           f"{', '.join(ROLLOUT_ACTIONS)}", "Warning")]


def _template_hash(deployment: Mapping[str, Any] | None) -> str:
    return str((((deployment or {}).get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION, ""))


def route_problem(route: Mapping[str, Any] | None, route_name: str, namespace: str, name: str) -> str | None:
    """What makes HTTPRoute `route_name` (None: not found) unusable for service `name`; None when usable."""
    if route is None:
        return f"HTTPRoute {route_name} not found in namespace {namespace}"
    if routed_rules(route, name, PORT, 0) is None:
        return f"HTTPRoute {route_name} has no rule with a backendRef to Service {name}"
    return None


@dataclass(frozen=True)
class _Service:
    """The InferenceService a plan is for: who it is, its spec and status, and its children as observed."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceServiceSpec
    status: Mapping[str, Any]
    pod_monitor: bool
    deployments: Mapping[str, Mapping[str, Any]]  # by revision
    config_maps: tuple[Mapping[str, Any], ...]

    def render(self, replicas: int | None = None) -> list[dict[str, Any]]:
        return render(self.name, self.namespace, self.uid, self.generation, self.spec, dict(self.status),
                      pod_monitor=self.pod_monitor, replicas=replicas)

    def apply_all(self, replicas: int | None = None) -> list[Write]:
        """Every child the spec renders; the spec's revision's Deployment at `replicas` pods (None: spec's)."""
        return [Apply(obj) for obj in self.render(replicas)]

    def apply_shared(self) -> list[Write]:
        """The children every revision shares (Service, PodDisruptionBudget, PodMonitor), not the spec's
        revision's own."""
        return [Apply(obj) for obj in self.render() if obj["kind"] in ("Service", "PodMonitor", "PodDisruptionBudget")]

    def keep_stable(self, revision: str) -> list[Write]:
        """Hold the Deployment of `revision` (not the spec's) at spec.replicas pods without re-rendering its
        template, and keep its ConfigMap's starting knobs on the tuned values."""
        writes: list[Write] = []
        replicas = self.spec.replicas
        dep_name = self.deployments[revision]["metadata"]["name"]
        if (self.deployments[revision].get("spec") or {}).get("replicas") != replicas:
            writes.append(Patch("Deployment", self.namespace, dep_name, {"spec": {"replicas": replicas}},
                                f"scaled Deployment/{dep_name} to {replicas}"))
        cm_name = config_map_name(self.name, revision)
        cm = next((c for c in self.config_maps if c["metadata"]["name"] == cm_name), None)
        data = synced_knobs(cm, self.status) if cm is not None else None
        if data is not None:
            writes.append(Patch("ConfigMap", self.namespace, cm_name, {"data": data},
                                f"updated ConfigMap/{cm_name} (tuned knobs)"))
        return writes


@dataclass(frozen=True)
class _Revisions:
    """Where the rollout's state machine leaves the revisions this pass, and the writes that put them there."""

    stable: str
    keep: frozenset[str]
    writes: list[Write]
    rollout: Rollout | None
    transitions: list[Transition]
    degraded: tuple[str, str] | None = None
    promoting: bool = False


def _divergence(desired: str, stable: str, rollout: Rollout) -> str:
    what = "rolled back" if rollout.phase == ROLLED_BACK else "aborted"
    why = (rollout.last_rollback or {}).get("message") or rollout.message
    return (f"the spec names revision {desired}, which was {what} ({why}); stable revision {stable} keeps serving. "
            "It is not retried: change the spec to roll out again, or back to the stable revision.")


def _hold_rolled_back(svc: _Service, desired: str, stable: str, rollout: Rollout,
                      transitions: list[Transition]) -> _Revisions:
    """The spec names a revision that was rolled back or aborted: stable keeps serving, Degraded says why."""
    return _Revisions(stable, frozenset({stable}), svc.keep_stable(stable) + svc.apply_shared(), rollout,
                      transitions, degraded=(rollout.phase, _divergence(desired, stable, rollout)))


def _finish_promotion(svc: _Service, desired: str, stable: str, rollout: Rollout,
                      transitions: list[Transition]) -> _Revisions:
    """The canary takes all of spec.replicas; the old stable goes only once they are ready (capacity never drops
    at promotion)."""
    writes = svc.apply_all()
    if svc.spec.replicas == 0 or ready_replicas(svc.deployments.get(desired)) >= svc.spec.replicas:
        return _Revisions(desired, frozenset({desired}), writes, rollout, transitions)
    return _Revisions(stable, frozenset({stable, desired}), writes + svc.keep_stable(stable), rollout, transitions,
                      promoting=True)


def _revisions(svc: _Service, desired: str, stable: str | None, last: Rollout | None, *, action: str | None,
               route_problem: str | None, judge_canary: CanaryJudge, now: float) -> _Revisions:
    """One step of the rollout's state machine and the revisions it leaves running. `stable` is None on a first
    deployment, or when the stable Deployment is gone (nothing to compare a canary with)."""
    spec = svc.spec
    rollout = last
    transitions: list[Transition] = []
    if stable is not None and stable != desired and rollout is not None and rollout.canary_revision == desired \
            and rollout.stable_revision == stable and not rollout.superseded:
        # The spec still names the revision of a rollout that ended: a rolled-back or aborted one is not
        # retried (GitOps divergence, Degraded); a promoted one finishes taking over.
        if rollout.phase in ENDED_WITHOUT_PROMOTION:
            return _hold_rolled_back(svc, desired, stable, rollout, transitions)
        if rollout.phase == PROMOTED:
            return _finish_promotion(svc, desired, stable, rollout, transitions)

    if stable is None or stable == desired or not spec.rollout.steps or spec.replicas == 0:
        if rollout is not None and rollout.phase in ENDED_WITHOUT_PROMOTION and rollout.canary_revision != desired:
            rollout = replace(rollout, superseded=True)  # the spec moved on: that revision may be tried again
        if rollout is not None and rollout.active:
            if stable == desired:
                why, phase, reason = "the spec returned to the stable revision", ABORTED, "SpecReverted"
            else:
                why, phase, reason = ("the spec's revision replaces the old one at once, unjudged (no steps, no "
                                      "replicas, or no stable Deployment)", PROMOTED, "ReplacedAtOnce")
            rollout = replace(rollout, phase=phase, reason=reason, message=why, step_started_at=None,
                              ended_at=stamp(now))
            transitions.append(Transition("RolloutEnded", f"rollout of {rollout.canary_revision} ended: {why}"))
        return _Revisions(desired, frozenset({desired}), svc.apply_all(), rollout, transitions)

    traffic = HTTP_ROUTE if spec.rollout.http_route else REPLICAS
    if rollout is None or not rollout.active or rollout.canary_revision != desired \
            or rollout.stable_revision != stable or rollout.traffic != traffic \
            or rollout.plan != plan_of(spec.rollout.steps):
        if rollout is not None and rollout.active:
            why = f"revision {rollout.canary_revision} is no longer the spec's" \
                if rollout.canary_revision != desired else "the spec's steps or traffic routing changed"
            transitions.append(Transition("RolloutSuperseded", f"{why}; rolling out {desired} from step 1",
                                          "Warning"))
        canary_hash = _template_hash(next(o for o in svc.render() if o["kind"] == "Deployment"))
        rollout, started = start(stable, desired, _template_hash(svc.deployments[stable]), canary_hash,
                                 spec.rollout.steps, spec.replicas, now, last, traffic)
        transitions.append(started)
    _, canary_count = replicas_during(rollout, spec.replicas)
    canary_ready = ready_replicas(svc.deployments.get(desired)) >= canary_count and route_problem is None
    judgement = None
    if canary_ready and action not in ("abort", "promote") and spec.rollout.rollback_on:
        judgement = judge_canary(stable, desired)
    rollout, moved = advance(rollout, spec.rollout.steps, spec.replicas, action=action, canary_ready=canary_ready,
                             judgement=judgement, now=now)
    transitions += moved
    if rollout.phase == PROMOTED:
        return _finish_promotion(svc, desired, stable, rollout, transitions)
    if rollout.phase in ENDED_WITHOUT_PROMOTION:
        return _hold_rolled_back(svc, desired, stable, rollout, transitions)
    return _Revisions(stable, frozenset({stable, desired}),
                      svc.keep_stable(stable) + svc.apply_all(replicas_during(rollout, spec.replicas)[1]),
                      rollout, transitions)


def _route_writes(svc: _Service, route: Mapping[str, Any] | None, stable: str, canary: str,
                  canary_weight: int) -> list[Write]:
    """Point `<name>-stable` and `<name>-canary` at their revisions and set the route's weights."""
    route_name = str(svc.spec.rollout.http_route)
    writes: list[Write] = [Apply(obj) for obj in role_services(svc.name, svc.namespace, svc.uid, stable, canary)]
    rules = routed_rules(route, svc.name, PORT, canary_weight) if route is not None else None
    if route is not None and rules is not None and rules != (route.get("spec") or {}).get("rules"):
        # resourceVersion: a concurrent edit of the route (by its owner) makes this patch fail and retry.
        writes.append(Patch("HTTPRoute", svc.namespace, route_name,
                            {"metadata": {"resourceVersion": (route.get("metadata") or {}).get("resourceVersion")},
                             "spec": {"rules": rules}},
                            f"weighted HTTPRoute/{route_name} {100 - canary_weight}/{canary_weight} "
                            f"({stable}/{canary})"))
    return writes


def _unroute_writes(svc: _Service, route_name: str, route: Mapping[str, Any] | None) -> list[Write]:
    """spec.rollout.httpRoute was removed: point the route's rules back at Service `name` and delete the role
    Services."""
    writes: list[Write] = []
    rules = unrouted_rules(route, svc.name, PORT) if route is not None else None
    if rules is not None:
        writes.append(Patch("HTTPRoute", svc.namespace, route_name, {"spec": {"rules": rules}},
                            f"pointed HTTPRoute/{route_name} back at Service/{svc.name}"))
    for role in ("stable", "canary"):
        service = role_service_name(svc.name, role)
        writes.append(Delete("Service", svc.namespace, service, f"deleted Service/{service}"))
    return writes


def _prune(namespace: str, snapshot: Snapshot, keep: frozenset[str]) -> list[Write]:
    """Delete the Deployments and ConfigMaps of revisions not in `keep` (a replaced stable, a rolled-back or
    superseded canary)."""
    writes: list[Write] = []
    for kind, children in (("Deployment", snapshot.deployments), ("ConfigMap", snapshot.config_maps)):
        for child in children:
            meta = child["metadata"]
            revision = (meta.get("labels") or {}).get(LABEL_REVISION)
            if revision is not None and revision not in keep:
                writes.append(Delete(kind, namespace, meta["name"],
                                     f"deleted {kind}/{meta['name']} (revision {revision})"))
    return writes


def plan_reconcile(name: str, namespace: str, uid: str, generation: int, spec: InferenceServiceSpec,
                   status: Mapping[str, Any], annotations: Mapping[str, Any], snapshot: Snapshot, *, now: float,
                   pod_monitor: bool, judge_canary: CanaryJudge) -> ReconcilePlan:
    """The writes, rollout step and Events of one pass over a valid spec, from what `snapshot` shows. Raises
    NameConflict when the admin-token Secret belongs to another object."""
    action, events = read_action(annotations)
    desired = revision_hash(spec)
    writes: list[Write] = []
    if snapshot.admin_secret is None:
        writes.append(CreateAdminSecret(name, namespace, uid))
    else:
        # One made beforehand without a controller is the user's own token (used as it is); another service's
        # is not this one's. (The Secret's metadata does not depend on its token.)
        check_controller("Secret", snapshot.admin_secret, admin_secret(name, namespace, uid, "")["metadata"],
                         uncontrolled_ok=True)
    deployments = by_revision(snapshot.deployments)
    svc = _Service(name, namespace, uid, generation, spec, status, pod_monitor, deployments, snapshot.config_maps)
    stable = status.get("revision")
    problem = route_problem(snapshot.route, spec.rollout.http_route, namespace, name) \
        if spec.rollout.http_route else None
    revisions = _revisions(svc, desired, stable if stable in deployments else None,
                           Rollout.from_status(status.get("rollout")), action=action, route_problem=problem,
                           judge_canary=judge_canary, now=now)
    writes += revisions.writes
    rollout = revisions.rollout
    # Traffic shifts to the canary while its rollout runs or is being promoted; its share now, else none.
    shifting = rollout is not None and (rollout.active or revisions.promoting)
    canary_weight = rollout.canary_weight if rollout is not None and shifting else 0
    old_routing = status.get("trafficRouting") or {}
    routing = None
    if spec.rollout.http_route:
        writes += _route_writes(svc, snapshot.route, revisions.stable, desired if shifting else revisions.stable,
                                canary_weight)
        routing = {"httpRoute": spec.rollout.http_route, "problem": problem}
        if problem and problem != old_routing.get("problem"):
            events.append(("HTTPRouteUnusable", f"{problem}; the canary's step waits until the route references the "
                                                "service", "Warning"))
    elif old_routing.get("httpRoute"):
        writes += _unroute_writes(svc, str(old_routing["httpRoute"]), snapshot.old_route)
    writes += _prune(namespace, snapshot, revisions.keep)
    budget = snapshot.disruption_budget
    if disruption_budget(name, namespace, uid, spec) is None and budget is not None \
            and (controller_of(budget) or {}).get("uid") == uid:
        writes.append(Delete("PodDisruptionBudget", namespace, name, f"deleted PodDisruptionBudget/{name} "
                                                                     "(spec.replicas ≤ 1)"))
    if action is not None and not revisions.transitions:
        events.append(("RolloutActionIgnored", f"{ACTION_ANNOTATION}={action}: no rollout in progress that it "
                                               "applies to", "Normal"))
    return ReconcilePlan(writes, desired, revisions.stable, revisions.keep, rollout, revisions.transitions, events,
                         revisions.degraded, revisions.promoting, canary_weight, routing,
                         consumed_action=annotations.get(ACTION_ANNOTATION) is not None)
