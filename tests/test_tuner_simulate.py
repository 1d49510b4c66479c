"""The tuner against the simulated engine: each scenario, static defaults vs tuned, same seed.

Runs the real loop (`governor.tuner.loop.Tuner`) on a virtual clock: an hour of 15-second windows per
run, in about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from governor.tuner.simulate import DEFAULT_SETTINGS, SCENARIOS, simulate

WINDOW_S = (DEFAULT_SETTINGS.settle_intervals + DEFAULT_SETTINGS.verify_intervals) * DEFAULT_SETTINGS.interval_s


def run(name: str, tmp_path: Path, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = simulate(name, tmp_path / name, seed=seed)
    records = [json.loads(line) for line in (tmp_path / name / "decisions.jsonl").read_text().splitlines()]
    return summary, records


def seconds(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("name, knob, direction", [
    ("load-step", "max_num_seqs", +1),
    ("long-prompts", "max_num_batched_tokens", -1),
    ("spec-decay", "num_speculative_tokens", -1),
])
def test_attainment_recovers_with_the_right_knob(name: str, knob: str, direction: int, tmp_path: Path) -> None:
    summary, records = run(name, tmp_path)
    assert summary["slo_attainment_before"] < 0.1  # static defaults miss the SLO after the shift
    assert summary["slo_attainment_after"] >= 0.8
    applied = [r for r in records if r["outcome"] == "applied"]
    assert applied and applied[0]["knob"] == knob
    assert (applied[0]["to"] - applied[0]["from"]) * direction > 0
    assert summary["reversals"] == 0 and summary["rollbacks"] == 0
    assert all(seconds(r) > SCENARIOS[name].shift_at_s for r in applied)  # nothing to fix before the shift


def test_the_regression_is_rolled_back_within_one_verification_window(tmp_path: Path) -> None:
    summary, records = run("regression", tmp_path)
    first = records[0]
    assert (first["knob"], first["from"], first["to"], first["outcome"]) == ("max_num_seqs", 32, 48, "applied")
    rolled = next(r for r in records if r["outcome"] == "rolled_back")
    assert rolled["id"] == first["id"]
    assert seconds(rolled) - seconds(first) <= WINDOW_S
    assert {e["metric"] for e in rolled["evidence"]} & {"ttft_p95_s", "itl_p95_s"}
    later = [r for r in records if r["outcome"] == "applied" and seconds(r) > seconds(rolled)]
    assert later and all(r["to"] < 48 for r in later)  # the blocked value is not tried again
    assert summary["rollbacks"] == 1
    assert summary["final_knobs"]["max_num_seqs"] == 44  # the most the captured graphs allow
    assert summary["slo_attainment_after"] > summary["slo_attainment_before"] + 0.5


def test_nothing_happens_blind(tmp_path: Path) -> None:
    summary, records = run("stale-metrics", tmp_path)
    start, end = SCENARIOS["stale-metrics"].stale or (0.0, 0.0)
    frozen = [r for r in records if r["outcome"] == "frozen"]
    assert len(frozen) == 1 and frozen[0]["reason"] == "SignalsStale" and frozen[0]["knob"] is None
    assert start <= seconds(frozen[0]) < start + DEFAULT_SETTINGS.interval_s * 2
    assert not [r for r in records if r["outcome"] != "frozen" and start <= seconds(r) < end]
    assert summary["frozen_intervals"] == round((end - start) / DEFAULT_SETTINGS.interval_s)
    assert summary["actions"] > 0  # and it acts once the signals are back
    assert summary["slo_attainment_after"] > summary["slo_attainment_before"] + 0.3


def test_raising_k_is_kept_while_it_shortens_itl(tmp_path: Path) -> None:
    """Light load, a cheap draft, acceptance 0.9 after the shift: K goes up one step at a time, each step verified
    and kept, until ITL is met."""
    summary, records = run("spec-headroom", tmp_path)
    applied = [r for r in records if r["outcome"] == "applied"]
    assert len(applied) >= 2
    assert all((r["knob"], r["to"] - r["from"], r["reason"]) == ("num_speculative_tokens", 1, "SpecHeadroom")
               for r in applied)
    assert all(seconds(r) > SCENARIOS["spec-headroom"].shift_at_s for r in applied)
    assert summary["kept"] == len(applied) and summary["rollbacks"] == 0
    assert summary["slo_attainment_before"] < 0.1 and summary["slo_attainment_after"] >= 0.8


def test_raising_k_that_lengthens_itl_is_rolled_back(tmp_path: Path) -> None:
    """The same signals with a draft three times as costly as the target: the raise is tried, ITL rises, and it is
    rolled back within one verification window, and not tried again."""
    summary, records = run("spec-costly-draft", tmp_path)
    first = records[0]
    assert (first["knob"], first["from"], first["to"], first["outcome"], first["reason"]) == (
        "num_speculative_tokens", 1, 2, "applied", "SpecHeadroom")
    rolled = next(r for r in records if r["outcome"] == "rolled_back")
    assert rolled["id"] == first["id"] and seconds(rolled) - seconds(first) <= WINDOW_S
    before = next(e["value"] for e in first["evidence"] if e["metric"] == "itl_p95_s")
    after = next(e["value"] for e in rolled["evidence"] if e["metric"] == "itl_p95_s")
    assert after > before
    assert summary["rollbacks"] == 1 and summary["actions"] == 1
    assert summary["final_knobs"]["num_speculative_tokens"] == 1


NO_KNOB_MEETS_THE_SLO = {"spec-costly-draft"}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_bounded_behaviour_across_seeds(name: str, tmp_path: Path) -> None:
    for seed in range(1, 4):
        summary, records = run(name, tmp_path / str(seed), seed=seed)
        assert summary["reversals"] <= 1
        assert summary["rollbacks"] <= 2
        assert summary["actions"] <= 8
        if name in NO_KNOB_MEETS_THE_SLO:
            assert summary["slo_attainment_after"] >= summary["slo_attainment_before"]
        else:
            assert summary["slo_attainment_after"] > summary["slo_attainment_before"]
        for r in records:
            if r["knob"] is not None:
                lo, hi = SCENARIOS[name].bounds[r["knob"]]
                assert lo <= r["to"] <= hi


def test_the_cli_writes_decisions_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    done = subprocess.run([sys.executable, "-m", "governor.cli", "tune", "simulate", "--scenario", "load-step",
                           "--out", str(out), "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(done.stdout)
    for key in ("slo_attainment_before", "slo_attainment_after", "actions", "rollbacks", "reversals",
                "frozen_intervals"):
        assert key in summary
    assert (out / "decisions.jsonl").read_text().count("\n") == summary["actions"] + summary["kept"] \
        + summary["rollbacks"] + summary["not_confirmed"]
    bad = subprocess.run([sys.executable, "-m", "governor.cli", "tune", "simulate", "--scenario", "nope",
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
