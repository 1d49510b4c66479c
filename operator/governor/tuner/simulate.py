"""A fast model of an engine, and scenarios that run the real tuner loop against it on a virtual clock.

`EngineModel` is a fluid model of continuous batching, advanced in `dt`-second slices. Each slice runs
n = dt / step_time engine steps; a step decodes every running sequence (decodes first) and spends
what is left of the token budget (`max_num_batched_tokens`) on prefill. So:

- step time = t_step + t_seq·decoding·(1 + v·K) + t_draft·K + t_token·prefill_tokens, × `cliff_factor`
  when more than `cliff_batch` sequences run (a batch size past the captured CUDA graphs);
- speculation emits E = (1 − a^(K+1)) / (1 − a) tokens per sequence per step (acceptance a);
- ITL of a token is step_time / E; steps that carry a prefill chunk are the slow ones;
- TTFT = time queued (waiting requests / admission rate) + time to drain the prefill backlog ahead;
- KV holds (prompt + half the output) tokens per running sequence; past `kv_tokens` sequences are
  preempted back to the queue (recompute).

Latency p95s per window come from the per-slice samples weighted by how many requests (TTFT, E2E) or
tokens (ITL) saw each, times log-normal noise. The tuner sees the model only through `Signals` (as it
would see Prometheus) and changes it only through an actuator that confirms like the engines' gauge.

`run_scenario` runs a scenario twice with the same seed — static default knobs, then tuned — and
`simulate` writes decisions.jsonl and summary.json. Thousands of intervals take seconds.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from governor.tuner.actuate import ActuationResult, EngineActuation, EngineStatus
from governor.tuner.loop import Tuner, TunerSettings
from governor.tuner.policy import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_SPECULATIVE_TOKENS, Bounds, Controller
from governor.tuner.records import DecisionRecord, HistorySink, Outcome
from governor.tuner.signals import SLO, Signals

SLICE_S = 0.5


@dataclass(frozen=True)
class Workload:
    """Offered load: Poisson arrivals, fixed prompt/output lengths, draft acceptance."""

    rate: float  # requests per second
    prompt_len: int
    output_len: int
    acceptance: float = 0.0


@dataclass(frozen=True)
class Costs:
    """The engine's cost model (seconds) and capacities; defaults are an 8B-class model on one GPU."""

    t_step: float = 0.010
    t_seq: float = 0.0002
    verify_factor: float = 0.15  # extra cost of verifying one draft token, relative to decoding one
    t_draft: float = 0.003  # one draft-model step
    t_token: float = 0.00001  # one prefill token
    kv_tokens: int = 400_000
    cliff_batch: int = 1_000_000
    cliff_factor: float = 1.0
    noise: float = 0.05


@dataclass
class Window:
    """What one tuner interval saw of the model: true p95s (before noise) and the observed `Signals`."""

    t: float
    ttft: float
    itl: float
    e2e: float
    signals: Signals


def _weighted_quantile(q: float, samples: list[tuple[float, float]]) -> float | None:
    """Quantile q of (value, weight) samples: the smallest value with ≥ q of the weight at or below it."""
    total = sum(w for _, w in samples)
    if total <= 0:
        return None
    acc = 0.0
    ordered = sorted(samples)
    for value, weight in ordered:
        acc += weight
        if acc >= q * total:
            return value
    return ordered[-1][0]


