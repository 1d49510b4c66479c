"""The tuner inside the operator: one SLO-controller loop per InferenceService with `spec.autotune.enabled`.

`run_tuner` is the body of the kopf daemon (`handlers.tuner_daemon`). Each interval it re-reads the service's
spec and status and runs one `ServiceTuning.interval`:

- Settings come from the operator's environment: `GOVERNOR_PROMETHEUS_URL` (none: the tuner holds, reason
  NoPrometheus) and `GOVERNOR_PROMETHEUS_SCRAPE_INTERVAL_S` (default 15; the PromQL window is the larger of
  the interval and two scrapes).
- Scope: the stable revision, `status.revision`. Signals are the engines' series with `model_name` = the
  served model name, `namespace` = the service's namespace and `revision` = that revision; knob changes go
  to the ready pods of that revision (`PodActuator`), with the bearer token from the service's admin Secret,
  read per change and never kept.
- The loop holds still while a rollout runs (`status.rollout.phase` Progressing or Paused) and starts a new
  `Tuner` when it ends: the windows from before describe another pod mix. A new `Tuner` is also built when
  the stable revision, the SLO, the autotune settings or the bounds change; otherwise the same one runs on
  (it holds the baseline windows and the change under verification).
- Every decision record goes to the log (one JSON line), to an Event (`TunerApplied`, `TunerRolledBack`, ...)
  and to `status.tuning` (see `tuning_status`), written through the status subresource. Tuned knob values
  live only there: reconcile renders new pods' starting knobs from `status.tuning.knobs`; the spec is never
  written. `status.tuning` is written when it changes (a record, a knob value, the state), not every interval.

Torch-free; the cluster is touched only by `run_tuner`, `PodActuator` and `write_tuning_status`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes import client

from governor import contract
from governor.operator.api import GROUP, PLURAL, VERSION, InferenceServiceSpec, duration_seconds
from governor.operator.render import (
    ADMIN_TOKEN_KEY,
    CONTAINER,
    LABEL_REVISION,
    LABEL_SERVICE,
    PORT,
    PORT_NAME,
    admin_secret_name,
    knob_limits,
    revision_selector,
)
from governor.operator.rollout import ACTIVE as ROLLOUT_ACTIVE
from governor.operator.validation import parse_spec
from governor.tuner.actuate import ActuationResult, apply_knobs
from governor.tuner.loop import Actuator, SignalSource, Tuner, TunerSettings
from governor.tuner.policy import DEFAULT_BOUNDS, Bounds, Controller, Hold
from governor.tuner.prom import PrometheusSource, duration, window_for
from governor.tuner.records import DecisionRecord, FanOut, LogSink, Outcome
from governor.tuner.signals import SLO

log = logging.getLogger(__name__)

PROMETHEUS_URL_ENV = "GOVERNOR_PROMETHEUS_URL"
SCRAPE_INTERVAL_ENV = "GOVERNOR_PROMETHEUS_SCRAPE_INTERVAL_S"
DEFAULT_SCRAPE_INTERVAL_S = 15.0
DEFAULT_INTERVAL_S = 15.0  # the spec's default; used while the spec cannot be read
HISTORY_LIMIT = 20
WARNING_OUTCOMES = (Outcome.ROLLED_BACK, Outcome.NOT_CONFIRMED, Outcome.FROZEN)
EVENT_MESSAGE_LIMIT = 1024  # what the API server keeps of an Event's message

# status.tuning.state.reason values (reconcile maps them to the Tuning condition).
ACTIVE = "Active"  # tuning on fresh signals; `hold` says why the last window led to no change
SIGNALS_STALE = Hold.SIGNALS_STALE.value
ROLLOUT_IN_PROGRESS = "RolloutInProgress"
NO_PROMETHEUS = "NoPrometheus"
INVALID_SETTINGS = "InvalidSettings"
NO_REVISION = "NoRevision"
INVALID_SPEC = "InvalidSpec"


# --- what the loop reads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TuningConfig:
    """Everything a `Tuner` is built from; a different config means a new `Tuner` (it is the rebuild key)."""

    service: str  # the InferenceService's name (decision records, Events)
    namespace: str  # the InferenceService's namespace: the engines' namespace label
    served_name: str  # the engines' model_name label
    revision: str  # the stable revision
    slo: SLO
    bounds: tuple[tuple[str, int, int], ...]
    interval_s: float
    cooldown_s: float
    hysteresis: float
    prometheus_url: str
    scrape_interval_s: float
    envelope: tuple[tuple[str, str], ...] = ()  # the engine set-up every decision record carries

    @property
    def window_s(self) -> float:
        """The PromQL window of one interval (`prom.window_for`)."""
        return window_for(self.interval_s, self.scrape_interval_s)


@dataclass(frozen=True)
class TuningState:
    """`status.tuning.state`: whether the tuner holds still (`frozen`), why (`reason`, CamelCase), the
    controller's hold of the last window when active (`hold`), and the stable revision tuned (`revision`)."""

    frozen: bool
    reason: str
    message: str
    hold: str | None = None
    revision: str | None = None

    def to_status(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "reason": self.reason, "hold": self.hold, "message": self.message,
                "revision": self.revision}


