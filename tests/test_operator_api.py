"""The InferenceService API: parsing, defaults, semantic checks, and the CRD generated from it."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from governor import contract
from governor.cli import main as governor_main
from governor.operator import api
from governor.operator.api import InferenceServiceSpec, duration_seconds, parse_model_uri
from governor.operator.crds import FILENAME, crd_manifest, render
from governor.operator.validation import FieldError, parse_spec, validate_spec
from governor.tuner import policy
from tests.crd_admission import apply_defaults

ROOT = Path(__file__).resolve().parents[1]

MINIMAL: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"},
    "engine": {"image": "ghcr.io/example/governor:0.1.0"},
    "slo": {"ttftP95": "500ms", "itlP95": "50ms"},
}

FULL: dict[str, Any] = {
    "model": {"uri": "pvc://models/llama-3.1-8b", "revision": "sha256-0f3a", "servedName": "llama-8b"},
    "engine": {
        "image": "ghcr.io/example/governor:0.1.0",
        "resources": {"gpus": 2, "memory": "64Gi", "cpu": 8},
        "dtype": "bfloat16",
        "kvCacheDtype": "fp8",
        "quantization": "fp8",
        "prefixCaching": False,
        "speculative": {"method": "draft_model", "draftModel": "hf://meta-llama/Llama-3.2-1B",
                        "numSpeculativeTokens": 4},
        "maxModelLen": 8192,
        "tensorParallelSize": 2,
        "knobs": {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048, "numSpeculativeTokens": 3},
        "extraArgs": ["--max-queue", "512"],
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                         "tolerationSeconds": 30}],
    },
    "replicas": 3,
    "slo": {"ttftP95": "800ms", "itlP95": "40ms", "e2eP95": "30s", "errorRate": 0.01, "window": "2m"},
    "autotune": {
        "enabled": True, "interval": "10s", "cooldown": "3m", "hysteresis": 0.15,
        "bounds": {"maxNumSeqs": {"min": 8, "max": 128}, "maxNumBatchedTokens": {"min": 512, "max": 4096},
                   "numSpeculativeTokens": {"min": 0, "max": 4}},
    },
    "rollout": {
        "steps": [{"weight": 5, "pause": "1m"}, {"weight": 25, "pause": "5m"}, {"weight": 75, "pause": "5m"}],
        "rollbackOn": [{"metric": "ttft_p95", "comparison": "relative", "threshold": 1.2, "for": "2m"},
                       {"metric": "error_rate", "comparison": "absolute", "threshold": 0.05, "for": "30s"}],
    },
}


def with_changes(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of `base` with dotted-path keys ("engine.resources.gpus") set; None deletes the key."""
    out = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def errors_of(raw: Any) -> dict[str, str]:
    result = parse_spec(raw)
    assert isinstance(result, list), f"expected errors, got a spec: {result!r}"
    assert result, "an invalid spec must report at least one error"
    assert all(isinstance(e, FieldError) for e in result)
    return {e.path: e.message for e in result}


def spec_of(raw: Any) -> InferenceServiceSpec:
    result = parse_spec(raw)
    assert isinstance(result, InferenceServiceSpec), [str(e) for e in result]
    return result


# --- parsing and defaults ---------------------------------------------------------------------------


def test_full_example_parses_with_its_values() -> None:
    spec = spec_of(FULL)
    assert spec.engine.resources.cpu == "8"  # an integer quantity is read as Kubernetes reads it
    assert spec.engine.speculative is not None and spec.engine.speculative.method == "draft_model"
    assert spec.engine.tolerations[1].toleration_seconds == 30
    assert spec.autotune.bounds is not None and spec.autotune.bounds.given() == {
        "max_num_seqs": (8, 128), "max_num_batched_tokens": (512, 4096), "num_speculative_tokens": (0, 4)}
    assert spec.rollout.rollback_on[1].for_ == "30s"
    assert spec.slo.targets() == api.SLO(ttft_p95_s=0.8, itl_p95_s=0.04, e2e_p95_s=30.0, error_rate=0.01)


def test_full_example_round_trips_through_its_wire_form() -> None:
    spec = spec_of(FULL)
    wire = spec.model_dump(by_alias=True)
    assert wire["rollout"]["rollbackOn"][0]["for"] == "2m" and wire["slo"]["e2eP95"] == "30s"
    assert spec_of(wire) == spec  # nulls in the dump are dropped, as the API server prunes them
    assert spec_of(spec.model_dump(by_alias=True, exclude_none=True)) == spec


