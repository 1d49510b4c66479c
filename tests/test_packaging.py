"""Packaging: the Helm chart, the Dockerfiles, the examples and the e2e script.

The chart is rendered by the real `helm` (`bash scripts/setup.sh` puts it in .venv/bin) for its defaults and
each documented override, and every rendered Kubernetes object is validated offline, in strict mode, against
the schemas kubernetes-validate ships. The PodMonitor, a Prometheus Operator kind with no shipped schema, is
checked field by field.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from governor.operator.api import EngineSpec, InferenceServiceSpec, ModelSpec
from governor.operator.validation import parse_spec
from tests.chart import CHART, FULLNAME, RELEASE, RELEASE_NAMESPACE, ROOT, run_helm
from tests.chart import rendered as render_chart
from tests.pod_security import restricted_violations

K8S_VERSION = "1.32.0"  # a version kubernetes-validate ships schemas for (1.25 to 1.37 in 1.37.0)
EXAMPLE_SERVICES = ["examples/inferenceservice-minimal.yaml", "examples/inferenceservice-full.yaml",
                    "examples/argocd/services/chat.yaml"]
POD_MONITOR_API = "monitoring.coreos.com/v1/PodMonitor"
EXAMPLE_DIGEST = "sha256:" + "0123456789abcdef" * 4

# The defaults and every override values.yaml documents: name -> helm arguments.
CASES: dict[str, list[str]] = {
    "defaults": [],
    "watched namespaces": ["--set", "watchedNamespaces={a,b}"],
    "no network policy": ["--set", "networkPolicy.enabled=false"],
    "an allowed client": ["--set", "networkPolicy.allowedClients[0].podSelector.matchLabels.app=gateway"],
    "pod monitor auto without the API": ["--set", "podMonitor.enabled=auto"],
    "pod monitor auto with the API": ["--set", "podMonitor.enabled=auto", "--api-versions", POD_MONITOR_API],
    "pod monitor true": ["--set", "podMonitor.enabled=true"],
    "pod monitor false": ["--set", "podMonitor.enabled=false"],
    "pod monitor in watched namespaces": ["--set", "podMonitor.enabled=true", "--set", "watchedNamespaces={a,b}"],
    "no operator pod monitors": ["--set", "podMonitor.operatorPodMonitors=false"],
    "no aggregated roles": ["--set", "rbac.aggregatedClusterRoles=false"],
    "prometheus": ["--set", "prometheusUrl=http://prometheus.monitoring:9090"],
    "scheduling": ["--set", "nodeSelector.pool=cpu", "--set", "tolerations[0].key=dedicated",
                   "--set", "tolerations[0].operator=Exists", "--set", "tolerations[0].effect=NoSchedule"],
    "image digest": ["--set", f"image.digest={EXAMPLE_DIGEST}"],
}

READ_WRITE = ["create", "delete", "get", "list", "patch"]
# The operator's rights, the same cluster-wide and per namespace: (apiGroup, resource) -> sorted verbs. Exactly
# what its calls use (the operator tests run against an emulator that refuses anything else).
OPERATOR_GRANTS = {
    ("governor.dev", "inferenceservices"): ["get", "list", "patch", "watch"],
    ("governor.dev", "inferenceservices/status"): ["patch"],
    ("apps", "deployments"): READ_WRITE,
    ("", "services"): READ_WRITE,
    ("", "configmaps"): READ_WRITE,
    ("policy", "poddisruptionbudgets"): ["create", "delete", "get", "patch"],  # by name
    ("", "secrets"): ["create", "delete", "get"],  # addressed by name only: list/watch would expose every Secret
    ("", "pods"): ["list"],  # the tuner finds each ready engine pod's admin API
    ("gateway.networking.k8s.io", "httproutes"): ["get", "patch"],  # canary weights
    ("", "events"): ["create"],
    ("monitoring.coreos.com", "podmonitors"): ["create", "get", "list", "patch"],
}




def rendered(case: str) -> list[dict[str, Any]]:
    return list(render_chart(*CASES[case]))


def _of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _deployment_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = _of_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _deployment_container(objects)["env"]}


def _operator_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Roles and ClusterRoles bound to the operator's ServiceAccount."""
    subject = {"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}
    roles = []
    for binding in [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]:
        if subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        (role,) = [o for o in objects if o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"]
                   and o["metadata"].get("namespace") == namespace]
        roles.append(role)
    return roles


def _grants(role: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    grants: dict[tuple[str, str], list[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in grants, f"{key} granted by two rules"
                grants[key] = sorted(rule["verbs"])
    return grants


def _validate(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {e.message} at {list(e.path)}")


# Prometheus Operator's Duration pattern (monitoring.coreos.com/v1).
_DURATION = re.compile(r"(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)")


def _validate_pod_monitor(obj: dict[str, Any]) -> None:
    """The PodMonitor fields the chart sets, against the Prometheus Operator's CRD schema."""
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    meta = obj["metadata"]
    assert set(meta) == {"name", "namespace", "labels"}
    assert all(isinstance(v, str) for v in [meta["name"], meta["namespace"], *meta["labels"].values()])
    spec = obj["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "podMetricsEndpoints"}
    assert set(spec["selector"]) == {"matchLabels"}
    assert all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    selector = spec["namespaceSelector"]
    assert selector == {"any": True} or (set(selector) == {"matchNames"}
                                         and all(isinstance(n, str) for n in selector["matchNames"]))
    assert spec["podMetricsEndpoints"]
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval"} and isinstance(endpoint["port"], str)
        assert endpoint["path"].startswith("/") and _DURATION.fullmatch(endpoint["interval"])


def _notes(*args: str) -> str:
    result = run_helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--dry-run=client", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:\n", 1)[1]


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
    assert set(engine) == {a.alias for a in EngineSpec.model_fields.values()}
    assert set(spec["model"]) == {a.alias for a in ModelSpec.model_fields.values()}
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


def test_chart_metadata_and_default_values() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["version"], chart["appVersion"]) == (
        "v2", "governor", "0.1.0", "0.1.0")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["watchedNamespaces"] == [] and values["engineAdminPort"] == 8000
    assert values["networkPolicy"]["enabled"] is True and values["rbac"]["aggregatedClusterRoles"] is True
    assert (values["podMonitor"]["enabled"], values["podMonitor"]["operatorPodMonitors"]) == ("auto", "auto")


@pytest.mark.parametrize("case", [c for c in CASES if "--api-versions" not in CASES[c]])
def test_chart_lints_strictly(case: str) -> None:
    result = run_helm("lint", "--strict", str(CHART), *CASES[case])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_validates(case: str) -> None:
    objects = rendered(case)
    assert {"ServiceAccount", "Deployment"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] == "PodMonitor":  # a Prometheus Operator CRD: no schema shipped
            _validate_pod_monitor(obj)
        else:
            _validate(obj)


# RBAC


@pytest.mark.parametrize("case", CASES)
def test_the_operator_is_granted_exactly_least_privilege(case: str) -> None:
    roles = _operator_roles(rendered(case))
    assert roles
    for role in roles:
        assert _grants(role) == OPERATOR_GRANTS, role["metadata"]


@pytest.mark.parametrize("case", CASES)
def test_operator_rules_name_no_wildcards_resource_names_or_urls(case: str) -> None:
    for role in _operator_roles(rendered(case)):
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
            assert not any("*" in item for key in ("apiGroups", "resources", "verbs") for item in rule[key]), rule


def test_operator_rules_are_literal_yaml_in_the_chart() -> None:
    """Both RBAC modes include one block that carries no templating, so what reviewers read is what is granted."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    match = re.search(r'\{\{- define "governor.operatorRules" -\}\}\n(.*?)\{\{- end -\}\}', helpers, re.S)
    assert match is not None
    assert "{{" not in match[1]
    assert _grants(yaml.safe_load(match[1])) == OPERATOR_GRANTS


def test_all_namespaces_bind_one_cluster_role_to_the_operator() -> None:
    objects = rendered("defaults")
    assert not _of_kind(objects, "Role") and not _of_kind(objects, "RoleBinding")
    (binding,) = _of_kind(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": FULLNAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}]
    assert [r["metadata"]["name"] for r in _operator_roles(objects)] == [FULLNAME]


def test_watched_namespaces_grant_a_role_in_each_and_nothing_cluster_wide() -> None:
    objects = rendered("watched namespaces")
    assert not _of_kind(objects, "ClusterRoleBinding")
    assert sorted(r["metadata"]["name"] for r in _of_kind(objects, "ClusterRole")) == [
        f"{FULLNAME}-edit", f"{FULLNAME}-view"]  # the aggregated user roles, bound to no one here
    assert sorted((r["metadata"]["namespace"], r["metadata"]["name"]) for r in _of_kind(objects, "Role")) == [
        ("a", FULLNAME), ("b", FULLNAME)]
    bindings = _of_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NAMESPACE}]
    assert sorted(r["metadata"]["namespace"] for r in _operator_roles(objects)) == ["a", "b"]


def test_aggregated_cluster_roles_let_namespace_viewers_and_editors_use_inference_services() -> None:
    roles = {r["metadata"]["name"]: r for r in _of_kind(rendered("defaults"), "ClusterRole")}
    view, edit = roles[f"{FULLNAME}-view"], roles[f"{FULLNAME}-edit"]
    aggregation = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith(aggregation)} == {
        f"{aggregation}view": "true"}
    assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith(aggregation)} == {
        f"{aggregation}edit": "true", f"{aggregation}admin": "true"}
    assert _grants(view) == {("governor.dev", "inferenceservices"): ["get", "list", "watch"],
                             ("governor.dev", "inferenceservices/status"): ["get", "list", "watch"]}
    assert _grants(edit) == {
        ("governor.dev", "inferenceservices"): ["create", "delete", "deletecollection", "get", "list", "patch",
                                                "update", "watch"],
        ("governor.dev", "inferenceservices/scale"): ["get", "patch", "update"]}


def test_aggregated_cluster_roles_are_optional() -> None:
    names = [r["metadata"]["name"] for r in _of_kind(rendered("no aggregated roles"), "ClusterRole")]
    assert names == [FULLNAME]


# PodMonitor


@pytest.mark.parametrize(("args", "pod_monitor", "operator_env"), [
    ([], False, "auto"),  # auto, and helm template serves no PodMonitor API
    (["--api-versions", POD_MONITOR_API], True, "false"),
    (["--set", "podMonitor.enabled=true"], True, "false"),
    (["--set", "podMonitor.enabled=false", "--api-versions", POD_MONITOR_API], False, "auto"),
    (["--set", "podMonitor.operatorPodMonitors=false"], False, "false"),
    (["--set", "podMonitor.enabled=false", "--set", "podMonitor.operatorPodMonitors=true"], False, "true"),
    (["--set", "podMonitor.operatorPodMonitors=true", "--api-versions", POD_MONITOR_API], True, "false"),
], ids=["auto", "auto with the API", "true", "false", "auto, operator off", "false, operator on",
        "auto with the API, operator on"])
def test_the_chart_s_pod_monitor_turns_off_the_operator_s_per_service_ones(
        args: list[str], pod_monitor: bool, operator_env: str) -> None:
    """One PodMonitor per engine: two would scrape each engine twice and double every summed signal."""
    objects = list(render_chart(*args))
    assert len(_of_kind(objects, "PodMonitor")) == int(pod_monitor)
    assert _env(objects)["GOVERNOR_POD_MONITOR"] == operator_env


def test_pod_monitor_scrapes_every_engine_in_the_served_namespaces() -> None:
    (everywhere,) = _of_kind(rendered("pod monitor true"), "PodMonitor")
    meta = everywhere["metadata"]
    assert (meta["name"], meta["namespace"]) == (f"{FULLNAME}-engines", RELEASE_NAMESPACE)
    assert everywhere["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "governor-engine"}},
        "namespaceSelector": {"any": True},
        "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}
    (listed,) = _of_kind(rendered("pod monitor in watched namespaces"), "PodMonitor")
    assert listed["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def test_pod_monitor_mode_must_be_auto_true_or_false() -> None:
    result = run_helm("template", RELEASE, str(CHART), "--set", "podMonitor.enabled=yes")
    assert result.returncode != 0
    assert 'podMonitor.enabled must be auto, true or false, not "yes"' in result.stderr


# The operator's Deployment


def test_operator_runs_standalone_with_a_liveness_endpoint() -> None:
    container = _deployment_container(rendered("defaults"))
    assert container["args"][:2] == ["--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert _env(rendered("defaults")) == {
        "GOVERNOR_PROMETHEUS_URL": "", "GOVERNOR_PROMETHEUS_SCRAPE_INTERVAL_S": "15",
        "GOVERNOR_RECONCILE_INTERVAL_S": "10", "GOVERNOR_LOG_LEVEL": "info", "GOVERNOR_POD_MONITOR": "auto"}


def test_operator_watches_all_namespaces_or_each_listed_one() -> None:
    assert _deployment_container(rendered("defaults"))["args"][2:] == ["--all-namespaces"]
    assert _deployment_container(rendered("watched namespaces"))["args"][2:] == ["--namespace=a", "--namespace=b"]


def test_operator_image_is_the_app_version_tag_or_a_pinned_digest() -> None:
    repository = "ghcr.io/governor-dev/governor-operator"
    assert _deployment_container(rendered("defaults"))["image"] == f"{repository}:0.1.0"
    assert _deployment_container(rendered("image digest"))["image"] == f"{repository}@{EXAMPLE_DIGEST}"


def test_prometheus_url_reaches_the_operator() -> None:
    assert _env(rendered("prometheus"))["GOVERNOR_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"


def test_node_selector_and_tolerations_place_the_operator_pod() -> None:
    (deployment,) = _of_kind(rendered("scheduling"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    (default,) = _of_kind(rendered("defaults"), "Deployment")
    assert "nodeSelector" not in default["spec"]["template"]["spec"]
    assert "tolerations" not in default["spec"]["template"]["spec"]


# NetworkPolicy


def test_network_policy_admits_only_the_engine_port_from_operator_and_prometheus() -> None:
    (policy,) = _of_kind(rendered("defaults"), "NetworkPolicy")
    assert policy["metadata"]["namespace"] == RELEASE_NAMESPACE
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "governor-engine"}}
    assert spec["policyTypes"] == ["Ingress"]
    (ingress,) = spec["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert ingress["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "governor-operator"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_network_policy_admits_the_allowed_clients_too() -> None:
    (policy,) = _of_kind(rendered("an allowed client"), "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["from"][2:] == [{"podSelector": {"matchLabels": {"app": "gateway"}}}]


def test_network_policy_covers_each_watched_namespace() -> None:
    policies = _of_kind(rendered("watched namespaces"), "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["a", "b"]


def test_network_policy_can_be_turned_off() -> None:
    assert not _of_kind(rendered("no network policy"), "NetworkPolicy")


# NOTES.txt


def test_notes_say_what_runs_without_prometheus() -> None:
    notes = " ".join(_notes().split())
    assert ("rollouts with rollbackOn triggers hold (Paused, reason SignalsStale), rollouts without triggers still "
            "walk their steps, and the tuner stays frozen (condition Tuning=False, reason NoPrometheus)") in notes
    assert "/metrics directly" not in notes
    assert "Prometheus: http://prometheus.monitoring:9090\n" in _notes(*CASES["prometheus"])


def test_notes_name_the_rbac_mode() -> None:
    assert "RBAC: cluster-wide. ClusterRole and ClusterRoleBinding governor-operator." in _notes()
    namespaced = " ".join(_notes(*CASES["watched namespaces"]).split())
    assert ("RBAC: namespaced. A Role and RoleBinding named governor-operator in each of a, b; "
            "no cluster-wide grant for the operator.") in namespaced


def test_notes_say_whether_a_pod_monitor_was_rendered() -> None:
    assert "PodMonitor: none from the chart (podMonitor.enabled=auto)" in _notes()
    assert "PodMonitor: governor-operator-engines in governor-system scrapes every engine" in _notes(
        *CASES["pod monitor true"])


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

KIND_SH = ROOT / "e2e" / "kind.sh"


def _unreachable_kubeconfig(tmp_path: Path) -> Path:
    kubeconfig = tmp_path / "kubeconfig"  # a cluster that cannot answer
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "users": [{"name": "none", "user": {}}]}))
    return kubeconfig


def test_e2e_script_skips_with_exit_0_without_a_cluster(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(KIND_SH)], check=True)
    env = {**os.environ, "KUBECONFIG": str(_unreachable_kubeconfig(tmp_path))}
    env.pop("E2E_REQUIRED", None)
    result = subprocess.run(["bash", str(KIND_SH)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert "SKIP: no Kubernetes cluster answers" in result.stdout


def test_e2e_script_fails_without_a_cluster_when_one_is_required(tmp_path: Path) -> None:
    env = {**os.environ, "KUBECONFIG": str(_unreachable_kubeconfig(tmp_path)), "E2E_REQUIRED": "1"}
    result = subprocess.run(["bash", str(KIND_SH)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1
    assert "SKIP" not in result.stdout
    assert "FAIL: no Kubernetes cluster answers" in result.stderr and "E2E_REQUIRED=1" in result.stderr


@pytest.mark.parametrize(("image", "split"), [
    ("localhost:5000/governor-operator:dev", "localhost:5000/governor-operator dev"),
    ("localhost:5000/governor-operator", "localhost:5000/governor-operator latest"),
    ("governor-operator:dev", "governor-operator dev"),
    ("ghcr.io/governor-dev/governor-operator", "ghcr.io/governor-dev/governor-operator latest"),
    (f"localhost:5000/governor-operator@{EXAMPLE_DIGEST}", f"localhost:5000/governor-operator {EXAMPLE_DIGEST}"),
    (f"governor-operator:dev@{EXAMPLE_DIGEST}", f"governor-operator {EXAMPLE_DIGEST}"),  # the digest decides
])
def test_e2e_splits_an_operator_image_into_repository_and_tag_or_digest(image: str, split: str) -> None:
    result = subprocess.run(["bash", str(KIND_SH), "--split-image", image], capture_output=True, text=True,
                            timeout=10)
    assert (result.returncode, result.stdout) == (0, split + "\n"), result.stderr


@pytest.mark.parametrize("image", ["governor-operator@latest", "governor-operator:", "governor-operator:a b"])
def test_e2e_refuses_an_image_it_cannot_split(image: str) -> None:
    result = subprocess.run(["bash", str(KIND_SH), "--split-image", image], capture_output=True, text=True,
                            timeout=10)
    assert result.returncode == 1 and result.stdout == ""
    assert image in result.stderr


_STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$E2E_CALLS"
case "$(basename "$0") $1 $2" in
  "kubectl get crd") [ "$HAVE_CRD" = 1 ]; exit;;
  "kubectl get namespace") [[ " $HAVE_NAMESPACES " == *" $3 "* ]]; exit;;
  "helm status "*) [ "$HAVE_RELEASE" = 1 ]; exit;;
  "helm install "*) exit 1;;  # ends the run here, so cleanup runs after a failure
esac
exit 0
"""


def _run_e2e_against_stubs(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """kind.sh with kubectl and helm replaced by stubs that log their calls; `helm install` fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("kubectl", "helm"):
        (bin_dir / tool).write_text(_STUB)
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    result = subprocess.run(["bash", str(KIND_SH)], capture_output=True, text=True, timeout=60, env={
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "E2E_CALLS": str(calls), "HAVE_CRD": "0",
        "HAVE_NAMESPACES": "", "HAVE_RELEASE": "0", **env})
    return result, calls.read_text().splitlines()


def test_e2e_applies_the_crd_server_side_and_waits_until_established(tmp_path: Path) -> None:
    _, calls = _run_e2e_against_stubs(tmp_path)
    apply = calls.index("kubectl apply --server-side --field-manager=governor-e2e -f crds/")
    assert calls[apply + 1] == ("kubectl wait --for=condition=Established crd/inferenceservices.governor.dev "
                                "--timeout=60s")


def test_e2e_cleanup_removes_everything_the_run_created(tmp_path: Path) -> None:
    result, calls = _run_e2e_against_stubs(tmp_path)
    assert result.returncode == 1
    deletes = [c for c in calls if c.startswith(("kubectl delete", "helm uninstall"))]
    assert deletes == [
        "kubectl delete namespace governor-e2e --ignore-not-found --timeout=180s",  # first: the operator finalizes
        "helm uninstall governor --namespace governor-system --wait --timeout 120s",
        "kubectl delete namespace governor-system --ignore-not-found --wait=false",
        "kubectl delete crd inferenceservices.governor.dev --ignore-not-found --wait=false"]


def test_e2e_cleanup_keeps_what_was_there_before(tmp_path: Path) -> None:
    result, calls = _run_e2e_against_stubs(tmp_path, HAVE_CRD="1", HAVE_NAMESPACES="governor-system governor-e2e")
    assert result.returncode == 1
    assert "kubectl create namespace governor-system" not in calls
    assert [c for c in calls if c.startswith(("kubectl delete", "helm uninstall"))] == [
        "helm uninstall governor --namespace governor-system --wait --timeout 120s"]


def test_e2e_never_touches_an_existing_release(tmp_path: Path) -> None:
    result, calls = _run_e2e_against_stubs(tmp_path, HAVE_RELEASE="1")
    assert result.returncode == 1 and "Helm release governor already exists in governor-system" in result.stderr
    assert not [c for c in calls if c.startswith(("helm install", "helm upgrade", "helm uninstall"))]


@pytest.mark.parametrize(("image", "values"), [
    ("localhost:5000/governor-operator:dev", ["image.repository=localhost:5000/governor-operator", "image.tag=dev"]),
    (f"localhost:5000/governor-operator@{EXAMPLE_DIGEST}",
     ["image.repository=localhost:5000/governor-operator", f"image.digest={EXAMPLE_DIGEST}"]),
])
def test_e2e_installs_the_chart_with_the_operator_image(tmp_path: Path, image: str, values: list[str]) -> None:
    _, calls = _run_e2e_against_stubs(tmp_path, OPERATOR_IMAGE=image)
    (install,) = [c.split() for c in calls if c.startswith("helm install")]
    assert [install[i + 1] for i, arg in enumerate(install) if arg == "--set" and "image." in install[i + 1]
            and "pullPolicy" not in install[i + 1]] == values


def test_the_operator_pod_passes_the_restricted_pod_security_profile() -> None:
    (deployment,) = [o for o in rendered("defaults") if o["kind"] == "Deployment"]
    assert restricted_violations(deployment["spec"]["template"]) == []