def tuner_bounds(spec: InferenceServiceSpec) -> Bounds:
    """The range of each knob: spec.autotune.bounds over the tuner's defaults, capped by the engines' hard caps
    (`render.knob_limits`; K is 0 with speculation off)."""
    given = spec.autotune.bounds.given() if spec.autotune.bounds is not None else {}
    limits = knob_limits(spec)
    bounds: Bounds = {}
    for knob, default in DEFAULT_BOUNDS.items():
        lo, hi = given.get(knob, default)
        _, cap = limits.get(knob, (0, 0))  # only K can be missing: speculation is off
        bounds[knob] = (min(lo, cap), min(hi, cap))
    return bounds


def rollout_phase(status: Mapping[str, Any]) -> str | None:
    """`status.rollout.phase` when a rollout is running (Progressing or Paused), else None."""
    rollout = status.get("rollout")
    phase = rollout.get("phase") if isinstance(rollout, Mapping) else None
    return phase if phase in ROLLOUT_ACTIVE else None


def hold_for(status: Mapping[str, Any], env: Mapping[str, str]) -> TuningState | None:
    """Why the tuner cannot run this interval (a frozen state), or None when it can."""
    if not env.get(PROMETHEUS_URL_ENV):
        return TuningState(True, NO_PROMETHEUS, f"the operator has no Prometheus to read signals from: set "
                                                f"{PROMETHEUS_URL_ENV} in its environment (e.g. "
                                                "http://prometheus.monitoring:9090)")
    try:
        scrape = float(env.get(SCRAPE_INTERVAL_ENV, DEFAULT_SCRAPE_INTERVAL_S))
    except ValueError:
        scrape = -1.0
    if not scrape > 0:
        return TuningState(True, INVALID_SETTINGS, f"{SCRAPE_INTERVAL_ENV}={env.get(SCRAPE_INTERVAL_ENV)!r}: "
                                                   "expected Prometheus' scrape interval in seconds, e.g. 15")
    revision = status.get("revision")
    if not isinstance(revision, str) or not revision:
        return TuningState(True, NO_REVISION, "waiting for the operator to report the stable revision "
                                              "(status.revision)")
    phase = rollout_phase(status)
    if phase is not None:
        return TuningState(True, ROLLOUT_IN_PROGRESS, f"a rollout is in progress (phase {phase}): the tuner holds "
                                                      "still and starts afresh on the stable revision when it ends",
                           revision=revision)
    return None


def tuning_config(name: str, namespace: str, spec: InferenceServiceSpec, status: Mapping[str, Any],
                  env: Mapping[str, str]) -> TuningConfig:
    """The config of this interval; call only when `hold_for` returned None."""
    bounds = tuner_bounds(spec)
    return TuningConfig(
        service=name, namespace=namespace, served_name=spec.model.served_name or name,
        revision=str(status["revision"]),
        slo=spec.slo.targets(), bounds=tuple((k, lo, hi) for k, (lo, hi) in sorted(bounds.items())),
        interval_s=duration_seconds(spec.autotune.interval), cooldown_s=duration_seconds(spec.autotune.cooldown),
        hysteresis=spec.autotune.hysteresis, prometheus_url=env[PROMETHEUS_URL_ENV],
        scrape_interval_s=float(env.get(SCRAPE_INTERVAL_ENV, DEFAULT_SCRAPE_INTERVAL_S)),
        envelope=engine_envelope(spec))


def engine_envelope(spec: InferenceServiceSpec) -> tuple[tuple[str, str], ...]:
    """The engine set-up a decision is made under, as the spec states it (`DecisionRecord.envelope`)."""
    engine = spec.engine
    return (("dtype", engine.dtype), ("kvCacheDtype", engine.kv_cache_dtype),
            ("quantization", engine.quantization or "auto"), ("tensorParallelSize", str(engine.tensor_parallel_size)))


