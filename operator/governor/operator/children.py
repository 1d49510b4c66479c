"""The operator's writes to the children of an InferenceService: create what is missing, patch what drifted,
delete what is no longer wanted, always by name and only what the service controls (a controller
ownerReference with its uid). Objects of the same name that the service does not control are never adopted or
changed (`NameConflict`). The admin-token Secret is created once and never rewritten; Secrets are reached by
name only (the operator may not list them).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from governor.operator.render import (
    LABEL_REVISION,
    LABEL_SERVICE,
    PORT,
    admin_secret,
    admin_secret_name,
    config_map_name,
    deployment_name,
    role_services,
    synced_knobs,
)
from governor.operator.traffic import ROUTE_API, role_service_name, routed_rules, unrouted_rules


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


class Ops(NamedTuple):
    """read(name, ns), create(ns, body), patch(name, ns, body) and delete(name, ns) of one child kind."""

    read: Callable[..., Any]
    create: Callable[..., Any]
    patch: Callable[..., Any]
    delete: Callable[..., Any]


def _ops(kind: str) -> Ops:
    """The namespaced API calls of a child kind."""
    core, apps = client.CoreV1Api(), client.AppsV1Api()
    if kind == "PodDisruptionBudget":
        policy = client.PolicyV1Api()
        return Ops(policy.read_namespaced_pod_disruption_budget, policy.create_namespaced_pod_disruption_budget,
                   policy.patch_namespaced_pod_disruption_budget, policy.delete_namespaced_pod_disruption_budget)
    if kind == "Deployment":
        return Ops(apps.read_namespaced_deployment, apps.create_namespaced_deployment,
                   apps.patch_namespaced_deployment, apps.delete_namespaced_deployment)
    if kind == "Service":
        return Ops(core.read_namespaced_service, core.create_namespaced_service, core.patch_namespaced_service,
                   core.delete_namespaced_service)
    if kind == "ConfigMap":
        return Ops(core.read_namespaced_config_map, core.create_namespaced_config_map,
                   core.patch_namespaced_config_map, core.delete_namespaced_config_map)
    if kind == "Secret":
        return Ops(core.read_namespaced_secret, core.create_namespaced_secret, core.patch_namespaced_secret,
                   core.delete_namespaced_secret)
    if kind == "PodMonitor":
        custom = client.CustomObjectsApi()
        group, version, plural = "monitoring.coreos.com", "v1", "podmonitors"
        return Ops(lambda name, ns: custom.get_namespaced_custom_object(group, version, ns, plural, name),
                   lambda ns, body: custom.create_namespaced_custom_object(group, version, ns, plural, body),
                   lambda name, ns, body: custom.patch_namespaced_custom_object(group, version, ns, plural, name,
                                                                                body),
                   lambda name, ns: custom.delete_namespaced_custom_object(group, version, ns, plural, name))
    raise ValueError(f"no API for child kind {kind!r}")


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    return dict(client.ApiClient().sanitize_for_serialization(obj))


class NameConflict(Exception):
    """A child's name is taken by an object the InferenceService does not control; the message says which."""


def _controller(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)


def check_controller(kind: str, existing: Mapping[str, Any], desired_meta: Mapping[str, Any], *,
                     uncontrolled_ok: bool = False) -> None:
    """Raise NameConflict unless `existing` is controlled by the owner `desired_meta` names (by uid), or has no
    controller at all and `uncontrolled_ok`. Objects are never adopted: not another service's, not (unless
    `uncontrolled_ok`) one a user created by hand."""
    want = _controller(desired_meta)
    have = _controller(existing.get("metadata") or {})
    if want is None or (have is None and uncontrolled_ok) or (have is not None and have.get("uid") == want.get("uid")):
        return
    by = f"{have.get('kind')}/{have.get('name')}" if have is not None else "no controller (made outside Governor)"
    raise NameConflict(f"{kind}/{desired_meta['name']} already exists and is controlled by {by}; it is left as it "
                       f"is. Rename this InferenceService or remove that {kind}.")