class EngineModel:
    """The simulated engine: state (queue, prefill backlog, decoding batch), knobs, and counters.

    Invariants: waiting ≥ 0, backlog_tokens ≥ 0, 0 ≤ prefilling + decoding ≤ max_num_seqs after admission.
    """

    def __init__(self, costs: Costs, knobs: dict[str, int], caps: Bounds, rng: random.Random) -> None:
        self.c = costs
        self.knobs = dict(knobs)
        self.caps = caps
        self.rng = rng
        self.waiting = 0.0
        self.prefilling = 0.0  # admitted requests whose prompt is not fully prefilled yet
        self.backlog_tokens = 0.0  # prompt tokens still to prefill
        self.decoding = 0.0
        self.queue_wait_s = 0.0  # smoothed time a request waits before admission

    def set_knobs(self, changes: dict[str, int]) -> dict[str, int]:
        """Apply knob values clamped to the engine's caps; returns the effective values (the gauge)."""
        for name, value in changes.items():
            lo, hi = self.caps[name]
            self.knobs[name] = min(hi, max(lo, value))
        return dict(self.knobs)

    def step_time(self, decoding: float, prefill_tokens: float) -> float:
        k = self.knobs[NUM_SPECULATIVE_TOKENS]
        c = self.c
        t = (c.t_step + c.t_seq * decoding * (1 + c.verify_factor * k) + c.t_draft * k
             + c.t_token * prefill_tokens)
        if decoding + self.prefilling > c.cliff_batch:
            t *= c.cliff_factor
        return t

    def advance(self, w: Workload, dt: float) -> dict[str, Any]:
        """Advance `dt` seconds under workload `w`; returns this slice's samples and counters."""
        c = self.c
        mns = self.knobs[MAX_NUM_SEQS]
        budget = self.knobs[MAX_NUM_BATCHED_TOKENS]
        k = self.knobs[NUM_SPECULATIVE_TOKENS]
        per_seq_kv = w.prompt_len + w.output_len / 2

        arrivals = _poisson(self.rng, w.rate * dt)
        self.waiting += arrivals
        slots = max(0.0, mns - self.prefilling - self.decoding)
        admitted = min(self.waiting, slots)
        self.waiting -= admitted
        self.prefilling += admitted
        self.backlog_tokens += admitted * w.prompt_len

        preempted = 0.0
        used = (self.prefilling + self.decoding) * per_seq_kv
        if used > c.kv_tokens:
            preempted = min(self.decoding, (used - c.kv_tokens) / per_seq_kv)
            self.decoding -= preempted
            self.waiting += preempted

        a = min(max(w.acceptance, 0.0), 0.999)
        tokens_per_step = (1 - a ** (k + 1)) / (1 - a) if k > 0 else 1.0
        decode_tokens = self.decoding * (1 + k)
        chunk = max(0.0, budget - decode_tokens)
        prefill_per_step = min(chunk, self.backlog_tokens) if self.backlog_tokens > 0 else 0.0
        t_prefill = self.step_time(self.decoding, prefill_per_step)
        t_decode = self.step_time(self.decoding, 0.0)
        # Steps with a prefill chunk first, until the backlog is drained, then decode-only steps.
        n_prefill = min(dt / t_prefill, self.backlog_tokens / prefill_per_step) if prefill_per_step > 0 else 0.0
        n_decode = max(0.0, (dt - n_prefill * t_prefill) / t_decode)
        prefilled_tokens = n_prefill * prefill_per_step
        done_prefill = (min(self.prefilling, prefilled_tokens / w.prompt_len) if self.backlog_tokens > 0 else 0.0)
        self.backlog_tokens = max(0.0, self.backlog_tokens - prefilled_tokens)
        self.prefilling -= done_prefill

        steps = n_prefill + n_decode
        generated = self.decoding * steps * tokens_per_step
        finished = min(self.decoding, generated / w.output_len)
        self.decoding += done_prefill - finished

        # Queue wait by Little's law over the admission rate; prefill wait = backlog ahead / prefill speed.
        admit_rate = max(admitted / dt, 1e-9)
        self.queue_wait_s = 0.7 * self.queue_wait_s + 0.3 * min(600.0, self.waiting / admit_rate)
        prefill_speed = max(chunk, 1.0) / (t_prefill if prefill_per_step > 0 else t_decode)  # tokens/s allowed
        ttft = self.queue_wait_s + (self.backlog_tokens + w.prompt_len) / prefill_speed + t_decode
        itl_prefill = t_prefill / tokens_per_step
        itl_decode = t_decode / tokens_per_step
        mean_itl = (n_prefill * itl_prefill + n_decode * itl_decode) / max(steps, 1e-9)
        return {
            "ttft": (ttft, max(admitted, 1e-3)),
            "itl": [(itl_prefill, n_prefill * self.decoding * tokens_per_step),
                    (itl_decode, n_decode * self.decoding * tokens_per_step)],
            "e2e": (ttft + w.output_len * mean_itl, max(finished, 1e-3)),
            "generated": generated,
            "prompted": prefilled_tokens,
            "finished": finished,
            "preempted": preempted,
            "proposed": self.decoding * steps * k,
            "accepted": self.decoding * steps * (tokens_per_step - 1) if k > 0 else 0.0,
            "kv_usage": min(1.0, (self.prefilling + self.decoding) * per_seq_kv / c.kv_tokens),
        }