def prometheus_source(config: TuningConfig) -> SignalSource:
    """Signals of the service's stable revision, in its namespace, from Prometheus."""
    return PrometheusSource(config.prometheus_url, config.served_name, config.revision, window_s=config.window_s,
                            scrape_interval_s=config.scrape_interval_s, namespace=config.namespace)


def build_tuner(config: TuningConfig, source: SignalSource, actuator: Actuator, sink: FanOut) -> Tuner:
    """A `Tuner` for `config`: the service's SLO, bounds, hysteresis and cooldown; the loop's other settings
    (consecutive windows, settle and verify windows, back-off) are the tuner's defaults."""
    controller = Controller(slo=config.slo, bounds={k: (lo, hi) for k, lo, hi in config.bounds},
                            hysteresis=config.hysteresis, cooldown_s=config.cooldown_s,
                            scrape_interval_s=config.interval_s, window=duration(config.window_s))
    return Tuner(config.service, config.revision, controller, source, actuator, sink,
                 TunerSettings(interval_s=config.interval_s), dict(config.envelope))


# --- actuation ----------------------------------------------------------------------------------------


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return (status.get("phase") == "Running" and bool(status.get("podIP"))
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions))


def _http_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == CONTAINER:
            for port in container.get("ports") or []:
                if port.get("name") == PORT_NAME and isinstance(port.get("containerPort"), int):
                    return int(port["containerPort"])
    return PORT


def engine_urls(pods: Iterable[Mapping[str, Any]], name: str, revision: str) -> list[str]:
    """Base URLs of the ready engines among `pods` (Pod objects as JSON) of revision `revision` of `name`:
    Running, with an IP and condition Ready=True; port: the `engine` container's port named `http`, else
    `render.PORT`. The labels are checked here too, whatever selector the list was made with. Sorted."""
    urls = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_SERVICE) == name and labels.get(LABEL_REVISION) == revision and _ready(pod):
            urls.append(f"http://{pod['status']['podIP']}:{_http_port(pod)}")
    return sorted(urls)


def admin_token(secret: Mapping[str, Any]) -> str:
    """The admin token in a Secret (JSON): `data` (base64, as the API server stores it), else `stringData`
    (as written; the test emulator keeps it so). Raises ValueError when neither holds the key."""
    data = (secret.get("data") or {}).get(ADMIN_TOKEN_KEY)
    if data:
        return base64.b64decode(data).decode()
    given = (secret.get("stringData") or {}).get(ADMIN_TOKEN_KEY)
    if given:
        return str(given)
    name = (secret.get("metadata") or {}).get("name")
    raise ValueError(f"Secret {name} has no {ADMIN_TOKEN_KEY!r} key, so the tuner cannot call the engines' admin "
                     "API: delete the Secret (the operator creates one with a new token), then restart the engine "
                     "pods so they read it")


def _json(response: Any) -> dict[str, Any]:
    # Raw JSON (`_preload_content=False`): the objects exactly as served, without the client's model classes.
    return dict(json.loads(response.data))


class PodActuator:
    """Applies knob changes to the ready engine pods of one revision (found anew for each change), with the
    admin token read from the service's Secret for each change (never kept or logged)."""

    def __init__(self, name: str, namespace: str, revision: str) -> None:
        self.name = name
        self.namespace = namespace
        self.revision = revision

    def apply(self, changes: dict[str, int]) -> ActuationResult:
        core = client.CoreV1Api()
        pods = _json(core.list_namespaced_pod(self.namespace, label_selector=revision_selector(self.name,
                                                                                               self.revision),
                                              _preload_content=False))
        urls = engine_urls(pods.get("items") or [], self.name, self.revision)
        if not urls:
            log.warning("no ready engine pod of %s/%s revision %s to apply %s to", self.namespace, self.name,
                        self.revision, changes)
            return ActuationResult(dict(changes), ())
        secret = _json(core.read_namespaced_secret(admin_secret_name(self.name), self.namespace,
                                                   _preload_content=False))
        return apply_knobs(urls, changes, admin_token(secret))


# --- records → status and Events --------------------------------------------------------------------


def record_json(record: DecisionRecord) -> dict[str, Any]:
    """A decision record as stored in status: the schema's JSON form (docs/decision-record.schema.json)."""
    return record.model_dump(mode="json", by_alias=True)


