"""Level-based reconcile of one InferenceService: parse → render → apply children → report status.

`reconcile` is called by every kopf handler (create, update, resume, and a periodic timer that
corrects drift). It is idempotent: a child whose fields already contain what was rendered is not
written (`contains`), so re-running it with nothing changed makes no writes. An invalid spec creates
nothing and is reported as Ready=False, reason InvalidSpec, with a message naming the field. The admin
token Secret is created once with a random token and never rendered, logged or rewritten.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from governor.operator.api import InferenceServiceSpec, parse_spec
from governor.operator.render import LABEL_REVISION, LABEL_SERVICE, admin_secret, render, revision_hash

log = logging.getLogger(__name__)

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Tuning")


def contains(existing: Any, desired: Any) -> bool:
    """True when `existing` already holds everything in `desired`: dicts by key (extra keys in `existing`
    are server defaults and ignored), lists element by element with equal length, scalars by equality."""
    if isinstance(desired, Mapping):
        return isinstance(existing, Mapping) and all(k in existing and contains(existing[k], v)
                                                     for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(existing, list) and len(existing) == len(desired)
                and all(contains(e, d) for e, d in zip(existing, desired, strict=True)))
    return bool(existing == desired)


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  generation: int, now: str) -> list[dict[str, Any]]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status changes."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") \
        else now
    new = {"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since, "observedGeneration": generation}
    return [c for c in conditions if c.get("type") != type_] + [new]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Outcome:
    """What a reconcile did: the status patch, and Events (reason, message, type) to emit."""

    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)  # "created Deployment/x", "updated Service/y"


# kind → (read, create, patch) on the namespaced typed APIs.
Ops = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


def _ops(kind: str) -> Ops:
    core, apps = client.CoreV1Api(), client.AppsV1Api()
    if kind == "Deployment":
        return apps.read_namespaced_deployment, apps.create_namespaced_deployment, apps.patch_namespaced_deployment
    if kind == "Service":
        return core.read_namespaced_service, core.create_namespaced_service, core.patch_namespaced_service
    if kind == "ConfigMap":
        return core.read_namespaced_config_map, core.create_namespaced_config_map, core.patch_namespaced_config_map
    if kind == "Secret":
        return core.read_namespaced_secret, core.create_namespaced_secret, core.patch_namespaced_secret
    if kind == "PodMonitor":
        custom = client.CustomObjectsApi()
        group, version, plural = "monitoring.coreos.com", "v1", "podmonitors"
        return (lambda name, ns: custom.get_namespaced_custom_object(group, version, ns, plural, name),
                lambda ns, body: custom.create_namespaced_custom_object(group, version, ns, plural, body),
                lambda name, ns, body: custom.patch_namespaced_custom_object(group, version, ns, plural, name, body))
    raise ValueError(f"no API for child kind {kind!r}")


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    return dict(client.ApiClient().sanitize_for_serialization(obj))


def apply_child(desired: dict[str, Any]) -> str | None:
    """Create `desired` if missing, patch it if it drifted from what was rendered; None when untouched."""
    kind, meta = desired["kind"], desired["metadata"]
    read, create, patch = _ops(kind)
    try:
        existing = _as_dict(read(meta["name"], meta["namespace"]))
    except ApiException as e:
        if e.status != 404:
            raise
        create(meta["namespace"], desired)
        return f"created {kind}/{meta['name']}"
    wanted = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    if contains(existing, wanted):
        return None
    patch(meta["name"], meta["namespace"], wanted)
    return f"updated {kind}/{meta['name']}"


def ensure_admin_secret(name: str, namespace: str, uid: str) -> str | None:
    """Create the admin token Secret once (random token); an existing one is never read out or rewritten."""
    body = admin_secret(name, namespace, uid, secrets.token_urlsafe(32))
    read, create, _ = _ops("Secret")
    try:
        read(body["metadata"]["name"], namespace)
        return None
    except ApiException as e:
        if e.status != 404:
            raise
    create(namespace, body)
    return f"created Secret/{body['metadata']['name']}"


def prune_old_revisions(name: str, namespace: str, revision: str) -> list[str]:
    """Delete this service's Deployments of other revisions: until canary rollouts exist, a new revision
    replaces the old one at once (the Service already routes to the new pods by its service label)."""
    apps = client.AppsV1Api()
    found = apps.list_namespaced_deployment(namespace, label_selector=f"{LABEL_SERVICE}={name}")
    removed = []
    for dep in found.items:
        d = _as_dict(dep)
        labels = d["metadata"].get("labels") or {}
        if labels.get(LABEL_REVISION) != revision:
            apps.delete_namespaced_deployment(d["metadata"]["name"], namespace)
            removed.append(f"deleted Deployment/{d['metadata']['name']} (revision {labels.get(LABEL_REVISION)})")
    return removed


def delete_children(name: str, namespace: str) -> list[str]:
    """Delete every child labelled for service `name`. The API server's garbage collector would do it
    through the ownerReferences; doing it explicitly makes deletion independent of the collector's pace."""
    core, apps = client.CoreV1Api(), client.AppsV1Api()
    selector = f"{LABEL_SERVICE}={name}"
    removed: list[str] = []
    for kind, lister, deleter in (
            ("Deployment", apps.list_namespaced_deployment, apps.delete_namespaced_deployment),
            ("Service", core.list_namespaced_service, core.delete_namespaced_service),
            ("ConfigMap", core.list_namespaced_config_map, core.delete_namespaced_config_map),
            ("Secret", core.list_namespaced_secret, core.delete_namespaced_secret)):
        for item in lister(namespace, label_selector=selector).items:
            child = str(_as_dict(item)["metadata"]["name"])
            try:
                deleter(child, namespace)
                removed.append(f"deleted {kind}/{child}")
            except ApiException as e:
                if e.status != 404:
                    raise
    return removed


