"""The desired children of an InferenceService, as plain Kubernetes manifests: a pure function of
(metadata, spec, status), with no I/O. Handlers fetch, call `render`, apply, and report.

What is rendered, per service `<name>`:
- Deployment `<name>-<revision>`: one per revision (canary and stable live side by side), selected by the
  service and revision labels;
- Service `<name>`: ClusterIP on port 8000, selected by the service label only, so stable and canary pods
  both receive traffic (their replica counts set the split);
- ConfigMap `<name>-<revision>-config`: the engine arguments as JSON for humans and drift checks, the
  revision, the starting knob values the pods read at start, and their limits (`synced_knobs` keeps a stable
  revision's values tuned without re-rendering it);
- PodDisruptionBudget `<name>` over every revision's pods, while spec.replicas > 1;
- PodMonitor `<name>` (Prometheus Operator), when asked for;
- with an HTTPRoute (`role_services`): Services `<name>-stable` and `<name>-canary`, one revision each.
The admin-token Secret is not rendered: the operator creates it once with a random token (`admin_secret`)
and never re-renders it, so the token does not change under running pods.

Revision identity (`revision_hash`): what changes the pod template — the model, the engine settings
except the knobs, and the knob hard caps — hashed; the knobs are tuned live and never change it.

Knobs are tuned live (through the admin API) and their tuned values live in status, so new pods must start
with them, yet a knob change must not roll the pods. So the Deployment never holds knob values: its args
say `--max-num-seqs $(GOVERNOR_KNOB_MAX_NUM_SEQS)`, and the kubelet expands that at container start from
an env var read from the ConfigMap, which `render` fills from status.tuning.knobs, else spec.engine.knobs,
else the cap. Updating the ConfigMap restarts nothing. The speculation depth K starts the same way
(`--num-speculative-tokens`, only with speculation on); its cap is the speculative config's K.

Hard caps: the engine's cap of a knob defaults to its starting value, which would pin a tuned-down pod
after a restart. So the caps are always given: `spec.autotune.bounds.<knob>.max`, else the tuner's default
range's max (the engine's own defaults, 256 and 8192). Starting values above the cap are clamped to it;
to start higher, raise the bound.

Model sources and their volumes: `model_sources`; the pods' security context and environment: `pod_hardening`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from governor import contract
from governor.operator.api import (
    API_VERSION,
    DEFAULT_CPU_REQUEST,
    DEFAULT_MEMORY_REQUEST,
    KIND,
    InferenceServiceSpec,
)
from governor.operator.model_sources import ModelMounts
from governor.operator.pod_hardening import (
    CONTAINER_SECURITY,
    POD_SECURITY,
    TMP_SIZE_LIMIT,
    TMP_VOLUME,
    container_env,
    env_from,
    tmp_mount,
)
from governor.operator.traffic import role_service_name
from governor.tuner.policy import DEFAULT_BOUNDS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

PORT = 8000
PORT_NAME = "http"
DRAIN_GRACE_S = 30
TERMINATION_GRACE_S = DRAIN_GRACE_S + 15  # the drain, then time for uvicorn and the process to exit
SHM_VOLUME = "dshm"
ADMIN_TOKEN_VOLUME = "admin-token"
ADMIN_TOKEN_DIR = "/var/run/governor/admin"
CONTAINER = "engine"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_SERVICE = "governor.dev/service"
LABEL_REVISION = "governor.dev/revision"

ADMIN_TOKEN_KEY = "token"
ENGINE_JSON_KEY = "engine.json"
REVISION_KEY = "revision"
LIMITS_KEY = "limits.json"  # (floor, cap) of each started knob: what `synced_knobs` clamps into
TEMPLATE_HASH_ANNOTATION = "governor.dev/template-hash"

# The knobs with a `governor serve` start flag, and the tuner's default range max, used as the cap when
# spec.autotune.bounds gives none (equal to the engine's default starting values).
STARTED_KNOBS: dict[str, int] = {knob: DEFAULT_BOUNDS[knob][1] for knob in (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)}
SPEC_KNOB = "num_speculative_tokens"


def deployment_name(name: str, revision: str) -> str:
    """The Deployment of one revision of service `name`."""
    return f"{name}-{revision}"


def revision_selector(name: str, revision: str) -> str:
    """The label selector of the engine pods of one revision of service `name`."""
    return f"{LABEL_SERVICE}={name},{LABEL_REVISION}={revision}"


def config_map_name(name: str, revision: str) -> str:
    """The ConfigMap holding the engine arguments and starting knobs of one revision of service `name`."""
    return f"{name}-{revision}-config"


def admin_secret_name(name: str) -> str:
    """The Secret holding the admin API bearer token of service `name`."""
    return f"{name}-admin-token"


def started_knobs(spec: InferenceServiceSpec) -> list[str]:
    """The knobs new pods are started with (flag value from the ConfigMap): K only with speculation on."""
    return [*STARTED_KNOBS, *([SPEC_KNOB] if spec.engine.speculative is not None else [])]


def knob_env(knob: str) -> str:
    """The engine container's env var carrying the starting value of `knob` (from the ConfigMap)."""
    return f"GOVERNOR_KNOB_{knob.upper()}"


