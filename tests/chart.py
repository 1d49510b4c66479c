"""The Helm chart rendered by the real `helm` (`bash scripts/setup.sh` puts it in .venv/bin), for the tests."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "governor"
RELEASE, RELEASE_NAMESPACE = "governor", "governor-system"
FULLNAME = "governor-operator"


def helm() -> str:
    """The helm binary: .venv/bin/helm, else one on PATH; the test fails without either."""
    local = ROOT / ".venv" / "bin" / "helm"
    found = str(local) if os.access(local, os.X_OK) else shutil.which("helm")
    if found is None:
        pytest.fail("helm is not installed: `bash scripts/setup.sh` puts it in .venv/bin")
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)


@functools.cache
def rendered(*args: str) -> tuple[dict[str, Any], ...]:
    """`helm template` of the chart with these extra arguments: its objects."""
    result = run_helm("template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def operator_bindings(*args: str) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """The rules bound to the operator's ServiceAccount by the chart rendered with these arguments: (namespace,
    rules) per RoleBinding, (None, rules) per ClusterRoleBinding."""
    objects = rendered(*args)
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o["rules"]
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    out: list[tuple[str | None, list[dict[str, Any]]]] = []
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE} not in binding["subjects"]:
            continue
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role_namespace = scope if ref["kind"] == "Role" else None
        out.append((scope, roles[(ref["kind"], role_namespace, ref["name"])]))
    return out