def record_event(record: DecisionRecord) -> tuple[str, str, str]:
    """(type, reason, message) of the Event for one record: reason `Tuner` + the outcome in CamelCase;
    Warning for rolled_back, not_confirmed and frozen."""
    type_ = "Warning" if record.outcome in WARNING_OUTCOMES else "Normal"
    reason = "Tuner" + "".join(part.capitalize() for part in record.outcome.value.split("_"))
    if record.knob is None:
        message = f"decision {record.id}: {record.reason}"
    else:
        message = f"decision {record.id}: {record.knob} {record.from_}→{record.to} ({record.reason})"
    if record.detail:
        message += f"; {record.detail}"
    return type_, reason, message[:EVENT_MESSAGE_LIMIT]


class StatusSink:
    """RecordSink for status and Events: the last `limit` records as JSON (`history`, newest last, seeded
    from the status already written) and the records not yet published (`take`)."""

    def __init__(self, history: Iterable[Mapping[str, Any]] = (), limit: int = HISTORY_LIMIT) -> None:
        self.history: deque[dict[str, Any]] = deque((dict(h) for h in history), maxlen=limit)
        self._new: list[DecisionRecord] = []

    def emit(self, record: DecisionRecord) -> None:
        self.history.append(record_json(record))
        self._new.append(record)

    def take(self) -> list[DecisionRecord]:
        """The records emitted since the last call."""
        new, self._new = self._new, []
        return new


