"""The canary rollout of one InferenceService: one state machine, pure, with its state in `status.rollout`.

A rollout starts when the spec's revision (`render.revision_hash`) differs from the stable one
(`status.revision`). The stable Deployment keeps its pods and its pod template; a canary Deployment of
the new revision runs beside it, behind the same Service, and the rollout walks `spec.rollout.steps`:

    Progressing(step i) ──pause passed──► Progressing(step i+1) ... ──last step passed──► Promoted
         │   ▲                                                                            (canary = stable,
         │   └── resume / data again ──┐                                                   old stable removed)
         ├── pause annotation ──► Paused(ManualPause)
         ├── a trigger has no data ──► Paused(SignalsStale)      (the step's clock restarts when it resumes)
         ├── a trigger fires ──► RolledBack                       (canary removed, stable untouched)
         ├── abort annotation ──► Aborted                         (the same, by hand)
         └── promote annotation ──► Promoted

A step's pause is counted from the moment the canary's pods are all ready and, when the rollout has
triggers, only while every trigger has a verdict: missing metrics hold the rollout and never promote it.
After RolledBack or Aborted the spec still names the new revision: the operator keeps the stable one, says
so (condition Degraded, reason RolledBack or Aborted) and does not retry that revision until the spec
changes to another one. Every transition is an Event with a stable reason.

State lives in status only, so an operator restart resumes where the rollout was (the step's clock is
wall time: the step started at `stepStartedAt`).

Stable keeps `spec.replicas` pods while the canary is judged (capacity never drops); the canary's pods and
share of traffic come from `traffic` (replica ratio, or weights on an HTTPRoute).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from governor.operator.analysis import Judgement
from governor.operator.api import RolloutStep, duration_seconds
from governor.operator.traffic import REPLICAS, canary_replicas, canary_share

ACTION_ANNOTATION = "governor.dev/rollout-action"
ROLLOUT_ACTIONS = ("pause", "resume", "abort", "promote")

PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED = "Progressing", "Paused", "Promoted", "RolledBack", "Aborted"
ACTIVE = (PROGRESSING, PAUSED)
ENDED_WITHOUT_PROMOTION = (ROLLED_BACK, ABORTED)


def stamp(t: float) -> str:
    """RFC 3339 UTC time, whole seconds (as Kubernetes writes times)."""
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


@dataclass(frozen=True)
class Rollout:
    """`status.rollout`, as data. Field names are the status' camelCase ones through `to_status`.

    Invariants: `step` indexes `spec.rollout.steps` while the phase is active; `step_started_at` is set exactly
    when the phase is Progressing and the canary is being judged (None while paused or while its pods start).
    """

    phase: str
    reason: str
    message: str
    step: int
    steps: int
    requested_weight: int
    canary_weight: int
    stable_revision: str
    canary_revision: str
    stable_template_hash: str
    canary_template_hash: str
    started_at: str
    step_started_at: str | None = None
    ended_at: str | None = None
    analysis: list[dict[str, Any]] = field(default_factory=list)
    last_rollback: dict[str, Any] | None = None
    traffic: str = REPLICAS  # how the split is made: `traffic.REPLICAS` or `traffic.HTTP_ROUTE`
    plan: str = ""  # the steps it walks (`plan_of`): other steps in the spec restart the rollout
    superseded: bool = False  # ended unpromoted, then the spec named another revision: it may be retried

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE

    def to_status(self) -> dict[str, Any]:
        """camelCase dict with every field; a None removes the field from status (merge patch), so nothing of
        an earlier rollout lingers."""
        return {_camel(k): v for k, v in asdict(self).items()}

    @classmethod
    def from_status(cls, raw: Any) -> Rollout | None:
        """The rollout in `status.rollout`, or None when there is none (or it is unreadable: then the next
        reconcile starts afresh, as after a first deployment)."""
        if not isinstance(raw, dict):
            return None
        names = {_camel(f): f for f in cls.__dataclass_fields__}
        values = {names[k]: v for k, v in raw.items() if k in names}
        try:
            return cls(**values)
        except TypeError:
            return None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


@dataclass(frozen=True)
class Transition:
    """An Event to emit: stable reason, message, and type (Normal or Warning)."""

    reason: str
    message: str
    type: str = "Normal"


def plan_of(steps: list[RolloutStep]) -> str:
    """The steps as one comparable string, e.g. "10%/2m,50%/2m"."""
    return ",".join(f"{s.weight}%/{s.pause}" for s in steps)


def start(stable: str, canary: str, stable_hash: str, canary_hash: str, steps: list[RolloutStep], replicas: int,
          now: float, last: Rollout | None, traffic: str = REPLICAS) -> tuple[Rollout, Transition]:
    """A new rollout at step 0 (its clock starts when the canary's pods are ready). `last` carries over
    `lastRollback`, so the previous rollback stays visible until another one happens."""
    weight = steps[0].weight
    state = Rollout(phase=PROGRESSING, reason="CanaryStarting", message=f"starting canary {canary} at {weight}%",
                    step=0, steps=len(steps), requested_weight=weight,
                    canary_weight=canary_share(replicas, weight, traffic),
                    stable_revision=stable, canary_revision=canary, stable_template_hash=stable_hash,
                    canary_template_hash=canary_hash, started_at=stamp(now),
                    last_rollback=last.last_rollback if last else None, traffic=traffic, plan=plan_of(steps))
    return state, Transition("RolloutStarted", f"rolling out revision {canary} over stable {stable} in "
                                               f"{len(steps)} step(s): {', '.join(f'{s.weight}%' for s in steps)}")


def _at_step(state: Rollout, step: int, steps: list[RolloutStep], replicas: int) -> Rollout:
    weight = steps[step].weight
    return replace(state, step=step, requested_weight=weight,
                   canary_weight=canary_share(replicas, weight, state.traffic))


def _ended(state: Rollout, phase: str, reason: str, message: str, now: float, **changes: Any) -> Rollout:
    return replace(state, phase=phase, reason=reason, message=message, step_started_at=None, ended_at=stamp(now),
                   **changes)


def advance(state: Rollout, steps: list[RolloutStep], replicas: int, *, action: str | None, canary_ready: bool,
            judgement: Judgement | None, now: float) -> tuple[Rollout, list[Transition]]:
    """One check of an active rollout. `action` is the rollout-action annotation (already validated against
    `ROLLOUT_ACTIONS`, or None); `judgement` the triggers' verdicts, None when nothing was judged (no triggers, or
    the canary not ready). Returns the new state and the transitions to report."""
    if not state.active:
        return state, []
    if action == "abort":
        rollback = {"trigger": "manual-abort", "metric": None, "comparison": None, "threshold": None,
                    "window": None, "observed": None, "stable": None, "limit": None, "fired": None, "missing": None,
                    "at": stamp(now), "revision": state.canary_revision,
                    "message": f"aborted by annotation {ACTION_ANNOTATION}=abort"}
        msg = f"revision {state.canary_revision} aborted by hand at step {state.step + 1}/{state.steps}; " \
              f"stable {state.stable_revision} serves all traffic"
        return _ended(state, ABORTED, "ManualAbort", msg, now, last_rollback=rollback), \
            [Transition("RolloutAborted", msg, "Warning")]
    if action == "promote":
        msg = f"revision {state.canary_revision} promoted by hand at step {state.step + 1}/{state.steps}"
        return _ended(state, PROMOTED, "ManualPromote", msg, now), [Transition("RolloutPromoted", msg)]
    # A fired trigger rolls back whatever else holds the rollout: a manual pause does not shelter a bad canary.
    if judgement is not None and (fired := judgement.fired) is not None:
        rollback = {**fired.to_status(), "at": stamp(now), "revision": state.canary_revision,
                    "message": fired.describe()}
        msg = f"revision {state.canary_revision} rolled back at step {state.step + 1}/{state.steps}: {fired.describe()}"
        return _ended(state, ROLLED_BACK, "TriggerFired", msg, now, analysis=judgement.to_status(),
                      last_rollback=rollback), [Transition("RolloutRolledBack", msg, "Warning")]
    manual = state.phase == PAUSED and state.reason == "ManualPause"
    if action == "pause" and not manual:
        msg = f"paused by hand at step {state.step + 1}/{state.steps}; resume with {ACTION_ANNOTATION}=resume"
        return replace(state, phase=PAUSED, reason="ManualPause", message=msg, step_started_at=None), \
            [Transition("RolloutPaused", msg)]
    transitions = []
    if manual:
        if action != "resume":
            return (state if judgement is None else replace(state, analysis=judgement.to_status())), []
        state = replace(state, phase=PROGRESSING, reason="Resumed", message="resumed by hand; the step's pause "
                        "starts again", step_started_at=None)
        transitions.append(Transition("RolloutResumed", f"resumed by hand at step {state.step + 1}/{state.steps}"))

    if judgement is not None:
        state = replace(state, analysis=judgement.to_status())
        if judgement.missing:
            msg = "holding: " + "; ".join(judgement.missing)
            if state.phase != PAUSED or state.reason != "SignalsStale":
                transitions.append(Transition("RolloutSignalsStale", msg, "Warning"))
            return replace(state, phase=PAUSED, reason="SignalsStale", message=msg, step_started_at=None), transitions
        if state.phase == PAUSED:  # SignalsStale, and every trigger has a verdict again
            transitions.append(Transition("RolloutResumed", f"metrics are back at step {state.step + 1}/{state.steps}; "
                                                            "the step's pause starts again"))
            state = replace(state, phase=PROGRESSING, reason="SignalsBack", message="metrics are back",
                            step_started_at=None)

    if not canary_ready:
        if state.step_started_at is None:
            return replace(state, phase=PROGRESSING, reason="CanaryStarting",
                           message=f"waiting for the canary's pods (and route) at step "
                                   f"{state.step + 1}/{state.steps}"), transitions
        return state, transitions  # a pod restarting mid-step does not restart the step
    if state.step_started_at is None:
        return replace(state, phase=PROGRESSING, reason="Judging", step_started_at=stamp(now),
                       message=f"step {state.step + 1}/{state.steps}: canary at {state.canary_weight}% for "
                               f"{steps[state.step].pause}"), transitions

    if now - parse_stamp(state.step_started_at) < duration_seconds(steps[state.step].pause):
        return state, transitions
    if state.step + 1 < len(steps):
        nxt = _at_step(state, state.step + 1, steps, replicas)
        msg = f"step {state.step + 1}/{state.steps} passed; step {nxt.step + 1}: canary at {nxt.requested_weight}%"
        return replace(nxt, reason="StepPassed", message=msg, step_started_at=None), \
            [*transitions, Transition("RolloutStepPassed", msg)]
    msg = f"all {state.steps} step(s) passed: revision {state.canary_revision} is now stable"
    return _ended(state, PROMOTED, "AllStepsPassed", msg, now), [*transitions, Transition("RolloutPromoted", msg)]


def replicas_during(state: Rollout, replicas: int) -> tuple[int, int]:
    """(stable, canary) pod counts while `state` is active."""
    return replicas, canary_replicas(replicas, state.requested_weight, state.traffic)

