"""The SLO controller's decision core: classification rules, bounded steps, the controller state machine, verify."""

from __future__ import annotations

import dataclasses
import random

import pytest

from governor.tuner.policy import (
    Bottleneck,
    Controller,
    Decision,
    Evidence,
    Hold,
    classify,
    step_knob,
    verify,
)
from governor.tuner.signals import SLO, Signals, is_stale

SLO_ = SLO(ttft_p95_s=1.0, itl_p95_s=0.05)
H = 0.1
BOUNDS = {"max_num_seqs": (4, 256), "max_num_batched_tokens": (256, 8192), "num_speculative_tokens": (0, 4)}


def window(**changes: object) -> Signals:
    """A fresh window sitting exactly on target (inside the release band), no spec, no pressure."""
    knobs = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "num_speculative_tokens": 0}
    knobs.update(changes.pop("knobs", {}))  # type: ignore[call-overload]
    base = Signals(time=1000.0, ttft_p95_s=1.0, itl_p95_s=0.05, e2e_p95_s=None, queue_len=0.0,
                   queue_time_p95_s=0.0, kv_usage=0.5, preemption_rate=0.0, error_rate=None,
                   throughput_tok_s=5000.0, spec_acceptance=None, running=10.0, knobs=knobs, age_s=5.0)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


QUEUEING = dict(ttft_p95_s=1.5, queue_len=12.0, kv_usage=0.6)
PREFILL = dict(itl_p95_s=0.08, itl_p50_s=0.02)  # spiky: a few steps carry prefill chunks
DECODE = dict(itl_p95_s=0.08, running=60.0, knobs={"max_num_batched_tokens": 512})
SPEC_LOW_ACCEPTANCE = dict(knobs={"num_speculative_tokens": 4}, spec_acceptance=0.3)
SPEC_HEADROOM = dict(itl_p95_s=0.08, running=2.0, spec_acceptance=0.9,
                     knobs={"max_num_batched_tokens": 512, "num_speculative_tokens": 2})


# --- classify: one rule each ----------------------------------------------------------------------


def test_any_preemption_is_kv_pressure() -> None:
    found = classify(window(preemption_rate=0.2), SLO_, H)
    assert found.bottleneck is Bottleneck.KV_PRESSURE
    assert found.evidence == [Evidence("preemption_rate", 0.2, 0.0, "1m")]


def test_high_ttft_with_a_queue_and_free_kv_is_queueing() -> None:
    found = classify(window(**QUEUEING), SLO_, H)
    assert found.bottleneck is Bottleneck.QUEUEING
    assert found.slo_at_risk == "ttft_p95_s"
    assert [e.metric for e in found.evidence] == ["ttft_p95_s", "queue_len", "kv_usage"]
    assert found.evidence[0].threshold == pytest.approx(1.1)


def test_high_ttft_with_full_kv_is_not_queueing() -> None:
    found = classify(window(**{**QUEUEING, "kv_usage": 0.95}), SLO_, H)
    assert found.bottleneck is Bottleneck.NONE
    assert found.slo_at_risk == "ttft_p95_s"


def test_high_ttft_with_an_empty_queue_is_not_queueing() -> None:
    assert classify(window(**{**QUEUEING, "queue_len": 0.0}), SLO_, H).bottleneck is Bottleneck.NONE


def test_high_itl_with_a_large_step_budget_is_prefill_interference() -> None:
    found = classify(window(**PREFILL), SLO_, H)
    assert found.bottleneck is Bottleneck.PREFILL_INTERFERENCE
    assert found.slo_at_risk == "itl_p95_s"
    assert found.evidence[1:] == [Evidence("itl_p95_over_p50", pytest.approx(4.0), 2.0, "1m"),
                                  Evidence("max_num_batched_tokens", 2048, 512, "1m")]


def test_high_itl_dominated_by_prompt_tokens_is_prefill_interference() -> None:
    # Chunks in most steps make ITL uniformly slow (p95 ≈ p50); prompt tokens outnumbering generated
    # ones still name prefill as the cause.
    found = classify(window(itl_p95_s=0.08, itl_p50_s=0.07, prompt_tok_s=9000.0), SLO_, H)
    assert found.bottleneck is Bottleneck.PREFILL_INTERFERENCE
    assert found.evidence[1] == Evidence("prompt_tok_s", 9000.0, 5000.0, "1m")