def _poisson(rng: random.Random, mean: float) -> float:
    if mean <= 0:
        return 0.0
    if mean > 50:  # normal approximation keeps large means fast
        return max(0.0, round(rng.gauss(mean, math.sqrt(mean))))
    n, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return float(n)
        n += 1


@dataclass(frozen=True)
class Scenario:
    """A workload over time, the engine it runs on, its SLO and knobs, and when signals go missing."""

    name: str
    description: str
    workload: Callable[[float], Workload]
    shift_at_s: float
    slo: SLO
    knobs: dict[str, int]
    bounds: Bounds
    costs: Costs = field(default_factory=Costs)
    duration_s: float = 3600.0
    stale: tuple[float, float] | None = None  # (start, end) seconds during which no signal arrives


BOUNDS: Bounds = {MAX_NUM_SEQS: (4, 256), MAX_NUM_BATCHED_TOKENS: (256, 8192), NUM_SPECULATIVE_TOKENS: (0, 8)}
DEFAULT_KNOBS = {MAX_NUM_SEQS: 32, MAX_NUM_BATCHED_TOKENS: 2048, NUM_SPECULATIVE_TOKENS: 0}
SHIFT_S = 600.0


def _step(before: Workload, after: Workload) -> Callable[[float], Workload]:
    return lambda t: before if t < SHIFT_S else after


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("load-step", "arrival rate doubles (4 → 8 req/s) at 10 min; max_num_seqs 32 becomes the limit",
             _step(Workload(4.0, 512, 256), Workload(8.0, 512, 256)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.05), DEFAULT_KNOBS, BOUNDS),
    Scenario("long-prompts", "prompts grow 512 → 2048 tokens at 10 min; with a 4096-token step budget, "
             "more than 5% of steps carry a slow prefill chunk and ITL p95 jumps",
             _step(Workload(6.0, 512, 128), Workload(6.0, 2048, 128)), SHIFT_S,
             SLO(ttft_p95_s=2.0, itl_p95_s=0.05), {**DEFAULT_KNOBS, MAX_NUM_BATCHED_TOKENS: 4096}, BOUNDS,
             costs=Costs(t_token=0.00003)),
    Scenario("spec-decay", "draft acceptance drops 0.85 → 0.3 at 10 min with K=4",
             _step(Workload(1.0, 256, 256, 0.85), Workload(1.0, 256, 256, 0.3)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.015), {**DEFAULT_KNOBS, NUM_SPECULATIVE_TOKENS: 4}, BOUNDS),
    Scenario("regression", "load rises 4 → 7.5 req/s at 10 min; more than 44 running sequences fall off the "
             "captured CUDA graphs (steps 2.2× slower): raising max_num_seqs past 44 looks right and must be "
             "rolled back",
             _step(Workload(4.0, 512, 256), Workload(7.5, 512, 256)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.05), DEFAULT_KNOBS, BOUNDS,
             costs=Costs(cliff_batch=44, cliff_factor=2.2)),
    Scenario("spec-headroom", "draft acceptance rises 0.6 → 0.9 at 10 min with K=1 at light load and a tight ITL "
             "SLO, with a cheap draft (a third of a millisecond a step): each raise of K shortens ITL and is kept",
             _step(Workload(0.5, 64, 256, 0.6), Workload(0.5, 64, 256, 0.9)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.004), {**DEFAULT_KNOBS, NUM_SPECULATIVE_TOKENS: 1}, BOUNDS,
             costs=Costs(t_draft=0.001)),
    Scenario("spec-costly-draft", "the same with a draft step three times a target step and an ITL SLO no K meets: "
             "raising K looks right (acceptance 0.9, ITL above target) but lengthens ITL, and must be rolled back",
             _step(Workload(0.5, 64, 256, 0.6), Workload(0.5, 64, 256, 0.9)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.009), {**DEFAULT_KNOBS, NUM_SPECULATIVE_TOKENS: 1}, BOUNDS,
             costs=Costs(t_draft=0.03)),
    Scenario("stale-metrics", "load doubles at 10 min while the signals stop from 9 to 25 min",
             _step(Workload(4.0, 512, 256), Workload(8.0, 512, 256)), SHIFT_S,
             SLO(ttft_p95_s=1.0, itl_p95_s=0.05), DEFAULT_KNOBS, BOUNDS, stale=(540.0, 1500.0)),
)}


