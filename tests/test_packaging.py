"""Packaging: the Helm chart, the Dockerfiles, the examples and the e2e script.

Without `helm` the chart is checked without Go templating: control lines are dropped and inline `{{ ... }}`
become values from values.yaml (or a placeholder name), which leaves valid Kubernetes objects because the
templates keep RBAC rules and ports literal. With `helm`, `helm lint` and `helm template` run as well.
Kubernetes objects are validated offline against the schemas kubernetes-validate ships.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from governor.operator.api import InferenceServiceSpec, drop_nulls, parse_spec

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "governor"
TEMPLATES = CHART / "templates"
K8S_VERSION = "1.32.0"  # a version kubernetes-validate ships schemas for (1.25 to 1.37 in 1.37.0)
EXAMPLE_SERVICES = ["examples/inferenceservice-minimal.yaml", "examples/inferenceservice-full.yaml",
                    "examples/argocd/services/chat.yaml"]

_INLINE = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}")


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _inline_value(expr: str, values: dict[str, Any]) -> str:
    match = re.fullmatch(r"\$?\.Values\.([\w.]+)", expr)
    if match is None:
        return "placeholder"
    value: Any = values
    for key in match[1].split("."):
        value = value[key]
    return str(value)


def detemplated(name: str) -> list[dict[str, Any]]:
    """The objects of one template with its Go templating removed (see the module docstring)."""
    values = _values()
    lines = []
    for line in (TEMPLATES / name).read_text().splitlines():
        if line.strip().startswith("{{"):  # control flow, includes and toYaml blocks
            continue
        lines.append(_INLINE.sub(lambda m: _inline_value(m[1], values), line))
    # Dropping `{{ toYaml ... }}` lines leaves their keys empty (null): prune them like the API server.
    return [drop_nulls(doc) for doc in yaml.safe_load_all("\n".join(lines)) if doc]


def _validate(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {e.message} at {list(e.path)}")


def _cluster_role() -> dict[str, Any]:
    (role,) = [o for o in detemplated("rbac.yaml") if o["kind"] == "ClusterRole"]
    return role


# --- examples -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLE_SERVICES)
def test_example_inference_services_are_valid_specs(path: str) -> None:
    obj = yaml.safe_load((ROOT / path).read_text())
    assert (obj["apiVersion"], obj["kind"]) == ("governor.dev/v1alpha1", "InferenceService")
    spec = parse_spec(obj["spec"])
    assert isinstance(spec, InferenceServiceSpec), [str(e) for e in spec]


def test_full_example_sets_every_spec_field() -> None:
    spec = yaml.safe_load((ROOT / "examples/inferenceservice-full.yaml").read_text())["spec"]
    assert set(spec) == {a.alias for a in InferenceServiceSpec.model_fields.values()}
    engine = spec["engine"]
    assert set(engine) == {"image", "resources", "dtype", "kvCacheDtype", "prefixCaching", "speculative",
                           "maxModelLen", "tensorParallelSize", "knobs", "extraArgs", "nodeSelector", "tolerations"}
    assert (engine["kvCacheDtype"], engine["tensorParallelSize"], engine["resources"]["gpus"]) == ("fp8", 2, 2)
    assert engine["speculative"] == {"method": "ngram", "numSpeculativeTokens": 4}
    assert {"e2eP95", "errorRate"} <= set(spec["slo"])
    assert spec["rollout"]["rollbackOn"] and spec["autotune"]["bounds"]


def test_every_static_yaml_parses() -> None:
    paths = [*(CHART / "crds").glob("*.yaml"), *(ROOT / "examples").rglob("*.yaml"),
             CHART / "Chart.yaml", CHART / "values.yaml"]
    assert len(paths) >= 7
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} holds no YAML document"


# --- chart ------------------------------------------------------------------------------------------------


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["version"], chart["appVersion"]) == (
        "v2", "governor", "0.1.0", "0.1.0")
    values = _values()
    assert values["watchedNamespaces"] == [] and values["engineAdminPort"] == 8000
    assert values["networkPolicy"]["enabled"] is True and values["podMonitor"]["enabled"] is True


def test_cluster_role_grants_exactly_least_privilege() -> None:
    granted = {(group, resource): sorted(rule["verbs"])
               for rule in _cluster_role()["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    crud = sorted(["get", "list", "watch", "create", "update", "patch", "delete"])
    assert granted == {
        ("governor.dev", "inferenceservices"): sorted(["get", "list", "watch", "patch", "update"]),
        ("governor.dev", "inferenceservices/status"): sorted(["get", "patch", "update"]),
        ("apps", "deployments"): crud,
        ("", "services"): crud,
        ("", "configmaps"): crud,
        ("", "secrets"): sorted(["get", "list", "watch", "create", "delete"]),  # delete: the delete handler
        ("", "events"): ["create", "patch"],
        ("events.k8s.io", "events"): ["create", "patch"],
        ("monitoring.coreos.com", "podmonitors"): crud,
        ("apiextensions.k8s.io", "customresourcedefinitions"): ["get", "list", "watch"],
        ("", "namespaces"): ["get", "list", "watch"],
        ("", "pods"): ["get", "list"],  # the tuner finds each ready engine pod's admin API
        ("gateway.networking.k8s.io", "httproutes"): ["get", "patch"],  # canary weights
    }


def test_cluster_role_has_no_wildcards() -> None:
    for rule in _cluster_role()["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert not any("*" in item for item in rule[key]), rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule


def test_operator_runs_standalone_so_needs_no_peering_rbac() -> None:
    (deployment,) = detemplated("deployment.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--standalone" in container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {e["name"] for e in container["env"]} == {"GOVERNOR_PROMETHEUS_URL", "GOVERNOR_PROMETHEUS_SCRAPE_INTERVAL_S",
                                                     "GOVERNOR_RECONCILE_INTERVAL_S", "GOVERNOR_LOG_LEVEL",
                                                     "GOVERNOR_POD_MONITOR"}
    assert not any("kopf.dev" in g for rule in _cluster_role()["rules"] for g in rule["apiGroups"])


def test_the_chart_s_pod_monitor_turns_off_the_operator_s_per_service_ones() -> None:
    """One PodMonitor per engine: two would scrape each engine twice and double every summed signal."""
    from governor.operator import handlers

    text = (TEMPLATES / "deployment.yaml").read_text()
    assert ('value: {{ ternary "false" .Values.podMonitor.operatorPodMonitors .Values.podMonitor.enabled | quote }}'
            in text)
    assert _values()["podMonitor"]["operatorPodMonitors"] == "auto"
    assert 'os.environ.get("GOVERNOR_POD_MONITOR", "auto")' in Path(handlers.__file__).read_text()


def test_operator_watches_all_namespaces_or_each_listed_one() -> None:
    text = (TEMPLATES / "deployment.yaml").read_text()
    assert "- --all-namespaces" in text and "- --namespace={{ . }}" in text


def test_network_policy_admits_only_the_engine_port_from_operator_and_clients() -> None:
    (policy,) = detemplated("networkpolicy.yaml")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "governor-engine"}}
    assert spec["policyTypes"] == ["Ingress"]
    (ingress,) = spec["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {"matchLabels": {"app.kubernetes.io/name": "governor-operator"}} in [p.get("podSelector")
                                                                                 for p in ingress["from"]]
    text = (TEMPLATES / "networkpolicy.yaml").read_text()
    assert "port: {{ $.Values.engineAdminPort }}" in text
    assert "$.Values.networkPolicy.allowedClients" in text and "$.Values.networkPolicy.prometheus" in text


@pytest.mark.parametrize("template", ["serviceaccount.yaml", "rbac.yaml", "networkpolicy.yaml", "deployment.yaml"])
def test_static_chart_objects_validate_against_kubernetes_schemas(template: str) -> None:
    objects = detemplated(template)
    assert objects
    for obj in objects:
        _validate(obj)


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm is not installed; the template-free checks ran")
def test_helm_lint_and_rendered_objects_validate(tmp_path: Path) -> None:
    subprocess.run(["helm", "lint", str(CHART)], check=True, capture_output=True)
    for extra in ([], ["--set", "watchedNamespaces={a,b}", "--set", "networkPolicy.allowedClients[0]."
                                                                      "podSelector.matchLabels.app=gateway"]):
        out = subprocess.run(["helm", "template", "governor", str(CHART), "--namespace", "governor-system", *extra],
                             check=True, capture_output=True, text=True).stdout
        objects = [d for d in yaml.safe_load_all(out) if d]
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "NetworkPolicy"} <= kinds
        for obj in objects:
            if obj["kind"] != "PodMonitor":  # a Prometheus Operator CRD: no schema shipped
                _validate(obj)


# --- images -------------------------------------------------------------------------------------------------


def _instructions(name: str) -> list[str]:
    text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_operator_image_installs_the_operator_extra_and_never_torch() -> None:
    lines = _instructions("operator.Dockerfile")
    assert lines[0] == "FROM python:3.12-slim"
    assert any(line.startswith("RUN pip install \".[operator]\"") for line in lines)
    assert not any("torch" in line for line in lines)
    assert "USER 10001:10001" in lines
    assert lines[-1] == 'ENTRYPOINT ["governor", "operator"]'


def test_engine_image_serves_on_port_8000_as_non_root() -> None:
    lines = _instructions("engine.Dockerfile")
    assert "ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04" in lines
    assert any(".[engine]" in line and "huggingface_hub" in line for line in lines)
    assert "EXPOSE 8000" in lines and "USER 10001:10001" in lines
    assert lines[-1] == 'ENTRYPOINT ["governor", "serve"]'


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "out", "*.whl", ".pytest_cache", ".ruff_cache", ".mypy_cache"} <= ignored


# --- e2e ------------------------------------------------------------------------------------------------------


def test_e2e_script_skips_with_exit_0_without_a_cluster(tmp_path: Path) -> None:
    script = ROOT / "e2e" / "kind.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    kubeconfig = tmp_path / "kubeconfig"  # a cluster that cannot answer
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "users": [{"name": "none", "user": {}}]}))
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    assert result.returncode == 0, result.stderr
    assert "SKIP" in result.stdout
