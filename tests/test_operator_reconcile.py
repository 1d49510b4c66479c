"""One reconcile pass when the API server refuses a child: reported in status, never a pass failing for ever."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from governor.operator import reconcile as reconcile_module
from governor.operator.reconcile import reconcile

SPEC = {"model": {"uri": "/models/chat"}, "engine": {"image": "ghcr.io/example/governor-engine:1"},
        "slo": {"ttftP95": "500ms", "itlP95": "50ms"}}


def _with_body(status: int, message: str) -> ApiException:
    e = ApiException(status=status, reason="Unprocessable Entity")
    e.body = json.dumps({"kind": "Status", "code": status, "message": message})
    return e


@pytest.fixture()
def cluster_refusing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The cluster calls of a pass, with children refused with the status in the returned list (422 first)."""
    codes = [422]

    def apply_child(desired: dict[str, Any]) -> str | None:
        raise _with_body(codes[0], f'Deployment.apps "{desired["metadata"]["name"]}" is invalid: '
                                   "spec.template.spec.affinity: Invalid value")

    monkeypatch.setattr(reconcile_module, "ensure_admin_secret", lambda *a: None)
    monkeypatch.setattr(reconcile_module, "revision_deployments", lambda *a: {})
    monkeypatch.setattr(reconcile_module, "read_route", lambda *a: (None, None))
    monkeypatch.setattr(reconcile_module, "apply_child", apply_child)
    return codes


def test_a_child_the_api_server_refuses_is_reported_as_child_rejected(cluster_refusing: list[int]) -> None:
    outcome = reconcile("chat", "llm", "uid-1", 4, SPEC, {}, pod_monitor=False, now=1_700_000_000)
    ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
    assert (outcome.status["phase"], ready["status"], ready["reason"]) == ("Failed", "False", "ChildRejected")
    assert "the API server refused a child of this service: Deployment.apps" in ready["message"]
    assert "spec.template.spec.affinity: Invalid value" in ready["message"]
    assert [(reason, kind) for reason, _, kind in outcome.events] == [("ChildRejected", "Warning")]


def test_a_transient_api_error_fails_the_pass_for_kopf_to_retry(cluster_refusing: list[int]) -> None:
    cluster_refusing[0] = 503
    with pytest.raises(ApiException):
        reconcile("chat", "llm", "uid-1", 4, SPEC, {}, pod_monitor=False, now=1_700_000_000)
