"""`governor demo` end to end at its shortest duration: the README's main job, on this machine's CPU.

Timing on a shared CI machine is not controlled, so this checks what the demo produces — both phases'
windows, valid decision records, a summary with both attainments, a PNG — not which way the SLOs went.
Bounded: 80 s of load plus set-up, killed after 400 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from governor.demo import INTERVAL_S
from governor.tuner.records import DecisionRecord


def test_the_demo_writes_its_outputs(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "governor.cli", "demo", "--duration", "80", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "calibrated:" in done.stdout and "static" in done.stdout and "tuned" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("slo_attainment_static", "slo_attainment_tuned", "actions", "rollbacks", "slo", "final_knobs"):
        assert key in summary
    assert 0.0 <= summary["slo_attainment_static"] <= 1.0 and 0.0 <= summary["slo_attainment_tuned"] <= 1.0
    assert summary["requests"]["static"]["completed"] > 0 and summary["requests"]["tuned"]["completed"] > 0
    rows = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    per_phase = int(40 // INTERVAL_S)
    assert [r["phase"] for r in rows] == ["static"] * per_phase + ["tuned"] * per_phase
    decisions = out / "decisions.jsonl"
    for line in decisions.read_text().splitlines() if decisions.exists() else []:
        DecisionRecord.model_validate_json(line)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_too_short_demo_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "governor.cli", "demo", "--duration", "10", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--duration must be" in done.stderr
