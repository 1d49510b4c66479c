"""`governor demo`: the whole loop on one machine — engine, workload shift, tuner — static vs tuned.

1. Generates a small random-weight model (once per --out) and starts `governor serve` on 127.0.0.1
   with an admin token and deliberately small default knobs (max_num_seqs 4).
2. Calibrates on this machine: TTFT and ITL of lone requests and of a batch of 8, from which it sets
   the SLO (TTFT p95, ITL p95). The load is closed-loop clients: 3, then 16 (the workload shift), so
   a queue forms behind the default max_num_seqs whatever the machine's speed.
3. Runs the same workload twice: `static` (defaults, the tuner only watches) and `tuned` (the tuner
   acts through the admin API, reading the engine's own /metrics). Between phases the knobs are
   reset and the engine drains.
4. Prints a live table per window and writes decisions.jsonl, timeline.jsonl, summary.json
   (SLO attainment with the static default vs tuned, actions, rollbacks) and timeline.png.

Torch-free itself: the engine runs in a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from governor import contract
from governor.loadgen.client import RequestRecord, endpoint_url, request_body, send_request
from governor.loadgen.workload import Workload
from governor.tuner.loop import EngineActuator, EngineSource, Tuner, TunerSettings
from governor.tuner.policy import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_SPECULATIVE_TOKENS, Controller
from governor.tuner.records import DecisionRecord, FanOut, HistorySink, JsonlSink, LogSink
from governor.tuner.scrape import EngineScraper, parse_metrics, total
from governor.tuner.signals import SLO, Signals

MODEL_NAME = "demo"
DEFAULT_KNOBS = {MAX_NUM_SEQS: 4, MAX_NUM_BATCHED_TOKENS: 512, NUM_SPECULATIVE_TOKENS: 0}
BOUNDS = {MAX_NUM_SEQS: (1, 32), MAX_NUM_BATCHED_TOKENS: (128, 2048), NUM_SPECULATIVE_TOKENS: (0, 0)}
PROMPT_WORDS = (24, 48)
OUTPUT_TOKENS = 32
INTERVAL_S = 3.0
SHIFT_FRACTION = 0.25  # the load steps up a quarter of the way into each phase
BASE_CLIENTS = 3  # closed-loop clients before the shift: the default max_num_seqs (4) serves them
SHIFT_CLIENTS = 16  # after it: a queue forms behind max_num_seqs 4


@dataclass
class Calibration:
    ttft_1: float
    itl_1: float
    itl_8: float
    slo: SLO
    base_clients: int
    shift_clients: int


@dataclass
class Phase:
    name: str
    t0: float = 0.0  # wall-clock start of the phase (epoch seconds)
    windows: list[dict[str, Any]] = field(default_factory=list)
    records: list[DecisionRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "governor.cli", *args], check=True)


class Engine:
    """The `governor serve` child process and its admin API."""

    def __init__(self, model: Path, out: Path, token: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log = (out / "serve.log").open("w")
        env = {**os.environ, contract.ADMIN_TOKEN_ENV: token}
        knobs = [f"--{k.replace('_', '-')}={v}" for k, v in DEFAULT_KNOBS.items() if k != NUM_SPECULATIVE_TOKENS]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "governor.cli", "serve", str(model), "--host", "127.0.0.1", "--port",
             str(self.port), "--served-model-name", MODEL_NAME, "--revision", "demo", *knobs,
             f"--max-num-seqs-cap={BOUNDS[MAX_NUM_SEQS][1]}",
             f"--max-num-batched-tokens-cap={BOUNDS[MAX_NUM_BATCHED_TOKENS][1]}", "--max-queue", "100000"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the engine was not ready within {timeout_s:g} s; see {self.log.name}")

    def set_knobs(self, knobs: dict[str, int]) -> None:
        r = httpx.put(f"{self.url}{contract.ADMIN_KNOBS_PATH}", json=knobs,
                      headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        r.raise_for_status()

    def busy(self) -> float:
        """Requests running or waiting in the engine, from its /metrics."""
        metrics = parse_metrics(httpx.get(f"{self.url}/metrics", timeout=5).text)
        return sum(total(metrics, name) or 0.0 for name in (contract.REQUESTS_RUNNING, contract.REQUESTS_WAITING))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def _send_batch(engine: Engine, count: int, seed: int) -> list[RequestRecord]:
    workload = Workload(PROMPT_WORDS, (OUTPUT_TOKENS, OUTPUT_TOKENS), seed=seed)
    url = endpoint_url(engine.url, "completions")
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        tasks = [send_request(client, url, request_body(spec, MODEL_NAME, "completions", True), {},
                              RequestRecord(spec.index, spec.prompt_words, spec.max_tokens, 0.0), t0, 120.0)
                 for spec in workload.requests(count)]
        return list(await asyncio.gather(*tasks))


def calibrate(engine: Engine) -> Calibration:
    """Measure this machine, then derive the SLO and the load from it."""
    asyncio.run(_send_batch(engine, 1, seed=99))  # warm-up
    singles = [r for _ in range(3) for r in asyncio.run(_send_batch(engine, 1, seed=100))]
    engine.set_knobs({MAX_NUM_SEQS: 8})
    batch = asyncio.run(_send_batch(engine, 8, seed=101))
    engine.set_knobs({MAX_NUM_SEQS: DEFAULT_KNOBS[MAX_NUM_SEQS]})
    if not all(r.ok for r in singles + batch):
        bad = next(r for r in singles + batch if not r.ok)
        raise RuntimeError(f"calibration request failed: {bad.error_kind}: {bad.error}")
    ttft_1 = statistics.median(r.ttft or 0.0 for r in singles)
    itl_1 = statistics.median(x for r in singles for x in r.itl)
    itl_8 = statistics.median(x for r in batch for x in r.itl)
    request_s = ttft_1 + OUTPUT_TOKENS * itl_1  # one request alone, start to end
    # With SHIFT_CLIENTS closed-loop clients and max_num_seqs 4, a request waits about three request times
    # for a slot: the TTFT target sits well below that and above what a batch of all clients gives.
    # ITL grows with the batch and with the load generator sharing the CPU: the ITL target leaves room for
    # a batch of every client, so the SLO pair is reachable — by the right max_num_seqs.
    slo = SLO(ttft_p95_s=round(1.5 * request_s, 3), itl_p95_s=round(max(4 * itl_8, 3 * itl_1), 4))
    return Calibration(ttft_1, itl_1, itl_8, slo, base_clients=BASE_CLIENTS, shift_clients=SHIFT_CLIENTS)


async def _drive(engine: Engine, cal: Calibration, seconds: float, stop: threading.Event, phase: Phase,
                 seed: int) -> None:
    """Closed-loop clients, each sending its next request when the last one ends: `BASE_CLIENTS` for
    the first quarter of the phase, then `SHIFT_CLIENTS` (the workload shift). Bounded by `seconds`."""
    workload = Workload(PROMPT_WORDS, (OUTPUT_TOKENS, OUTPUT_TOKENS), seed=seed)
    url = endpoint_url(engine.url, "completions")
    counter = iter(range(10**9))
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def client_loop(http: httpx.AsyncClient, start_at: float) -> None:
        await asyncio.sleep(start_at)
        while not stop.is_set() and time.perf_counter() - t0 < seconds:
            i = next(counter)
            spec = workload.request(i)
            record = RequestRecord(i, spec.prompt_words, spec.max_tokens, time.perf_counter() - t0)
            left = seconds - (time.perf_counter() - t0)
            await send_request(http, url, request_body(spec, MODEL_NAME, "completions", True), {}, record, t0,
                               max(1.0, left))
            records.append(record)

    async with httpx.AsyncClient(timeout=httpx.Timeout(seconds + 30)) as http:
        shift = SHIFT_FRACTION * seconds
        loops = [client_loop(http, 0.0) for _ in range(BASE_CLIENTS)]
        loops += [client_loop(http, shift) for _ in range(SHIFT_CLIENTS - BASE_CLIENTS)]
        await asyncio.gather(*loops)
    phase.requests = records


def _window_row(phase: str, t: float, s: Signals, slo: SLO, hold: str | None,
                last: DecisionRecord | None) -> dict[str, Any]:
    met = (s.ttft_p95_s is not None and s.itl_p95_s is not None
           and s.ttft_p95_s <= slo.ttft_p95_s and s.itl_p95_s <= slo.itl_p95_s)
    return {"phase": phase, "t": round(t, 2), "ttft_p95_s": s.ttft_p95_s, "itl_p95_s": s.itl_p95_s,
            "queue_len": s.queue_len, "running": s.running, "throughput_tok_s": s.throughput_tok_s,
            "knobs": dict(s.knobs), "slo_met": met, "hold": hold,
            "last_decision": None if last is None else f"#{last.id} {last.knob} {last.from_}→{last.to} "
                                                        f"{last.reason} {last.outcome.value}"}


def _fmt(x: float | None, scale: float = 1000.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _print_row(row: dict[str, Any], seconds: float) -> None:
    knobs = row["knobs"]
    cells = [f"{row['phase']:>6}", f"{row['t']:6.0f}/{seconds:<4.0f}", f"{_fmt(row['ttft_p95_s']):>8}",
             f"{_fmt(row['itl_p95_s'], digits=1):>7}", f"{_fmt(row['queue_len'], 1):>6}",
             f"{knobs.get(MAX_NUM_SEQS, '-')!s:>4}", f"{knobs.get(MAX_NUM_BATCHED_TOKENS, '-')!s:>6}",
             f" {'yes' if row['slo_met'] else 'NO':>3} ", row["hold"] or "", row["last_decision"] or ""]
    print(" ".join(cells), flush=True)


def run_phase(engine: Engine, cal: Calibration, name: str, seconds: float, out: Path, tuned: bool,
              seed: int) -> Phase:
    phase = Phase(name)
    engine.set_knobs({MAX_NUM_SEQS: DEFAULT_KNOBS[MAX_NUM_SEQS],
                      MAX_NUM_BATCHED_TOKENS: DEFAULT_KNOBS[MAX_NUM_BATCHED_TOKENS]})

    history = HistorySink(limit=None)
    controller = Controller(slo=cal.slo, bounds=BOUNDS, hysteresis=0.1, consecutive=4, cooldown_s=10.0,
                            max_actions_per_hour=60, scrape_interval_s=INTERVAL_S, window=f"{INTERVAL_S:g}s",
                            step_factors={MAX_NUM_SEQS: 2.0, MAX_NUM_BATCHED_TOKENS: 2.0, NUM_SPECULATIVE_TOKENS: 1.0})
    tuner = Tuner(MODEL_NAME, "demo", controller, EngineSource(EngineScraper([engine.url], INTERVAL_S)),
                  EngineActuator([engine.url], engine.token),
                  FanOut([LogSink(), JsonlSink(out / "decisions.jsonl"), history]),
                  TunerSettings(interval_s=INTERVAL_S, settle_intervals=1, verify_intervals=5, backoff_s=600.0))
    source = tuner.source
    stop = threading.Event()
    driver = threading.Thread(target=lambda: asyncio.run(_drive(engine, cal, seconds, stop, phase, seed)), daemon=True)
    t0 = phase.t0 = time.time()
    source.observe(t0)  # the first scrape: windows start here
    driver.start()
    for k in range(1, int(seconds // INTERVAL_S) + 1):
        time.sleep(max(0.0, t0 + k * INTERVAL_S - time.time()))
        now = time.time()
        s = tuner.step(now) if tuned else source.observe(now)
        hold = (controller.hold.value if controller.hold else None) if tuned else "watching"
        row = _window_row(name, now - t0, s, cal.slo, hold, tuner.last_record)
        phase.windows.append(row)
        with (out / "timeline.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        _print_row(row, seconds)
    stop.set()
    driver.join(timeout=60)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and engine.busy() > 0:  # let aborted requests leave before the next phase
        time.sleep(0.5)
    phase.records = list(history.records)
    return phase


def attainment(phase: Phase, seconds: float) -> float:
    after = [w for w in phase.windows if w["t"] > SHIFT_FRACTION * seconds]
    return round(sum(w["slo_met"] for w in after) / max(1, len(after)), 4)


def plot(phases: list[Phase], cal: Calibration, seconds: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(phases), figsize=(12, 8), sharex=True, squeeze=False)
    for col, phase in enumerate(phases):
        t = [w["t"] for w in phase.windows]
        panels = [("TTFT p95 (s)", [w["ttft_p95_s"] for w in phase.windows], cal.slo.ttft_p95_s),
                  ("ITL p95 (ms)", [None if w["itl_p95_s"] is None else 1000 * w["itl_p95_s"] for w in phase.windows],
                   1000 * cal.slo.itl_p95_s),
                  ("max_num_seqs", [w["knobs"].get(MAX_NUM_SEQS) for w in phase.windows], None)]
        for row, (label, ys, slo) in enumerate(panels):
            ax = axes[row][col]
            ax.plot(t, [float("nan") if y is None else y for y in ys], marker=".", drawstyle="steps-post"
                    if row == 2 else "default")
            if slo is not None:
                ax.axhline(slo, color="red", linestyle="--", linewidth=1, label="SLO")
            ax.axvline(SHIFT_FRACTION * seconds, color="gray", linestyle=":", linewidth=1)
            for r in phase.records:
                if r.outcome.value in ("applied", "rolled_back"):
                    when = datetime.fromisoformat(r.time.replace("Z", "+00:00")).timestamp() - phase.t0
                    ax.axvline(when, color="green" if r.outcome.value == "applied" else "orange", linewidth=1)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{phase.name} (SLO attainment after the shift: {attainment(phase, seconds):.0%})")
            if row == 2:
                ax.set_xlabel("seconds into the phase (dotted: load steps up)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="governor demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load in all (two phases)")
    parser.add_argument("--out", default="out/demo", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.duration < 80:
        print("governor demo: --duration must be ≥ 80 s (two phases of ≥ 40 s)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("decisions.jsonl", "timeline.jsonl"):
        (out / name).unlink(missing_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        print("generating a small random-weight model ...", flush=True)
        _run(["make-model", str(model), "--arch", "qwen3", "--preset", "small", "--dtype", "float32"])
    engine = Engine(model, out, secrets.token_hex(16))
    try:
        engine.wait_ready()
        cal = calibrate(engine)
        print(f"calibrated: TTFT {cal.ttft_1 * 1000:.0f} ms, ITL {cal.itl_1 * 1000:.1f} ms (batch 1) / "
              f"{cal.itl_8 * 1000:.1f} ms (batch 8) → SLO TTFT p95 ≤ {cal.slo.ttft_p95_s:.2f} s, ITL p95 ≤ "
              f"{cal.slo.itl_p95_s * 1000:.1f} ms; load {cal.base_clients} → {cal.shift_clients} clients", flush=True)
        half = args.duration / 2
        print(f"{'phase':>6} {'t':>6}      {'TTFT ms':>8} {'ITL ms':>7} {'queue':>6} {'seqs':>4} {'chunk':>6}  SLO",
              flush=True)
        static = run_phase(engine, cal, "static", half, out, tuned=False, seed=args.seed)
        tuned = run_phase(engine, cal, "tuned", half, out, tuned=True, seed=args.seed)
    finally:
        engine.stop()
    outcomes = [r.outcome.value for r in tuned.records]
    summary = {
        "duration_s": args.duration,
        "interval_s": INTERVAL_S,
        "calibration": {"ttft_batch1_s": cal.ttft_1, "itl_batch1_s": cal.itl_1, "itl_batch8_s": cal.itl_8},
        "slo": {"ttft_p95_s": cal.slo.ttft_p95_s, "itl_p95_s": cal.slo.itl_p95_s},
        "load_clients": {"base": cal.base_clients, "shifted": cal.shift_clients, "shift_at_s": SHIFT_FRACTION * half},
        "default_knobs": DEFAULT_KNOBS,
        "final_knobs": tuned.windows[-1]["knobs"] if tuned.windows else None,
        "slo_attainment_static": attainment(static, half),
        "slo_attainment_tuned": attainment(tuned, half),
        "requests": {p.name: {"sent": len(p.requests), "completed": sum(r.ok for r in p.requests)}
                     for p in (static, tuned)},
        "actions": outcomes.count("applied"),
        "rollbacks": outcomes.count("rolled_back"),
        "kept": outcomes.count("kept"),
        "not_confirmed": outcomes.count("not_confirmed"),
        "frozen": outcomes.count("frozen"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot([static, tuned], cal, half, out / "timeline.png")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}/decisions.jsonl, timeline.jsonl, summary.json, timeline.png")
    return 0
