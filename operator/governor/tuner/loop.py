"""The tuner loop: observe → decide → actuate → verify → keep, or roll back and back off.

One `Tuner` per service. `step(now)` runs one interval and never sleeps, so the same loop runs live
(`run`, wall clock) and in the simulator (virtual clock). At most one change is in flight: while it is
being verified the controller does not decide.

Verification compares the windows that justified a change (the run of consecutive windows showing
its bottleneck, at most `verify_intervals`) with the `verify_intervals` fresh windows after it,
skipping `settle_intervals` windows right after it (the engines drain the old batch). Every guarded
metric is tested (`policy.verify`: one-sided Mann–Whitney U plus a relative effect on medians), at
`alpha` divided by the number of metrics judged (Bonferroni: five tests must not give five chances
of a false rollback). A metric that has an SLO counts as regressed only when it is also no longer met
with margin after the change (after-median > target·(1−hysteresis)): trading some TTFT for ITL while
both stay comfortably inside their SLOs is the point of tuning, not a regression. Throughput (and the
error rate when it has no SLO) counts on the test alone; throughput is judged only when requests queued
on both sides (otherwise it is the offered load, not the engine's capacity). A regression restores the old value and
blocks the new one, and anything beyond it in the same direction, for `backoff_s` (doubling with each
rollback of that knob in that direction). A change that wrecks the ITL SLO (beyond its band and twice its
before-median for two consecutive windows after settling) is rolled back at once, without waiting out
the window; TTFT and E2E are left to the full window because they lag behind a queue still draining.

Stale or missing signals freeze the loop (`frozen`; condition Tuning=False, reason SignalsStale): no
decisions, and a change under verification waits, counting only fresh windows.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from governor.tuner.actuate import ActuationResult, apply_knobs
from governor.tuner.policy import Controller, Decision, Hold, verify
from governor.tuner.records import DecisionRecord, EvidenceRecord, Outcome, RecordSink
from governor.tuner.scrape import EngineScraper, Snapshot
from governor.tuner.signals import STALE_AFTER_INTERVALS, Signals, is_stale

log = logging.getLogger(__name__)

# Fast rollback: this many consecutive fresh windows after settling with an SLO metric beyond
# both its SLO band and this multiple of its before-median roll the change back before verification ends.
FAST_ROLLBACK_WINDOWS = 2
FAST_ROLLBACK_FACTOR = 2.0

# Guarded metrics: Signals attribute → True when higher is worse.
GUARDED: dict[str, bool] = {
    "ttft_p95_s": True,
    "itl_p95_s": True,
    "e2e_p95_s": True,
    "error_rate": True,
    "throughput_tok_s": False,
}


class SignalSource(Protocol):
    """Where windows come from: Prometheus (`governor.tuner.prom`) or the engines' own /metrics."""

    def observe(self, now: float) -> Signals: ...


class Actuator(Protocol):
    """Applies knob values to every engine of the service and reports whether each confirmed."""

    def apply(self, changes: dict[str, int]) -> ActuationResult: ...


class EngineSource:
    """The embedded signal source: scrapes the engines' /metrics each interval; a window spans two scrapes.

    The first call has no previous scrape, so its window is stale (all None, infinite age).
    """

    def __init__(self, scraper: EngineScraper) -> None:
        self.scraper = scraper
        self.prev: Snapshot | None = None

    def observe(self, now: float) -> Signals:
        cur = self.scraper.scrape(now)
        prev, self.prev = self.prev, cur
        if prev is None:
            prev = cur  # a window of zero length: stale by construction
        return self.scraper.signals(prev, cur, now)


class EngineActuator:
    """PUT /admin/knobs on the service's engines (`governor.tuner.actuate.apply_knobs`)."""

    def __init__(self, urls: list[str], token: str) -> None:
        self.urls = list(urls)
        self._token = token

    def apply(self, changes: dict[str, int]) -> ActuationResult:
        return apply_knobs(self.urls, changes, self._token)


