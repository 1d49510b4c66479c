"""The rollout state machine and trigger judging as pure functions (no cluster, no Prometheus).

`advance` is driven with explicit times, readiness and judgements; `judge` with a query function that
answers from a table keyed by the PromQL the operator would send, so the queries are checked too.
"""

from __future__ import annotations

from typing import Any

import pytest

from governor.operator.analysis import (
    Judgement,
    engines_query,
    evaluate,
    judge,
    metric_query,
)
from governor.operator.api import RollbackTrigger, RolloutStep
from governor.operator.render import synced_knobs
from governor.operator.rollout import (
    ABORTED,
    PAUSED,
    PROGRESSING,
    PROMOTED,
    ROLLED_BACK,
    Rollout,
    advance,
    start,
)
from governor.operator.traffic import HTTP_ROUTE, canary_replicas, canary_share, routed_rules

STEPS = [RolloutStep(weight=10, pause="30s"), RolloutStep(weight=50, pause="30s")]
T0 = 1_800_000_000.0
TTFT = RollbackTrigger.model_validate({"metric": "ttft_p95", "comparison": "relative", "threshold": 1.2, "for": "1m"})
ERRORS = RollbackTrigger.model_validate({"metric": "error_rate", "comparison": "absolute", "threshold": 0.01})
THROUGHPUT = RollbackTrigger.model_validate({"metric": "throughput", "comparison": "relative", "threshold": 0.8})


def started() -> Rollout:
    state, transition = start("stable1", "canary2", "a" * 64, "b" * 64, STEPS, replicas=4, now=T0, last=None)
    assert transition.reason == "RolloutStarted"
    return state


def step(state: Rollout, now: float, *, action: str | None = None, ready: bool = True,
         judgement: Judgement | None = None) -> tuple[Rollout, list[str]]:
    new, transitions = advance(state, STEPS, 4, action=action, canary_ready=ready, judgement=judgement, now=now)
    return new, [t.reason for t in transitions]


def ok() -> Judgement:
    return Judgement((evaluate(0, TTFT, 0.10, 0.10),))


def test_canary_replicas_approximate_the_weight_beside_a_full_stable() -> None:
    assert [canary_replicas(4, w) for w in (10, 25, 50, 75)] == [1, 1, 4, 12]
    assert canary_replicas(1, 10) == 1 and canary_share(1, 10) == 50  # coarse with one stable pod
    assert canary_replicas(9, 10) == 1 and canary_share(9, 10) == 10


def test_with_an_http_route_the_weight_is_exact_and_the_canary_sized_for_its_share() -> None:
    assert [canary_replicas(4, w, HTTP_ROUTE) for w in (10, 25, 50, 75)] == [1, 1, 2, 3]
    assert canary_share(1, 10, HTTP_ROUTE) == 10


def test_route_rules_referencing_the_service_get_weighted_role_backends() -> None:
    route = {"spec": {"rules": [
        {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
         "backendRefs": [{"name": "chat", "port": 8000}, {"name": "other", "port": 80, "weight": 1}]},
        {"backendRefs": [{"name": "unrelated", "port": 80}]},
    ]}}
    rules = routed_rules(route, "chat", 8000, 25)
    assert rules is not None
    assert rules[0]["matches"] == route["spec"]["rules"][0]["matches"]  # the user's parts are kept
    assert rules[0]["backendRefs"] == [{"name": "other", "port": 80, "weight": 1},
                                       {"name": "chat-stable", "port": 8000, "weight": 75},
                                       {"name": "chat-canary", "port": 8000, "weight": 25}]
    assert rules[1] == route["spec"]["rules"][1]
    again = routed_rules({"spec": {"rules": rules}}, "chat", 8000, 0)  # idempotent over its own output
    assert again is not None and [r.get("weight") for r in again[0]["backendRefs"]] == [1, 100, 0]
    assert routed_rules({"spec": {"rules": [{"backendRefs": [{"name": "x"}]}]}}, "chat", 8000, 10) is None


def test_a_step_is_timed_from_when_the_canary_is_ready_then_the_rollout_promotes() -> None:
    state = started()
    assert (state.phase, state.step, state.step_started_at) == (PROGRESSING, 0, None)
    state, _ = step(state, T0 + 100, ready=False)  # pods still loading: the clock has not started
    assert (state.reason, state.step_started_at) == ("CanaryStarting", None)
    state, _ = step(state, T0 + 200, judgement=ok())
    assert state.reason == "Judging" and state.step_started_at is not None
    state, reasons = step(state, T0 + 229, judgement=ok())
    assert (state.step, reasons) == (0, [])  # 29 s of a 30 s pause
    state, reasons = step(state, T0 + 230, judgement=ok())
    assert (state.step, state.requested_weight, reasons) == (1, 50, ["RolloutStepPassed"])
    state, _ = step(state, T0 + 231, judgement=ok())  # the bigger canary is ready: step 2's clock starts
    state, reasons = step(state, T0 + 261, judgement=ok())
    assert (state.phase, state.reason, reasons) == (PROMOTED, "AllStepsPassed", ["RolloutPromoted"])
    assert state.ended_at is not None and state.analysis[0]["fired"] is False


