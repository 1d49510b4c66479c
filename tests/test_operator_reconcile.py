"""One reconcile pass through an injected cluster: a child the API server refuses is reported in status, never a
pass failing for ever; an invalid spec touches nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from governor.operator.reconcile import reconcile

SPEC = {"model": {"uri": "/models/chat"}, "engine": {"image": "ghcr.io/example/governor-engine:1"},
        "slo": {"ttftP95": "500ms", "itlP95": "50ms"}}


def _with_body(status: int, message: str) -> ApiException:
    e = ApiException(status=status, reason="Unprocessable Entity")
    e.body = json.dumps({"kind": "Status", "code": status, "message": message})
    return e


class RefusingCluster:
    """An empty namespace but for the user's admin-token Secret, whose API server refuses every Deployment with
    `code` (and records every call)."""

    def __init__(self, code: int = 422) -> None:
        self.code = code
        self.calls: list[tuple[str, str]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind))
        return {"metadata": {"name": name, "namespace": namespace}} if kind == "Secret" else None

    def list_labelled(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list", kind))
        return []

    def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> None:
        self.calls.append(("create", kind))
        if kind == "Deployment":
            raise _with_body(self.code, f'Deployment.apps "{body["metadata"]["name"]}" is invalid: '
                                        "spec.template.spec.affinity: Invalid value")

    def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self.calls.append(("patch", kind))

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.calls.append(("delete", kind))
        return False


def test_a_child_the_api_server_refuses_is_reported_as_child_rejected() -> None:
    result = reconcile(RefusingCluster(422), "chat", "llm", "uid-1", 4, SPEC, {}, pod_monitor=False,
                       now=1_700_000_000)
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert (result.status["phase"], ready["status"], ready["reason"]) == ("Failed", "False", "ChildRejected")
    assert "the API server refused a child of this service: Deployment.apps" in ready["message"]
    assert "spec.template.spec.affinity: Invalid value" in ready["message"]
    assert [(reason, kind) for reason, _, kind in result.events] == [("ChildRejected", "Warning")]


def test_a_transient_api_error_fails_the_pass_for_kopf_to_retry() -> None:
    with pytest.raises(ApiException):
        reconcile(RefusingCluster(503), "chat", "llm", "uid-1", 4, SPEC, {}, pod_monitor=False, now=1_700_000_000)


def test_an_invalid_spec_is_reported_without_reading_or_writing_the_cluster() -> None:
    cluster = RefusingCluster()
    result = reconcile(cluster, "chat", "llm", "uid-1", 4, {**SPEC, "replicas": -1}, {},
                       {"governor.dev/rollout-action": "pause"}, pod_monitor=False, now=1_700_000_000)
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert (result.status["phase"], ready["reason"]) == ("Failed", "InvalidSpec")
    assert ready["message"].startswith("spec.replicas")
    assert [(reason, kind) for reason, _, kind in result.events] == [("InvalidSpec", "Warning")]
    assert result.consumed_action  # an action on an invalid spec is dropped with it
    assert cluster.calls == []
