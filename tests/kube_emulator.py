"""KMock's Kubernetes emulator on 127.0.0.1 in a background thread, for the operator tests.

The emulator stores objects as given; `Emulator` assigns the fields a real API server would (uid,
resourceVersion, creationTimestamp, a name from generateName, and generation bumped on spec changes),
because kopf and the kubernetes client rely on them. It does no garbage collection and no strategic merge
(see TESTING.md).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition",
                                                          "singular": "customresourcedefinition",
                                                          "namespaced": False},
    "monitoring.coreos.com/v1/podmonitors": {"kind": "PodMonitor", "singular": "podmonitor", "namespaced": True},
    "gateway.networking.k8s.io/v1/httproutes": {"kind": "HTTPRoute", "singular": "httproute", "namespaced": True},
    # The CRD declares the status subresource; discovery says so, and kopf then writes status through it.
    "governor.dev/v1alpha1/inferenceservices": {"kind": "InferenceService", "singular": "inferenceservice",
                                                "namespaced": True, "subresources": ["status"]},
}


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """Assigns uid, resourceVersion, creationTimestamp and generation like the API server."""

    _rv = itertools.count(1)

    async def _handle(self, request: Any) -> Any:
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


@contextmanager
def start_emulator(tmp: Path) -> Iterator[Cluster]:
    """Serve the emulator on a free 127.0.0.1 port from a thread; yields its URL and a kubeconfig for it."""
    started = threading.Event()
    stop: list[asyncio.Event] = []
    loop_box: list[asyncio.AbstractEventLoop] = []
    url: list[str] = []

    async def serve() -> None:
        emulator = Emulator()
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
users: [{{name: test, user: {{token: test}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: test}}}}]
current-context: kmock
""")
    try:
        yield Cluster(url[0], kubeconfig)
    finally:
        loop_box[0].call_soon_threadsafe(stop[0].set)
        thread.join(timeout=10)