def test_uniformly_slow_itl_without_prefill_load_is_not_prefill_interference() -> None:
    # A large step budget alone is no evidence: lowering it would change nothing.
    slow = window(itl_p95_s=0.08, itl_p50_s=0.07, prompt_tok_s=500.0)
    assert classify(slow, SLO_, H).bottleneck is Bottleneck.NONE
    assert classify(dataclasses.replace(slow, running=60.0), SLO_, H).bottleneck is Bottleneck.DECODE_PRESSURE


def test_high_itl_with_a_full_batch_is_decode_pressure() -> None:
    found = classify(window(**DECODE), SLO_, H)
    assert found.bottleneck is Bottleneck.DECODE_PRESSURE
    running = found.evidence[1]
    assert (running.metric, running.value, running.threshold) == ("running", 60.0, pytest.approx(51.2))


def test_high_itl_with_a_small_batch_and_small_budget_is_none() -> None:
    found = classify(window(**{**DECODE, "running": 20.0}), SLO_, H)
    assert found.bottleneck is Bottleneck.NONE


def test_low_acceptance_is_spec_not_paying() -> None:
    assert classify(window(**SPEC_LOW_ACCEPTANCE), SLO_, H).bottleneck is Bottleneck.SPEC_NOT_PAYING


def test_a_busy_batch_is_spec_not_paying_even_with_good_acceptance() -> None:
    found = classify(window(knobs={"num_speculative_tokens": 2}, spec_acceptance=0.9, running=40.0), SLO_, H)
    assert found.bottleneck is Bottleneck.SPEC_NOT_PAYING
    assert found.evidence == [Evidence("running", 40.0, 32, "1m")]


def test_itl_bound_light_load_with_high_acceptance_is_spec_headroom() -> None:
    assert classify(window(**SPEC_HEADROOM), SLO_, H, bounds=BOUNDS).bottleneck is Bottleneck.SPEC_HEADROOM


def test_spec_headroom_needs_room_under_the_k_cap() -> None:
    at_cap = window(**{**SPEC_HEADROOM, "knobs": {"max_num_batched_tokens": 512, "num_speculative_tokens": 4}})
    assert classify(at_cap, SLO_, H, bounds=BOUNDS).bottleneck is Bottleneck.NONE


COMFORTABLE = dict(ttft_p95_s=0.5, itl_p95_s=0.03)
FULL_BATCH = dict(running=60.0)  # ≥ 0.8 × max_num_seqs 64


def test_every_slo_met_with_margin_and_a_full_batch_is_headroom() -> None:
    found = classify(window(**COMFORTABLE, **FULL_BATCH), SLO_, H)
    assert found.bottleneck is Bottleneck.HEADROOM
    assert found.slo_at_risk is None
    assert [e.metric for e in found.evidence] == ["ttft_p95_s", "itl_p95_s", "running"]
    assert [e.threshold for e in found.evidence] == pytest.approx([0.9, 0.045, 51.2])


def test_headroom_with_a_queue_names_the_queue() -> None:
    found = classify(window(**COMFORTABLE, queue_len=3.0), SLO_, H)
    assert found.bottleneck is Bottleneck.HEADROOM
    assert found.evidence[-1] == Evidence("queue_len", 3.0, 0.0, "1m")


def test_no_headroom_probe_while_the_batch_has_room() -> None:
    # Running 10 of 64 with no queue: a larger max_num_seqs would change nothing.
    assert classify(window(**COMFORTABLE), SLO_, H).bottleneck is Bottleneck.NONE


def test_headroom_needs_every_set_slo_observed() -> None:
    slo = SLO(ttft_p95_s=1.0, itl_p95_s=0.05, e2e_p95_s=10.0)
    assert classify(window(**COMFORTABLE, **FULL_BATCH), slo, H).bottleneck is Bottleneck.NONE
    assert classify(window(**COMFORTABLE, **FULL_BATCH, e2e_p95_s=5.0), slo, H).bottleneck is Bottleneck.HEADROOM