def _ready_replicas(name: str, namespace: str) -> tuple[int, int]:
    try:
        dep = _as_dict(client.AppsV1Api().read_namespaced_deployment(name, namespace))
    except ApiException:
        return 0, 0
    st = dep.get("status") or {}
    return int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0)


def reconcile(name: str, namespace: str, uid: str, generation: int, raw_spec: Any, status: Mapping[str, Any],
              *, pod_monitor: bool) -> Outcome:
    """One level-based pass over an InferenceService; returns the status to patch and the Events."""
    now = _now()
    conditions = list(status.get("conditions") or [])
    parsed = parse_spec(raw_spec)
    if not isinstance(parsed, InferenceServiceSpec):
        message = "; ".join(f"{e.path}: {e.message}" for e in parsed)[:1000]
        conditions = set_condition(conditions, "Ready", "False", "InvalidSpec", message, generation, now)
        conditions = set_condition(conditions, "Progressing", "False", "InvalidSpec", "nothing is created from "
                                   "an invalid spec", generation, now)
        old_ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        changed = status.get("phase") != "Failed" or old_ready.get("message") != message
        return Outcome({"observedGeneration": generation, "phase": "Failed", "conditions": conditions},
                       [("InvalidSpec", message, "Warning")] if changed else [])

    spec = parsed
    rev = revision_hash(spec)
    writes = [w for w in [ensure_admin_secret(name, namespace, uid)] if w]
    desired = render(name, namespace, uid, generation, spec, dict(status), pod_monitor=pod_monitor)
    for obj in desired:
        w = apply_child(obj)
        if w:
            writes.append(w)
    writes += prune_old_revisions(name, namespace, rev)
    deployment = next(o["metadata"]["name"] for o in desired if o["kind"] == "Deployment")
    replicas, ready = _ready_replicas(deployment, namespace)
    want = spec.replicas
    if want == 0 or ready >= want:
        phase, ready_status, reason, msg = "Ready", "True", "ReplicasReady", f"{ready}/{want} replicas ready"
    else:
        phase, ready_status, reason, msg = "Progressing", "False", "ReplicasStarting", f"{ready}/{want} replicas ready"
    conditions = set_condition(conditions, "Ready", ready_status, reason, msg, generation, now)
    conditions = set_condition(conditions, "Progressing", "False" if phase == "Ready" else "True",
                               "RevisionAvailable" if phase == "Ready" else "RevisionRolling",
                               f"revision {rev}", generation, now)
    conditions = set_condition(conditions, "Degraded", "False", "AsSpecified", "running the revision the spec names",
                               generation, now)
    if spec.autotune.enabled:
        conditions = set_condition(conditions, "Tuning", "Unknown", "TunerNotRunning",
                                   "autotune is enabled; the tuner inside the operator is not implemented yet",
                                   generation, now)
    else:
        conditions = set_condition(conditions, "Tuning", "False", "AutotuneDisabled", "spec.autotune.enabled is false",
                                   generation, now)
    events = [("Reconciled", ", ".join(writes), "Normal")] if writes else []
    if status.get("phase") != phase:
        events.append((phase, msg, "Normal"))
    return Outcome({"observedGeneration": generation, "phase": phase, "revision": rev, "replicas": replicas,
                    "readyReplicas": ready, "conditions": conditions}, events, writes)