def test_minimal_spec_gets_every_default() -> None:
    spec = spec_of(MINIMAL)
    assert spec.model.revision is None and spec.model.served_name is None
    e = spec.engine
    assert (e.resources.gpus, e.resources.memory, e.resources.cpu) == (1, None, None)
    assert (e.dtype, e.kv_cache_dtype, e.prefix_caching, e.speculative) == ("auto", "auto", True, None)
    assert (e.max_model_len, e.tensor_parallel_size) == (None, 1)
    assert e.knobs.model_dump() == {"max_num_seqs": None, "max_num_batched_tokens": None,
                                    "num_speculative_tokens": None}
    assert (e.extra_args, e.node_selector, e.tolerations) == ([], {}, [])
    assert spec.replicas == 1
    assert (spec.slo.e2e_p95, spec.slo.error_rate, spec.slo.window) == (None, None, "1m")
    a = spec.autotune
    assert (a.enabled, a.interval, a.cooldown, a.hysteresis, a.bounds) == (False, "15s", "5m", 0.1, None)
    assert [(s.weight, s.pause) for s in spec.rollout.steps] == [(10, "2m"), (50, "2m")]
    assert spec.rollout.rollback_on == []


def test_rollback_trigger_defaults() -> None:
    spec = spec_of(with_changes(MINIMAL, **{"rollout.rollbackOn": [{"metric": "itl_p95", "threshold": 1.1}]}))
    trigger = spec.rollout.rollback_on[0]
    assert (trigger.comparison, trigger.for_) == ("relative", "2m")


def test_knob_field_names_are_the_contracts() -> None:
    assert tuple(api.StartingKnobs.model_fields) == contract.KNOB_NAMES
    assert tuple(api.AutotuneBounds.model_fields) == contract.KNOB_NAMES


def test_every_other_declaration_of_the_knob_names_is_the_contracts() -> None:
    assert contract.KNOB_NAMES == ("max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens")
    assert tuple(contract.KnobsState.model_fields) == (*contract.KNOB_NAMES, "bounds")
    assert (policy.MAX_NUM_SEQS, policy.MAX_NUM_BATCHED_TOKENS, policy.NUM_SPECULATIVE_TOKENS) == contract.KNOB_NAMES


@pytest.mark.parametrize(("text", "seconds"), [("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("1.5m", 90.0),
                                               ("0.25s", 0.25), ("15s", 15.0)])
def test_duration_seconds(text: str, seconds: float) -> None:
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5h", "ms", "-1s", "1.s", " 1s", "1 s", "1e3ms"])
def test_duration_seconds_rejects_other_forms(text: str) -> None:
    with pytest.raises(ValueError, match="expected a duration like '500ms'"):
        duration_seconds(text)


def test_model_uri_forms() -> None:
    assert parse_model_uri("/models/llama") == api.ModelURI(scheme="path", path="/models/llama")
    assert parse_model_uri("pvc://models/llama/8b/") == api.ModelURI(scheme="pvc", claim="models", path="/llama/8b")
    assert parse_model_uri("pvc://models") == api.ModelURI(scheme="pvc", claim="models")
    assert parse_model_uri("hf://Qwen/Qwen3-0.6B@abc123") == api.ModelURI(scheme="hf", repo="Qwen/Qwen3-0.6B",
                                                                         revision="abc123")


# --- schema errors, as people read them ---------------------------------------------------------------


def test_wrong_enum_names_the_field() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"engine.dtype": "int4"}))
    assert list(errors) == ["spec.engine.dtype"]
    assert "bfloat16" in errors["spec.engine.dtype"]


def test_negative_replicas() -> None:
    assert list(errors_of(with_changes(MINIMAL, replicas=-1))) == ["spec.replicas"]


def test_bad_duration_says_what_a_duration_looks_like() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"slo.ttftP95": "half a second"}))
    assert errors == {"spec.slo.ttftP95": "expected a duration like '500ms', '2s' or '1m' (number + ms|s|m), "
                                          "got 'half a second'"}


@pytest.mark.parametrize(("path", "uri"), [
    ("model.uri", "pvc://Bad_Claim/x"), ("model.uri", "hf://no-org"), ("model.uri", "hf://org/name@"),
    ("engine.speculative", {"method": "draft_model", "draftModel": "hf://no-org", "numSpeculativeTokens": 4})])
