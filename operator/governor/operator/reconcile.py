"""Level-based reconcile of one InferenceService: parse → observe → plan → apply → report.

`reconcile` is called by every kopf handler (create, update, resume, and a periodic timer that
corrects drift), with the cluster given as a `cluster.ClusterApi`. It reads what the pass needs into a
`Snapshot` (`observe`), decides from data alone (`reconcile_plan.plan_reconcile`), carries out the writes in
order (`children.execute`) and reports status and Events (`reconcile_status.report`).

It is idempotent: a child whose fields already contain what was rendered is not written (`contains`), so
re-running it with nothing changed makes no writes. An invalid spec reads and creates nothing and is reported
as Ready=False, reason InvalidSpec, with a message naming the field. The admin token Secret is created once with
a random token and never rendered, logged or rewritten. A child whose name is taken by an object this service
does not control (another service's, or one a user made) is never adopted or changed: the pass stops and
reports Ready=False, reason NameConflict, naming the object. A child the API server refuses stops the pass the
same way, as ChildRejected with the server's message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from governor.operator.analysis import Judgement, Query, judge, no_prometheus
from governor.operator.api import InferenceServiceSpec
from governor.operator.children import NameConflict, by_revision, execute, owned_children
from governor.operator.cluster import ClusterApi
from governor.operator.reconcile_plan import Snapshot, plan_reconcile
from governor.operator.reconcile_status import ReconcileResult, failed, report
from governor.operator.render import admin_secret_name, disruption_budget
from governor.operator.rollout import ACTION_ANNOTATION
from governor.operator.validation import parse_spec


def observe(api: ClusterApi, name: str, namespace: str, uid: str, spec: InferenceServiceSpec,
            status: Mapping[str, Any]) -> Snapshot:
    """Read what a pass over `spec` decides from: the admin-token Secret, the service's Deployments and
    ConfigMaps, the HTTPRoute it weights (or the one it weighted before), and its PodDisruptionBudget when the
    spec renders none."""
    old_route = (status.get("trafficRouting") or {}).get("httpRoute")
    return Snapshot(
        admin_secret=api.get("Secret", namespace, admin_secret_name(name)),
        deployments=tuple(owned_children(api, "Deployment", namespace, name)),
        config_maps=tuple(owned_children(api, "ConfigMap", namespace, name)),
        route=api.get("HTTPRoute", namespace, spec.rollout.http_route) if spec.rollout.http_route else None,
        old_route=api.get("HTTPRoute", namespace, str(old_route)) if old_route and not spec.rollout.http_route
        else None,
        disruption_budget=api.get("PodDisruptionBudget", namespace, name)
        if disruption_budget(name, namespace, uid, spec) is None else None)


def reconcile(api: ClusterApi, name: str, namespace: str, uid: str, generation: int, raw_spec: Any,
              status: Mapping[str, Any], annotations: Mapping[str, Any] | None = None, *, pod_monitor: bool,
              query: Query = no_prometheus, scrape_interval_s: float = 0.0,
              now: float | None = None) -> ReconcileResult:
    """One level-based pass over an InferenceService: children, rollout, status and Events.

    `query` answers the rollout's PromQL (`analysis.PrometheusQuery`, or `no_prometheus`), whose scrape interval
    is `scrape_interval_s` (trigger windows span at least two scrapes); `annotations` may hold a rollout
    action, which the caller removes when `ReconcileResult.consumed_action` is set. A NameConflict stops the pass
    (children applied before it stay) and is reported in status; the rest of the status is kept as it was, and
    a rollout action is left for the pass that can act on it. A child the API server refuses (400, 422) is
    reported the same way, as ChildRejected with the server's message."""
    now_s = time.time() if now is None else now
    annotations = annotations or {}
    parsed = parse_spec(raw_spec)
    if not isinstance(parsed, InferenceServiceSpec):
        message = "; ".join(f"{e.path}: {e.message}" for e in parsed)[:1000]
        return failed(status, generation, now_s, "InvalidSpec", message, "nothing is created from an invalid spec",
                      consumed_action=annotations.get(ACTION_ANNOTATION) is not None)
    spec = parsed

    def judge_canary(stable: str, canary: str) -> Judgement:
        return judge(spec.rollout.rollback_on, query, spec.model.served_name or name, stable, canary,
                     namespace=namespace, scrape_interval_s=scrape_interval_s)

    try:
        snapshot = observe(api, name, namespace, uid, spec, status)
        plan = plan_reconcile(name, namespace, uid, generation, spec, status, annotations, snapshot, now=now_s,
                              pod_monitor=pod_monitor, judge_canary=judge_canary)
        written = execute(api, plan.writes)
    except NameConflict as e:
        return failed(status, generation, now_s, "NameConflict", str(e), "waiting for the name conflict to be "
                      "resolved", keep=status)
    except ApiException as e:
        if e.status not in (400, 422):
            raise  # a transient failure: kopf retries the pass
        # The API server refused a child the spec rendered (a value no schema or rule here caught): retrying
        # cannot help until the spec changes, so say so in status instead of failing the pass for ever.
        return failed(status, generation, now_s, "ChildRejected",
                      f"the API server refused a child of this service: {_server_message(e)}",
                      "waiting for a spec whose children the API server accepts", keep=status)
    # Writes may have replaced the stable Deployment: report its pods as they are now.
    deployments = by_revision(owned_children(api, "Deployment", namespace, name)) if written \
        else by_revision(snapshot.deployments)
    return report(plan, name, generation, spec, status, deployments.get(plan.stable), written, now_s)


def _server_message(e: ApiException) -> str:
    """The message of the API server's Status in an error response, else its reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:1000]
    except (ValueError, AttributeError):
        return str(e.reason)