# --- identity -----------------------------------------------------------------------------------------


def knob_caps(spec: InferenceServiceSpec) -> dict[str, int]:
    """Hard cap of each knob with a start flag: the autotune bound's max, else the tuner's default max."""
    given = spec.autotune.bounds.given() if spec.autotune.bounds is not None else {}
    return {knob: given[knob][1] if knob in given else default for knob, default in STARTED_KNOBS.items()}


def revision_hash(spec: InferenceServiceSpec) -> str:
    """Identity of the pod template: 10 hex digits of the sha256 of the canonical JSON of the model, the
    engine settings except the knobs, and the knob hard caps. Knob values, replicas, SLOs and rollout
    settings never change it; a changed image, model revision or static engine setting always does."""
    # Fields at their defaults are left out, so a field added to the API later (at its default) keeps every
    # existing service's revision, and writing a default out changes nothing.
    identity = {
        "model": spec.model.model_dump(mode="json", by_alias=True, exclude_defaults=True),
        "engine": spec.engine.model_dump(mode="json", by_alias=True, exclude={"knobs"}, exclude_defaults=True),
        "caps": knob_caps(spec),
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def knob_limits(spec: InferenceServiceSpec) -> dict[str, tuple[int, int]]:
    """(floor, cap) of each knob new pods are started with (`started_knobs`), by contract name."""
    limits = {knob: (1, cap) for knob, cap in knob_caps(spec).items()}
    if spec.engine.speculative is not None:
        limits[SPEC_KNOB] = (0, spec.engine.speculative.num_speculative_tokens)
    return limits


def clamp_knobs(tuned: Mapping[str, Any], given: Mapping[str, int], limits: Mapping[str, tuple[int, int]]
                ) -> dict[str, int]:
    """Starting values for the knobs in `limits`: the tuned value, else the given one, else the cap, clamped
    into (floor, cap). `tuned` comes from status, read leniently: a value that is not an int is ignored."""
    knobs: dict[str, int] = {}
    for knob, (floor, cap) in limits.items():
        value = tuned.get(knob)
        if not isinstance(value, int) or isinstance(value, bool):
            value = given.get(knob, cap)
        knobs[knob] = min(max(value, floor), cap)
    return knobs


def tuned_knobs(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """status.tuning.knobs: the values the tuner last confirmed ({} before any)."""
    knobs = ((status or {}).get("tuning") or {}).get("knobs")
    return knobs if isinstance(knobs, Mapping) else {}


def starting_knobs(spec: InferenceServiceSpec, status: Mapping[str, Any] | None) -> dict[str, int]:
    """Knob values new pods start with, by contract name: status.tuning.knobs (tuned values) over
    spec.engine.knobs, else the cap; clamped into the knob's range. K only with speculation on."""
    return clamp_knobs(tuned_knobs(status), spec.engine.knobs.model_dump(exclude_none=True), knob_limits(spec))


def synced_knobs(config_map: Mapping[str, Any], status: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The knob entries of an existing revision's ConfigMap brought up to status.tuning.knobs, clamped into the
    limits recorded in it; None when they already agree. This keeps the stable revision's restarts on the tuned
    values while the spec names another revision (a rollout, or after a rollback), without re-rendering it."""
    data = config_map.get("data") or {}
    try:
        limits = {k: (int(lo), int(hi)) for k, (lo, hi) in json.loads(data.get(LIMITS_KEY, "{}")).items()}
        current = {k: int(data[k]) for k in limits}
    except (ValueError, TypeError, KeyError):
        return None  # not a ConfigMap this version rendered: leave it alone
    wanted = clamp_knobs(tuned_knobs(status), current, limits)
    return None if wanted == current else {k: str(v) for k, v in wanted.items()}


# --- engine arguments ---------------------------------------------------------------------------------


def _engine_args(name: str, spec: InferenceServiceSpec, revision: str, mounts: ModelMounts,
                 knob_value: Mapping[str, str]) -> list[str]:
    """`governor serve` arguments; each knob with a start flag gets `knob_value[knob]`."""
    engine = spec.engine
    args = [mounts.path_of(spec.model.uri, spec.model.revision, "model"),
            "--host", "0.0.0.0", "--port", str(PORT),
            "--admin-token-file", f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
            "--served-model-name", spec.model.served_name or name,
            "--revision", revision,
            "--drain-grace-s", str(DRAIN_GRACE_S),
            "--dtype", engine.dtype,
            "--kv-cache-dtype", engine.kv_cache_dtype,
            "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching",
            "--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if engine.resources.gpus == 0:
        args += ["--device", "cpu"]  # "auto" would take a GPU the pod did not ask for, if one is visible
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.quantization is not None:
        args += ["--quantization", engine.quantization]
    if engine.speculative is not None:
        config: dict[str, Any] = {"method": engine.speculative.method,
                                  "num_speculative_tokens": engine.speculative.num_speculative_tokens}
        if engine.speculative.draft_model:
            config["model"] = mounts.path_of(engine.speculative.draft_model, None, "draft-model")
        if engine.speculative.quantization:
            config["quantization"] = engine.speculative.quantization
        args += ["--speculative-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    for knob, cap in knob_caps(spec).items():
        flag = "--" + knob.replace("_", "-")
        args += [flag, knob_value[knob], f"{flag}-cap", str(cap)]
    if SPEC_KNOB in knob_value:  # K's cap is the speculative config's K
        args += ["--num-speculative-tokens", knob_value[SPEC_KNOB]]
    return args + list(engine.extra_args)


# --- manifests ----------------------------------------------------------------------------------------


def _labels(name: str, revision: str | None, component: str = "engine") -> dict[str, str]:
    labels = {LABEL_NAME: "governor-engine", LABEL_INSTANCE: name, LABEL_MANAGED_BY: "governor",
              LABEL_COMPONENT: component, LABEL_SERVICE: name}
    if revision is not None:
        labels[LABEL_REVISION] = revision
    return labels


def _metadata(name: str, namespace: str, uid: str, owner: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels,
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": owner, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}]}


def _http_probe(path: str, period_s: int, failure_threshold: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": PORT_NAME}, "periodSeconds": period_s,
            "failureThreshold": failure_threshold, "timeoutSeconds": 5}


def _resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    """Requests always carry CPU and memory (documented defaults), so the pod is never BestEffort."""
    res = spec.engine.resources
    requests = {"cpu": res.cpu or DEFAULT_CPU_REQUEST, "memory": res.memory or DEFAULT_MEMORY_REQUEST}
    limits: dict[str, str] = {}
    if res.gpus > 0:
        # One GPU per tensor-parallel rank; validate_spec already rejects gpus < tensorParallelSize.
        limits["nvidia.com/gpu"] = str(max(res.gpus, spec.engine.tensor_parallel_size))
    if res.memory is not None:
        limits["memory"] = res.memory  # a given memory is request and limit; no CPU limit: it throttles the step loop
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def _scheduling(name: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The pod's scheduling and identity settings from spec.engine, only those given."""
    engine = spec.engine
    out: dict[str, Any] = {}
    if engine.node_selector:
        out["nodeSelector"] = dict(sorted(engine.node_selector.items()))
    if engine.tolerations:
        out["tolerations"] = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in engine.tolerations]
    if engine.affinity is not None:
        out["affinity"] = engine.affinity.model_dump(mode="json", by_alias=True, exclude_none=True,
                                                     exclude_defaults=True)
    if engine.topology_spread_constraints:
        constraints = []
        for c in engine.topology_spread_constraints:
            constraint = c.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
            # Without a selector a constraint counts no pods; this service's are the ones meant.
            constraint.setdefault("labelSelector", {"matchLabels": {LABEL_SERVICE: name}})
            constraints.append(constraint)
        out["topologySpreadConstraints"] = constraints
    if engine.image_pull_secrets:
        out["imagePullSecrets"] = [s.model_dump(mode="json", by_alias=True) for s in engine.image_pull_secrets]
    for key, value in (("serviceAccountName", engine.service_account_name),
                       ("priorityClassName", engine.priority_class_name),
                       ("runtimeClassName", engine.runtime_class_name)):
        if value is not None:
            out[key] = value
    return out


def _deployment(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, revision: str,
                args: list[str], mounts: ModelMounts, replicas: int) -> dict[str, Any]:
    labels = _labels(name, revision)
    volumes = [{"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
               {"name": ADMIN_TOKEN_VOLUME, "secret": {"secretName": admin_secret_name(name), "defaultMode": 0o440,
                                                       "items": [{"key": ADMIN_TOKEN_KEY, "path": ADMIN_TOKEN_KEY}]}}]
    volume_mounts = [tmp_mount(), {"name": ADMIN_TOKEN_VOLUME, "mountPath": ADMIN_TOKEN_DIR, "readOnly": True}]
    cache = mounts.cache_volume()
    volumes += mounts.volumes + ([cache] if cache is not None else [])
    volume_mounts += mounts.mounts
    if spec.engine.tensor_parallel_size > 1:
        # NCCL between ranks goes through /dev/shm; the container default (64 MiB) is too small.
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        volume_mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    operator_env: list[dict[str, Any]] = [
        {"name": contract.REVISION_ENV, "value": revision},
        # The namespace scope label of the metrics: another namespace's service of this name and spec has the
        # same model_name and revision.
        {"name": contract.NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    operator_env += [{"name": knob_env(knob),
                      "valueFrom": {"configMapKeyRef": {"name": config_map_name(name, revision), "key": knob}}}
                     for knob in started_knobs(spec)]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.engine.image,
        "command": ["governor", "serve"],
        "args": args,
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "env": container_env(spec, operator_env),
        "resources": _resources(spec),
        "startupProbe": _http_probe("/health", 10, 180),  # up to 30 minutes to load a model
        "livenessProbe": _http_probe("/health", 10, 3),
        "readinessProbe": _http_probe("/ready", 5, 2),
        "volumeMounts": volume_mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    if spec.engine.env_from:
        container["envFrom"] = env_from(spec)
    pod: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "automountServiceAccountToken": False,  # the engine never calls the Kubernetes API
        "enableServiceLinks": False,  # no env var per Service in the namespace
        "securityContext": POD_SECURITY,
        "volumes": volumes,
        **_scheduling(name, spec),
    }
    if mounts.init_containers:
        pod["initContainers"] = mounts.init_containers
    annotations = {**spec.engine.pod_annotations, "prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                   "prometheus.io/path": "/metrics"}
    template = {
        "metadata": {"labels": {**spec.engine.pod_labels, **labels}, "annotations": annotations},
        "spec": pod,
    }
    metadata = _metadata(deployment_name(name, revision), namespace, uid, name, labels)
    metadata["annotations"] = {TEMPLATE_HASH_ANNOTATION: template_hash(template)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {LABEL_SERVICE: name, LABEL_REVISION: revision}},
            "template": template,
        },
    }


def template_hash(template: Mapping[str, Any]) -> str:
    """The full sha256 (hex) of a pod template's canonical JSON, as rendered: recorded on the Deployment
    (annotation governor.dev/template-hash) and in status.rollout, so anyone can tell exactly what ran."""
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def render(name: str, namespace: str, uid: str, generation: int, spec: InferenceServiceSpec,
           status: Mapping[str, Any] | None, *, pod_monitor: bool, replicas: int | None = None
           ) -> list[dict[str, Any]]:
    """The desired children of InferenceService `name` (uid `uid`): Deployment and ConfigMap of the spec's
    revision (with `replicas` pods, default spec.replicas: a canary gets fewer), Service, and PodMonitor when
    `pod_monitor`. Pure and deterministic; of status only tuning.knobs is read. `spec` should have passed
    `validate_spec`; an invalid model URI raises ValueError. `generation` is recorded on the ConfigMap
    (annotation governor.dev/generation)."""
    revision = revision_hash(spec)
    knobs = starting_knobs(spec, status)
    started = started_knobs(spec)
    template_mounts = ModelMounts(spec)
    args = _engine_args(name, spec, revision, template_mounts, {knob: f"$({knob_env(knob)})" for knob in started})
    # The same arguments with the knobs filled in, for humans: what the next pod will run.
    effective = _engine_args(name, spec, revision, ModelMounts(spec),
                             {knob: str(knobs[knob]) for knob in started})

    labels = _labels(name, revision)
    shared = _labels(name, None)  # the Service and PodMonitor serve every revision
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**_metadata(config_map_name(name, revision), namespace, uid, name, labels),
                     "annotations": {"governor.dev/generation": str(generation)}},
        "data": {
            ENGINE_JSON_KEY: json.dumps({"revision": revision, "command": ["governor", "serve"], "args": effective,
                                         "knobs": knobs}, sort_keys=True, indent=2),
            REVISION_KEY: revision,
            LIMITS_KEY: json.dumps({k: list(v) for k, v in knob_limits(spec).items()}, sort_keys=True),
            **{knob: str(knobs[knob]) for knob in started},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, uid, name, shared),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_SERVICE: name},
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }
    deployment = _deployment(name, namespace, uid, spec, revision, args, template_mounts,
                             spec.replicas if replicas is None else replicas)
    children = [deployment, service, config_map]
    budget = disruption_budget(name, namespace, uid, spec)
    if budget is not None:
        children.append(budget)
    if pod_monitor:
        children.append({
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": _metadata(name, namespace, uid, name, shared),
            "spec": {
                "selector": {"matchLabels": {LABEL_SERVICE: name}},
                "podMetricsEndpoints": [{"port": PORT_NAME, "path": "/metrics"}],
            },
        })
    return children


