"""Decision records: the one JSON object the tuner writes for every decision and every outcome.

`DecisionRecord` is the schema (docs/decision-record.schema.json is generated from it; a test fails on
drift). A decision leaves one record per event, linked by `id`: `applied` (or `not_confirmed`) when the
knob change was actuated, then `kept` or `rolled_back` when it was verified. A freeze on stale signals
leaves one `frozen` record (no knob) when it begins.

Sinks receive every record: the log (one JSON line), a JSONL file, a bounded in-memory history (the
operator's `status.tuning.history`), and Prometheus counters. The operator adds its own sink for Events.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("governor.tuner.decisions")


class Outcome(str, Enum):
    APPLIED = "applied"  # every engine took the change and confirmed it through its knob gauge
    NOT_CONFIRMED = "not_confirmed"  # some engine refused, was unreachable, or did not confirm: not counted
    KEPT = "kept"  # verification found no regression on any guarded metric
    ROLLED_BACK = "rolled_back"  # a guarded metric regressed: the old value was restored and the new one blocked
    FROZEN = "frozen"  # signals went stale or missing: the tuner holds still until they are fresh again


class EvidenceRecord(BaseModel):
    """One observed value against the threshold it crossed (or stayed within)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(description="Signal name, e.g. ttft_p95_s, itl_p95_s, running, signal_age_s.")
    value: float | None = Field(description="Observed value over the window; null when the signal was missing.")
    threshold: float | None = Field(description="The threshold it was compared with; null when none applies.")
    window: str = Field(description="The window the value was computed over, e.g. '15s' or 'after 6x15s'.")


class DecisionRecord(BaseModel):
    """One event in the life of a tuning decision (see the module docstring for the sequence)."""

    model_config = ConfigDict(extra="forbid")

    id: int = Field(description="Decision number within one tuner run; the records of one decision share it.")
    time: str = Field(description="When the event happened, RFC 3339 UTC.")
    service: str
    revision: str
    knob: str | None = Field(description="The knob changed; null for a freeze.")
    from_: int | None = Field(alias="from", description="The value before the change.")
    to: int | None = Field(description="The value the change set (for rolled_back: the value that was undone).")
    reason: str = Field(description="The bottleneck that justified the change (e.g. Queueing), or SignalsStale.")
    evidence: list[EvidenceRecord]
    outcome: Outcome
    detail: str = Field(default="", description="Per-engine actuation results, the regressed metrics, etc.")
    envelope: dict[str, str] = Field(default_factory=dict, description=(
        "The engine set-up the decision was made under, as the InferenceService states it: dtype, kvCacheDtype, "
        "quantization ('auto': the checkpoint's own) and tensorParallelSize. A knob value that pays under one "
        "set-up may not under another. Empty when the tuner was not told (a standalone `governor tune run`)."))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True), separators=(",", ":"))


def record_schema() -> dict[str, object]:
    """The JSON Schema of a decision record (what docs/decision-record.schema.json holds)."""
    return DecisionRecord.model_json_schema(by_alias=True, mode="serialization")


class RecordSink(Protocol):
    def emit(self, record: DecisionRecord) -> None: ...


class LogSink:
    """Each record as one JSON line on the `governor.tuner.decisions` logger."""

    def emit(self, record: DecisionRecord) -> None:
        log.info("%s", record.to_json())


class JsonlSink:
    """Appends each record to a JSON Lines file (flushed per record, so a crash loses nothing written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def emit(self, record: DecisionRecord) -> None:
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(record.to_json() + "\n")


class HistorySink:
    """The last `limit` records (all with None), newest last: the bounded history the operator writes to
    status, or a whole run's records (the simulator, the demo)."""

    def __init__(self, limit: int | None = 20) -> None:
        self.records: deque[DecisionRecord] = deque(maxlen=limit)

    def emit(self, record: DecisionRecord) -> None:
        self.records.append(record)


class MetricsSink:
    """Counts records as `governor_tuner_decisions_total{service, knob, outcome}` (knob "" for a freeze)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.decisions = Counter("governor_tuner_decisions", "Tuner decision records by outcome.",
                                 ["service", "knob", "outcome"], registry=registry)

    def emit(self, record: DecisionRecord) -> None:
        self.decisions.labels(record.service, record.knob or "", record.outcome.value).inc()


class FanOut:
    """Sends each record to every sink; a failing sink is logged and does not stop the others."""

    def __init__(self, sinks: Iterable[RecordSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, record: DecisionRecord) -> None:
        for sink in self.sinks:
            try:
                sink.emit(record)
            except Exception:  # a broken sink must not stop the controller or the other sinks
                log.exception("decision sink %s failed", type(sink).__name__)


if __name__ == "__main__":  # regenerate docs/decision-record.schema.json
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/decision-record.schema.json")
    target.write_text(json.dumps(record_schema(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {target}")
