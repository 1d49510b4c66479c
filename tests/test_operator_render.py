"""Rendering an InferenceService into its children: pure manifests, stable revision identity."""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from governor import contract
from governor.engine.cli import build_parser
from governor.operator.api import InferenceServiceSpec
from governor.operator.model_sources import cache_size
from governor.operator.pod_ownership import OPERATOR_FLAGS
from governor.operator.render import (
    LABEL_REVISION,
    LABEL_SERVICE,
    admin_secret,
    render,
    revision_hash,
    starting_knobs,
)
from governor.operator.validation import parse_spec
from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parents[1]
NAME, NAMESPACE, UID = "chat", "ml", "0b6f1c9e-7d1a-4c1e-9a53-6a1f2d1f7e00"

MINIMAL: dict[str, Any] = {
    "model": {"uri": "/models/llama"},
    "engine": {"image": "ghcr.io/example/governor:0.1.0"},
    "slo": {"ttftP95": "500ms", "itlP95": "50ms"},
}


def spec_of(raw: dict[str, Any], **engine: Any) -> InferenceServiceSpec:
    raw = copy.deepcopy(raw)
    raw["engine"].update(engine)
    parsed = parse_spec(raw)
    assert isinstance(parsed, InferenceServiceSpec), parsed
    return parsed


def with_model(**model: Any) -> dict[str, Any]:
    raw = copy.deepcopy(MINIMAL)
    raw["model"] = model
    return raw


def children(spec: InferenceServiceSpec, status: dict[str, Any] | None = None, *,
             pod_monitor: bool = False) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in render(NAME, NAMESPACE, UID, 3, spec, status, pod_monitor=pod_monitor)}