class SimulatedService:
    """The model behind a tuner: a `SignalSource` and an `Actuator` over one `EngineModel`."""

    def __init__(self, scenario: Scenario, seed: int, interval_s: float) -> None:
        self.scenario = scenario
        self.rng = random.Random(seed)
        self.engine = EngineModel(scenario.costs, scenario.knobs, scenario.bounds, self.rng)
        self.interval_s = interval_s
        self.t = 0.0
        self.windows: list[Window] = []

    def advance_window(self) -> Window:
        """Run the model for one interval and aggregate the window's samples."""
        ttft: list[tuple[float, float]] = []
        itl: list[tuple[float, float]] = []
        e2e: list[tuple[float, float]] = []
        sums = {"generated": 0.0, "prompted": 0.0, "finished": 0.0, "preempted": 0.0, "proposed": 0.0,
                "accepted": 0.0}
        kv = 0.0
        for _ in range(round(self.interval_s / SLICE_S)):
            out = self.engine.advance(self.scenario.workload(self.t), SLICE_S)
            self.t += SLICE_S
            ttft.append(out["ttft"])
            itl.extend(out["itl"])
            e2e.append(out["e2e"])
            for key in sums:
                sums[key] += out[key]
            kv = out["kv_usage"]
        true = {"ttft": _weighted_quantile(0.95, ttft) or 0.0, "itl": _weighted_quantile(0.95, itl) or 0.0,
                "e2e": _weighted_quantile(0.95, e2e) or 0.0, "itl50": _weighted_quantile(0.5, itl) or 0.0}

        def noisy(x: float) -> float:
            return x * math.exp(self.rng.gauss(0.0, self.scenario.costs.noise))

        e = self.engine
        signals = Signals(
            time=self.t, ttft_p95_s=noisy(true["ttft"]), itl_p95_s=noisy(true["itl"]), e2e_p95_s=noisy(true["e2e"]),
            queue_len=e.waiting, queue_time_p95_s=e.queue_wait_s, kv_usage=kv,
            preemption_rate=sums["preempted"] / self.interval_s, error_rate=0.0,
            throughput_tok_s=sums["generated"] / self.interval_s,
            spec_acceptance=(sums["accepted"] / sums["proposed"]) if sums["proposed"] > 0 else None,
            running=e.prefilling + e.decoding, knobs=dict(e.knobs), age_s=0.0,
            itl_p50_s=noisy(true["itl50"]), prompt_tok_s=sums["prompted"] / self.interval_s)
        window = Window(self.t, signals.ttft_p95_s or 0.0, signals.itl_p95_s or 0.0, signals.e2e_p95_s or 0.0,
                        signals)
        self.windows.append(window)
        return window

    def observe(self, now: float) -> Signals:
        """The tuner's view of the window that just ended: stale (every value missing) during an outage."""
        window = self.windows[-1]
        stale = self.scenario.stale
        if stale is not None and stale[0] <= now < stale[1]:
            return replace(window.signals, ttft_p95_s=None, itl_p95_s=None, e2e_p95_s=None, knobs={},
                           age_s=now - stale[0])
        return replace(window.signals, age_s=max(0.0, now - window.t))

    def apply(self, changes: dict[str, int]) -> ActuationResult:
        effective = self.engine.set_knobs(changes)
        ok = all(effective[k] == v for k, v in changes.items())
        status = EngineStatus.OK if ok else EngineStatus.UNCONFIRMED
        return ActuationResult(dict(changes), (EngineActuation("sim://engine-0", status, 200, "", effective),))


def met(w: Window, slo: SLO) -> bool:
    """Every SLO of the scenario met in this window (as observed)."""
    return w.ttft <= slo.ttft_p95_s and w.itl <= slo.itl_p95_s and (slo.e2e_p95_s is None or w.e2e <= slo.e2e_p95_s)


@dataclass
class Run:
    scenario: Scenario
    windows: list[Window]
    records: list[DecisionRecord]
    frozen_intervals: int