def test_headroom_is_withheld_when_the_error_slo_is_not_met_with_margin() -> None:
    slo = SLO(ttft_p95_s=1.0, itl_p95_s=0.05, error_rate=0.01)
    found = classify(window(**COMFORTABLE, **FULL_BATCH, error_rate=0.02), slo, H)
    assert found.bottleneck is Bottleneck.NONE
    assert found.slo_at_risk == "error_rate"


@pytest.mark.parametrize("ttft, itl", [(1.09, 0.05), (0.91, 0.05), (1.0, 0.054), (0.5, 0.046), (1.1, 0.055)])
def test_values_inside_the_release_band_classify_as_none(ttft: float, itl: float) -> None:
    found = classify(window(ttft_p95_s=ttft, itl_p95_s=itl, queue_len=5.0), SLO_, H)
    assert found.bottleneck is Bottleneck.NONE
    assert found.slo_at_risk is None


@pytest.mark.parametrize("first, second, winner", [
    (dict(preemption_rate=0.1), QUEUEING, Bottleneck.KV_PRESSURE),
    (QUEUEING, PREFILL, Bottleneck.QUEUEING),
    (QUEUEING, SPEC_LOW_ACCEPTANCE, Bottleneck.QUEUEING),
    (SPEC_LOW_ACCEPTANCE, PREFILL, Bottleneck.SPEC_NOT_PAYING),
    (PREFILL, dict(running=60.0), Bottleneck.PREFILL_INTERFERENCE),
    (dict(itl_p95_s=0.08, running=4.0, knobs={"max_num_seqs": 4, "max_num_batched_tokens": 512}),
     dict(spec_acceptance=0.9, knobs={"num_speculative_tokens": 2}), Bottleneck.DECODE_PRESSURE),
    (SPEC_HEADROOM, dict(queue_len=1.0), Bottleneck.SPEC_HEADROOM),
])
def test_the_higher_priority_bottleneck_wins(first: dict, second: dict, winner: Bottleneck) -> None:
    knobs = {**second.get("knobs", {}), **first.get("knobs", {})}
    both = window(**{**second, **first, "knobs": knobs})
    assert classify(both, SLO_, H).bottleneck is winner


# --- step_knob ------------------------------------------------------------------------------------


@pytest.mark.parametrize("current, direction, factor, expected", [
    (64, +1, 1.5, 96),
    (64, -1, 1.5, 43),
    (1024, -1, 1.5, 683),
    (5, +1, 1.5, 7),
    (2, +1, 1.5, 3),  # ×1.5 rounds to no move: step at least 1
    (2, -1, 1.5, 1),
    (2, +1, 1.0, 3),  # K moves by one
    (2, -1, 1.0, 1),
])
def test_step_is_multiplicative_and_moves_at_least_one(current: int, direction: int, factor: float,
                                                       expected: int) -> None:
    assert step_knob(current, direction, factor, (1, 10_000)) == expected


@pytest.mark.parametrize("current, direction, expected", [(200, +1, 256), (256, +1, 256), (5, -1, 4), (4, -1, 4),
                                                           (1000, -1, 256), (1, +1, 4)])
def test_step_is_clamped_to_bounds(current: int, direction: int, expected: int) -> None:
    assert step_knob(current, direction, 1.5, (4, 256)) == expected


def test_step_rejects_inverted_bounds_and_shrinking_factor() -> None:
    with pytest.raises(ValueError, match="inverted"):
        step_knob(8, +1, 1.5, (10, 4))
    with pytest.raises(ValueError, match="factor"):
        step_knob(8, +1, 0.5, (1, 10))


# --- controller -----------------------------------------------------------------------------------


def controller(**changes: object) -> Controller:
    settings = dict(hysteresis=H, consecutive=3, cooldown_s=300.0, max_actions_per_hour=4, scrape_interval_s=15.0)
    return Controller(slo=SLO_, bounds=BOUNDS, **{**settings, **changes})  # type: ignore[arg-type]


def test_acts_only_after_n_consecutive_windows_of_the_same_bottleneck() -> None:
    ctl = controller()
    queueing = window(**QUEUEING)
    assert ctl.decide(queueing, 0.0) is None
    assert ctl.hold is Hold.SETTLING
    assert ctl.decide(queueing, 60.0) is None
    decision = ctl.decide(queueing, 120.0)
    assert decision == Decision(120.0, "max_num_seqs", 64, 96, Bottleneck.QUEUEING,
                                classify(queueing, SLO_, H).evidence, windows=3)
    assert ctl.hold is None