def apply_child(desired: dict[str, Any]) -> str | None:
    """Create `desired` if missing, patch it if it drifted from what was rendered; None when untouched.
    NameConflict when an object of that name exists that `desired`'s controller does not control."""
    kind, meta = desired["kind"], desired["metadata"]
    read, create, patch, _ = _ops(kind)
    try:
        existing = _as_dict(read(meta["name"], meta["namespace"]))
    except ApiException as e:
        if e.status != 404:
            raise
        create(meta["namespace"], desired)
        return f"created {kind}/{meta['name']}"
    check_controller(kind, existing, meta)
    wanted = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    if contains(existing, wanted):
        return None
    patch(meta["name"], meta["namespace"], wanted)
    return f"updated {kind}/{meta['name']}"


def ensure_admin_secret(name: str, namespace: str, uid: str) -> str | None:
    """Create the admin token Secret once (random token); an existing one is never read out or rewritten. One
    that exists without a controller (made beforehand by the user) is used as the token; one controlled by
    another object is a NameConflict."""
    body = admin_secret(name, namespace, uid, secrets.token_urlsafe(32))
    read, create, _, _ = _ops("Secret")
    try:
        existing = _as_dict(read(body["metadata"]["name"], namespace))
    except ApiException as e:
        if e.status != 404:
            raise
    else:
        # One made beforehand without a controller is the user's own token (used as it is); another service's
        # is not this one's.
        check_controller("Secret", existing, body["metadata"], uncontrolled_ok=True)
        return None
    create(namespace, body)
    return f"created Secret/{body['metadata']['name']}"


def owned_children(lister: Callable[..., Any], namespace: str, name: str) -> list[dict[str, Any]]:
    """The objects `lister` returns for service `name`'s label, checked again here before anyone acts on them
    (a selector an API stand-in ignores must not make the operator delete another service's children)."""
    items = lister(namespace, label_selector=f"{LABEL_SERVICE}={name}").items
    return [d for item in items if ((d := _as_dict(item))["metadata"].get("labels") or {}).get(LABEL_SERVICE) == name]