@dataclass(frozen=True)
class TunerSettings:
    """Timing of the loop and of verification; `interval_s` is also the freshness yardstick."""

    interval_s: float = 15.0
    settle_intervals: int = 2
    verify_intervals: int = 6
    alpha: float = 0.05
    min_effect: float = 0.1
    backoff_s: float = 3600.0
    min_samples: int = 3  # a guarded metric with fewer fresh values on either side is not judged

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"tuner interval must be > 0 s, got {self.interval_s}")
        if self.verify_intervals < self.min_samples:
            raise ValueError(f"verify_intervals ({self.verify_intervals}) must be ≥ min_samples ({self.min_samples})")


@dataclass
class Pending:
    """A change under verification: the windows before it, and the fresh windows seen since."""

    id: int
    decision: Decision
    before: list[Signals]
    fresh_since: int = 0
    severe_streak: int = 0  # consecutive fresh windows with a severe SLO breach (see FAST_ROLLBACK_*)
    after: list[Signals] = field(default_factory=list)


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class Tuner:
    """The SLO controller of one service: wires a `SignalSource`, a `Controller`, an `Actuator` and a sink.

    Invariants: at most one `pending` change; `frozen` is True exactly when the last window was stale;
    `history` holds the last fresh windows under the knob values that run now (a before-window); the
    controller decides only when it is full; `current` is the last knob values
    the engines confirmed (or reported), None before the first fresh window.
    """

    def __init__(self, service: str, revision: str, controller: Controller, source: SignalSource,
                 actuator: Actuator, sink: RecordSink, settings: TunerSettings | None = None,
                 envelope: Mapping[str, str] | None = None) -> None:
        self.service = service
        self.revision = revision
        self.envelope = dict(envelope or {})  # every record carries it (DecisionRecord.envelope)
        self.controller = controller
        self.source = source
        self.actuator = actuator
        self.sink = sink
        self.settings = settings or TunerSettings(interval_s=controller.scrape_interval_s)
        if self.settings.interval_s != controller.scrape_interval_s:
            raise ValueError(f"the controller's scrape interval ({controller.scrape_interval_s} s) must equal the "
                             f"tuner interval ({self.settings.interval_s} s): staleness is judged against it")
        n, m = min(controller.consecutive, self.settings.verify_intervals), self.settings.verify_intervals
        if 1 / math.comb(n + m, n) >= self.settings.alpha / len(GUARDED):
            raise ValueError(f"with {n} windows before a change and {m} after, no Mann-Whitney test can reach "
                             f"p < {self.settings.alpha / len(GUARDED):.4f} (alpha / {len(GUARDED)} metrics): "
                             "raise the controller's `consecutive` or `verify_intervals`")
        self.history: deque[Signals] = deque(maxlen=self.settings.verify_intervals)
        self.pending: Pending | None = None
        self.frozen = False
        self.windows = 0
        self.next_id = 1
        self.last_record: DecisionRecord | None = None
        self.current: dict[str, int] | None = None
        self._rollbacks: dict[tuple[str, int], int] = {}

    # --- one interval ---------------------------------------------------------------------------

    def step(self, now: float) -> Signals:
        """Run one interval at time `now`; returns the window it observed."""
        signals = self.source.observe(now)
        self.windows += 1
        if is_stale(signals, self.settings.interval_s):
            self._freeze(signals, now)
            self.controller.decide(signals, now)  # resets the controller's streak, sets hold SignalsStale
            return signals
        self.frozen = False
        self.current = dict(signals.knobs)
        self.history.append(signals)
        if self.pending is not None:
            self._advance_verification(signals, now)
        # The controller sees every fresh window (its streak counts on), but acts only with no change in
        # flight and a full baseline: a change made without one could not be verified against anything.
        baseline = len(self.history) >= self.settings.verify_intervals
        decision = self.controller.decide(signals, now, may_act=self.pending is None and baseline)
        if self.pending is not None:
            self.controller.hold = Hold.VERIFYING
        elif self.controller.hold is Hold.VERIFYING:  # held only for want of a baseline
            self.controller.hold = Hold.NO_BASELINE
        if decision is not None:
            self._actuate(decision, now)
        return signals

    def run(self, stop: threading.Event, clock: Callable[[], float] = time.time) -> None:
        """Step every `interval_s` until `stop` is set; an exception in one step is logged, not fatal."""
        next_at = clock()
        while not stop.is_set():
            try:
                self.step(clock())
            except Exception:  # a bug in one interval must not end tuning of the service
                log.exception("tuner step failed for %s", self.service)
            next_at += self.settings.interval_s
            stop.wait(max(0.0, next_at - clock()))

    # --- internals --------------------------------------------------------------------------------

    def _emit(self, record: DecisionRecord) -> None:
        self.last_record = record
        self.sink.emit(record)

    def _record(self, id_: int, now: float, knob: str | None, from_: int | None, to: int | None, reason: str,
                evidence: list[EvidenceRecord], outcome: Outcome, detail: str = "") -> None:
        self._emit(DecisionRecord.model_validate({
            "id": id_, "time": _stamp(now), "service": self.service, "revision": self.revision, "knob": knob,
            "from": from_, "to": to, "reason": reason, "evidence": evidence, "outcome": outcome, "detail": detail,
            "envelope": self.envelope}))

    def _freeze(self, signals: Signals, now: float) -> None:
        # The first window of a run has no history to be stale against (the embedded source needs two
        # scrapes for a window): a freeze is recorded from the second window on, once per freeze.
        if (not self.frozen and self.windows > 1) or (self.frozen and self.windows == 2):
            age = signals.age_s if signals.age_s != float("inf") else None
            missing = [name for name in ("ttft_p95_s", "itl_p95_s") if getattr(signals, name) is None]
            detail = "signals stale or missing: " + (", ".join(missing) if missing else "knob values")
            if self.pending is not None:
                detail += f"; verification of decision {self.pending.id} waits for fresh windows"
            self._record(self.next_id, now, None, None, None, Hold.SIGNALS_STALE.value,
                         [EvidenceRecord(metric="signal_age_s", value=age,
                                         threshold=STALE_AFTER_INTERVALS * self.settings.interval_s,
                                         window=f"{self.settings.interval_s:g}s")],
                         Outcome.FROZEN, detail)
            self.next_id += 1
        self.frozen = True

    def _actuate(self, decision: Decision, now: float) -> None:
        id_ = self.next_id
        self.next_id += 1
        evidence = [EvidenceRecord(**e.to_record()) for e in decision.evidence]
        result = self.actuator.apply({decision.knob: decision.to_value})
        if result.applied:
            self._record(id_, now, decision.knob, decision.from_value, decision.to_value, decision.reason.value,
                         evidence, Outcome.APPLIED, result.summary())
            # The before-window is the run of windows that showed the bottleneck: older windows may belong
            # to a workload that has since shifted, which would confound the comparison.
            self.pending = Pending(id_, decision, before=list(self.history)[-decision.windows:])
            self.history.clear()  # windows under the new value start the next baseline
            return
        # Not applied: not counted against the hourly cap, and the engines that did take it are put back,
        # so the service does not run with engines that disagree.
        self.controller.uncount(now)
        revert = self.actuator.apply({decision.knob: decision.from_value})
        self._record(id_, now, decision.knob, decision.from_value, decision.to_value, decision.reason.value,
                     evidence, Outcome.NOT_CONFIRMED,
                     f"change: {result.summary()}; revert to {decision.from_value}: {revert.summary()}")

    def _advance_verification(self, signals: Signals, now: float) -> None:
        p = self.pending
        assert p is not None
        p.fresh_since += 1
        if p.fresh_since <= self.settings.settle_intervals:
            return
        p.after.append(signals)
        severe = self._severe_breach(p, signals)
        p.severe_streak = p.severe_streak + 1 if severe else 0
        if p.severe_streak >= FAST_ROLLBACK_WINDOWS:
            # Do not wait out the verification window while the change wrecks an SLO.
            self.pending = None
            evidence = [EvidenceRecord(metric=m, value=v, threshold=t, window=f"{self.settings.interval_s:g}s")
                        for m, v, t in severe]
            self._roll_back(p, now, evidence, f"{FAST_ROLLBACK_WINDOWS} consecutive windows beyond "
                            f"{FAST_ROLLBACK_FACTOR:g}x the before-median and the SLO")
            return
        if len(p.after) < self.settings.verify_intervals:
            return
        self.pending = None
        d = p.decision
        regressed, judged = self._judge(p)
        if not regressed:
            self._record(p.id, now, d.knob, d.from_value, d.to_value, d.reason.value,
                         judged, Outcome.KEPT, "no guarded metric regressed")
            return
        self._roll_back(p, now, regressed, f"{len(p.after)}x{self.settings.interval_s:g}s after vs before")

    def _severe_breach(self, p: Pending, signals: Signals) -> list[tuple[str, float, float]]:
        """ITL of this window if beyond both its SLO band and `FAST_ROLLBACK_FACTOR`× its before-median:
        [(metric, value, threshold)], else []."""
        slo = self.controller.slo
        out: list[tuple[str, float, float]] = []
        # ITL only: it answers within a step, while TTFT and E2E lag behind a queue the change may still be draining.
        for metric, target in (("itl_p95_s", slo.itl_p95_s),):
            value = getattr(signals, metric)
            before = [v for w in p.before if (v := getattr(w, metric)) is not None]
            if target is None or value is None or not before:
                continue
            threshold = max(FAST_ROLLBACK_FACTOR * statistics.median(before), target * (1 + self.controller.hysteresis))
            if value > threshold:
                out.append((metric, value, threshold))
        return out

    def _roll_back(self, p: Pending, now: float, regressed: list[EvidenceRecord], why: str) -> None:
        d = p.decision
        direction = 1 if d.to_value > d.from_value else -1
        times = self._rollbacks.get((d.knob, direction), 0) + 1
        self._rollbacks[(d.knob, direction)] = times
        until = now + self.settings.backoff_s * 2 ** (times - 1)
        self.controller.block(d.knob, d.from_value, d.to_value, until)
        self.controller.last_action_at = now  # a rollback is an action: cooldown again
        result = self.actuator.apply({d.knob: d.from_value})
        names = ", ".join(e.metric for e in regressed)
        self._record(p.id, now, d.knob, d.from_value, d.to_value, d.reason.value, regressed, Outcome.ROLLED_BACK,
                     f"regressed: {names} ({why}); restored {d.knob}={d.from_value}: {result.summary()}; "
                     f"{d.to_value} blocked until {_stamp(until)}")
        self.history.clear()  # the windows under the rolled-back value describe nothing that runs now
        if result.applied:
            self.current = {**(self.current or {}), d.knob: d.from_value}

    def _judge(self, p: Pending) -> tuple[list[EvidenceRecord], list[EvidenceRecord]]:
        """(regressed metrics, every judged metric) as evidence: value = after-median, threshold = the
        median that would count as worse by `min_effect`."""
        s = self.settings
        slo = self.controller.slo
        targets = {"ttft_p95_s": slo.ttft_p95_s, "itl_p95_s": slo.itl_p95_s, "e2e_p95_s": slo.e2e_p95_s,
                   "error_rate": slo.error_rate}
        window = f"{len(p.after)}x{s.interval_s:g}s after"
        regressed: list[EvidenceRecord] = []
        judged: list[EvidenceRecord] = []
        # Without a queue, throughput is the offered load: it says nothing about the change.
        saturated = any((w.queue_len or 0) > 0 for w in p.before) and any((w.queue_len or 0) > 0 for w in p.after)
        for metric, higher_is_worse in GUARDED.items():
            if metric == "throughput_tok_s" and not saturated:
                continue
            before = [v for w in p.before if (v := getattr(w, metric)) is not None]
            after = [v for w in p.after if (v := getattr(w, metric)) is not None]
            if len(before) < s.min_samples or len(after) < s.min_samples:
                continue
            verdict = verify(before, after, higher_is_worse, alpha=s.alpha / len(GUARDED), min_effect=s.min_effect)
            m_before = statistics.median(before)
            m_after = statistics.median(after)
            threshold = m_before * (1 + s.min_effect) if higher_is_worse else m_before * (1 - s.min_effect)
            ev = EvidenceRecord(metric=metric, value=m_after, threshold=threshold, window=window)
            judged.append(ev)
            target = targets.get(metric)
            comfortably_met = target is not None and m_after <= target * (1 - self.controller.hysteresis)
            if verdict.regressed and not comfortably_met:
                regressed.append(ev)
        return regressed, judged
