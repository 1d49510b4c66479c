"""Level-based reconcile of one InferenceService: parse → render → apply children → report status.

`reconcile` is called by every kopf handler (create, update, resume, and a periodic timer that
corrects drift). It is idempotent: a child whose fields already contain what was rendered is not
written (`contains`), so re-running it with nothing changed makes no writes. An invalid spec creates
nothing and is reported as Ready=False, reason InvalidSpec, with a message naming the field. The admin
token Secret is created once with a random token and never rendered, logged or rewritten. A child whose
name is taken by an object this service does not control (another service's, or one a user made) is never
adopted or changed: the pass stops and reports Ready=False, reason NameConflict, naming the object. A child
the API server refuses stops the pass the same way, as ChildRejected with the server's message.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes.client.exceptions import ApiException

from governor.operator.analysis import Query, judge, no_prometheus
from governor.operator.api import InferenceServiceSpec
from governor.operator.children import (
    NameConflict,
    apply_child,
    delete_controlled,
    ensure_admin_secret,
    keep_stable,
    prune_revisions,
    read_route,
    revision_deployments,
    route_traffic,
    unroute_traffic,
)
from governor.operator.render import (
    TEMPLATE_HASH_ANNOTATION,
    disruption_budget,
    render,
    revision_hash,
    revision_selector,
)
from governor.operator.rollout import (
    ABORTED,
    ACTION_ANNOTATION,
    ACTIONS,
    ENDED_WITHOUT_PROMOTION,
    PROMOTED,
    ROLLED_BACK,
    Rollout,
    Transition,
    advance,
    plan_of,
    replicas_during,
    stamp,
    start,
)
from governor.operator.traffic import (
    HTTP_ROUTE,
    REPLICAS,
)
from governor.operator.validation import parse_spec

log = logging.getLogger(__name__)

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Tuning")


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  generation: int, now: str) -> list[dict[str, Any]]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status changes."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") \
        else now
    new = {"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since, "observedGeneration": generation}
    return [c for c in conditions if c.get("type") != type_] + [new]


@dataclass
class Outcome:
    """What a reconcile did: the status patch, and Events (reason, message, type) to emit."""

    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    consumed_action: bool = False  # a rollout-action annotation was read: the caller removes it


def _ready(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def _replicas(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("replicas") or 0)


def _template_hash(deployment: Mapping[str, Any] | None) -> str:
    return str((((deployment or {}).get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION, ""))


def read_action(annotations: Mapping[str, Any]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """The rollout action asked for by annotation (None if none) and a Warning for an unknown one."""
    value = annotations.get(ACTION_ANNOTATION)
    if value is None:
        return None, []
    if value in ACTIONS:
        return str(value), []
    return None, [("UnknownRolloutAction", f"annotation {ACTION_ANNOTATION}={value!r} ignored: expected one of "
                                           f"{', '.join(ACTIONS)}", "Warning")]


def _tuning_condition(spec: InferenceServiceSpec, status: Mapping[str, Any]) -> tuple[str, str, str]:
    """Tuning condition (status, reason, message) from the tuner's state in status.tuning.state."""
    if not spec.autotune.enabled:
        return "False", "AutotuneDisabled", "spec.autotune.enabled is false"
    state = (status.get("tuning") or {}).get("state")
    if not isinstance(state, Mapping):
        return "Unknown", "TunerStarting", "the tuner has not reported yet"
    reason = str(state.get("reason") or ("Frozen" if state.get("frozen") else "Tuning"))
    return ("False" if state.get("frozen") else "True"), reason, str(state.get("message") or "")


