"""The CRD's CEL rules (x-kubernetes-validations), evaluated with a real CEL implementation (cel-python) on the
objects `kubectl apply` would send: every example is admitted; every spec `validate_spec` refuses is refused by
the API server too, with the rule's message, before the operator ever sees it; and the two agree on generated
specs. `validate_spec` stays as the second line of defence (objects stored before a rule existed)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor.operator.api import InferenceServiceSpec
from governor.operator.crds import FILENAME, crd_manifest
from governor.operator.validation import parse_spec
from tests.crd_admission import admit, rule_failures
from tests.test_operator_api import FULL, MINIMAL, SEMANTIC_CASES, with_changes

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / FILENAME).read_text())
EXAMPLES = ["examples/inferenceservice-minimal.yaml", "examples/inferenceservice-full.yaml",
            "examples/argocd/services/chat.yaml"]


def service(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "governor.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "llm"}, "spec": spec}


def refusals(spec: dict[str, Any]) -> list[str]:
    return admit(service(spec), CRD)[1]


def test_the_file_is_the_generated_crd() -> None:
    assert crd_manifest() == CRD


@pytest.mark.parametrize("path", EXAMPLES)
def test_every_example_is_admitted(path: str) -> None:
    obj = yaml.safe_load((ROOT / path).read_text())
    assert admit(obj, CRD)[1] == []


@pytest.mark.parametrize("spec", [MINIMAL, FULL], ids=["minimal", "full"])
def test_the_parsing_tests_specs_are_admitted(spec: dict[str, Any]) -> None:
    assert refusals(spec) == []


def test_admission_applies_the_schema_defaults_before_the_rules() -> None:
    stored, errors = admit(service(MINIMAL), CRD)
    assert errors == []
    assert stored["spec"]["engine"]["resources"] == {"gpus": 1}
    assert stored["spec"]["rollout"]["steps"] == [{"weight": 10, "pause": "2m"}, {"weight": 50, "pause": "2m"}]


# The rule message each semantic case meets on `kubectl apply`.
RULE_MESSAGES = {
    "bound min above max": "min must not exceed max",
    "bound min zero for a knob that starts at 1": "maxNumBatchedTokens cannot go below 1",
    "draft_model without draftModel": "method draft_model needs draftModel",
    "ngram with a draftModel": "method ngram takes no draftModel",
    "ngram with a draft quantization": "method ngram takes no quantization",
    "tensor parallel wider than the pod's GPUs": "tensorParallelSize needs as many GPUs per pod",
    "starting knob below its autotune bound": "engine.knobs.maxNumSeqs must lie inside autotune.bounds.maxNumSeqs",
    "starting knob above its autotune bound": "engine.knobs.maxNumBatchedTokens must lie inside "
                                              "autotune.bounds.maxNumBatchedTokens",
    "K knob without speculative decoding": "knobs.numSpeculativeTokens needs speculative decoding",
    "K knob above the speculative cap": "knobs.numSpeculativeTokens needs speculative decoding and at most",
    "K bound above the speculative cap": "autotune.bounds.numSpeculativeTokens.max must not exceed",
    "hf revision disagreeing with model.revision": "revision disagrees with the uri's @revision",
    "zero SLO target": "must be longer than zero",
    "zero tuner interval": "must be longer than zero",
    "rollout weights not increasing": "step weights must strictly increase",
    "rollout step of 100": "100 is not a step",
    "relative latency trigger below 1 (would fire on a better canary)": "must be at least 1",
    "relative throughput trigger above 1": "must be at most 1",
    "absolute error rate above 1": "an absolute error-rate threshold is a fraction",
    "relative throughput trigger with route weights": "with httpRoute, a throughput trigger must be absolute",
    "trigger window under a second": "a trigger window must be at least 1s",
    "extraArgs setting a flag the operator sets": "extraArgs must not set a flag the operator sets",
    "extraArgs setting an operator flag as flag=value": "extraArgs must not set a flag the operator sets",
    "extraArgs setting the admin token file": "extraArgs must not set a flag the operator sets",
    "env setting an operator variable": "env must not set GOVERNOR_*",
    "env moving the writable home": "env must not set GOVERNOR_*",
    "podLabels setting a selector label": "podLabels must not set governor.dev/*",
    "podLabels setting an app.kubernetes.io label": "podLabels must not set governor.dev/*",
    "podLabels with an invalid key": "podLabels keys must be valid keys",
    "podAnnotations setting the scrape annotation": "podAnnotations must not set governor.dev/*",
}


def test_every_semantic_check_has_a_rule() -> None:
    assert set(RULE_MESSAGES) == set(SEMANTIC_CASES)


@pytest.mark.parametrize("case", list(SEMANTIC_CASES))
def test_a_spec_validate_spec_refuses_is_refused_by_the_api_server_with_the_rule_s_message(case: str) -> None:
    changes, _ = SEMANTIC_CASES[case]
    errors = refusals(with_changes(MINIMAL, **changes))
    assert len(errors) == 1 and RULE_MESSAGES[case] in errors[0], errors


# Rules on the embedded Kubernetes types (pydantic model validators are their second line of defence).
TYPE_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "env value and valueFrom": (
        {"engine.env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
        "spec.engine.env[0]", "an env var takes value or valueFrom, not both"),
    "valueFrom with two sources": (
        {"engine.env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"},
                                                    "secretKeyRef": {"name": "s", "key": "k"}}}]},
        "spec.engine.env[0].valueFrom", "valueFrom takes exactly one of"),
    "envFrom with neither source": (
        {"engine.envFrom": [{"prefix": "X_"}]}, "spec.engine.envFrom[0]", "envFrom takes exactly one of"),
    "disruption with both fields": (
        {"disruption": {"maxUnavailable": 1, "minAvailable": 1}}, "spec.disruption", "not both"),
    "a budget that never allows an eviction": (
        {"disruption": {"maxUnavailable": 0}}, "spec.disruption", "maxUnavailable 0 would block every node drain"),
    "a budget of 0%": (
        {"disruption": {"maxUnavailable": "0%"}}, "spec.disruption", "maxUnavailable 0 would block every node drain"),
    "a budget keeping every pod": (
        {"disruption": {"minAvailable": "100%"}}, "spec.disruption", "minAvailable 100% would block every node"),
    "node affinity In without values": (
        {"engine.affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]}}}},
        "spec.engine.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0]", "need values"),
    "node affinity Gt with a word": (
        {"engine.affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 1, "preference": {"matchExpressions": [{"key": "mem", "operator": "Gt",
                                                              "values": ["lots"]}]}}]}}},
        "spec.engine.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
        ".matchExpressions[0]", "exactly one integer"),
    "pod anti-affinity Exists with values": (
        {"engine.affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]}}]}}},
        "spec.engine.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector"
        ".matchExpressions[0]", "take no values"),
    "minDomains with ScheduleAnyway": (
        {"engine.topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "minDomains": 2,
                                               "whenUnsatisfiable": "ScheduleAnyway"}]},
        "spec.engine.topologySpreadConstraints[0]", "minDomains needs whenUnsatisfiable DoNotSchedule"),
    "matchLabelKeys repeating the default selector's key": (
        {"engine.topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable":
                                               "DoNotSchedule", "matchLabelKeys": ["governor.dev/service"]}]},
        "spec.engine.topologySpreadConstraints[0]", "must not be in labelSelector"),
    "matchLabelKeys repeating a selector key": (
        {"engine.topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable":
                                               "DoNotSchedule", "matchLabelKeys": ["tier"],
                                               "labelSelector": {"matchExpressions": [
                                                   {"key": "tier", "operator": "Exists"}]}}]},
        "spec.engine.topologySpreadConstraints[0]", "must not be in labelSelector"),
    "a label selector with an invalid key": (
        {"engine.affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "zone", "labelSelector": {"matchLabels": {"bad key": "x"}}}]}}},
        "spec.engine.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector",
        "matchLabels keys must be valid label keys"),
}


# Values the schema itself refuses (a pattern), before any rule.
SCHEMA_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "a budget above 100%": ({"disruption": {"maxUnavailable": "150%"}}, "spec.disruption.maxUnavailable"),
    "an env var from a field the downward API does not serve": (
        {"engine.env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}]},
        "spec.engine.env[0].valueFrom.fieldRef.fieldPath"),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_values_the_schema_refuses_are_refused_by_the_operator_too(case: str) -> None:
    changes, path = SCHEMA_CASES[case]
    raw = with_changes(MINIMAL, **changes)
    errors = refusals(raw)
    assert len(errors) == 1 and path.removeprefix("spec") in errors[0] and "should match" in errors[0], errors
    parsed = parse_spec(raw)
    assert isinstance(parsed, list) and [e.path for e in parsed] == [path], parsed


@pytest.mark.parametrize("case", list(TYPE_CASES))
def test_embedded_kubernetes_types_are_checked_by_rule_and_by_the_operator(case: str) -> None:
    changes, path, message = TYPE_CASES[case]
    raw = with_changes(MINIMAL, **changes)
    errors = refusals(raw)
    assert len(errors) == 1 and message in errors[0], errors
    parsed = parse_spec(raw)
    assert isinstance(parsed, list) and [e.path for e in parsed] == [path], parsed
    assert message in parsed[0].message


def test_a_rule_that_cannot_evaluate_refuses_like_the_api_server() -> None:
    """A rule reading a field that is absent errs; the API server then refuses the object rather than skip it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "x-kubernetes-validations": [{"rule": "self.a > 0", "message": "a must be positive"}]}
    assert rule_failures({"a": 1}, schema) == []
    assert rule_failures({"a": 0}, schema) == [(".", "a must be positive")]
    assert rule_failures({}, schema) == [(".", "a must be positive")]