def test_the_uri_pattern_accepts_exactly_what_the_parser_does(path: str, uri: Any) -> None:
    errors = errors_of(with_changes(MINIMAL, **{path: uri}))
    (field,) = errors
    assert field in ("spec.model.uri", "spec.engine.speculative.draftModel")
    assert "unsupported model URI" in errors[field]


@pytest.mark.parametrize("uri", ["/m", "/models/llama 3", "pvc://c", "pvc://c.d-e/x/y", "pvc://C/x", "hf://a/b",
                                 "hf://a/b@v1.0/x", "hf://a", "s3://b/k", "//", "pvc://c/x y"])
def test_model_uri_pattern_and_parser_agree(uri: str) -> None:
    try:
        parse_model_uri(uri)
        parsed = True
    except ValueError:
        parsed = False
    assert (re.fullmatch(api.MODEL_URI_PATTERN, uri) is not None) == parsed


def test_bad_uri_scheme_lists_the_accepted_forms() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"model.uri": "s3://bucket/llama"}))
    assert list(errors) == ["spec.model.uri"]
    assert "pvc://claim[/path]" in errors["spec.model.uri"] and "hf://org/name" in errors["spec.model.uri"]


def test_types_are_strict_like_the_api_server() -> None:
    errors = errors_of(with_changes(MINIMAL, replicas="3", **{"engine.prefixCaching": "yes",
                                                            "autotune.hysteresis": "0.1"}))
    assert set(errors) == {"spec.replicas", "spec.engine.prefixCaching", "spec.autotune.hysteresis"}


def test_paths_index_into_lists() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"rollout.steps": [{"weight": 10}, {"weight": 101}]}))
    assert list(errors) == ["spec.rollout.steps[1].weight"]


def test_null_for_a_required_field_is_missing() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"engine": {"image": None}}))
    assert errors == {"spec.engine.image": "Field required"}


def test_nulls_for_optional_fields_mean_their_defaults() -> None:
    raw = {**MINIMAL, "replicas": None, "autotune": None, "engine": {**MINIMAL["engine"], "knobs": None}}
    assert spec_of(raw) == spec_of(MINIMAL)


def test_empty_spec_names_every_required_field() -> None:
    assert set(errors_of({})) == {"spec.model", "spec.engine", "spec.slo"}


def test_unknown_and_snake_case_fields_are_rejected() -> None:
    errors = errors_of(with_changes(MINIMAL, **{"engine.tensor_parallel_size": 2, "engine.gpuCount": 1}))
    assert set(errors) == {"spec.engine.tensor_parallel_size", "spec.engine.gpuCount"}
    assert "camelCase" in errors["spec.engine.gpuCount"]


def test_non_object_spec() -> None:
    assert errors_of(["model"]) == {"spec": "expected an object, got list"}


def test_non_finite_numbers_are_rejected() -> None:
    assert set(errors_of(with_changes(MINIMAL, **{"slo.errorRate": float("nan")}))) == {"spec.slo.errorRate"}


# --- semantic checks (validate_spec, run by parse_spec) ------------------------------------------------