def reconcile(name: str, namespace: str, uid: str, generation: int, raw_spec: Any, status: Mapping[str, Any],
              annotations: Mapping[str, Any] | None = None, *, pod_monitor: bool, query: Query = no_prometheus,
              scrape_interval_s: float = 0.0, now: float | None = None) -> Outcome:
    """One level-based pass over an InferenceService: children, rollout, status and Events.

    `query` answers the rollout's PromQL (`analysis.PrometheusQuery`, or `no_prometheus`), whose scrape interval
    is `scrape_interval_s` (trigger windows span at least two scrapes); `annotations` may hold a rollout
    action, which the caller removes when `Outcome.consumed_action` is set. A NameConflict stops the pass
    (children applied before it stay) and is reported in status; the rest of the status is kept as it was, and
    a rollout action is left for the pass that can act on it. A child the API server refuses (400, 422) is
    reported the same way, as ChildRejected with the server's message."""
    try:
        return _reconcile(name, namespace, uid, generation, raw_spec, status, annotations, pod_monitor=pod_monitor,
                          query=query, scrape_interval_s=scrape_interval_s, now=now)
    except NameConflict as e:
        return _failed(status, generation, stamp(time.time() if now is None else now), "NameConflict", str(e),
                       "waiting for the name conflict to be resolved", keep=status)
    except ApiException as e:
        if e.status not in (400, 422):
            raise  # a transient failure: kopf retries the pass
        # The API server refused a child the spec rendered (a value no schema or rule here caught): retrying
        # cannot help until the spec changes, so say so in status instead of failing the pass for ever.
        return _failed(status, generation, stamp(time.time() if now is None else now), "ChildRejected",
                       f"the API server refused a child of this service: {_server_message(e)}",
                       "waiting for a spec whose children the API server accepts", keep=status)


