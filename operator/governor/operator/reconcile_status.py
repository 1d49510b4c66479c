"""The status and Events of a reconcile pass, from its plan (`reconcile_plan`) and what its writes did.

Conditions Ready, Progressing, Degraded and Tuning each carry a reason and message and move their
lastTransitionTime only when their status changes. Pure: no cluster, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from governor.operator.api import InferenceServiceSpec
from governor.operator.children import Event, ready_replicas
from governor.operator.render import revision_selector
from governor.operator.rollout import stamp

if TYPE_CHECKING:
    from governor.operator.reconcile_plan import ReconcilePlan

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Tuning")



@dataclass
class ReconcileResult:
    """What a reconcile pass did: the status patch, and Events to post."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    consumed_action: bool = False  # a rollout-action annotation was read: the caller removes it


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  generation: int, now: str) -> list[dict[str, Any]]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status changes."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") \
        else now
    new = {"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since, "observedGeneration": generation}
    return [c for c in conditions if c.get("type") != type_] + [new]


def failed(status: Mapping[str, Any], generation: int, now: float, reason: str, message: str, progressing: str,
           keep: Mapping[str, Any] | None = None, consumed_action: bool = False) -> ReconcileResult:
    """Phase Failed with Ready and Progressing False for `reason`; a Warning Event only when Ready's reason or
    message changes. `keep` holds the status fields to carry over (none: the status is only this)."""
    conditions = set_condition(list(status.get("conditions") or []), "Ready", "False", reason, message, generation,
                               stamp(now))
    conditions = set_condition(conditions, "Progressing", "False", reason, progressing, generation, stamp(now))
    old_ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    changed = old_ready.get("reason") != reason or old_ready.get("message") != message
    return ReconcileResult({**(keep or {}), "observedGeneration": generation, "phase": "Failed",
                            "conditions": conditions},
                           [(reason, message, "Warning")] if changed else [], consumed_action=consumed_action)


def _replicas(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("replicas") or 0)


def _tuning_condition(spec: InferenceServiceSpec, status: Mapping[str, Any]) -> tuple[str, str, str]:
    """Tuning condition (status, reason, message) from the tuner's state in status.tuning.state."""
    if not spec.autotune.enabled:
        return "False", "AutotuneDisabled", "spec.autotune.enabled is false"
    state = (status.get("tuning") or {}).get("state")
    if not isinstance(state, Mapping):
        return "Unknown", "TunerStarting", "the tuner has not reported yet"
    reason = str(state.get("reason") or ("Frozen" if state.get("frozen") else "Tuning"))
    return ("False" if state.get("frozen") else "True"), reason, str(state.get("message") or "")


def report(plan: ReconcilePlan, name: str, generation: int, spec: InferenceServiceSpec, status: Mapping[str, Any],
           stable_deployment: Mapping[str, Any] | None, written: list[str], now: float) -> ReconcileResult:
    """The status and Events of a pass: `plan`'s decisions, what its writes changed (`written`) and the stable
    revision's Deployment as read after them."""
    stamp_now = stamp(now)
    stable, rollout = plan.stable, plan.rollout
    active = rollout is not None and rollout.active
    ready = ready_replicas(stable_deployment)
    want = spec.replicas
    if want == 0 or ready >= want:
        ready_status, reason, msg = "True", "ReplicasReady", f"{ready}/{want} replicas of revision {stable} ready"
    else:
        ready_status, reason, msg = "False", "ReplicasStarting", f"{ready}/{want} replicas of revision {stable} ready"
    phase = "Degraded" if plan.degraded else "Progressing" if active or plan.promoting or ready_status == "False" \
        else "Ready"
    conditions = set_condition(list(status.get("conditions") or []), "Ready", ready_status, reason, msg, generation,
                               stamp_now)
    if active and rollout is not None:
        conditions = set_condition(conditions, "Progressing", "True", rollout.reason, rollout.message, generation,
                                   stamp_now)
    elif plan.promoting:
        conditions = set_condition(conditions, "Progressing", "True", "Promoting",
                                   f"revision {plan.revision} promoted; waiting for its {want} pods to be ready "
                                   f"before revision {stable} is removed", generation, stamp_now)
    else:
        conditions = set_condition(conditions, "Progressing", "False" if ready_status == "True" else "True",
                                   "RevisionAvailable" if ready_status == "True" else "RevisionRolling",
                                   f"revision {stable}", generation, stamp_now)
    if plan.degraded:
        conditions = set_condition(conditions, "Degraded", "True", *plan.degraded, generation, stamp_now)
    else:
        conditions = set_condition(conditions, "Degraded", "False", "AsSpecified",
                                   "running the revision the spec names" if not active else
                                   "rolling out the revision the spec names", generation, stamp_now)
    conditions = set_condition(conditions, "Tuning", *_tuning_condition(spec, status), generation, stamp_now)
    events = list(plan.events)
    if written:
        events.append(("Reconciled", ", ".join(written), "Normal"))
    events += [(t.reason, t.message, t.type) for t in plan.transitions]
    if status.get("phase") != phase:
        events.append((phase, msg, "Normal"))
    new_status: dict[str, Any] = {
        "observedGeneration": generation, "phase": phase, "revision": stable,
        # The scale subresource's view: the stable revision is what spec.replicas sizes.
        "replicas": _replicas(stable_deployment), "readyReplicas": ready,
        "selector": revision_selector(name, stable),
        "canaryWeight": plan.canary_weight,
        "conditions": conditions}
    if rollout is not None:
        new_status["rollout"] = rollout.to_status()
    if plan.traffic_routing is not None or status.get("trafficRouting") is not None:
        new_status["trafficRouting"] = plan.traffic_routing
    return ReconcileResult(new_status, events, consumed_action=plan.consumed_action)
