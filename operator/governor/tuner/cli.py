"""`governor tune`: run the SLO controller outside Kubernetes.

- `governor tune simulate --scenario NAME --out DIR`: the tuner against the engine model
  (`governor.tuner.simulate`), static vs tuned; writes decisions.jsonl and summary.json.
- `governor tune run --engine URL ... --ttft-p95 S --itl-p95 S`: the live tuner against running engines,
  reading their own /metrics (or Prometheus with `--prometheus URL`) and actuating through their
  admin API; decision records go to the log and to `--records FILE` (JSON Lines).

Torch-free. Exit status: 0 on success, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from governor import contract
from governor.tuner.loop import EngineActuator, EngineSource, SignalSource, Tuner, TunerSettings
from governor.tuner.policy import DEFAULT_BOUNDS, Bounds, Controller
from governor.tuner.records import FanOut, JsonlSink, LogSink, MetricsSink, RecordSink
from governor.tuner.scrape import EngineScraper
from governor.tuner.signals import SLO


def parse_bounds(specs: list[str]) -> Bounds:
    """`name=min:max` flags over the defaults; raises ValueError naming the bad flag."""
    bounds = dict(DEFAULT_BOUNDS)
    for spec in specs:
        name, sep, rng = spec.partition("=")
        lo, sep2, hi = rng.partition(":")
        if not sep or not sep2 or name not in contract.KNOB_NAMES:
            names = ", ".join(contract.KNOB_NAMES)
            raise ValueError(f"--bound {spec!r}: expected NAME=MIN:MAX with NAME one of {names}")
        try:
            b = (int(lo), int(hi))
        except ValueError:
            raise ValueError(f"--bound {spec!r}: MIN and MAX must be integers") from None
        if b[0] > b[1] or b[0] < 0:
            raise ValueError(f"--bound {spec!r}: need 0 ≤ MIN ≤ MAX")
        bounds[name] = b
    return bounds


def _simulate(args: argparse.Namespace) -> int:
    from governor.tuner.simulate import simulate

    summary = simulate(args.scenario, Path(args.out), seed=args.seed, duration_s=args.duration)
    print(json.dumps(summary, indent=2))
    return 0


def build_tuner(args: argparse.Namespace, sink: RecordSink) -> Tuner:
    """The live tuner for `tune run` (and the demo): source, controller, actuator and settings from flags."""
    token = os.environ.get(contract.ADMIN_TOKEN_ENV, "")
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"no admin token: pass --token-file or set {contract.ADMIN_TOKEN_ENV}")
    slo = SLO(ttft_p95_s=args.ttft_p95, itl_p95_s=args.itl_p95, e2e_p95_s=args.e2e_p95, error_rate=args.error_rate)
    controller = Controller(slo=slo, bounds=parse_bounds(args.bound), hysteresis=args.hysteresis,
                            consecutive=args.consecutive, cooldown_s=args.cooldown,
                            max_actions_per_hour=args.max_actions_per_hour, scrape_interval_s=args.interval,
                            window=f"{args.interval:g}s")
    settings = TunerSettings(interval_s=args.interval, settle_intervals=args.settle_intervals,
                             verify_intervals=args.verify_intervals, backoff_s=args.backoff)
    source: SignalSource
    if args.prometheus:
        from governor.tuner.prom import PrometheusSource, window_for

        source = PrometheusSource(args.prometheus, args.service, args.revision,
                                  window_s=window_for(args.interval, args.scrape_interval),
                                  scrape_interval_s=args.scrape_interval, namespace=args.namespace)
    else:
        source = EngineSource(EngineScraper(args.engine, scrape_interval_s=args.interval))
    return Tuner(args.service, args.revision or "", controller, source, EngineActuator(args.engine, token), sink,
                 settings)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", required=True, help="engine base URL (repeat for every replica)")
    p.add_argument("--service", required=True, help="the service (engines' served model name)")
    p.add_argument("--revision", default=None, help="revision label to scope Prometheus queries to")
    p.add_argument("--namespace", default=None,
                   help="namespace label to scope Prometheus queries to (the engines' Kubernetes namespace)")
    p.add_argument("--prometheus", default=None, help="Prometheus URL (default: scrape the engines directly)")
    p.add_argument("--scrape-interval", type=float, default=5.0,
                   help="Prometheus's scrape interval for the engines, seconds (rate windows span ≥ 2 of them)")
    p.add_argument("--token-file", default=None, help=f"admin token file (default: ${contract.ADMIN_TOKEN_ENV})")
    p.add_argument("--ttft-p95", type=float, required=True, help="TTFT p95 SLO, seconds")
    p.add_argument("--itl-p95", type=float, required=True, help="ITL p95 SLO, seconds")
    p.add_argument("--e2e-p95", type=float, default=None, help="E2E p95 SLO, seconds (optional)")
    p.add_argument("--error-rate", type=float, default=None, help="error-rate SLO, fraction (optional)")
    p.add_argument("--interval", type=float, default=15.0, help="seconds per window (default 15)")
    p.add_argument("--hysteresis", type=float, default=0.1)
    p.add_argument("--consecutive", type=int, default=4, help="windows a bottleneck must persist before acting")
    p.add_argument("--cooldown", type=float, default=300.0, help="seconds after an action before the next")
    p.add_argument("--max-actions-per-hour", type=int, default=4)
    p.add_argument("--settle-intervals", type=int, default=2)
    p.add_argument("--verify-intervals", type=int, default=6)
    p.add_argument("--backoff", type=float, default=3600.0, help="seconds a rolled-back value stays blocked")
    p.add_argument("--bound", action="append", default=[], metavar="NAME=MIN:MAX",
                   help="knob bounds (default: " + ", ".join(f"{k}={v[0]}:{v[1]}" for k, v in DEFAULT_BOUNDS.items())
                   + ")")


def _run(args: argparse.Namespace) -> int:
    sinks: list[RecordSink] = [LogSink()]
    if args.records:
        sinks.append(JsonlSink(Path(args.records)))
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        sinks.append(MetricsSink(registry))
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    tuner = build_tuner(args, FanOut(sinks))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    tuner.run(stop)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="governor tune", description="the SLO controller outside Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    from governor.tuner.simulate import SCENARIOS

    sim = sub.add_parser("simulate", help="the tuner against a simulated engine: static vs tuned")
    sim.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    sim.add_argument("--out", required=True, help="directory for decisions.jsonl and summary.json")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--duration", type=float, default=None, help="simulated seconds (default: the scenario's)")
    run = sub.add_parser("run", help="the live tuner against running engines")
    add_run_arguments(run)
    run.add_argument("--records", default=None, help="append decision records to this JSON Lines file")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve governor_tuner_decisions_total on this port (/metrics)")
    run.add_argument("--metrics-host", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _simulate(args) if args.command == "simulate" else _run(args)
    except ValueError as e:
        print(f"governor tune: {e}", file=sys.stderr)
        return 2