SEMANTIC_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "bound min above max": (
        {"autotune.bounds": {"maxNumSeqs": {"min": 64, "max": 8}}}, "spec.autotune.bounds.maxNumSeqs"),
    "bound min zero for a knob that starts at 1": (
        {"autotune.bounds": {"maxNumBatchedTokens": {"min": 0, "max": 8}}},
        "spec.autotune.bounds.maxNumBatchedTokens.min"),
    "draft_model without draftModel": (
        {"engine.speculative": {"method": "draft_model", "numSpeculativeTokens": 4}},
        "spec.engine.speculative.draftModel"),
    "ngram with a draftModel": (
        {"engine.speculative": {"method": "ngram", "draftModel": "/models/draft", "numSpeculativeTokens": 4}},
        "spec.engine.speculative.draftModel"),
    "ngram with a draft quantization": (
        {"engine.speculative": {"method": "ngram", "quantization": "fp8", "numSpeculativeTokens": 4}},
        "spec.engine.speculative.quantization"),
    "tensor parallel wider than the pod's GPUs": (
        {"engine.tensorParallelSize": 4, "engine.resources": {"gpus": 2}}, "spec.engine.tensorParallelSize"),
    "starting knob below its autotune bound": (
        {"engine.knobs": {"maxNumSeqs": 4}, "autotune.bounds": {"maxNumSeqs": {"min": 8, "max": 64}}},
        "spec.engine.knobs.maxNumSeqs"),
    "starting knob above its autotune bound": (
        {"engine.knobs": {"maxNumBatchedTokens": 8192},
         "autotune.bounds": {"maxNumBatchedTokens": {"min": 256, "max": 4096}}},
        "spec.engine.knobs.maxNumBatchedTokens"),
    "K knob without speculative decoding": (
        {"engine.knobs": {"numSpeculativeTokens": 2}}, "spec.engine.knobs.numSpeculativeTokens"),
    "K knob above the speculative cap": (
        {"engine.knobs": {"numSpeculativeTokens": 5},
         "engine.speculative": {"method": "ngram", "numSpeculativeTokens": 4}},
        "spec.engine.knobs.numSpeculativeTokens"),
    "K bound above the speculative cap": (
        {"engine.speculative": {"method": "ngram", "numSpeculativeTokens": 4},
         "autotune.bounds": {"numSpeculativeTokens": {"min": 0, "max": 8}}},
        "spec.autotune.bounds.numSpeculativeTokens.max"),
    "hf revision disagreeing with model.revision": (
        {"model.uri": "hf://org/name@v1", "model.revision": "v2"}, "spec.model.revision"),
    "zero SLO target": ({"slo.itlP95": "0ms"}, "spec.slo.itlP95"),
    "zero tuner interval": ({"autotune.interval": "0s"}, "spec.autotune.interval"),
    "rollout weights not increasing": (
        {"rollout.steps": [{"weight": 50}, {"weight": 50}]}, "spec.rollout.steps[1].weight"),
    "rollout step of 100": (
        {"rollout.steps": [{"weight": 10}, {"weight": 100}]}, "spec.rollout.steps[1].weight"),
    "relative latency trigger below 1 (would fire on a better canary)": (
        {"rollout.rollbackOn": [{"metric": "ttft_p95", "threshold": 0.2}]}, "spec.rollout.rollbackOn[0].threshold"),
    "relative throughput trigger above 1": (
        {"rollout.rollbackOn": [{"metric": "throughput", "threshold": 1.5}]}, "spec.rollout.rollbackOn[0].threshold"),
    "absolute error rate above 1": (
        {"rollout.rollbackOn": [{"metric": "error_rate", "comparison": "absolute", "threshold": 2.0}]},
        "spec.rollout.rollbackOn[0].threshold"),
    "relative throughput trigger with route weights": (
        {"rollout.rollbackOn": [{"metric": "throughput", "threshold": 0.8}], "rollout.httpRoute": "chat-route"},
        "spec.rollout.rollbackOn[0].comparison"),
    "trigger window under a second": (
        {"rollout.rollbackOn": [{"metric": "itl_p95", "threshold": 1.5, "for": "500ms"}]},
        "spec.rollout.rollbackOn[0].for"),
    "extraArgs setting a flag the operator sets": (
        {"engine.extraArgs": ["--max-queue", "64", "--tensor-parallel-size", "4"]}, "spec.engine.extraArgs[2]"),
    "extraArgs setting an operator flag as flag=value": (
        {"engine.extraArgs": ["--port=9000"]}, "spec.engine.extraArgs[0]"),
    "extraArgs setting the admin token file": (
        {"engine.extraArgs": ["--admin-token-file", "/tmp/t"]}, "spec.engine.extraArgs[0]"),
    "env setting an operator variable": (
        {"engine.env": [{"name": "GOVERNOR_REVISION", "value": "x"}]}, "spec.engine.env[0].name"),
    "env moving the writable home": ({"engine.env": [{"name": "HOME", "value": "/"}]}, "spec.engine.env[0].name"),
    "podLabels setting a selector label": (
        {"engine.podLabels": {"governor.dev/revision": "x"}}, "spec.engine.podLabels[governor.dev/revision]"),
    "podLabels setting an app.kubernetes.io label": (
        {"engine.podLabels": {"app.kubernetes.io/name": "x"}}, "spec.engine.podLabels[app.kubernetes.io/name]"),
    "podLabels with an invalid key": ({"engine.podLabels": {"bad key": "x"}}, "spec.engine.podLabels[bad key]"),
    "podAnnotations setting the scrape annotation": (
        {"engine.podAnnotations": {"prometheus.io/scrape": "false"}},
        "spec.engine.podAnnotations[prometheus.io/scrape]"),
}