def test_the_route_rule_guards_an_absent_rollback_list() -> None:
    """With httpRoute and no rollbackOn the throughput rule has nothing to read: it must pass, not err."""
    raw = with_changes(MINIMAL, **{"rollout.httpRoute": "route"})
    assert refusals(raw) == []
    assert refusals(with_changes(raw, **{"rollout.rollbackOn": [{"metric": "throughput", "threshold": 0.8,
                                                                 "comparison": "absolute"}]})) == []


# --- agreement on generated specs ------------------------------------------------------------------------------

# A generated spec is valid except, half the time, at the edge of one rule (one edge per spec, so that a rule
# that is off by one shows as a disagreement instead of hiding behind another refusal).
FLAGS = ["--max-queue", "--seed", "--enforce-eager", "--max-queue=9"]
OWNED_FLAGS = ["--port", "--tensor-parallel-size=2", "--admin-token-file"]
ENV_NAMES = ["HF_TOKEN", "HTTPS_PROXY", "HF_ENDPOINT", "NCCL_DEBUG"]
LABEL_KEYS = ["team", "example.com/tier", "tier"]
TRIGGERS = [{"metric": "ttft_p95", "comparison": "relative", "threshold": 1.0},
            {"metric": "error_rate", "comparison": "absolute", "threshold": 1.0},
            {"metric": "throughput", "comparison": "absolute", "threshold": 1.5},
            {"metric": "throughput", "comparison": "relative", "threshold": 1.0}]