def tuning_status(state: TuningState, knobs: Mapping[str, int] | None, baseline: Mapping[str, int] | None,
                  history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The `status.tuning` document. `knobs`: the effective knob values (contract names) of the stable
    revision, which new pods start with; `baseline`: the values when the current tuner started; `history`:
    the last decision records, newest last, and `lastDecision` the newest. Unknown parts are left out (a
    merge patch then keeps what status holds)."""
    doc: dict[str, Any] = {"state": state.to_status()}
    if knobs is not None:
        doc["knobs"] = dict(knobs)
    if baseline is not None:
        doc["baseline"] = dict(baseline)
    if history:
        doc["history"] = [dict(h) for h in history]
        doc["lastDecision"] = dict(history[-1])
    return doc


def active_state(tuner: Tuner) -> TuningState:
    """The state of a tuner that stepped: frozen on stale signals, else active with the controller's hold."""
    if tuner.frozen:
        return TuningState(True, SIGNALS_STALE, "signals of the stable revision are stale or missing in "
                                                "Prometheus: the tuner holds still until they are fresh",
                           hold=SIGNALS_STALE, revision=tuner.revision)
    hold = tuner.controller.hold
    return TuningState(False, ACTIVE, f"tuning revision {tuner.revision} on fresh signals",
                       hold=None if hold is None else hold.value, revision=tuner.revision)


# --- the loop -----------------------------------------------------------------------------------------


class ServiceTuning:
    """The tuner of one service across intervals; I/O is injected (`write_status`, `post_event`,
    `make_actuator`, `make_source`), so the behaviour is testable without a cluster.

    Invariants: `tuner` is None while the loop holds (no Prometheus, no stable revision, a rollout, a bad
    spec), so the next active interval starts a fresh one; otherwise it was built from `config`. `written` is
    the `status.tuning` last written (or found at start); a document equal to it is not written again.
    """

    def __init__(self, name: str, namespace: str, previous: Mapping[str, Any] | None, *,
                 write_status: Callable[[dict[str, Any]], None], post_event: Callable[[str, str, str], None],
                 make_actuator: Callable[[str], Actuator],
                 make_source: Callable[[TuningConfig], SignalSource] = prometheus_source,
                 clock: Callable[[], float] = time.time) -> None:
        prev = dict(previous or {})
        self.name = name
        self.namespace = namespace
        self.write_status = write_status
        self.post_event = post_event
        self.make_actuator = make_actuator
        self.make_source = make_source
        self.clock = clock
        history = prev.get("history")
        self.sink = StatusSink(h for h in (history if isinstance(history, list) else []) if isinstance(h, Mapping))
        # Only the contract's knobs carry over: one an older operator wrote is dropped from status on the first write.
        self.knobs = _contract_knobs(prev.get("knobs"))
        self.baseline = _contract_knobs(prev.get("baseline"))
        self.new_baseline = True  # the next fresh knob values become the baseline
        self.tuner: Tuner | None = None
        self.config: TuningConfig | None = None
        self.interval_s = DEFAULT_INTERVAL_S
        self.written: dict[str, Any] | None = prev or None

    def interval(self, raw_spec: Any, status: Mapping[str, Any], env: Mapping[str, str]) -> float:
        """Run one interval against the current spec and status; returns the seconds until the next."""
        parsed = parse_spec(raw_spec)
        if not isinstance(parsed, InferenceServiceSpec):
            message = "; ".join(str(e) for e in parsed)[:EVENT_MESSAGE_LIMIT]
            self._hold(TuningState(True, INVALID_SPEC, message))
            return self.interval_s
        self.interval_s = duration_seconds(parsed.autotune.interval)
        held = hold_for(status, env)
        if held is not None:
            self._hold(held)
            return self.interval_s
        config = tuning_config(self.name, self.namespace, parsed, status, env)
        if self.tuner is None or config != self.config:
            if self.tuner is not None:
                log.info("tuner of %s/%s restarts: its settings or stable revision changed", self.namespace,
                         self.name)
            self.tuner = build_tuner(config, self.make_source(config), self.make_actuator(config.revision),
                                     FanOut([LogSink(), self.sink]))
            # Decision ids stay unique per service across tuners (rollouts, restarts): they go on from history.
            self.tuner.next_id = 1 + max((h["id"] for h in self.sink.history if isinstance(h.get("id"), int)),
                                         default=0)
            self.config = config
            self.new_baseline = True
        tuner = self.tuner
        tuner.step(self.clock())
        if tuner.current is not None:
            self.knobs = dict(tuner.current)
            if self.new_baseline:
                self.baseline, self.new_baseline = dict(tuner.current), False
        self._publish(active_state(tuner))
        return self.interval_s

    def _hold(self, state: TuningState) -> None:
        self.tuner = None
        self.config = None
        self._publish(state)

    def _publish(self, state: TuningState) -> None:
        for record in self.sink.take():
            self.post_event(*record_event(record))
        doc = tuning_status(state, self.knobs, self.baseline, self.sink.history)
        if doc != self.written:
            old = (self.written or {}).get("state")
            if not isinstance(old, Mapping) or old.get("reason") != state.reason:
                log.info("tuner of %s/%s: %s (%s)", self.namespace, self.name, state.reason, state.message)
            self.write_status(replacing_patch(self.written, doc))
            self.written = doc


def _contract_knobs(value: Any) -> dict[str, int] | None:
    """A status knob map restricted to the contract's knob names; None when it is not a map."""
    return {k: v for k, v in value.items() if k in contract.KNOB_NAMES} if isinstance(value, Mapping) else None


def replacing_patch(written: Mapping[str, Any] | None, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` as a merge patch over `written` that replaces its knob maps whole: a key of `written`'s knobs or
    baseline that `doc`'s lacks is set to null (a merge patch otherwise keeps it, and new pods would start from
    a knob value the tuner no longer reports)."""
    patch = dict(doc)
    for part in ("knobs", "baseline"):
        before, after = (written or {}).get(part), doc.get(part)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            patch[part] = {**dict.fromkeys(k for k in before if k not in after), **after}
    return patch


def write_tuning_status(name: str, namespace: str, doc: dict[str, Any]) -> None:
    """Merge-patch `status.tuning` through the status subresource (the CRD declares it, so a real API server
    ignores status in a patch of the object itself)."""
    client.CustomObjectsApi().patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name,
                                                                    {"status": {"tuning": doc}})


async def run_tuner(name: str, namespace: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                    logger: kopf.Logger) -> None:
    """The kopf daemon's body: one interval per `spec.autotune.interval` until `stopped`. `body` is kopf's live
    view of the object, re-read every interval. An exception in one interval is logged (an Error Event the
    first time it occurs, the log after) and the loop goes on."""
    tuning = ServiceTuning(
        name, namespace, (body.get("status") or {}).get("tuning"),
        write_status=lambda doc: write_tuning_status(name, namespace, doc),
        post_event=lambda type_, reason, message: kopf.event(body, type=type_, reason=reason, message=message),
        make_actuator=lambda revision: PodActuator(name, namespace, revision))
    last_error = ""
    next_at = time.monotonic()
    while not stopped:
        wait_s = tuning.interval_s
        try:
            # In a thread (the interval blocks on HTTP); the daemon itself is async so that kopf can cancel it
            # at shutdown even when it was restarted after the stop signal (a sync daemon's thread would hold
            # the process open until the pod's grace period ends).
            wait_s = await asyncio.to_thread(tuning.interval, body.get("spec"), dict(body.get("status") or {}),
                                             dict(os.environ))
            last_error = ""
        except Exception as e:  # a failing interval must not end tuning of the service
            error = f"{type(e).__name__}: {e}"
            if error != last_error:
                logger.exception("tuner interval failed")
            else:
                log.warning("tuner interval of %s/%s failed again: %s", namespace, name, error[:300])
            last_error = error
        next_at = max(next_at + wait_s, time.monotonic())
        await stopped.wait(max(0.0, next_at - time.monotonic()))