def _delete(deleter: Callable[..., Any], child: str, namespace: str) -> bool:
    try:
        deleter(child, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        return False
    return True


def prune_revisions(name: str, namespace: str, keep: set[str]) -> list[str]:
    """Delete this service's Deployments and ConfigMaps of revisions not in `keep` (a replaced stable, a
    rolled-back or superseded canary)."""
    core, apps = client.CoreV1Api(), client.AppsV1Api()
    removed = []
    listers = (("Deployment", apps.list_namespaced_deployment), ("ConfigMap", core.list_namespaced_config_map))
    for kind, lister in listers:
        for child in owned_children(lister, namespace, name):
            meta = child["metadata"]
            revision = (meta.get("labels") or {}).get(LABEL_REVISION)
            if revision is not None and revision not in keep and _delete(_ops(kind).delete, meta["name"], namespace):
                removed.append(f"deleted {kind}/{meta['name']} (revision {revision})")
    return removed


def revision_deployments(name: str, namespace: str) -> dict[str, dict[str, Any]]:
    """This service's Deployments by revision label."""
    out = {}
    for d in owned_children(client.AppsV1Api().list_namespaced_deployment, namespace, name):
        revision = (d["metadata"].get("labels") or {}).get(LABEL_REVISION)
        if revision:
            out[revision] = d
    return out


def keep_stable(name: str, namespace: str, revision: str, replicas: int, status: Mapping[str, Any]) -> list[str]:
    """Hold the stable Deployment of `revision` (not the spec's) at `replicas` pods without re-rendering its
    template, and keep its ConfigMap's starting knobs on the tuned values."""
    writes = []
    apps, core = client.AppsV1Api(), client.CoreV1Api()
    dep = _as_dict(apps.read_namespaced_deployment(deployment_name(name, revision), namespace))
    if (dep.get("spec") or {}).get("replicas") != replicas:
        apps.patch_namespaced_deployment(dep["metadata"]["name"], namespace, {"spec": {"replicas": replicas}})
        writes.append(f"scaled Deployment/{dep['metadata']['name']} to {replicas}")
    try:
        cm = _as_dict(core.read_namespaced_config_map(config_map_name(name, revision), namespace))
    except ApiException as e:
        if e.status != 404:
            raise
        return writes
    data = synced_knobs(cm, status)
    if data is not None:
        core.patch_namespaced_config_map(cm["metadata"]["name"], namespace, {"data": data})
        writes.append(f"updated ConfigMap/{cm['metadata']['name']} (tuned knobs)")
    return writes


def delete_children(name: str, namespace: str, uid: str) -> list[str]:
    """Delete every child labelled for service `name`, and its admin-token Secret and PodDisruptionBudget by name
    (the operator may not list Secrets). The API server's garbage collector would do it through the
    ownerReferences; doing it explicitly makes deletion independent of the collector's pace."""
    removed: list[str] = []
    core, apps = client.CoreV1Api(), client.AppsV1Api()
    for kind, lister in (("Deployment", apps.list_namespaced_deployment), ("Service", core.list_namespaced_service),
                         ("ConfigMap", core.list_namespaced_config_map)):
        for child in owned_children(lister, namespace, name):
            if _delete(_ops(kind).delete, child["metadata"]["name"], namespace):
                removed.append(f"deleted {kind}/{child['metadata']['name']}")
    for kind, by_name in (("Secret", admin_secret_name(name)), ("PodDisruptionBudget", name)):
        if delete_controlled(kind, by_name, namespace, uid):
            removed.append(f"deleted {kind}/{by_name}")
    return removed


def delete_controlled(kind: str, child: str, namespace: str, owner_uid: str) -> bool:
    """Delete `kind`/`child` if it exists and the InferenceService of uid `owner_uid` controls it; True when
    deleted. One made outside Governor (e.g. an admin-token Secret the user created) or another's is left alone."""
    ops = _ops(kind)
    try:
        existing = _as_dict(ops.read(child, namespace))
    except ApiException as e:
        if e.status != 404:
            raise
        return False
    controller = _controller(existing.get("metadata") or {})
    if controller is None or controller.get("uid") != owner_uid:
        return False
    return _delete(ops.delete, child, namespace)


def _routes() -> tuple[Callable[..., Any], Callable[..., Any]]:
    custom = client.CustomObjectsApi()
    group, version, plural = ROUTE_API
    return (lambda ns, route: custom.get_namespaced_custom_object(group, version, ns, plural, route),
            lambda ns, route, body: custom.patch_namespaced_custom_object(group, version, ns, plural, route, body))


def read_route(namespace: str, route_name: str, name: str) -> tuple[dict[str, Any] | None, str | None]:
    """The HTTPRoute `route_name`, and what makes it unusable for service `name` (None when usable)."""
    get, _ = _routes()
    try:
        route = _as_dict(get(namespace, route_name))
    except ApiException as e:
        if e.status == 404:
            return None, f"HTTPRoute {route_name} not found in namespace {namespace}"
        raise
    if routed_rules(route, name, PORT, 0) is None:
        return route, f"HTTPRoute {route_name} has no rule with a backendRef to Service {name}"
    return route, None


def route_traffic(name: str, namespace: str, uid: str, route_name: str, route: Mapping[str, Any] | None,
                  stable: str, canary: str, canary_weight: int) -> list[str]:
    """Point `<name>-stable` and `<name>-canary` at their revisions and set the route's weights."""
    writes = [w for obj in role_services(name, namespace, uid, stable, canary) if (w := apply_child(obj))]
    rules = routed_rules(route, name, PORT, canary_weight) if route is not None else None
    if route is not None and rules is not None and rules != (route.get("spec") or {}).get("rules"):
        _, patch = _routes()
        # resourceVersion: a concurrent edit of the route (by its owner) makes this patch fail and retry.
        patch(namespace, route_name, {"metadata": {"resourceVersion": route["metadata"].get("resourceVersion")},
                                      "spec": {"rules": rules}})
        writes.append(f"weighted HTTPRoute/{route_name} {100 - canary_weight}/{canary_weight} "
                      f"({stable}/{canary})")
    return writes


def unroute_traffic(name: str, namespace: str, route_name: str) -> list[str]:
    """spec.rollout.httpRoute was removed: point the route's rules back at Service `name` and delete the role
    Services."""
    writes = []
    get, patch = _routes()
    try:
        route = _as_dict(get(namespace, route_name))
        rules = unrouted_rules(route, name, PORT)
        if rules is not None:
            patch(namespace, route_name, {"spec": {"rules": rules}})
            writes.append(f"pointed HTTPRoute/{route_name} back at Service/{name}")
    except ApiException as e:
        if e.status != 404:
            raise
    core = client.CoreV1Api()
    for role in ("stable", "canary"):
        try:
            core.delete_namespaced_service(role_service_name(name, role), namespace)
            writes.append(f"deleted Service/{role_service_name(name, role)}")
        except ApiException as e:
            if e.status != 404:
                raise
    return writes