def disruption_budget(name: str, namespace: str, uid: str, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """PodDisruptionBudget `<name>` over every engine pod of the service while spec.replicas > 1 (a budget on a
    single pod a budget either lets the drain evict it, protecting nothing, or blocks the drain for good);
    maxUnavailable 1 unless spec.disruption says otherwise."""
    if spec.replicas <= 1:
        return None
    given = spec.disruption.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, uid, name, _labels(name, None)),
        "spec": {"selector": {"matchLabels": {LABEL_SERVICE: name}}, **(given or {"maxUnavailable": 1})},
    }


def admin_secret(name: str, namespace: str, uid: str, token: str) -> dict[str, Any]:
    """The Secret with the admin API bearer token of service `name`; created once, never re-rendered."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(admin_secret_name(name), namespace, uid, name, _labels(name, None, "admin-token")),
        "stringData": {ADMIN_TOKEN_KEY: token},
    }


def role_services(name: str, namespace: str, uid: str, stable: str, canary: str) -> list[dict[str, Any]]:
    """Services `<name>-stable` and `<name>-canary`, each selecting one revision's pods: the backends an
    HTTPRoute weights (spec.rollout.httpRoute). Outside a rollout `canary` is the stable revision."""
    out = []
    for role, revision in (("stable", stable), ("canary", canary)):
        out.append({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(role_service_name(name, role), namespace, uid, name,
                                  _labels(name, None, f"{role}-service")),
            "spec": {
                "type": "ClusterIP",
                "selector": {LABEL_SERVICE: name, LABEL_REVISION: revision},
                "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
            },
        })
    return out
