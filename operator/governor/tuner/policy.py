"""The SLO controller's decision core: classify a window, pick one bounded knob step, verify the outcome.

Functions of data only; the tuner loop around it observes, actuates and records.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from scipy.stats import mannwhitneyu

from governor.tuner.signals import SLO, Signals, is_stale

MAX_NUM_SEQS = "max_num_seqs"
MAX_NUM_BATCHED_TOKENS = "max_num_batched_tokens"
NUM_SPECULATIVE_TOKENS = "num_speculative_tokens"

Bounds = dict[str, tuple[int, int]]
"""Per-knob hard limits, (min, max) inclusive; the controller never steps outside them."""

DEFAULT_BOUNDS: Bounds = {MAX_NUM_SEQS: (1, 256), MAX_NUM_BATCHED_TOKENS: (256, 8192), NUM_SPECULATIVE_TOKENS: (0, 8)}
"""Bounds where a service gives none (the max of the first two equals the engine's default starting values)."""

# Thresholds of the classification rules (see `classify`).
KV_QUEUEING_CEILING = 0.9  # above this KV fill, more sequences would only preempt
PREFILL_TOKENS_FLOOR = 512  # below this step budget, chunked prefill no longer hurts ITL much
MIN_BISECT_MOVE = 0.1  # a step halved toward a blocked value must still move the knob by this fraction
ITL_SPIKE_RATIO = 2.0  # ITL p95 ≥ this × p50: slow steps are the exception (prefill chunks), not the rule
DECODE_BATCH_FRACTION = 0.8  # running ≥ this share of max_num_seqs counts as a full batch
SPEC_MIN_ACCEPTANCE = 0.5
SPEC_BUSY_RUNNING = 32  # a batch this large is compute-bound: drafts cost more than they save
SPEC_HEADROOM_ACCEPTANCE = 0.8
SPEC_HEADROOM_RUNNING = 4

# Multiplicative step per knob; 1.0 means the knob moves by ±1 (speculation depth K).
STEP_FACTORS: dict[str, float] = {MAX_NUM_SEQS: 1.5, MAX_NUM_BATCHED_TOKENS: 1.5, NUM_SPECULATIVE_TOKENS: 1.0}


class Bottleneck(str, Enum):
    """What limits the service in a window; the value doubles as the decision record's `reason`."""

    QUEUEING = "Queueing"
    PREFILL_INTERFERENCE = "PrefillInterference"
    DECODE_PRESSURE = "DecodePressure"
    KV_PRESSURE = "KVPressure"
    SPEC_NOT_PAYING = "SpecNotPaying"
    SPEC_HEADROOM = "SpecHeadroom"
    HEADROOM = "Headroom"
    NONE = "None"


# The remedy for each bottleneck: which knob, and which way (+1 up, -1 down).
REMEDIES: dict[Bottleneck, tuple[str, int]] = {
    Bottleneck.KV_PRESSURE: (MAX_NUM_SEQS, -1),
    Bottleneck.QUEUEING: (MAX_NUM_SEQS, +1),
    Bottleneck.PREFILL_INTERFERENCE: (MAX_NUM_BATCHED_TOKENS, -1),
    Bottleneck.DECODE_PRESSURE: (MAX_NUM_SEQS, -1),
    Bottleneck.SPEC_NOT_PAYING: (NUM_SPECULATIVE_TOKENS, -1),
    Bottleneck.SPEC_HEADROOM: (NUM_SPECULATIVE_TOKENS, +1),
    Bottleneck.HEADROOM: (MAX_NUM_SEQS, +1),
}


class Hold(str, Enum):
    """Why `Controller.decide` returned no decision; `SIGNALS_STALE` is the `Tuning=False` condition reason."""

    SIGNALS_STALE = "SignalsStale"
    NO_BOTTLENECK = "NoBottleneck"
    SETTLING = "Settling"  # bottleneck seen, but not yet for `consecutive` windows
    COOLDOWN = "Cooldown"
    HOURLY_CAP = "HourlyCap"
    AT_BOUND = "AtBound"
    BACKED_OFF = "BackedOff"  # the step's target (and the value halfway to it) was rolled back recently
    VERIFYING = "Verifying"  # the last change is still being verified (set by the tuner loop)
    NO_BASELINE = "NoBaseline"  # too few fresh windows yet to verify a change against (set by the tuner loop)


@dataclass(frozen=True)
class Evidence:
    """One observed value measured against the threshold it crossed (or stayed within)."""

    metric: str
    value: float
    threshold: float
    window: str

    def to_record(self) -> dict[str, Any]:
        """The evidence entry of a decision record."""
        return {"metric": self.metric, "value": self.value, "threshold": self.threshold, "window": self.window}


@dataclass(frozen=True)
class Classification:
    """The bottleneck of one window, the first SLO above its band (if any), and the evidence for both."""

    bottleneck: Bottleneck
    slo_at_risk: str | None
    evidence: list[Evidence]


def classify(signals: Signals, slo: SLO, hysteresis: float, *, bounds: Bounds | None = None,
             window: str = "1m", engaged: frozenset[str] = frozenset()) -> Classification:
    """Name the bottleneck of one window.

    With h = `hysteresis`, a metric is *above* its target when value > target·(1+h) and *met with
    margin* when value < target·(1−h); between the two is the release band. A metric named in
    `engaged` (it went above and has not yet come back below target·(1−h)) still counts as above inside
    the band: the controller acts until it is released, and never starts acting from inside the band.

    Rules (knob remedy in brackets):

    - KV pressure: preemption_rate > 0 [lower max_num_seqs].
    - Queueing: TTFT above target, queue_len > 0 and kv_usage < 0.9 [raise max_num_seqs].
    - Spec not paying: num_speculative_tokens > 0 and (acceptance < 0.5 or running ≥ 32) [lower K]. Drafts
      that are mostly rejected (or a compute-bound batch) cost time whether or not an SLO is breached.
    - Prefill interference: ITL above target, max_num_batched_tokens > 512, and prefill visibly in the
      steps: ITL spiky (p95 ≥ 2·p50: the steps that carry a prefill chunk are much slower than plain
      decode steps) or more prompt tokens than generated tokens per second (chunks in most steps)
      [lower max_num_batched_tokens].
    - Decode pressure: ITL above target and running ≥ 0.8·max_num_seqs [lower max_num_seqs].
    - Spec headroom: ITL above target, running ≤ 4, acceptance ≥ 0.8, and K below its cap in `bounds`
      (when given) [raise K].
    - Headroom: every SLO (TTFT, ITL, and E2E / error rate when set) met with margin while the batch is
      the limit (queue_len > 0 or running ≥ 0.8·max_num_seqs) [raise max_num_seqs: probe toward
      throughput]. With room in the batch a larger cap would change nothing.

    When several apply, the first in this order wins: KV pressure, queueing, spec not paying, prefill
    interference, decode pressure, spec headroom, headroom. A rule whose input is missing (None) does
    not apply. `slo_at_risk` names the first SLO above its band, in the order TTFT, ITL, E2E, errors.
    """
    s = signals
    up = 1.0 + hysteresis
    down = 1.0 - hysteresis

    def ev(metric: str, value: float, threshold: float) -> Evidence:
        return Evidence(metric, value, threshold, window)

    targets = [("ttft_p95_s", s.ttft_p95_s, slo.ttft_p95_s), ("itl_p95_s", s.itl_p95_s, slo.itl_p95_s),
               ("e2e_p95_s", s.e2e_p95_s, slo.e2e_p95_s), ("error_rate", s.error_rate, slo.error_rate)]
    # Evidence names the threshold crossed: target·(1+h), or the release threshold when engaged inside the band.
    at_risk = [ev(name, value, target * (up if value > target * up else down)) for name, value, target in targets
               if value is not None and target is not None
               and (value > target * up or (name in engaged and value >= target * down))]
    slo_at_risk = at_risk[0].metric if at_risk else None
    ttft_high = next((e for e in at_risk if e.metric == "ttft_p95_s"), None)
    itl_high = next((e for e in at_risk if e.metric == "itl_p95_s"), None)
    mns = s.knobs.get(MAX_NUM_SEQS)
    mnbt = s.knobs.get(MAX_NUM_BATCHED_TOKENS)
    k = s.knobs.get(NUM_SPECULATIVE_TOKENS)

    def found(bottleneck: Bottleneck, *evidence: Evidence) -> Classification:
        return Classification(bottleneck, slo_at_risk, list(evidence))

    if s.preemption_rate is not None and s.preemption_rate > 0:
        return found(Bottleneck.KV_PRESSURE, ev("preemption_rate", s.preemption_rate, 0.0))

    if (ttft_high and s.queue_len is not None and s.queue_len > 0
            and s.kv_usage is not None and s.kv_usage < KV_QUEUEING_CEILING):
        return found(Bottleneck.QUEUEING, ttft_high, ev("queue_len", s.queue_len, 0.0),
                     ev("kv_usage", s.kv_usage, KV_QUEUEING_CEILING))

    if k is not None and k > 0:
        if s.spec_acceptance is not None and s.spec_acceptance < SPEC_MIN_ACCEPTANCE:
            return found(Bottleneck.SPEC_NOT_PAYING, ev("spec_acceptance", s.spec_acceptance, SPEC_MIN_ACCEPTANCE))
        if s.running is not None and s.running >= SPEC_BUSY_RUNNING:
            return found(Bottleneck.SPEC_NOT_PAYING, ev("running", s.running, SPEC_BUSY_RUNNING))

    if itl_high and mnbt is not None and mnbt > PREFILL_TOKENS_FLOOR:
        budget = ev(MAX_NUM_BATCHED_TOKENS, mnbt, PREFILL_TOKENS_FLOOR)
        if s.itl_p50_s and s.itl_p95_s is not None and s.itl_p95_s >= ITL_SPIKE_RATIO * s.itl_p50_s:
            return found(Bottleneck.PREFILL_INTERFERENCE, itl_high,
                         ev("itl_p95_over_p50", s.itl_p95_s / s.itl_p50_s, ITL_SPIKE_RATIO), budget)
        if s.prompt_tok_s is not None and s.throughput_tok_s is not None and s.prompt_tok_s > s.throughput_tok_s:
            return found(Bottleneck.PREFILL_INTERFERENCE, itl_high,
                         ev("prompt_tok_s", s.prompt_tok_s, s.throughput_tok_s), budget)

    batch_full = mns is not None and s.running is not None and s.running >= DECODE_BATCH_FRACTION * mns
    if itl_high and batch_full:
        assert mns is not None and s.running is not None
        return found(Bottleneck.DECODE_PRESSURE, itl_high, ev("running", s.running, DECODE_BATCH_FRACTION * mns))

    k_cap = bounds[NUM_SPECULATIVE_TOKENS][1] if bounds and NUM_SPECULATIVE_TOKENS in bounds else None
    if (itl_high and s.running is not None and s.running <= SPEC_HEADROOM_RUNNING
            and s.spec_acceptance is not None and s.spec_acceptance >= SPEC_HEADROOM_ACCEPTANCE
            and k is not None and (k_cap is None or k < k_cap)):
        return found(Bottleneck.SPEC_HEADROOM, itl_high, ev("running", s.running, SPEC_HEADROOM_RUNNING),
                     ev("spec_acceptance", s.spec_acceptance, SPEC_HEADROOM_ACCEPTANCE))

    # Headroom needs every set SLO observed and met with margin: a missing signal is not a met one.
    margins = [(name, value, target) for name, value, target in targets if target is not None]
    queued = s.queue_len is not None and s.queue_len > 0
    if (batch_full or queued) and all(value is not None and value < target * down for _, value, target in margins):
        met = [ev(name, value, target * down) for name, value, target in margins if value is not None]
        limit = (ev("queue_len", s.queue_len, 0.0) if queued and s.queue_len is not None
                 else ev("running", s.running or 0.0, DECODE_BATCH_FRACTION * (mns or 0)))
        return found(Bottleneck.HEADROOM, *met, limit)

    return found(Bottleneck.NONE, *at_risk)


def step_knob(current: int, direction: int, factor: float, bounds: tuple[int, int]) -> int:
    """One bounded step of a knob: ×`factor` up or ÷`factor` down, moving at least 1, clamped to `bounds`.

    `factor` 1.0 gives an additive ±1 step (used for speculation depth K). The result is always within
    (min, max), even when `current` was not.
    """
    lo, hi = bounds
    if lo > hi:
        raise ValueError(f"knob bounds ({lo}, {hi}) are inverted: min must be ≤ max")
    if direction not in (1, -1):
        raise ValueError(f"step direction must be +1 or -1, got {direction}")
    if factor < 1.0:
        raise ValueError(f"step factor must be ≥ 1.0 (1.0 = ±1 steps), got {factor}")
    if direction > 0:
        stepped = max(current + 1, math.floor(current * factor))
    else:
        stepped = min(current - 1, math.ceil(current / factor))
    return min(hi, max(lo, stepped))


@dataclass(frozen=True)
class Decision:
    """One knob step the controller chose, with the bottleneck and evidence that justified it."""

    time: float
    knob: str
    from_value: int
    to_value: int
    reason: Bottleneck
    evidence: list[Evidence]
    windows: int = 1  # consecutive fresh windows, this one included, that showed the bottleneck


@dataclass
class Controller:
    """Hysteresis, cooldown and rate limit around `classify`: at most one knob step per call to `decide`.

    Invariants: `engaged` holds the SLO metrics that went above their band and have not been released
    (see `classify`). `streak` counts the consecutive fresh windows classified as `streak_bottleneck` (0 when
    that is NONE); it restarts after every action and on stale signals. `action_times` holds only the
    actions of the last hour. `blocked` maps (knob, direction) to (value, until): until `until`, a step
    in that direction refuses that value and anything beyond it (a rolled-back increase makes larger
    ones suspect too). A refused step target is replaced by the value halfway to the block when that
    still moves the knob by at least `MIN_BISECT_MOVE` of its value (K: by 1). `hold` says why the last
    `decide` returned None (None after an action).
    """

    slo: SLO
    bounds: Bounds
    hysteresis: float = 0.1
    consecutive: int = 4
    cooldown_s: float = 300.0
    max_actions_per_hour: int = 4
    scrape_interval_s: float = 15.0
    window: str = "1m"
    step_factors: dict[str, float] = field(default_factory=lambda: dict(STEP_FACTORS))

    streak_bottleneck: Bottleneck = Bottleneck.NONE
    streak: int = 0
    engaged: set[str] = field(default_factory=set)
    last_action_at: float | None = None
    action_times: list[float] = field(default_factory=list)
    blocked: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    hold: Hold | None = None

    def decide(self, signals: Signals, now: float, may_act: bool = True) -> Decision | None:
        """Observe one window; return the knob step to take now, or None (with the reason in `hold`).

        With `may_act` False (the tuner is verifying a change, or has no baseline yet) the window still
        counts toward the streak, but no decision is made.
        """
        if is_stale(signals, self.scrape_interval_s):
            self._reset_streak()
            self.hold = Hold.SIGNALS_STALE
            return None

        self._update_engaged(signals)
        found = classify(signals, self.slo, self.hysteresis, bounds=self.bounds, window=self.window,
                         engaged=frozenset(self.engaged))
        if found.bottleneck is Bottleneck.NONE:
            self._reset_streak()
            self.hold = Hold.NO_BOTTLENECK
            return None
        if found.bottleneck is self.streak_bottleneck:
            self.streak += 1
        else:
            self.streak_bottleneck, self.streak = found.bottleneck, 1
        if self.streak < self.consecutive:
            self.hold = Hold.SETTLING
            return None
        if not may_act:
            self.hold = Hold.VERIFYING
            return None

        if self.last_action_at is not None and now - self.last_action_at < self.cooldown_s:
            self.hold = Hold.COOLDOWN
            return None
        self.action_times = [t for t in self.action_times if now - t < 3600.0]
        if len(self.action_times) >= self.max_actions_per_hour:
            self.hold = Hold.HOURLY_CAP
            return None

        knob, direction = REMEDIES[found.bottleneck]
        current = signals.knobs[knob]
        target = step_knob(current, direction, self.step_factors[knob], self.bounds[knob])
        if target == current:
            self.hold = Hold.AT_BOUND
            return None
        block = self._block(knob, direction, now)
        if block is not None and (target - block) * direction >= 0:
            # Bisect toward the block: a smaller step in the same direction may still help.
            halfway = current + (block - current) // 2 if direction > 0 else current - (current - block) // 2
            min_move = 1 if self.step_factors[knob] == 1.0 else max(1, math.ceil(current * MIN_BISECT_MOVE))
            if abs(halfway - current) < min_move:
                self.hold = Hold.BACKED_OFF
                return None
            target = halfway

        self.last_action_at = now
        self.action_times.append(now)
        windows = self.streak
        self._reset_streak()
        self.hold = None
        return Decision(now, knob, current, target, found.bottleneck, found.evidence, windows)

    def _update_engaged(self, s: Signals) -> None:
        """Engage an SLO metric when it goes above target·(1+h); release it below target·(1−h)."""
        for name, value, target in (("ttft_p95_s", s.ttft_p95_s, self.slo.ttft_p95_s),
                                    ("itl_p95_s", s.itl_p95_s, self.slo.itl_p95_s),
                                    ("e2e_p95_s", s.e2e_p95_s, self.slo.e2e_p95_s),
                                    ("error_rate", s.error_rate, self.slo.error_rate)):
            if value is None or target is None:
                continue
            if value > target * (1 + self.hysteresis):
                self.engaged.add(name)
            elif value < target * (1 - self.hysteresis):
                self.engaged.discard(name)

    def block(self, knob: str, from_value: int, to_value: int, until: float) -> None:
        """Back off from a rolled-back step `from_value` → `to_value`: refuse `to_value` and beyond (in the
        step's direction) until `until` (epoch seconds). An active block closer to `from_value` is kept."""
        direction = 1 if to_value > from_value else -1
        old = self.blocked.get((knob, direction))
        if old is not None and old[1] > until - 1e-9 and (to_value - old[0]) * direction >= 0:
            return
        self.blocked[(knob, direction)] = (to_value, until)

    def _block(self, knob: str, direction: int, now: float) -> int | None:
        entry = self.blocked.get((knob, direction))
        return entry[0] if entry is not None and entry[1] > now else None

    def uncount(self, at: float) -> None:
        """Forget the action taken at `at` for the hourly cap (it was not applied); its cooldown stays."""
        if at in self.action_times:
            self.action_times.remove(at)

    def _reset_streak(self) -> None:
        self.streak_bottleneck, self.streak = Bottleneck.NONE, 0


@dataclass(frozen=True)
class Verdict:
    """Outcome of comparing a guarded metric before and after a change; `effect` > 0 means worse."""

    regressed: bool
    p_value: float
    effect: float


def verify(before: list[float], after: list[float], higher_is_worse: bool, alpha: float = 0.05,
           min_effect: float = 0.1) -> Verdict:
    """Did a guarded metric get worse after a change?

    One-sided Mann–Whitney U test (after worse than before) plus a relative effect on medians,
    effect = (median(after) − median(before)) / |median(before)|, sign flipped when lower is worse.
    Regressed only when p < `alpha` and effect > `min_effect`: significant but tiny shifts are kept.
    """
    if not before or not after:
        raise ValueError(f"verify needs samples on both sides, got {len(before)} before and {len(after)} after; "
                         "wait for the settle window to fill")
    alternative = "greater" if higher_is_worse else "less"
    p_value = float(mannwhitneyu(after, before, alternative=alternative).pvalue)
    m_before, m_after = statistics.median(before), statistics.median(after)
    worse_by = (m_after - m_before) if higher_is_worse else (m_before - m_after)
    # A zero baseline has no relative scale: any worsening from it counts as unbounded.
    effect = math.copysign(math.inf, worse_by) if worse_by and not m_before else worse_by / (abs(m_before) or 1.0)
    return Verdict(regressed=p_value < alpha and effect > min_effect, p_value=p_value, effect=effect)