def test_a_window_released_below_the_band_resets_the_count() -> None:
    ctl = controller()
    queueing = window(**QUEUEING)
    ctl.decide(queueing, 0.0)
    ctl.decide(queueing, 60.0)
    assert ctl.decide(window(ttft_p95_s=0.85), 120.0) is None  # below the release threshold 0.9
    assert ctl.hold is Hold.NO_BOTTLENECK
    assert ctl.decide(queueing, 180.0) is None
    assert ctl.decide(queueing, 240.0) is None
    assert ctl.decide(queueing, 300.0) is not None


def test_a_different_bottleneck_restarts_the_count() -> None:
    ctl = controller()
    ctl.decide(window(**QUEUEING), 0.0)
    ctl.decide(window(**QUEUEING), 60.0)
    assert ctl.decide(window(**PREFILL), 120.0) is None
    assert (ctl.streak_bottleneck, ctl.streak) == (Bottleneck.PREFILL_INTERFERENCE, 1)


def test_cooldown_holds_after_an_action() -> None:
    ctl = controller(consecutive=1)
    assert ctl.decide(window(**PREFILL), 0.0) is not None
    assert ctl.decide(window(**PREFILL), 299.0) is None
    assert ctl.hold is Hold.COOLDOWN
    decision = ctl.decide(window(**PREFILL), 300.0)
    assert decision is not None and decision.knob == "max_num_batched_tokens"


def test_hourly_cap_holds_until_the_oldest_action_is_an_hour_old() -> None:
    ctl = controller(consecutive=1, cooldown_s=0.0, max_actions_per_hour=2)
    assert ctl.decide(window(**PREFILL), 0.0) is not None
    assert ctl.decide(window(**PREFILL), 600.0) is not None
    assert ctl.decide(window(**PREFILL), 1200.0) is None
    assert ctl.hold is Hold.HOURLY_CAP
    assert ctl.decide(window(**PREFILL), 3600.0) is not None


def test_no_action_at_a_bound() -> None:
    ctl = controller(consecutive=1)
    assert ctl.decide(window(**COMFORTABLE, running=250.0, knobs={"max_num_seqs": 256}), 0.0) is None
    assert ctl.hold is Hold.AT_BOUND
    assert ctl.action_times == []


def test_decisions_never_leave_the_bounds() -> None:
    ctl = controller(consecutive=1, cooldown_s=0.0, max_actions_per_hour=1000)
    seqs = 64
    for i in range(20):
        decision = ctl.decide(window(**COMFORTABLE, queue_len=2.0, knobs={"max_num_seqs": seqs}), 60.0 * i)
        if decision is None:
            break
        assert decision.from_value == seqs and decision.to_value > seqs
        seqs = decision.to_value
    assert seqs == 256
    assert ctl.hold is Hold.AT_BOUND


def test_each_decision_moves_one_knob() -> None:
    ctl = controller(consecutive=1)
    decision = ctl.decide(window(**SPEC_LOW_ACCEPTANCE), 0.0)
    assert decision is not None
    assert (decision.knob, decision.from_value, decision.to_value) == ("num_speculative_tokens", 4, 3)


def test_an_engaged_slo_keeps_acting_inside_the_band_until_released() -> None:
    ctl = controller(consecutive=1, cooldown_s=0.0)
    assert ctl.decide(window(**PREFILL), 0.0) is not None  # 0.08 > 0.055: engaged
    in_band = dict(PREFILL, itl_p95_s=0.052)  # inside the band (0.045 .. 0.055)
    decision = ctl.decide(window(**in_band), 60.0)
    assert decision is not None and decision.reason is Bottleneck.PREFILL_INTERFERENCE
    assert decision.evidence[0].threshold == pytest.approx(0.045)  # the release threshold
    assert ctl.decide(window(**dict(PREFILL, itl_p95_s=0.04)), 120.0) is None  # released below 0.045
    assert "itl_p95_s" not in ctl.engaged
    assert ctl.decide(window(**in_band), 180.0) is None  # never starts acting from inside the band