def run_once(scenario: Scenario, seed: int, tuned: bool, settings: TunerSettings,
             controller_args: dict[str, Any] | None = None) -> Run:
    """One run of `scenario`: the model advances one interval, then the tuner (if `tuned`) steps once."""
    service = SimulatedService(scenario, seed, settings.interval_s)
    sink = HistorySink(limit=None)
    controller = Controller(slo=scenario.slo, bounds=scenario.bounds, scrape_interval_s=settings.interval_s,
                            window=f"{settings.interval_s:g}s", **(controller_args or {}))
    tuner = Tuner(scenario.name, "sim", controller, service, service, sink, settings)
    frozen = 0
    for _ in range(round(scenario.duration_s / settings.interval_s)):
        service.advance_window()
        if tuned:
            tuner.step(service.t)
            frozen += int(tuner.frozen)
    return Run(scenario, service.windows, list(sink.records), frozen)


def _reversals(records: list[DecisionRecord]) -> int:
    """Applied changes that move a knob opposite to its previous applied change (rollbacks not counted)."""
    last: dict[str, int] = {}
    count = 0
    for r in records:
        if r.outcome is not Outcome.APPLIED or r.knob is None or r.from_ is None or r.to is None:
            continue
        direction = 1 if r.to > r.from_ else -1
        if last.get(r.knob, direction) != direction:
            count += 1
        last[r.knob] = direction
    return count


def attainment(run: Run) -> float:
    """Fraction of intervals after the workload shift in which every SLO was met."""
    after = [w for w in run.windows if w.t > run.scenario.shift_at_s]
    return sum(met(w, run.scenario.slo) for w in after) / max(1, len(after))


def summarize(static: Run, tuned: Run, seed: int, settings: TunerSettings) -> dict[str, Any]:
    """summary.json: attainment with static defaults (before) and tuned (after), and the tuner's actions."""
    records = tuned.records
    return {
        "scenario": tuned.scenario.name,
        "description": tuned.scenario.description,
        "seed": seed,
        "duration_s": tuned.scenario.duration_s,
        "interval_s": settings.interval_s,
        "shift_at_s": tuned.scenario.shift_at_s,
        "slo": {"ttft_p95_s": tuned.scenario.slo.ttft_p95_s, "itl_p95_s": tuned.scenario.slo.itl_p95_s},
        "initial_knobs": dict(tuned.scenario.knobs),
        "final_knobs": dict(tuned.windows[-1].signals.knobs),
        "slo_attainment_before": round(attainment(static), 4),
        "slo_attainment_after": round(attainment(tuned), 4),
        "actions": sum(r.outcome is Outcome.APPLIED for r in records),
        "kept": sum(r.outcome is Outcome.KEPT for r in records),
        "rollbacks": sum(r.outcome is Outcome.ROLLED_BACK for r in records),
        "not_confirmed": sum(r.outcome is Outcome.NOT_CONFIRMED for r in records),
        "reversals": _reversals(records),
        "frozen_intervals": tuned.frozen_intervals,
    }


DEFAULT_SETTINGS = TunerSettings(interval_s=15.0, settle_intervals=2, verify_intervals=6, backoff_s=3600.0)
DEFAULT_CONTROLLER = {"hysteresis": 0.1, "consecutive": 4, "cooldown_s": 180.0, "max_actions_per_hour": 8}


def simulate(scenario: str, out_dir: Path, seed: int = 0, duration_s: float | None = None) -> dict[str, Any]:
    """Run `scenario` static and tuned; write decisions.jsonl (the tuned run's records) and summary.json."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIOS)}")
    sc = SCENARIOS[scenario]
    if duration_s is not None:
        if duration_s <= sc.shift_at_s:
            raise ValueError(f"--duration must be longer than the workload shift at {sc.shift_at_s:g} s")
        sc = replace(sc, duration_s=duration_s)
    static = run_once(sc, seed, tuned=False, settings=DEFAULT_SETTINGS, controller_args=DEFAULT_CONTROLLER)
    tuned = run_once(sc, seed, tuned=True, settings=DEFAULT_SETTINGS, controller_args=DEFAULT_CONTROLLER)
    summary = summarize(static, tuned, seed, DEFAULT_SETTINGS)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "decisions.jsonl").open("w", encoding="utf-8") as f:
        for r in tuned.records:
            f.write(r.to_json() + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