def test_a_fired_trigger_rolls_back_and_records_what_fired() -> None:
    state, _ = step(started(), T0 + 1, judgement=ok())
    judgement = Judgement((evaluate(0, TTFT, 0.15, 0.10), evaluate(1, ERRORS, 0.0, None)))
    state, reasons = step(state, T0 + 10, judgement=judgement)
    assert (state.phase, state.reason, reasons) == (ROLLED_BACK, "TriggerFired", ["RolloutRolledBack"])
    last = state.last_rollback
    assert last is not None
    assert (last["trigger"], last["metric"], last["threshold"], last["window"]) == \
        ("spec.rollout.rollbackOn[0]", "ttft_p95", 1.2, "1m")
    assert last["observed"] == pytest.approx(0.15) and last["limit"] == pytest.approx(0.12)
    assert last["revision"] == "canary2" and last["at"].endswith("Z")


def test_missing_metrics_pause_the_rollout_and_never_promote_it() -> None:
    state, _ = step(started(), T0 + 1, judgement=ok())
    missing = Judgement((evaluate(0, TTFT, None, 0.10),))
    state, reasons = step(state, T0 + 40, judgement=missing)  # past the pause, but no verdict
    assert (state.phase, state.reason, state.step, reasons) == (PAUSED, "SignalsStale", 0, ["RolloutSignalsStale"])
    state, reasons = step(state, T0 + 400, judgement=missing)
    assert (state.phase, state.step, reasons) == (PAUSED, 0, [])  # reported once, still held
    state, reasons = step(state, T0 + 401, judgement=ok())
    assert (state.phase, state.step, reasons) == (PROGRESSING, 0, ["RolloutResumed"])
    state, _ = step(state, T0 + 430, judgement=ok())
    assert state.step == 0  # the step's full pause is judged again after the data came back
    state, reasons = step(state, T0 + 431 + 30, judgement=ok())
    assert (state.step, reasons) == (1, ["RolloutStepPassed"])


def test_manual_pause_holds_until_resumed_and_abort_rolls_back() -> None:
    state, _ = step(started(), T0 + 1, judgement=ok())
    state, reasons = step(state, T0 + 5, action="pause")
    assert (state.phase, state.reason, reasons) == (PAUSED, "ManualPause", ["RolloutPaused"])
    state, reasons = step(state, T0 + 500)
    assert (state.phase, reasons) == (PAUSED, [])
    state, reasons = step(state, T0 + 501, action="resume", judgement=ok())
    assert (state.phase, reasons) == (PROGRESSING, ["RolloutResumed"])
    state, reasons = step(state, T0 + 502, action="abort")
    assert (state.phase, state.reason, reasons) == (ABORTED, "ManualAbort", ["RolloutAborted"])
    assert state.last_rollback is not None and state.last_rollback["trigger"] == "manual-abort"


def test_promote_now_ends_the_rollout_at_any_step() -> None:
    state, reasons = step(started(), T0 + 1, action="promote")
    assert (state.phase, state.reason, reasons) == (PROMOTED, "ManualPromote", ["RolloutPromoted"])


def test_an_ended_rollout_does_not_move() -> None:
    state, _ = step(started(), T0 + 1, action="abort")
    assert step(state, T0 + 1000, action="promote", judgement=ok()) == (state, [])


def test_status_round_trip_keeps_every_field() -> None:
    state, _ = step(started(), T0 + 1, judgement=ok())
    raw = state.to_status()
    assert {"phase", "step", "canaryWeight", "stableRevision", "canaryRevision", "stableTemplateHash",
            "canaryTemplateHash", "lastRollback", "stepStartedAt"} <= set(raw)
    assert Rollout.from_status(raw) == state
    assert Rollout.from_status({"phase": "Progressing"}) is None  # unreadable: started afresh
    assert Rollout.from_status(None) is None


@pytest.mark.parametrize(("trigger", "canary", "stable", "fired"), [
    (TTFT, 0.15, 0.10, True),      # 1.5 × stable > 1.2 × stable
    (TTFT, 0.11, 0.10, False),
    (ERRORS, 0.02, None, True),    # absolute: stable not needed
    (ERRORS, 0.0, None, False),
    (THROUGHPUT, 70.0, 100.0, True),  # per-engine throughput fell below 0.8 × stable
    (THROUGHPUT, 90.0, 100.0, False),
])
def test_trigger_verdicts(trigger: RollbackTrigger, canary: float, stable: float | None, fired: bool) -> None:
    result = evaluate(0, trigger, canary, stable)
    assert (result.fired, result.missing) == (fired, None)