def test_a_blocked_step_is_halved_and_then_backs_off() -> None:
    ctl = controller(consecutive=1, cooldown_s=0.0, max_actions_per_hour=100)
    ctl.block("max_num_seqs", 64, 96, until=1000.0)  # 64 → 96 was rolled back
    decision = ctl.decide(window(**QUEUEING), 0.0)
    assert decision is not None and (decision.from_value, decision.to_value) == (64, 80)
    # From 80, the step to 120 is past the block (96 and beyond): halfway is 88, a move of 10% — allowed.
    decision = ctl.decide(window(**QUEUEING, knobs={"max_num_seqs": 80}), 10.0)
    assert decision is not None and decision.to_value == 88
    # From 90, halfway to 96 is 93: less than a 10% move — hold.
    assert ctl.decide(window(**QUEUEING, knobs={"max_num_seqs": 90}), 20.0) is None
    assert ctl.hold is Hold.BACKED_OFF
    # Steps in the other direction, and steps after the block expires, are not affected.
    assert ctl.decide(window(**QUEUEING, knobs={"max_num_seqs": 90}), 1000.0) is not None


def test_an_unapplied_action_does_not_count_toward_the_hourly_cap() -> None:
    ctl = controller(consecutive=1, cooldown_s=0.0, max_actions_per_hour=1)
    decision = ctl.decide(window(**QUEUEING), 0.0)
    assert decision is not None
    ctl.uncount(decision.time)
    assert ctl.decide(window(**QUEUEING), 60.0) is not None


@pytest.mark.parametrize("stale", [
    dict(age_s=31.0),
    dict(ttft_p95_s=None),
    dict(itl_p95_s=None),
    dict(knobs={}),
])
def test_stale_signals_freeze_the_controller(stale: dict) -> None:
    ctl = controller(consecutive=2)
    ctl.decide(window(**PREFILL), 0.0)
    signals = window(**{**PREFILL, **stale})
    if stale.get("knobs") == {}:
        signals = dataclasses.replace(signals, knobs={})
    assert ctl.decide(signals, 60.0) is None
    assert ctl.hold is Hold.SIGNALS_STALE
    assert ctl.hold.value == "SignalsStale"
    assert ctl.streak == 0  # the stale window breaks the run of consecutive windows


def test_staleness_is_two_scrape_intervals() -> None:
    assert not is_stale(window(age_s=30.0), 15.0)
    assert is_stale(window(age_s=30.1), 15.0)
    knobs_missing_k = dataclasses.replace(window(), knobs={"max_num_seqs": 64, "max_num_batched_tokens": 2048})
    assert is_stale(knobs_missing_k, 15.0)


# --- verify ---------------------------------------------------------------------------------------


def latencies(seed: int, n: int = 60, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(-1.0, 0.25) for _ in range(n)]


def test_verify_flags_latency_thirty_percent_higher() -> None:
    verdict = verify(latencies(1), latencies(2, scale=1.3), higher_is_worse=True)
    assert verdict.regressed
    assert verdict.p_value < 0.001
    assert verdict.effect == pytest.approx(0.3, abs=0.1)


def test_verify_ignores_noise_from_the_same_distribution() -> None:
    verdict = verify(latencies(1), latencies(2), higher_is_worse=True)
    assert not verdict.regressed
    assert verdict.p_value > 0.05
    assert abs(verdict.effect) < 0.1


def test_verify_does_not_flag_an_improvement() -> None:
    verdict = verify(latencies(1), latencies(2, scale=0.7), higher_is_worse=True)
    assert not verdict.regressed
    assert verdict.effect < 0


def test_verify_flags_a_throughput_drop_when_lower_is_worse() -> None:
    verdict = verify(latencies(1, scale=5000.0), latencies(2, scale=3500.0), higher_is_worse=False)
    assert verdict.regressed
    assert verdict.effect == pytest.approx(0.3, abs=0.1)


def test_verify_keeps_a_significant_but_tiny_shift() -> None:
    before = latencies(1, n=2000)
    verdict = verify(before, [x * 1.05 for x in before], higher_is_worse=True)
    assert verdict.p_value < 0.05
    assert not verdict.regressed


def test_verify_needs_samples_on_both_sides() -> None:
    with pytest.raises(ValueError, match="settle window"):
        verify([], [1.0], higher_is_worse=True)
