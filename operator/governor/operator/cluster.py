"""The cluster as reconcile sees it: get, list, create, patch and delete of a service's children, by kind.

`ClusterApi` is what `reconcile` and the child functions are given; `KubernetesApi` is the real one, built at the
edge (the kopf handlers) from the kubernetes client's configuration, and tests pass a stand-in over plain dicts.
Objects go in and come out as JSON dicts. A missing object is `None` from `get` and `False` from `delete`; every
other failure is the client's `ApiException`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from governor.operator.traffic import ROUTE_API


class ClusterApi(Protocol):
    """Namespaced calls on one kind of object (Deployment, Service, ConfigMap, Secret, PodDisruptionBudget,
    PodMonitor, HTTPRoute)."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none of that name."""

    def list_labelled(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The objects the selector matches (a stand-in may ignore the selector: callers check labels again)."""

    def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> None: ...

    def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """A merge patch of the object."""

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """True when deleted, False when there was none of that name."""


class _Ops(NamedTuple):
    get: Callable[..., Any]  # (name, namespace)
    list: Callable[..., Any]  # (namespace, label_selector=...)
    create: Callable[..., Any]  # (namespace, body)
    patch: Callable[..., Any]  # (name, namespace, body)
    delete: Callable[..., Any]  # (name, namespace)


def _custom(group: str, version: str, plural: str) -> _Ops:
    api = client.CustomObjectsApi()
    return _Ops(lambda name, ns: api.get_namespaced_custom_object(group, version, ns, plural, name),
                lambda ns, label_selector: api.list_namespaced_custom_object(group, version, ns, plural,
                                                                             label_selector=label_selector),
                lambda ns, body: api.create_namespaced_custom_object(group, version, ns, plural, body),
                lambda name, ns, body: api.patch_namespaced_custom_object(group, version, ns, plural, name, body),
                lambda name, ns: api.delete_namespaced_custom_object(group, version, ns, plural, name))


def _ops(kind: str) -> _Ops:
    """The kubernetes client's calls for `kind`."""
    if kind == "Deployment":
        apps = client.AppsV1Api()
        return _Ops(apps.read_namespaced_deployment, apps.list_namespaced_deployment,
                    apps.create_namespaced_deployment, apps.patch_namespaced_deployment,
                    apps.delete_namespaced_deployment)
    if kind == "PodDisruptionBudget":
        policy = client.PolicyV1Api()
        return _Ops(policy.read_namespaced_pod_disruption_budget, policy.list_namespaced_pod_disruption_budget,
                    policy.create_namespaced_pod_disruption_budget, policy.patch_namespaced_pod_disruption_budget,
                    policy.delete_namespaced_pod_disruption_budget)
    core = client.CoreV1Api()
    if kind == "Service":
        return _Ops(core.read_namespaced_service, core.list_namespaced_service, core.create_namespaced_service,
                    core.patch_namespaced_service, core.delete_namespaced_service)
    if kind == "ConfigMap":
        return _Ops(core.read_namespaced_config_map, core.list_namespaced_config_map,
                    core.create_namespaced_config_map, core.patch_namespaced_config_map,
                    core.delete_namespaced_config_map)
    if kind == "Secret":
        return _Ops(core.read_namespaced_secret, core.list_namespaced_secret, core.create_namespaced_secret,
                    core.patch_namespaced_secret, core.delete_namespaced_secret)
    if kind == "PodMonitor":
        return _custom("monitoring.coreos.com", "v1", "podmonitors")
    if kind == "HTTPRoute":
        return _custom(*ROUTE_API)
    raise ValueError(f"no API for child kind {kind!r}")


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    return dict(client.ApiClient().sanitize_for_serialization(obj))


class KubernetesApi:
    """`ClusterApi` through the kubernetes client (configured beforehand: in-cluster or a kubeconfig)."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _as_dict(_ops(kind).get(name, namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_labelled(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        found = _as_dict(_ops(kind).list(namespace, label_selector=label_selector))
        return [_as_dict(item) for item in found.get("items") or []]

    def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> None:
        _ops(kind).create(namespace, body)

    def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        _ops(kind).patch(name, namespace, body)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            _ops(kind).delete(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True