BAD_TRIGGERS = [{"metric": "ttft_p95", "comparison": "relative", "threshold": 0.99},
                {"metric": "throughput", "comparison": "relative", "threshold": 1.01},
                {"metric": "error_rate", "comparison": "absolute", "threshold": 1.01}]
EDGES = ["gpus", "draft", "draft-quantization", "bound", "bound-floor", "knob-low", "knob-high", "k-knob", "k-bound",
         "weights", "weight-100", "window", "trigger", "route-throughput", "flag", "env", "label", "slo"]


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    edge = draw(st.one_of(st.none(), st.sampled_from(EDGES)))
    spec = copy.deepcopy(MINIMAL)
    engine = spec["engine"]
    tp = draw(st.integers(1, 4))
    engine["tensorParallelSize"] = tp
    engine["resources"] = {"gpus": tp - 1 if edge == "gpus" else draw(st.sampled_from([0, tp, tp + 1]))}
    cap = draw(st.integers(1, 8))
    speculative = edge in ("k-bound", "draft-quantization") or draw(st.booleans())
    if speculative:
        method = "ngram" if edge == "draft-quantization" else draw(st.sampled_from(["ngram", "draft_model"]))
        engine["speculative"] = {"method": method, "numSpeculativeTokens": cap}
        if (method == "draft_model") != (edge == "draft"):
            engine["speculative"]["draftModel"] = "/models/draft"
        if (method == "draft_model" and draw(st.booleans())) or (method == "ngram" and edge == "draft-quantization"):
            engine["speculative"]["quantization"] = draw(st.sampled_from(["fp8", "awq"]))
    bounds: dict[str, Any] = {}
    knobs: dict[str, int] = {}
    for name in ("maxNumSeqs", "maxNumBatchedTokens"):
        low = draw(st.integers(1, 64))
        high = low + draw(st.integers(0, 64))
        if edge == "bound" and name == "maxNumSeqs":
            high = low - 1
        if edge == "bound-floor" and name == "maxNumBatchedTokens":
            low = 0
        if draw(st.booleans()) or edge in ("bound", "bound-floor", "knob-low", "knob-high"):
            bounds[name] = {"min": low, "max": high}
            if edge == "knob-low" and name == "maxNumSeqs" and low > 1:
                knobs[name] = low - 1
            elif edge == "knob-high" and name == "maxNumSeqs":
                knobs[name] = high + 1
            elif draw(st.booleans()) and edge != "bound":
                knobs[name] = draw(st.integers(max(1, low), max(1, low, high)))
        elif draw(st.booleans()):
            knobs[name] = draw(st.integers(1, 300))
    if edge == "k-knob":
        knobs["numSpeculativeTokens"] = cap + 1 if speculative else 1
    elif draw(st.booleans()):
        knobs["numSpeculativeTokens"] = draw(st.integers(0, cap)) if speculative else 0
    k_max = cap + 1 if edge == "k-bound" else draw(st.integers(0, cap))
    if edge == "k-bound" or (speculative and draw(st.booleans())):
        bounds["numSpeculativeTokens"] = {"min": 0, "max": k_max}
        if knobs.get("numSpeculativeTokens", 0) > k_max:
            knobs["numSpeculativeTokens"] = k_max
    engine["knobs"] = knobs
    if bounds:
        spec["autotune"] = {"bounds": bounds}
    weights = sorted(set(draw(st.lists(st.integers(1, 99), max_size=4))))
    if edge == "weights":
        weights = [*weights, weights[-1]] if weights else [50, 50]
    elif edge == "weight-100":
        weights = [*weights, 100]
    triggers = [{**t, "for": "1s"} for t in draw(st.lists(st.sampled_from(TRIGGERS), max_size=2))]
    route = edge == "route-throughput" or draw(st.booleans())
    if route:
        triggers = [t for t in triggers if not (t["metric"] == "throughput" and t["comparison"] == "relative")]
    if edge == "window":
        triggers.append({**TRIGGERS[0], "for": "999ms"})
    elif edge == "trigger":
        triggers.append({**draw(st.sampled_from(BAD_TRIGGERS)), "for": "2m"})
    elif edge == "route-throughput":
        triggers.append({**TRIGGERS[3], "for": "2m"})
    spec["rollout"] = {"steps": [{"weight": w} for w in weights], "rollbackOn": triggers}
    if route:
        spec["rollout"]["httpRoute"] = "route"
    engine["extraArgs"] = draw(st.lists(st.sampled_from(FLAGS), max_size=2))
    if edge == "flag":
        engine["extraArgs"].append(draw(st.sampled_from(OWNED_FLAGS)))
    engine["env"] = [{"name": n, "value": "v"} for n in draw(st.lists(st.sampled_from(ENV_NAMES), max_size=2))]
    if edge == "env":
        engine["env"].append({"name": draw(st.sampled_from(["GOVERNOR_X", "HOME", "HF_HOME"])), "value": "v"})
    engine["podLabels"] = {k: "v" for k in draw(st.lists(st.sampled_from(LABEL_KEYS), max_size=2))}
    if edge == "label":
        engine["podLabels"][draw(st.sampled_from(["governor.dev/x", "app.kubernetes.io/name", "-bad"]))] = "v"
    spec["slo"]["itlP95"] = draw(st.sampled_from(["0ms", "0.0s"])) if edge == "slo" else \
        draw(st.sampled_from(["1ms", "1.5m", "0.5s"]))
    return spec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_the_api_server_and_the_operator_agree_on_every_generated_spec(spec: dict[str, Any]) -> None:
    admitted = refusals(spec) == []
    accepted = isinstance(parse_spec(spec), InferenceServiceSpec)
    assert admitted == accepted, (refusals(spec), parse_spec(spec))