def test_a_trigger_without_data_has_no_verdict() -> None:
    assert evaluate(0, TTFT, None, 0.1).missing == "no canary data for ttft_p95 over 1m"
    assert "no stable data" in (evaluate(0, TTFT, 0.1, None).missing or "")


def test_judge_sends_scoped_promql_and_reads_both_revisions() -> None:
    answers: dict[str, Any] = {
        engines_query("chat", "s1", namespace="team-a"): 3.0, engines_query("chat", "c2", namespace="team-a"): 1.0,
        metric_query("ttft_p95", "chat", "c2", 60, namespace="team-a"): 0.3,
        metric_query("ttft_p95", "chat", "s1", 60, namespace="team-a"): 0.2,
    }
    asked: list[str] = []

    def query(promql: str) -> float | None:
        asked.append(promql)
        return answers.get(promql)

    judgement = judge([TTFT], query, "chat", stable="s1", canary="c2", namespace="team-a")
    assert judgement.fired is not None and judgement.fired.canary == 0.3 and judgement.missing == []
    assert set(asked) == set(answers)
    ttft = metric_query("ttft_p95", "chat", "c2", 60, namespace="team-a")
    assert 'model_name="chat", revision="c2", namespace="team-a"' in ttft and "[1m]" not in ttft and "[60s]" in ttft
    assert "governor_time_to_first_token_seconds_bucket" in ttft
    throughput = metric_query("throughput", "chat", "c2", 60, namespace="team-a")
    assert throughput.endswith('/ avg_over_time(count(governor_engine_info{model_name="chat", revision="c2", '
                               'namespace="team-a"})[60s:])')


def test_judge_holds_when_a_revision_is_not_scraped() -> None:
    judgement = judge([TTFT], lambda q: 0.5 if "c2" in q else None, "chat", stable="s1", canary="c2",
                      namespace="team-a")
    assert judgement.fired is None
    assert judgement.missing[0] == "revision s1: no engine scraped now"


def test_stable_config_map_knobs_follow_status_within_its_own_limits() -> None:
    cm = {"data": {"limits.json": '{"max_num_seqs": [1, 64], "max_num_batched_tokens": [1, 2048]}',
                   "max_num_seqs": "8", "max_num_batched_tokens": "512"}}
    assert synced_knobs(cm, {"tuning": {"knobs": {"max_num_seqs": 128}}}) == \
        {"max_num_seqs": "64", "max_num_batched_tokens": "512"}  # clamped to the stable revision's cap
    assert synced_knobs(cm, {"tuning": {"knobs": {"max_num_seqs": 8}}}) is None
    assert synced_knobs({"data": {"max_num_seqs": "x"}}, {}) is None  # not ours: left alone


def test_a_manual_pause_does_not_shelter_a_canary_whose_trigger_fires() -> None:
    state, _ = step(started(), T0 + 1, judgement=ok())
    state, _ = step(state, T0 + 5, action="pause")
    fired = Judgement((evaluate(0, TTFT, 0.2, 0.1),))
    state, reasons = step(state, T0 + 6, judgement=fired)
    assert (state.phase, reasons) == (ROLLED_BACK, ["RolloutRolledBack"])


def test_an_abort_after_a_trigger_rollback_leaves_no_trigger_fields_behind() -> None:
    # status is merge-patched: lastRollback of an abort names every key a fired trigger's has, as None
    state, _ = step(started(), T0 + 1, judgement=Judgement((evaluate(0, TTFT, 0.2, 0.1),)))
    fired_keys = set(state.last_rollback or {})
    again, _ = start("stable1", "canary3", "a" * 64, "c" * 64, STEPS, replicas=4, now=T0 + 100, last=state)
    aborted, _ = step(again, T0 + 101, action="abort")
    assert set(aborted.last_rollback or {}) == fired_keys
    assert (aborted.last_rollback or {})["limit"] is None and (aborted.last_rollback or {})["fired"] is None


def test_a_canary_that_restarts_its_pods_while_stale_waits_as_starting_not_paused() -> None:
    state, _ = step(started(), T0 + 1, judgement=Judgement((evaluate(0, TTFT, None, 0.1),)))
    assert state.phase == PAUSED
    state, _ = step(state, T0 + 2, ready=False)
    assert (state.phase, state.reason) == (PROGRESSING, "CanaryStarting")