@pytest.mark.parametrize("case", list(SEMANTIC_CASES))
def test_semantic_check_names_the_field(case: str) -> None:
    changes, path = SEMANTIC_CASES[case]
    errors = errors_of(with_changes(MINIMAL, **changes))
    assert list(errors) == [path], errors
    # validate_spec alone reports the same for a spec built without parse_spec's checks
    spec = InferenceServiceSpec.model_validate(with_changes(MINIMAL, **changes))
    assert [e.path for e in validate_spec(spec)] == [path]


def test_semantic_checks_pass_on_edges() -> None:
    spec = spec_of(with_changes(
        MINIMAL, **{"engine.resources": {"gpus": 0}, "engine.tensorParallelSize": 2,  # CPU ranks need no GPUs
                    "engine.knobs": {"maxNumSeqs": 8, "numSpeculativeTokens": 0},
                    "autotune.bounds": {"maxNumSeqs": {"min": 8, "max": 8}},
                    "rollout.steps": [], "model.uri": "hf://org/name@v1", "model.revision": "v1"}))
    assert validate_spec(spec) == []


# --- never raises -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
FIELD_NAMES = st.sampled_from(["model", "engine", "slo", "replicas", "autotune", "rollout", "uri", "image",
                               "ttftP95", "itlP95", "steps", "bounds", "knobs", "speculative", "resources"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(FIELD_NAMES | st.text(max_size=8), JSON, max_size=6))
def test_parse_spec_never_raises_on_random_json(raw: dict[str, Any]) -> None:
    result = parse_spec(raw)
    assert isinstance(result, InferenceServiceSpec) or all(isinstance(e, FieldError) for e in result)


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    return out


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_paths(FULL)[1:]), JSON)
def test_parse_spec_never_raises_when_any_field_of_a_valid_spec_is_replaced(path: tuple[str, ...],
                                                                           value: Any) -> None:
    raw = copy.deepcopy(FULL)
    node = raw
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    result = parse_spec(raw)
    assert isinstance(result, InferenceServiceSpec) or all(isinstance(e, FieldError) for e in result)


@pytest.mark.parametrize("raw", [None, 0, "spec", [], {"model": None, "engine": None, "slo": None},
                                 {1: 2}, {"model": {"uri": ["/x"]}}, {"rollout": {"steps": [None, 3]}}])
def test_parse_spec_never_raises_on_odd_inputs(raw: Any) -> None:
    assert isinstance(parse_spec(raw), list)


# --- the CRD ----------------------------------------------------------------------------------------

FORBIDDEN_KEYS = ("$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "const")


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """Every schema node under `node` with its path (properties, array items and map values)."""
    out = [(path, node)]
    for name, child in node.get("properties", {}).items():
        out += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_crd_schema_is_structural() -> None:
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root, ""):
        assert not set(FORBIDDEN_KEYS) & set(node), f"{path} keeps {set(FORBIDDEN_KEYS) & set(node)}"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert node.get("additionalProperties") is not False, f"{path}: additionalProperties: false"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, f"{path}: properties and additionalProperties together"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, f"{path}: OpenAPI 3.0 form expected"
        for key in ("items", "additionalProperties"):
            assert not isinstance(node.get(key), bool), f"{path}.{key} must be a schema"
    spec_nodes = [(p, n) for p, n in _walk(root["properties"]["spec"], "spec")]
    assert len(spec_nodes) > 60
    for path, node in spec_nodes + _walk(root["properties"]["status"], "status"):
        if not path.endswith("[]") and not path.endswith("{}"):
            assert node.get("description"), f"{path} has no description (kubectl explain shows it)"


