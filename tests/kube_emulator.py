"""KMock's Kubernetes emulator on 127.0.0.1 in a background thread, for the operator tests.

The emulator stores objects as given; `Emulator` assigns the fields a real API server would (uid,
resourceVersion, creationTimestamp, a name from generateName, and generation bumped on spec changes),
because kopf and the kubernetes client rely on them. It does no garbage collection and no strategic merge
(see TESTING.md).

RBAC: with `Grants`, requests bearing the operator's token (`OPERATOR_TOKEN`, the one the kubeconfig carries)
are authorized like the API server's RBAC authorizer does for resource requests: a rule matches by API group,
resource (`plural` or `plural/subresource`) and verb (get, list, watch, create, patch, update, delete); a Role's
rules only in its namespace, a ClusterRole's everywhere. Anything else is 403 and recorded in `Grants.denied`.
Requests without that token (the tests' own) are an administrator's. Discovery is open to all, as in a cluster.

Subresources: a PATCH of `.../<name>/status` is a JSON merge patch of the whole stored object (the emulator
does not confine it to `status`, nor drop `status` from a patch of the object itself, as an API server
does); `subresources` in `RESOURCES` only puts `<plural>/status` into discovery. List requests ignore
`labelSelector`: callers filter by labels themselves. There is no kubelet: Pods are stored as given.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attrs
import kmock
from kmock._internal import enums

VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "singular": "namespace", "namespaced": False},
    "v1/configmaps": {"kind": "ConfigMap", "singular": "configmap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "singular": "secret", "namespaced": True},
    "v1/services": {"kind": "Service", "singular": "service", "namespaced": True},
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True},
    "v1/pods": {"kind": "Pod", "singular": "pod", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "singular": "deployment", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "singular": "poddisruptionbudget",
                                       "namespaced": True},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition",
                                                          "singular": "customresourcedefinition",
                                                          "namespaced": False},
    "monitoring.coreos.com/v1/podmonitors": {"kind": "PodMonitor", "singular": "podmonitor", "namespaced": True},
    "gateway.networking.k8s.io/v1/httproutes": {"kind": "HTTPRoute", "singular": "httproute", "namespaced": True},
    # The CRD declares the status subresource; discovery says so, and kopf then writes status through it.
    "governor.dev/v1alpha1/inferenceservices": {"kind": "InferenceService", "singular": "inferenceservice",
                                                "namespaced": True, "subresources": ["status", "scale"]},
}
OPERATOR_TOKEN = "operator"

_VERBS = {enums.action.FETCH: "get", enums.action.LIST: "list", enums.action.WATCH: "watch",
          enums.action.CREATE: "create", enums.action.DELETE: "delete"}


@dataclass
class Grants:
    """What the operator's token may do: (namespace, rules) per binding, namespace None for a ClusterRole bound
    cluster-wide. `denied` collects every refused request as "verb group/resource in namespace"."""

    bindings: list[tuple[str | None, list[dict[str, Any]]]]
    denied: list[str] = field(default_factory=list)

    def allows(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        for scope, rules in self.bindings:
            if scope is not None and scope != namespace:
                continue
            if any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules):
                return True
        return False


@attrs.frozen
class Forbidden(kmock.KubernetesError):  # type: ignore[misc]
    status: int = 403
    reason: str = "Forbidden"


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """Assigns uid, resourceVersion, creationTimestamp and generation like the API server."""

    _rv = itertools.count(1)
    grants: Grants | None = None

    def _authorize(self, request: Any) -> None:
        bearer = str((request.headers or {}).get("Authorization", ""))
        if self.grants is None or request.resource is None or bearer != f"Bearer {OPERATOR_TOKEN}":
            return
        if not request.resource.plural:  # discovery of a group or version
            return
        action = request.action
        verb = _VERBS.get(action) or ("update" if str(request.method).upper().endswith("PUT") else "patch")
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        group = request.resource.group or ""
        if not self.grants.allows(verb, group, resource, request.namespace):
            where = f"namespace {request.namespace}" if request.namespace else "the cluster scope"
            denial = f"{verb} {group or 'core'}/{resource} in {where}"
            self.grants.denied.append(denial)
            raise Forbidden(message=f"the operator's service account cannot {denial}")

    async def _handle(self, request: Any) -> Any:
        self._authorize(request)
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None:
            meta = data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):  # kopf's Events, for one
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp",
                                datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta["resourceVersion"] = str(next(self._rv))
            elif request.action == enums.action.UPDATE:
                meta["resourceVersion"] = str(next(self._rv))
                if "spec" in data and request.subresource is None:
                    key = (request.resource, request.namespace, request.name)
                    if key in self._objects and not self._objects[key].deleted:
                        current = self._objects[key].raw.get("metadata", {}).get("generation", 1)
                        meta["generation"] = int(current) + 1
        return await super()._handle(request)


@dataclass
class Cluster:
    url: str
    kubeconfig: Path
    grants: Grants | None = None

    def assert_nothing_denied(self) -> None:
        """Every request the operator made was within its grants."""
        assert self.grants is None or not self.grants.denied, f"the operator was refused: {self.grants.denied}"


@contextmanager
def start_emulator(tmp: Path, grants: Grants | None = None) -> Iterator[Cluster]:
    """Serve the emulator on a free 127.0.0.1 port from a thread; yields its URL and a kubeconfig for it, whose
    token is the operator's: with `grants`, its requests get only what they allow."""
    started = threading.Event()
    stop: list[asyncio.Event] = []
    loop_box: list[asyncio.AbstractEventLoop] = []
    url: list[str] = []

    async def serve() -> None:
        emulator = Emulator()
        emulator.grants = grants
        for path, info in RESOURCES.items():
            emulator.resources[path] = {**info, "verbs": VERBS}
        async with emulator, kmock.Server(emulator) as server:
            url.append(str(server.url).rstrip("/"))
            stop.append(asyncio.Event())
            loop_box.append(asyncio.get_running_loop())
            started.set()
            await stop[0].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(30), "the Kubernetes emulator did not start within 30 s"
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: kmock, cluster: {{server: "{url[0]}"}}}}]
users: [{{name: operator, user: {{token: {OPERATOR_TOKEN}}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: operator}}}}]
current-context: kmock
""")
    try:
        yield Cluster(url[0], kubeconfig, grants)
    finally:
        loop_box[0].call_soon_threadsafe(stop[0].set)
        thread.join(timeout=10)
