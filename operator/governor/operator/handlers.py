"""kopf handlers for InferenceService: thin — fetch, call `reconcile` with the real cluster, patch status, post
Events.

Run with `governor operator [kopf run flags, e.g. -A or -n NS]` (standalone: no peering objects).
Create, update and resume all reconcile; a timer reconciles every `GOVERNOR_RECONCILE_INTERVAL_S`
seconds (default 30) so that manual drift in a child is corrected. Exceptions are retried by kopf with
back-off; the operator process never exits on a bad object.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import kopf
import kubernetes

from governor.operator.analysis import PrometheusQuery, Query, no_prometheus
from governor.operator.api import GROUP, PLURAL, VERSION
from governor.operator.children import contains, delete_children
from governor.operator.cluster import KubernetesApi
from governor.operator.reconcile import reconcile
from governor.operator.rollout import ACTION_ANNOTATION
from governor.operator.tuning import DEFAULT_SCRAPE_INTERVAL_S, SCRAPE_INTERVAL_ENV, run_tuner

INTERVAL_S = float(os.environ.get("GOVERNOR_RECONCILE_INTERVAL_S", "30"))
POD_MONITOR = os.environ.get("GOVERNOR_POD_MONITOR", "auto")
PROMETHEUS_URL = os.environ.get("GOVERNOR_PROMETHEUS_URL", "")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = 20  # INFO and up become Events
    # A delete that finds a timer pass in flight (its thread cannot be cancelled) holds the finalizer until
    # kopf sees the timer exit, and kopf looks again only on a new watch event or after this many seconds
    # (default 60: the service lingered a minute after its delete handler had succeeded).
    settings.background.cancellation_polling = 1.0
    # API discovery only: kopf never lists or watches CustomResourceDefinitions or Namespaces, so the operator
    # needs no cluster-wide grant when it serves listed namespaces (the chart then binds namespaced Roles only).
    # The CRD must be installed before the operator starts (Helm installs crds/ first); namespaces given with
    # --namespace are taken as exact names.
    settings.scanning.disabled = True
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def _pod_monitor_available(namespace: str) -> bool:
    """PodMonitors are rendered when their CRD is served (Prometheus Operator installed) and readable."""
    if POD_MONITOR in ("true", "false"):
        return POD_MONITOR == "true"
    try:
        kubernetes.client.CustomObjectsApi().list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "podmonitors", limit=1)
    except kubernetes.client.exceptions.ApiException:
        return False  # 404: no such CRD; 403: not allowed to manage them
    return True


def _query() -> Query:
    return PrometheusQuery(PROMETHEUS_URL) if PROMETHEUS_URL else no_prometheus


def _scrape_interval_s() -> float:
    try:
        return max(0.0, float(os.environ.get(SCRAPE_INTERVAL_ENV, DEFAULT_SCRAPE_INTERVAL_S)))
    except ValueError:
        return DEFAULT_SCRAPE_INTERVAL_S


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def _run(body: kopf.Body, logger: kopf.Logger) -> None:
    """One reconcile, serialized per object: kopf runs the timer beside the create/update handlers, and two
    passes working from different snapshots could undo each other's rollout step. Inside the lock the object
    is read afresh, and its status (and a consumed rollout action) written before the lock is released."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    api = kubernetes.client.CustomObjectsApi()
    with _lock(meta["uid"]):
        try:
            current = cast("dict[str, Any]", api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
        except kubernetes.client.exceptions.ApiException as e:
            if e.status == 404:
                return  # deleted meanwhile
            raise
        cmeta = current["metadata"]
        if cmeta.get("deletionTimestamp"):
            return  # being deleted: on_delete removes the children; a reconcile now would recreate them
        result = reconcile(KubernetesApi(), name, namespace, cmeta["uid"], int(cmeta.get("generation") or 1),
                           current.get("spec"), current.get("status") or {}, cmeta.get("annotations") or {},
                           pod_monitor=_pod_monitor_available(namespace), query=_query(),
                           scrape_interval_s=_scrape_interval_s())
        if not contains(current.get("status") or {}, result.status):
            # Only a changed status is written: a periodic pass over a settled service makes no write at all (each
            # write is a new resourceVersion, a watch event for every watcher, and a conflict for a concurrent
            # writer that tests the old resourceVersion, as kopf's own patches do).
            api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name,
                                                      {"status": result.status})
        if result.consumed_action:  # one-shot: the rollout's state in status remembers what it did
            api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                               {"metadata": {"annotations": {ACTION_ANNOTATION: None}}})
    for reason, message, type_ in result.events:
        kopf.event(body, type=type_, reason=reason, message=message)
        logger.info("%s: %s", reason, message)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    _run(body, logger)


@kopf.on.update(GROUP, VERSION, PLURAL, annotations={ACTION_ANNOTATION: kopf.PRESENT})
def on_rollout_action(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """pause, resume, abort or promote, asked for with `kubectl annotate ... governor.dev/rollout-action=...`."""
    _run(body, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL_S, initial_delay=INTERVAL_S, idle=None)
def on_timer(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    _run(body, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """Deletes the children under the object's reconcile lock: a reconcile already running (the timer's, which
    kopf runs beside this handler) finishes first, and every later one sees the deletion and does nothing, so
    no child is recreated after this and no status is written to an object on its way out."""
    meta = body["metadata"]
    with _lock(meta["uid"]):
        removed = delete_children(KubernetesApi(), meta["name"], meta["namespace"], meta["uid"])
    logger.info("deleted children: %s", ", ".join(removed) or "none")


def _autotune_enabled(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autotune") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, when=_autotune_enabled, cancellation_timeout=30)
async def tuner_daemon(name: str, namespace: str | None, body: kopf.Body, stopped: kopf.DaemonStopped,
                       logger: kopf.Logger, **_: Any) -> None:
    """The SLO controller of one service, while spec.autotune.enabled (kopf stops it when that turns false or
    the service is deleted). `body` is kopf's live view of the object: each interval sees the current spec and
    status."""
    await run_tuner(name, namespace or "default", body, stopped, logger)
