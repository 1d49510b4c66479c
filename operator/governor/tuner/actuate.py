"""The tuner's actuator: PUT /admin/knobs on every engine of a service, then confirm on `/metrics`.

A change counts as applied only when every engine answered 200 and its `governor_knob{name=...}` gauge
shows every new value. Nothing is rolled back here: a partial result is reported per engine, and the
next scrape sees the engines disagree (which freezes the controller until they agree again).

The admin token is sent only in the `Authorization` header; it is never logged, stored or echoed.
Imports no torch and no kopf.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

import httpx

from governor import contract
from governor.tuner.scrape import knob_values, parse_metrics

log = logging.getLogger(__name__)

CONFIRM_ATTEMPTS = 5
CONFIRM_PAUSE_S = 0.1
BODY_LIMIT = 500  # characters of an error body kept in the result


class EngineStatus(str, Enum):
    """How one engine took a knob change."""

    OK = "ok"  # 200, and the gauge shows every new value
    HTTP_ERROR = "http_error"  # the PUT was answered with a non-200 (401, 422, 503, ...)
    UNREACHABLE = "unreachable"  # connection error or timeout on the PUT
    UNCONFIRMED = "unconfirmed"  # 200, but the gauge did not show the new values (or /metrics failed)


@dataclass(frozen=True)
class EngineActuation:
    """One engine's outcome: `http_status` of the PUT (None if unreachable), `detail` (error body or reason),
    and `confirmed` — the knob values its gauge showed at the last confirmation read."""

    url: str
    status: EngineStatus
    http_status: int | None = None
    detail: str = ""
    confirmed: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ActuationResult:
    """Outcome of one knob change across a service; `applied` only when every engine is `ok`."""

    changes: dict[str, int]
    engines: tuple[EngineActuation, ...]

    @property
    def applied(self) -> bool:
        return bool(self.engines) and all(e.status is EngineStatus.OK for e in self.engines)

    def summary(self) -> str:
        """One line per engine, for logs and decision records (no token in it)."""
        return "; ".join(f"{e.url}: {e.status.value}" + (f" {e.http_status}" if e.http_status else "")
                         + (f" ({e.detail})" if e.detail else "") for e in self.engines)


def _error_detail(r: httpx.Response) -> str:
    """The OpenAI-style error message when the body has one, else the body text (truncated)."""
    try:
        body = r.json()
        message = body["error"]["message"] if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    except ValueError:
        message = None
    return str(message if message is not None else r.text)[:BODY_LIMIT]


def _apply_one(client: httpx.Client, url: str, changes: dict[str, int], token: str) -> EngineActuation:
    try:
        r = client.put(f"{url}{contract.ADMIN_KNOBS_PATH}", json=changes,
                       headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        return EngineActuation(url, EngineStatus.UNREACHABLE, None, type(e).__name__)
    if r.status_code != 200:
        return EngineActuation(url, EngineStatus.HTTP_ERROR, r.status_code, _error_detail(r))
    seen: dict[str, int] = {}
    why = ""
    for attempt in range(CONFIRM_ATTEMPTS):
        if attempt:
            time.sleep(CONFIRM_PAUSE_S)
        try:
            m = client.get(f"{url}/metrics")
        except httpx.HTTPError as e:
            why = f"/metrics: {type(e).__name__}"
            continue
        if m.status_code != 200:
            why = f"/metrics: HTTP {m.status_code}"
            continue
        try:
            seen = knob_values(parse_metrics(m.text))
        except ValueError:
            why = "/metrics: unparsable"
            continue
        if all(seen.get(k) == v for k, v in changes.items()):
            return EngineActuation(url, EngineStatus.OK, 200, "", seen)
        why = "gauge shows " + ", ".join(f"{k}={seen.get(k)}" for k in changes)
    return EngineActuation(url, EngineStatus.UNCONFIRMED, 200, why, seen)


def apply_knobs(urls: list[str], changes: dict[str, int], token: str, timeout_s: float = 10.0) -> ActuationResult:
    """PUT `changes` to /admin/knobs of every engine (bearer `token`), then confirm each engine's
    `governor_knob` gauge. Raises `ValueError` for an unknown knob name, a non-integer or a value below a
    knob's floor (`governor.contract.KnobsUpdate`); values above an engine's cap come back as its 422.
    """
    body = contract.KnobsUpdate.model_validate(changes).changes()
    if not body:
        raise ValueError("no knob change given")
    bases = [u.rstrip("/") for u in urls]
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(max_workers=max(1, min(16, len(bases)))) as pool:
        engines = tuple(pool.map(lambda u: _apply_one(client, u, body, token), bases))
    result = ActuationResult(body, engines)
    log.log(logging.INFO if result.applied else logging.WARNING, "knobs %s: %s", body, result.summary())
    return result