def test_crd_keeps_validation_and_defaults() -> None:
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    engine = props["engine"]["properties"]
    assert spec["required"] == ["model", "engine", "slo"]
    assert props["model"]["required"] == ["uri"]
    assert props["model"]["properties"]["uri"]["pattern"] == api.MODEL_URI_PATTERN
    assert engine["dtype"] == {"type": "string", "description": engine["dtype"]["description"],
                               "default": "auto", "enum": ["auto", "float32", "bfloat16", "float16"]}
    assert (engine["tensorParallelSize"]["minimum"], engine["tensorParallelSize"]["maximum"]) == (1, 8)
    assert engine["nodeSelector"]["additionalProperties"] == {"type": "string"}
    assert engine["resources"]["properties"]["cpu"]["x-kubernetes-int-or-string"] is True
    assert props["slo"]["properties"]["ttftP95"]["pattern"] == api.DURATION_PATTERN
    assert props["slo"]["properties"]["e2eP95"]["pattern"] == api.DURATION_PATTERN
    trigger = props["rollout"]["properties"]["rollbackOn"]["items"]["properties"]
    assert trigger["threshold"]["minimum"] == 0 and trigger["threshold"]["exclusiveMinimum"] is True
    assert trigger["for"]["default"] == "2m"
    assert props["rollout"]["properties"]["steps"]["default"] == [{"weight": 10, "pause": "2m"},
                                                                  {"weight": 50, "pause": "2m"}]
    status = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert status["properties"]["tuning"] == {
        "type": "object", "description": status["properties"]["tuning"]["description"],
        "x-kubernetes-preserve-unknown-fields": True}
    rollout = status["properties"]["rollout"]
    assert rollout["x-kubernetes-preserve-unknown-fields"] is True  # typed where read, open for what is added
    assert rollout["properties"]["canaryWeight"]["type"] == "integer"
    conditions = status["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert "type" in conditions["items"]["required"]  # a list-map key must be required


def test_crd_defaults_agree_with_the_models() -> None:
    spec_schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    minimal = apply_defaults(spec_schema, copy.deepcopy(MINIMAL))
    assert minimal["replicas"] == 1 and minimal["autotune"]["interval"] == "15s"
    assert minimal["rollout"]["steps"][1] == {"weight": 50, "pause": "2m"}
    for raw in (MINIMAL, FULL):
        assert spec_of(apply_defaults(spec_schema, copy.deepcopy(raw))) == spec_of(raw)


def test_crd_shape() -> None:
    crd = crd_manifest()
    assert (crd["apiVersion"], crd["kind"]) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "inferenceservices.governor.dev"
    spec = crd["spec"]
    assert spec["group"] == "governor.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "InferenceService", "listKind": "InferenceServiceList",
                             "plural": "inferenceservices", "singular": "inferenceservice", "shortNames": ["infsvc"],
                             "categories": ["all", "governor"]}
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    assert [(c["name"], c["type"], c["jsonPath"], c.get("priority", 0))
            for c in version["additionalPrinterColumns"]] == [
        ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', 0),
        ("Phase", "string", ".status.phase", 0), ("Revision", "string", ".status.revision", 0),
        ("Canary", "integer", ".status.canaryWeight", 0), ("Replicas", "integer", ".status.replicas", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0), ("Model", "string", ".spec.model.uri", 1)]
    root = version["schema"]["openAPIV3Schema"]
    assert root["type"] == "object" and root["required"] == ["spec"]
    assert set(root["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert root["properties"]["metadata"] == {"type": "object"}  # the API server allows nothing else there


@pytest.mark.parametrize("where", ["crds", "charts/governor/crds"])
def test_generated_crd_files_match_the_models(where: str) -> None:
    path = ROOT / where / FILENAME
    assert path.exists(), f"{path} is missing: run `governor crds` from the repository root"
    text = path.read_text(encoding="utf-8")
    assert yaml.safe_load(text) == crd_manifest(), f"{path} drifted from governor.operator.api: run `governor crds`"
    assert text == render(crd_manifest()), f"{path} is not as generated: run `governor crds`"


def test_governor_crds_writes_every_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert governor_main(["crds", "--out-dir", str(tmp_path / "a"), "--out-dir", str(tmp_path / "b")]) == 0
    for d in ("a", "b"):
        assert yaml.safe_load((tmp_path / d / FILENAME).read_text(encoding="utf-8")) == crd_manifest()
    assert capsys.readouterr().out.split() == [str(tmp_path / "a" / FILENAME), str(tmp_path / "b" / FILENAME)]


def test_crd_parses_as_the_kubernetes_clients_crd_model() -> None:
    client = pytest.importorskip("kubernetes.client")
    crd = client.V1CustomResourceDefinition.from_dict(crd_manifest())  # the client validates with pydantic
    version = crd.spec.versions[0]
    assert (crd.spec.names.short_names, version.subresources.status) == (["infsvc"], {})
    resources = version.schema.open_apiv3_schema.properties["spec"].properties["engine"].properties["resources"]
    assert resources.properties["cpu"].x_kubernetes_int_or_string is True