def _server_message(e: ApiException) -> str:
    """The message of the API server's Status in an error response, else its reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:1000]
    except (ValueError, AttributeError):
        return str(e.reason)


def _failed(status: Mapping[str, Any], generation: int, stamp_now: str, reason: str, message: str,
            progressing: str, keep: Mapping[str, Any] | None = None, consumed_action: bool = False) -> Outcome:
    """Phase Failed with Ready and Progressing False for `reason`; a Warning Event only when Ready's reason or
    message changes. `keep` holds the status fields to carry over (none: the status is only this)."""
    conditions = set_condition(list(status.get("conditions") or []), "Ready", "False", reason, message, generation,
                               stamp_now)
    conditions = set_condition(conditions, "Progressing", "False", reason, progressing, generation, stamp_now)
    old_ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    changed = old_ready.get("reason") != reason or old_ready.get("message") != message
    return Outcome({**(keep or {}), "observedGeneration": generation, "phase": "Failed", "conditions": conditions},
                   [(reason, message, "Warning")] if changed else [], consumed_action=consumed_action)


def _reconcile(name: str, namespace: str, uid: str, generation: int, raw_spec: Any, status: Mapping[str, Any],
               annotations: Mapping[str, Any] | None = None, *, pod_monitor: bool, query: Query = no_prometheus,
               scrape_interval_s: float = 0.0, now: float | None = None) -> Outcome:
    now_s = time.time() if now is None else now
    stamp_now = stamp(now_s)
    conditions = list(status.get("conditions") or [])
    action, events = read_action(annotations or {})
    consumed = (annotations or {}).get(ACTION_ANNOTATION) is not None
    parsed = parse_spec(raw_spec)
    if not isinstance(parsed, InferenceServiceSpec):
        message = "; ".join(f"{e.path}: {e.message}" for e in parsed)[:1000]
        return _failed(status, generation, stamp_now, "InvalidSpec", message, "nothing is created from an invalid "
                       "spec", consumed_action=consumed)

    spec = parsed
    desired = revision_hash(spec)
    writes = [w for w in [ensure_admin_secret(name, namespace, uid)] if w]
    existing = revision_deployments(name, namespace)
    stable = status.get("revision")
    if stable not in existing:
        stable = None  # first deployment, or the stable Deployment is gone: nothing to compare a canary with
    last = Rollout.from_status(status.get("rollout"))
    rollout = last
    transitions: list[Transition] = []

    def apply_all(replicas: int | None = None) -> None:
        desired_children = render(name, namespace, uid, generation, spec, dict(status), pod_monitor=pod_monitor,
                                  replicas=replicas)
        writes.extend(w for obj in desired_children if (w := apply_child(obj)))

    traffic = HTTP_ROUTE if spec.rollout.http_route else REPLICAS
    route, route_problem = read_route(namespace, spec.rollout.http_route, name) if spec.rollout.http_route \
        else (None, None)
    degraded: tuple[str, str] | None = None
    promoting = False  # promoted, and the new revision's pods are not all ready yet: the old stable stays

    def hold_rolled_back(r: Rollout, old: str) -> set[str]:
        nonlocal degraded
        writes.extend(keep_stable(name, namespace, old, spec.replicas, status))
        apply_shared(name, namespace, uid, generation, spec, status, pod_monitor, writes)
        degraded = (r.phase, _divergence(desired, old, r))
        return {old}

    def finish_promotion(old: str) -> tuple[str, set[str]]:
        """The canary takes all of spec.replicas; the old stable goes only once they are ready (capacity never
        drops at promotion)."""
        nonlocal promoting
        apply_all()
        if spec.replicas == 0 or _ready(existing.get(desired)) >= spec.replicas:
            return desired, {desired}
        promoting = True
        writes.extend(keep_stable(name, namespace, old, spec.replicas, status))
        return old, {old, desired}

    keep: set[str] | None = None
    if stable is not None and stable != desired and rollout is not None and rollout.canary_revision == desired \
            and rollout.stable_revision == stable and not rollout.superseded:
        # The spec still names the revision of a rollout that ended: a rolled-back or aborted one is not
        # retried (GitOps divergence, Degraded); a promoted one finishes taking over.
        if rollout.phase in ENDED_WITHOUT_PROMOTION:
            keep = hold_rolled_back(rollout, stable)
        elif rollout.phase == PROMOTED:
            stable, keep = finish_promotion(stable)
    if keep is not None:
        pass
    elif stable is None or stable == desired or not spec.rollout.steps or spec.replicas == 0:
        if rollout is not None and rollout.phase in ENDED_WITHOUT_PROMOTION and rollout.canary_revision != desired:
            rollout = replace(rollout, superseded=True)  # the spec moved on: that revision may be tried again
        if rollout is not None and rollout.active:
            if stable == desired:
                why, phase, reason = "the spec returned to the stable revision", ABORTED, "SpecReverted"
            else:
                why, phase, reason = ("the spec's revision replaces the old one at once, unjudged (no steps, no "
                                      "replicas, or no stable Deployment)", PROMOTED, "ReplacedAtOnce")
            rollout = replace(rollout, phase=phase, reason=reason, message=why, step_started_at=None,
                              ended_at=stamp(now_s))
            transitions.append(Transition("RolloutEnded", f"rollout of {rollout.canary_revision} ended: {why}"))
        apply_all()
        stable, keep = desired, {desired}
    else:
        assert stable is not None
        if rollout is None or not rollout.active or rollout.canary_revision != desired \
                or rollout.stable_revision != stable or rollout.traffic != traffic \
                or rollout.plan != plan_of(spec.rollout.steps):
            if rollout is not None and rollout.active:
                why = f"revision {rollout.canary_revision} is no longer the spec's" \
                    if rollout.canary_revision != desired else "the spec's steps or traffic routing changed"
                transitions.append(Transition("RolloutSuperseded", f"{why}; rolling out {desired} from step 1",
                                              "Warning"))
            rendered = render(name, namespace, uid, generation, spec, dict(status), pod_monitor=pod_monitor)
            canary_hash = _template_hash(next(o for o in rendered if o["kind"] == "Deployment"))
            rollout, started = start(stable, desired, _template_hash(existing[stable]), canary_hash,
                                     spec.rollout.steps, spec.replicas, now_s, last, traffic)
            transitions.append(started)
        _, canary_count = replicas_during(rollout, spec.replicas)
        canary_ready = _ready(existing.get(desired)) >= canary_count and route_problem is None
        judgement = None
        if canary_ready and action not in ("abort", "promote") and spec.rollout.rollback_on:
            judgement = judge(spec.rollout.rollback_on, query, spec.model.served_name or name, stable, desired,
                              namespace=namespace, scrape_interval_s=scrape_interval_s)
        rollout, moved = advance(rollout, spec.rollout.steps, spec.replicas, action=action, canary_ready=canary_ready,
                                 judgement=judgement, now=now_s)
        transitions += moved
        if rollout.phase == PROMOTED:
            stable, keep = finish_promotion(stable)
        elif rollout.phase in ENDED_WITHOUT_PROMOTION:
            keep = hold_rolled_back(rollout, stable)
        else:
            writes += keep_stable(name, namespace, stable, spec.replicas, status)
            apply_all(replicas_during(rollout, spec.replicas)[1])
            keep = {stable, desired}
    assert stable is not None  # every branch above settles the stable revision
    active = rollout is not None and rollout.active
    # Traffic shifts to the canary while its rollout runs or is being promoted; its share now, else none.
    shifting = rollout is not None and (active or promoting)
    canary_weight = rollout.canary_weight if rollout is not None and shifting else 0
    route_status = None
    if spec.rollout.http_route:
        writes += route_traffic(name, namespace, uid, spec.rollout.http_route, route, stable,
                                desired if shifting else stable, canary_weight)
        route_status = {"httpRoute": spec.rollout.http_route, "problem": route_problem}
        if route_problem and route_problem != ((status.get("trafficRouting") or {}).get("problem")):
            events.append(("HTTPRouteUnusable", f"{route_problem}; the canary's step waits until the route "
                                                "references the service", "Warning"))
    elif (old_route := (status.get("trafficRouting") or {}).get("httpRoute")):
        writes += unroute_traffic(name, namespace, str(old_route))
    assert keep is not None
    writes += prune_revisions(name, namespace, keep)
    if disruption_budget(name, namespace, uid, spec) is None and delete_controlled("PodDisruptionBudget", name,
                                                                                    namespace, uid):
        writes.append(f"deleted PodDisruptionBudget/{name} (spec.replicas ≤ 1)")
    if action is not None and not transitions:
        events.append(("RolloutActionIgnored", f"{ACTION_ANNOTATION}={action}: no rollout in progress that it "
                                               "applies to", "Normal"))

    stable_dep = revision_deployments(name, namespace).get(stable) if writes else existing.get(stable)
    ready = _ready(stable_dep)
    want = spec.replicas
    if want == 0 or ready >= want:
        ready_status, reason, msg = "True", "ReplicasReady", f"{ready}/{want} replicas of revision {stable} ready"
    else:
        ready_status, reason, msg = "False", "ReplicasStarting", f"{ready}/{want} replicas of revision {stable} ready"
    phase = "Degraded" if degraded else "Progressing" if active or promoting or ready_status == "False" else "Ready"
    conditions = set_condition(conditions, "Ready", ready_status, reason, msg, generation, stamp_now)
    if active and rollout is not None:
        conditions = set_condition(conditions, "Progressing", "True", rollout.reason, rollout.message, generation,
                                   stamp_now)
    elif promoting:
        conditions = set_condition(conditions, "Progressing", "True", "Promoting",
                                   f"revision {desired} promoted; waiting for its {want} pods to be ready before "
                                   f"revision {stable} is removed", generation, stamp_now)
    else:
        conditions = set_condition(conditions, "Progressing", "False" if ready_status == "True" else "True",
                                   "RevisionAvailable" if ready_status == "True" else "RevisionRolling",
                                   f"revision {stable}", generation, stamp_now)
    if degraded:
        conditions = set_condition(conditions, "Degraded", "True", degraded[0], degraded[1], generation, stamp_now)
    else:
        conditions = set_condition(conditions, "Degraded", "False", "AsSpecified",
                                   "running the revision the spec names" if not active else
                                   "rolling out the revision the spec names", generation, stamp_now)
    conditions = set_condition(conditions, "Tuning", *_tuning_condition(spec, status), generation, stamp_now)
    if writes:
        events.append(("Reconciled", ", ".join(writes), "Normal"))
    events += [(t.reason, t.message, t.type) for t in transitions]
    if status.get("phase") != phase:
        events.append((phase, msg, "Normal"))
    new_status: dict[str, Any] = {
        "observedGeneration": generation, "phase": phase, "revision": stable,
        # The scale subresource's view: the stable revision is what spec.replicas sizes.
        "replicas": _replicas(stable_dep), "readyReplicas": ready,
        "selector": revision_selector(name, stable),
        "canaryWeight": canary_weight,
        "conditions": conditions}
    if rollout is not None:
        new_status["rollout"] = rollout.to_status()
    if route_status is not None or status.get("trafficRouting") is not None:
        new_status["trafficRouting"] = route_status
    return Outcome(new_status, events, consumed_action=consumed)


def _divergence(desired: str, stable: str, rollout: Rollout) -> str:
    what = "rolled back" if rollout.phase == ROLLED_BACK else "aborted"
    why = (rollout.last_rollback or {}).get("message") or rollout.message
    return (f"the spec names revision {desired}, which was {what} ({why}); stable revision {stable} keeps serving. "
            "It is not retried: change the spec to roll out again, or back to the stable revision.")


def apply_shared(name: str, namespace: str, uid: str, generation: int, spec: InferenceServiceSpec,
                 status: Mapping[str, Any], pod_monitor: bool, writes: list[str]) -> None:
    """Apply the children every revision shares (Service, PodDisruptionBudget, PodMonitor), not the spec's
    revision's own."""
    for obj in render(name, namespace, uid, generation, spec, dict(status), pod_monitor=pod_monitor):
        if obj["kind"] in ("Service", "PodMonitor", "PodDisruptionBudget") and (w := apply_child(obj)):
            writes.append(w)