def pod_of(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = objs["Deployment"]["spec"]["template"]["spec"]
    return pod


def engine_of(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_of(objs)["containers"]
    return container


def expanded_args(objs: dict[str, dict[str, Any]]) -> list[str]:
    """The container args as the kubelet runs them: $(VAR) filled from env (ConfigMap keys here)."""
    container = engine_of(objs)
    data = objs["ConfigMap"]["data"]
    env = {}
    for e in container["env"]:
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            assert ref["name"] == objs["ConfigMap"]["metadata"]["name"]
            env[e["name"]] = data[ref["key"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def serve_args(objs: dict[str, dict[str, Any]]) -> Any:
    return build_parser().parse_args(["serve", *expanded_args(objs)])


def test_minimal_spec_renders_deployment_service_and_config_map_owned_and_labelled() -> None:
    spec = spec_of(MINIMAL)
    objs = render(NAME, NAMESPACE, UID, 3, spec, None, pod_monitor=False)
    rev = revision_hash(spec)
    assert [o["kind"] for o in objs] == ["Deployment", "Service", "ConfigMap"]
    assert [o["metadata"]["name"] for o in objs] == [f"chat-{rev}", "chat", f"chat-{rev}-config"]
    for o in objs:
        assert o["metadata"]["namespace"] == NAMESPACE
        assert o["metadata"]["ownerReferences"] == [{"apiVersion": "governor.dev/v1alpha1", "kind": "InferenceService",
                                                     "name": NAME, "uid": UID, "controller": True,
                                                     "blockOwnerDeletion": True}]
        assert o["metadata"]["labels"] == {"app.kubernetes.io/name": "governor-engine",
                                           "app.kubernetes.io/instance": NAME,
                                           "app.kubernetes.io/managed-by": "governor",
                                           "app.kubernetes.io/component": "engine",
                                           LABEL_SERVICE: NAME,
                                           # the Service serves every revision; the rest belong to one
                                           **({} if o["kind"] == "Service" else {LABEL_REVISION: rev})}


def test_deployment_selects_its_revision_and_service_selects_every_revision() -> None:
    objs = children(spec_of({**MINIMAL, "replicas": 2}))
    rev = objs["ConfigMap"]["data"]["revision"]
    dep = objs["Deployment"]["spec"]
    assert dep["replicas"] == 2
    assert dep["selector"]["matchLabels"] == {LABEL_SERVICE: NAME, LABEL_REVISION: rev}
    assert dep["template"]["metadata"]["labels"][LABEL_REVISION] == rev
    svc = objs["Service"]["spec"]
    assert svc["type"] == "ClusterIP"
    assert svc["selector"] == {LABEL_SERVICE: NAME}
    assert svc["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_engine_args_carry_the_static_configuration() -> None:
    objs = children(spec_of(MINIMAL, dtype="bfloat16", kvCacheDtype="fp8", maxModelLen=4096, quantization="fp8"))
    args = expanded_args(objs)
    rev = objs["ConfigMap"]["data"]["revision"]
    assert engine_of(objs)["command"] == ["governor", "serve"]
    assert args[0] == "/models/llama"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--served-model-name") == NAME
    assert flag(args, "--revision") == rev
    assert flag(args, "--drain-grace-s") == "30"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--kv-cache-dtype") == "fp8"
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--quantization") == "fp8"
    assert flag(args, "--tensor-parallel-size") == "1"
    assert "--enable-prefix-caching" in args
    assert "--speculative-config" not in args


def test_every_rendered_flag_parses_with_the_engine_serve_parser() -> None:
    raw = with_model(uri="pvc://models/llama-8b", revision="abc", servedName="llama")
    raw["engine"].update(dtype="float16", prefixCaching=False, maxModelLen=2048, tensorParallelSize=2,
                         resources={"gpus": 2}, knobs={"maxNumSeqs": 32, "numSpeculativeTokens": 2},
                         speculative={"method": "ngram", "numSpeculativeTokens": 4}, extraArgs=["--max-queue", "64"])
    raw["autotune"] = {"bounds": {"maxNumSeqs": {"min": 8, "max": 128}}}
    ns = serve_args(children(spec_of(raw)))
    assert ns.model == "/models/models/llama-8b"
    assert ns.served_model_name == "llama"
    assert ns.enable_prefix_caching is False
    assert ns.tensor_parallel_size == 2
    assert ns.max_model_len == 2048
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert (ns.max_num_seqs, ns.max_num_seqs_cap) == (32, 128)
    assert (ns.max_num_batched_tokens, ns.max_num_batched_tokens_cap) == (8192, 8192)
    assert ns.max_queue == 64
    assert ns.device is None  # on GPU the engine picks the device itself


def test_the_quantization_flag_parses_with_the_engine_serve_parser() -> None:
    raw = with_model(uri="pvc://models/llama-8b-fp8")
    raw["engine"].update(quantization="compressed-tensors")
    assert serve_args(children(spec_of(raw))).quantization == "compressed-tensors"
    assert serve_args(children(spec_of(with_model(uri="pvc://models/llama-8b")))).quantization is None


def test_the_operator_s_flags_are_exactly_those_extra_args_may_not_set() -> None:
    """Every flag the operator renders, over specs that between them render each one, is refused in extraArgs;
    every refused flag is rendered, or stands for what the operator sets another way (--model: the positional
    model argument; --namespace: GOVERNOR_NAMESPACE); all but --model are serve flags."""
    rendered: set[str] = set()
    for engine in ({"resources": {"gpus": 0}, "maxModelLen": 2048, "prefixCaching": False, "quantization": "fp8",
                    "speculative": {"method": "ngram", "numSpeculativeTokens": 4}}, {}):
        raw = with_model(uri="pvc://models/llama-8b", servedName="llama")
        raw["engine"].update(engine)
        rendered |= {a.split("=", 1)[0] for a in engine_of(children(spec_of(raw)))["args"] if a.startswith("--")}
    assert rendered == set(OPERATOR_FLAGS) - {"--model", "--namespace"}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve_flags = {o for a in commands.choices["serve"]._actions for o in a.option_strings}
    assert set(OPERATOR_FLAGS) - serve_flags == {"--model"}


def test_the_engine_refuses_abbreviated_flags() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/m", "--tensor-parallel", "2"])


def test_cpu_service_pins_the_engine_to_cpu_and_asks_for_no_gpu() -> None:
    objs = children(spec_of(MINIMAL, resources={"gpus": 0, "memory": "8Gi", "cpu": 4}))
    assert serve_args(objs).device == "cpu"
    assert engine_of(objs)["resources"] == {"requests": {"memory": "8Gi", "cpu": "4"}, "limits": {"memory": "8Gi"}}


def test_extra_args_come_last_as_given() -> None:
    args = engine_of(children(spec_of(MINIMAL, extraArgs=["--max-queue", "512", "--seed", "7"])))["args"]
    assert args[-4:] == ["--max-queue", "512", "--seed", "7"]


def test_knobs_come_from_status_over_spec_and_reach_pods_through_the_config_map() -> None:
    spec = spec_of(MINIMAL, knobs={"maxNumSeqs": 64, "maxNumBatchedTokens": 2048})
    status = {"tuning": {"knobs": {"max_num_seqs": 48}}}
    objs = children(spec, status)
    assert objs["ConfigMap"]["data"]["max_num_seqs"] == "48"
    assert objs["ConfigMap"]["data"]["max_num_batched_tokens"] == "2048"
    ns = serve_args(objs)
    assert (ns.max_num_seqs, ns.max_num_batched_tokens) == (48, 2048)
    # The pod template holds references, never the values, so a tuned knob restarts no pod.
    args = engine_of(objs)["args"]
    assert flag(args, "--max-num-seqs") == "$(GOVERNOR_KNOB_MAX_NUM_SEQS)"
    assert json.loads(objs["ConfigMap"]["data"]["engine.json"])["knobs"] == {"max_num_seqs": 48,
                                                                            "max_num_batched_tokens": 2048}


def test_knobs_without_spec_or_status_start_at_their_caps() -> None:
    assert starting_knobs(spec_of(MINIMAL), None) == {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def test_starting_knobs_are_clamped_to_the_autotune_bounds_max() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["autotune"] = {"bounds": {"maxNumSeqs": {"min": 1, "max": 64}}}
    knobs = starting_knobs(spec_of(raw), {"tuning": {"knobs": {"max_num_seqs": 100}}})
    assert knobs["max_num_seqs"] == 64


def test_speculation_depth_starts_from_status_within_its_cap() -> None:
    spec = spec_of(MINIMAL, speculative={"method": "ngram", "numSpeculativeTokens": 4},
                   knobs={"numSpeculativeTokens": 3})
    assert starting_knobs(spec, None)["num_speculative_tokens"] == 3
    assert starting_knobs(spec, {"tuning": {"knobs": {"num_speculative_tokens": 0}}})["num_speculative_tokens"] == 0


def test_changing_knobs_changes_neither_revision_nor_deployment() -> None:
    a = children(spec_of(MINIMAL, knobs={"maxNumSeqs": 64}))
    b = children(spec_of(MINIMAL, knobs={"maxNumSeqs": 16}), {"tuning": {"knobs": {"max_num_seqs": 8}}})
    assert a["Deployment"] == b["Deployment"]
    assert a["ConfigMap"]["data"]["revision"] == b["ConfigMap"]["data"]["revision"]
    assert a["ConfigMap"]["data"]["max_num_seqs"] != b["ConfigMap"]["data"]["max_num_seqs"]


@pytest.mark.parametrize("change", [
    {"engine": {"image": "ghcr.io/example/governor:0.2.0"}},
    {"model": {"uri": "/models/llama", "revision": "v2"}},
    {"engine": {"image": "ghcr.io/example/governor:0.1.0", "kvCacheDtype": "fp8"}},
    {"autotune": {"bounds": {"maxNumSeqs": {"min": 1, "max": 512}}}},
    {"engine": {"image": "ghcr.io/example/governor:0.1.0", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}},
    {"engine": {"image": "ghcr.io/example/governor:0.1.0", "podLabels": {"team": "a"}}},
    {"model": {"uri": "/models/llama", "cache": {"size": "10Gi"}}},
])
def test_pod_template_changes_change_the_revision_and_deployment_name(change: dict[str, Any]) -> None:
    before = spec_of(MINIMAL)
    after = spec_of({**MINIMAL, **change})
    assert revision_hash(before) != revision_hash(after)
    assert children(before)["Deployment"]["metadata"]["name"] != children(after)["Deployment"]["metadata"]["name"]


def test_fields_written_out_at_their_defaults_keep_the_revision() -> None:
    explicit = spec_of(MINIMAL, dtype="auto", kvCacheDtype="auto", prefixCaching=True, tensorParallelSize=1,
                       resources={"gpus": 1}, env=[], extraArgs=[], podLabels={}, affinity=None)
    assert revision_hash(explicit) == revision_hash(spec_of(MINIMAL))


def test_revision_hash_is_ten_hex_digits_and_ignores_replicas_slo_and_rollout() -> None:
    base = revision_hash(spec_of(MINIMAL))
    assert re.fullmatch(r"[0-9a-f]{10}", base)
    other = spec_of({**MINIMAL, "replicas": 5, "slo": {"ttftP95": "1s", "itlP95": "80ms"},
                     "rollout": {"steps": []}, "autotune": {"enabled": True}})
    assert revision_hash(other) == base


def test_tensor_parallel_validation_requires_a_gpu_per_rank() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["engine"].update(tensorParallelSize=2, resources={"gpus": 1})
    assert [e.path for e in parse_spec(raw)] == ["spec.engine.tensorParallelSize"]  # type: ignore[union-attr]


def test_tensor_parallel_pod_gets_a_gpu_per_rank_and_shared_memory() -> None:
    objs = children(spec_of(MINIMAL, tensorParallelSize=2, resources={"gpus": 2}))
    pod = pod_of(objs)
    assert engine_of(objs)["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine_of(objs)["volumeMounts"]


def test_unvalidated_tensor_parallel_spec_still_asks_for_a_gpu_per_rank() -> None:
    spec = spec_of(MINIMAL, resources={"gpus": 1})
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"tensor_parallel_size": 2})})
    assert engine_of(children(spec))["resources"]["limits"]["nvidia.com/gpu"] == "2"


def volumes_of(objs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod's volumes by name, without the two every engine pod has (/tmp and the admin token)."""
    return {v["name"]: v for v in pod_of(objs)["volumes"] if v["name"] not in ("tmp", "admin-token")}


def model_mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in container["volumeMounts"] if m["name"] not in ("tmp", "admin-token")]


def test_single_rank_pod_has_no_shared_memory_volume() -> None:
    objs = children(spec_of(MINIMAL))
    assert volumes_of(objs) == {}
    assert engine_of(objs)["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"},
                                            "limits": {"nvidia.com/gpu": "1"}}


def test_pvc_model_is_mounted_read_only_under_models() -> None:
    objs = children(spec_of(with_model(uri="pvc://weights/llama/3.1-8b")))
    assert volumes_of(objs) == {"model-pvc-0": {"name": "model-pvc-0",
                                                "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}}
    assert model_mounts(engine_of(objs)) == [{"name": "model-pvc-0", "mountPath": "/models/weights",
                                              "readOnly": True}]
    assert serve_args(objs).model == "/models/weights/llama/3.1-8b"
    assert "initContainers" not in pod_of(objs)


def test_pvc_draft_model_on_the_same_claim_shares_its_volume() -> None:
    objs = children(spec_of(with_model(uri="pvc://weights/big"),
                            speculative={"method": "draft_model", "draftModel": "pvc://weights/small",
                                         "numSpeculativeTokens": 3}))
    assert len(volumes_of(objs)) == 1
    assert serve_args(objs).speculative_config == {"method": "draft_model", "num_speculative_tokens": 3,
                                                   "model": "/models/weights/small"}


def test_a_draft_quantization_reaches_the_engines_speculative_config() -> None:
    objs = children(spec_of(with_model(uri="pvc://weights/big"),
                            speculative={"method": "draft_model", "draftModel": "pvc://weights/small",
                                         "numSpeculativeTokens": 4, "quantization": "fp8"}))
    config = serve_args(objs).speculative_config
    assert config["quantization"] == "fp8" and config["model"] == "/models/weights/small"
    # The engine's own parser takes what the operator renders.
    from governor.engine.config import SpeculativeConfig

    assert SpeculativeConfig.model_validate(config).quantization == "fp8"


def test_hf_model_is_downloaded_by_an_init_container_into_the_model_cache() -> None:
    objs = children(spec_of(with_model(uri="hf://meta-llama/Llama-3.1-8B@main")))
    pod = pod_of(objs)
    assert volumes_of(objs) == {"model-cache": {"name": "model-cache", "emptyDir": {"sizeLimit": "34Gi"}}}
    (init,) = pod["initContainers"]
    assert init["image"] == "ghcr.io/example/governor:0.1.0"
    assert init["command"][:2] == ["python", "-c"]
    assert "snapshot_download" in init["command"][2] and "allow_patterns" in init["command"][2]
    assert init["command"][3:6] == ["meta-llama/Llama-3.1-8B", "main", "/models/hf/meta-llama/Llama-3.1-8B"]
    assert json.loads(init["command"][6]) == ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    assert json.loads(init["command"][7]) == ["consolidated*", "original/*"]  # the same weights in other layouts
    assert model_mounts(init) == [{"name": "model-cache", "mountPath": "/models/hf"}]
    assert model_mounts(engine_of(objs)) == [{"name": "model-cache", "mountPath": "/models/hf", "readOnly": True}]
    assert serve_args(objs).model == "/models/hf/meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize(("repos", "size"), [
    (["meta-llama/Llama-3.1-8B-Instruct"], "34Gi"),  # 8e9 × 4.5 B = 33.5 GiB
    (["Qwen/Qwen2.5-0.5B-Instruct"], "3Gi"),
    (["mistralai/Mixtral-8x7B-v0.1"], "235Gi"),  # 8 experts × 7B, counted as full models
    (["meta-llama/Llama-4-Scout-17B-16E-Instruct"], "1140Gi"),  # 16 experts × 17B: too large is harmless
    (["HuggingFaceTB/SmolLM2-135M"], "1Gi"),
    (["Qwen/Qwen3-30B-A3B"], "126Gi"),  # the total, not the active 3B
    (["openai-community/gpt2"], None),  # no size in the name: no limit rather than a guess
    (["meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.2-1B"], "299Gi"),  # target and draft share the volume
])
def test_model_cache_size_is_derived_from_the_repository_names(repos: list[str], size: str | None) -> None:
    assert cache_size(repos) == size


def test_draft_model_download_is_counted_in_the_cache_size() -> None:
    objs = children(spec_of(with_model(uri="hf://meta-llama/Llama-3.1-70B"),
                            speculative={"method": "draft_model", "draftModel": "hf://meta-llama/Llama-3.2-1B",
                                         "numSpeculativeTokens": 3}))
    assert volumes_of(objs)["model-cache"]["emptyDir"] == {"sizeLimit": "299Gi"}
    assert [c["name"] for c in pod_of(objs)["initContainers"]] == ["fetch-model", "fetch-draft-model"]


def test_a_model_whose_name_states_no_size_gets_an_unlimited_cache() -> None:
    objs = children(spec_of(with_model(uri="hf://openai-community/gpt2")))
    assert volumes_of(objs)["model-cache"] == {"name": "model-cache", "emptyDir": {}}


def test_model_cache_size_from_the_spec_overrides_the_derived_one() -> None:
    objs = children(spec_of(with_model(uri="hf://org/model-8B", cache={"size": "40Gi"})))
    assert volumes_of(objs)["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}}


def test_model_cache_on_a_claim_keeps_downloads_across_restarts() -> None:
    objs = children(spec_of(with_model(uri="hf://org/model-8B", cache={"claimName": "hf-cache"})))
    assert volumes_of(objs)["model-cache"] == {"name": "model-cache",
                                               "persistentVolumeClaim": {"claimName": "hf-cache"}}
    (init,) = pod_of(objs)["initContainers"]
    assert model_mounts(init) == [{"name": "model-cache", "mountPath": "/models/hf"}]  # written by the download only
    assert model_mounts(engine_of(objs))[0]["readOnly"] is True


def test_hf_revision_comes_from_model_revision_when_the_uri_has_none() -> None:
    objs = children(spec_of(with_model(uri="hf://org/model", revision="0123abc")))
    assert pod_of(objs)["initContainers"][0]["command"][4] == "0123abc"


def test_admin_token_reaches_the_engine_only_as_a_mounted_secret_file() -> None:
    objs = children(spec_of(MINIMAL))
    container = engine_of(objs)
    env = {e["name"]: e for e in container["env"]}
    assert contract.ADMIN_TOKEN_ENV not in env
    assert env[contract.REVISION_ENV]["value"] == objs["ConfigMap"]["data"]["revision"]
    assert "Secret" not in objs
    volume = next(v for v in pod_of(objs)["volumes"] if v["name"] == "admin-token")
    assert volume["secret"] == {"secretName": "chat-admin-token", "defaultMode": 0o440,
                                "items": [{"key": "token", "path": "token"}]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "admin-token")
    assert mount == {"name": "admin-token", "mountPath": "/var/run/governor/admin", "readOnly": True}
    assert serve_args(objs).admin_token_file == "/var/run/governor/admin/token"


def test_the_engine_takes_its_namespace_label_from_the_pod_s_own_namespace() -> None:
    env = {e["name"]: e for e in engine_of(children(spec_of(MINIMAL)))["env"]}
    assert env[contract.NAMESPACE_ENV] == {"name": "GOVERNOR_NAMESPACE", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.namespace"}}}


def test_admin_secret_holds_the_token_and_is_owned() -> None:
    secret = admin_secret(NAME, NAMESPACE, UID, "s3cret")
    assert secret["metadata"]["name"] == "chat-admin-token"
    assert secret["stringData"] == {"token": "s3cret"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    assert LABEL_REVISION not in secret["metadata"]["labels"]


def test_pod_monitor_is_rendered_only_when_asked_for() -> None:
    spec = spec_of(MINIMAL)
    assert "PodMonitor" not in children(spec, pod_monitor=False)
    pm = children(spec, pod_monitor=True)["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["name"] == NAME
    assert pm["spec"] == {"selector": {"matchLabels": {LABEL_SERVICE: NAME}},
                          "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}]}


def test_pod_is_probed_drained_and_scraped() -> None:
    objs = children(spec_of(MINIMAL))
    container = engine_of(objs)
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert pod_of(objs)["terminationGracePeriodSeconds"] == 45
    assert objs["Deployment"]["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}


def test_node_selector_and_tolerations_come_from_the_spec() -> None:
    objs = children(spec_of(MINIMAL, nodeSelector={"nvidia.com/gpu.product": "H100"},
                            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]))
    pod = pod_of(objs)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_render_is_deterministic() -> None:
    raw = with_model(uri="hf://org/model@v1")
    raw["engine"].update(speculative={"method": "draft_model", "draftModel": "pvc://drafts/small",
                                      "numSpeculativeTokens": 2}, tensorParallelSize=2, resources={"gpus": 2})
    status = {"tuning": {"knobs": {"max_num_seqs": 12}}}
    first = render(NAME, NAMESPACE, UID, 3, spec_of(raw), status, pod_monitor=True)
    assert first == render(NAME, NAMESPACE, UID, 3, spec_of(raw), copy.deepcopy(status), pod_monitor=True)
    assert json.dumps(first, sort_keys=True) == json.dumps(render(NAME, NAMESPACE, UID, 3, spec_of(raw), status,
                                                                  pod_monitor=True), sort_keys=True)


def test_only_tuned_knobs_are_read_from_status() -> None:
    spec = spec_of(MINIMAL)
    knobs_only = {"tuning": {"knobs": {"max_num_seqs": 12}}}
    busy = {"tuning": {"knobs": {"max_num_seqs": 12}, "frozen": True, "lastDecision": {"knob": "x"}},
            "revision": "ffffffffff", "phase": "Degraded", "observedGeneration": 9,
            "rollout": {"step": 1, "canary": "eeeeeeeeee"}, "conditions": [{"type": "Ready", "status": "False"}]}
    assert render(NAME, NAMESPACE, UID, 3, spec, knobs_only, pod_monitor=True) == \
        render(NAME, NAMESPACE, UID, 3, spec, busy, pod_monitor=True)


def test_speculation_depth_starts_from_the_configmap_like_the_other_knobs() -> None:
    spec = spec_of(MINIMAL, speculative={"method": "ngram", "numSpeculativeTokens": 4},
                   knobs={"numSpeculativeTokens": 2})
    objs = children(spec)
    ns = serve_args(objs)
    assert ns.num_speculative_tokens == 2 and ns.speculative_config["num_speculative_tokens"] == 4
    tuned = children(spec, {"tuning": {"knobs": {"num_speculative_tokens": 1}}})
    assert serve_args(tuned).num_speculative_tokens == 1
    assert objs["Deployment"] == tuned["Deployment"]  # a tuned K changes the ConfigMap only
    assert "--num-speculative-tokens" not in expanded_args(children(spec_of(MINIMAL)))


def test_only_objects_the_service_controls_are_applied_over() -> None:
    """`check_controller` (children.apply_child, and the plan for the admin Secret): a rendered child may replace
    only an object its own InferenceService (same uid) controls; another service's, or one without a controller,
    is a NameConflict naming who holds it."""
    from governor.operator.children import NameConflict, check_controller

    def ref(name: str, uid: str, controller: bool = True) -> dict[str, Any]:
        return {"apiVersion": "governor.dev/v1alpha1", "kind": "InferenceService", "name": name, "uid": uid,
                "controller": controller}

    desired = {"name": "chat-stable", "ownerReferences": [ref("chat", "u-1")]}
    check_controller("Service", {"metadata": {"ownerReferences": [ref("chat", "u-1")]}}, desired)
    with pytest.raises(NameConflict, match=r"Service/chat-stable .* controlled by InferenceService/chat-stable;"):
        check_controller("Service", {"metadata": {"ownerReferences": [ref("chat-stable", "u-2")]}}, desired)
    with pytest.raises(NameConflict, match=r"no controller"):
        check_controller("Service", {"metadata": {"ownerReferences": [ref("chat", "u-1", controller=False)]}},
                         desired)
    with pytest.raises(NameConflict, match=r"Secret/chat-stable .* no controller .* remove that Secret"):
        check_controller("Secret", {"metadata": {}}, desired)
    # The admin token Secret may be the user's own (no controller), never another service's.
    check_controller("Secret", {"metadata": {}}, desired, uncontrolled_ok=True)
    with pytest.raises(NameConflict, match=r"controlled by InferenceService/other"):
        check_controller("Secret", {"metadata": {"ownerReferences": [ref("other", "u-3")]}}, desired,
                         uncontrolled_ok=True)


# --- security posture and pod settings ---------------------------------------------------------------------------

FULL_EXAMPLE = yaml.safe_load((ROOT / "examples" / "inferenceservice-full.yaml").read_text())["spec"]
POD_SHAPES: dict[str, dict[str, Any]] = {
    "minimal (mounted path)": MINIMAL,
    "hf model and hf draft": with_model(uri="hf://meta-llama/Llama-3.1-8B"),
    "pvc model": with_model(uri="pvc://weights/llama"),
    "CPU": MINIMAL,
    "tensor parallel": MINIMAL,
    "the full example": FULL_EXAMPLE,
}
POD_ENGINE: dict[str, dict[str, Any]] = {
    "hf model and hf draft": {"speculative": {"method": "draft_model", "draftModel": "hf://meta-llama/Llama-3.2-1B",
                                              "numSpeculativeTokens": 3}},
    "CPU": {"resources": {"gpus": 0}},
    "tensor parallel": {"tensorParallelSize": 2, "resources": {"gpus": 2}},
}


def shape(name: str) -> dict[str, dict[str, Any]]:
    return children(spec_of(POD_SHAPES[name], **POD_ENGINE.get(name, {})))


@pytest.mark.parametrize("name", list(POD_SHAPES))
def test_engine_pods_pass_the_restricted_pod_security_profile(name: str) -> None:
    template = shape(name)["Deployment"]["spec"]["template"]
    assert restricted_violations(template) == []


@pytest.mark.parametrize("name", list(POD_SHAPES))
def test_rendered_objects_validate_against_the_kubernetes_schemas(name: str) -> None:
    for obj in render(NAME, NAMESPACE, UID, 3, spec_of(POD_SHAPES[name], **POD_ENGINE.get(name, {})), None,
                      pod_monitor=False):
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


@pytest.mark.parametrize("name", list(POD_SHAPES))
def test_engine_pods_are_never_best_effort(name: str) -> None:
    pod = pod_of(shape(name))
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]


@pytest.mark.parametrize("name", list(POD_SHAPES))
def test_the_root_filesystem_is_read_only_and_every_writer_points_into_tmp(name: str) -> None:
    pod = pod_of(shape(name))
    assert pod["automountServiceAccountToken"] is False
    assert next(v for v in pod["volumes"] if v["name"] == "tmp") == {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}}
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        for var in ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            assert env[var].startswith("/tmp"), (container["name"], var)


def test_the_pod_runs_as_the_engine_image_s_user() -> None:
    dockerfile = (ROOT / "docker" / "engine.Dockerfile").read_text()
    assert "USER 10001:10001" in dockerfile
    assert pod_of(shape("minimal (mounted path)"))["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def test_resources_given_in_the_spec_replace_the_default_requests() -> None:
    given = engine_of(children(spec_of(MINIMAL, resources={"gpus": 1, "cpu": "12", "memory": "96Gi"})))
    assert given["resources"] == {"requests": {"cpu": "12", "memory": "96Gi"},
                                  "limits": {"nvidia.com/gpu": "1", "memory": "96Gi"}}


def test_pod_settings_of_the_full_example_reach_the_pod() -> None:
    objs = children(spec_of(FULL_EXAMPLE))
    pod, container = pod_of(objs), engine_of(objs)
    (fetch,) = pod["initContainers"]
    hf_token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    proxy = [{"configMapRef": {"name": "llm-proxy-settings", "optional": True}}]
    for c in (container, fetch):  # the download needs the token as much as the engine
        assert hf_token in c["env"] and c["envFrom"] == proxy
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert (pod["serviceAccountName"], pod["priorityClassName"], pod["runtimeClassName"]) == (
        "llm-engine", "llm-serving", "nvidia")
    assert pod["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["70000"]}]}]}}}
    assert pod["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {LABEL_SERVICE: "chat"}}}]  # this service's pods by default
    template = objs["Deployment"]["spec"]["template"]["metadata"]
    assert template["labels"]["team"] == "llm-platform" and template["labels"][LABEL_SERVICE] == "chat"
    assert template["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert template["annotations"]["prometheus.io/scrape"] == "true"
    assert volumes_of(objs)["model-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}


def test_a_topology_constraint_keeps_the_selector_it_was_given() -> None:
    given = {"matchLabels": {"tier": "gpu"}}
    pod = pod_of(children(spec_of(MINIMAL, topologySpreadConstraints=[
        {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": given}])))
    assert pod["topologySpreadConstraints"][0]["labelSelector"] == given


@pytest.mark.parametrize(("replicas", "disruption", "budget"), [
    (1, {}, None),  # over one pod a budget protects nothing (maxUnavailable 1) or blocks drains for good
    (2, {}, {"maxUnavailable": 1}),
    (3, {"minAvailable": "50%"}, {"minAvailable": "50%"}),
    (4, {"maxUnavailable": 2}, {"maxUnavailable": 2}),
])
def test_a_disruption_budget_covers_the_service_s_pods_while_replicas_exceed_one(
        replicas: int, disruption: dict[str, Any], budget: dict[str, Any] | None) -> None:
    objs = children(spec_of({**MINIMAL, "replicas": replicas, "disruption": disruption}))
    if budget is None:
        assert "PodDisruptionBudget" not in objs
        return
    pdb = objs["PodDisruptionBudget"]
    assert (pdb["apiVersion"], pdb["metadata"]["name"]) == ("policy/v1", NAME)
    assert pdb["spec"] == {"selector": {"matchLabels": {LABEL_SERVICE: NAME}}, **budget}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == UID
