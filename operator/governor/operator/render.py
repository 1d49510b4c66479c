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

Model sources (`spec.model.uri`, and `speculative.draftModel` the same way):
- `/path`: used as is (the user mounts it, e.g. through the node or an image);
- `pvc://claim/path`: the claim is mounted read-only at /models/<claim>, the model is /models/<claim>/<path>;
- `hf://org/name@rev`: an init container, from the engine image, downloads the weights, configs and tokenizer
  files of the repository (`huggingface_hub.snapshot_download`, `DOWNLOAD_PATTERNS`) into the volume
  `model-cache` at /models/hf/org/name: an emptyDir whose sizeLimit is `spec.model.cache.size`, else derived
  from the repository names (`cache_size`; none when a name states no size), or the PersistentVolumeClaim
  `spec.model.cache.claimName`, where
  files already present are not fetched again. This needs network access from the pod to the Hub (or
  HF_ENDPOINT) and, for gated repositories, an HF_TOKEN from `spec.engine.env`.

Pods pass the Pod Security "restricted" profile: non-root (uid `RUN_AS_USER`, the engine image's user), no
privilege escalation, every capability dropped, the runtime's default seccomp profile, a read-only root
filesystem with emptyDirs where the engine and the download write (/tmp: HOME and the Triton, Torch Inductor
and Hugging Face caches), no service account token, and the admin token as a mounted Secret file. CPU and
memory are always requested (never BestEffort).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from governor import contract
from governor.operator.api import (
    API_VERSION,
    DEFAULT_CPU_REQUEST,
    DEFAULT_MEMORY_REQUEST,
    KIND,
    TMP_DIR,
    WRITABLE_ENV,
    InferenceServiceSpec,
    parse_model_uri,
)
from governor.operator.traffic import role_service_name
from governor.tuner.policy import DEFAULT_BOUNDS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

PORT = 8000
PORT_NAME = "http"
DRAIN_GRACE_S = 30
TERMINATION_GRACE_S = DRAIN_GRACE_S + 15  # the drain, then time for uvicorn and the process to exit
MODELS_DIR = "/models"
HF_DIR = f"{MODELS_DIR}/hf"
MODEL_CACHE_VOLUME = "model-cache"
SHM_VOLUME = "dshm"
TMP_VOLUME = "tmp"
TMP_SIZE_LIMIT = "4Gi"  # compile caches (Triton, Torch Inductor, CUDA) and the download's metadata
ADMIN_TOKEN_VOLUME = "admin-token"
ADMIN_TOKEN_DIR = "/var/run/governor/admin"
CONTAINER = "engine"

RUN_AS_USER = 10001  # the engine image's user (docker/engine.Dockerfile)
# What the engine reads of a Hugging Face repository: configs, safetensors weights, tokenizer and chat template
# files. Other formats of the same weights (e.g. `original/*.pth`) are not downloaded.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# The same weights again in another layout (Mistral's consolidated file, Meta's original/ folder).
SKIPPED_PATTERNS = ["consolidated*", "original/*"]
INIT_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}}
# The emptyDir's sizeLimit from a repository name: parameters ("8B", "0.5B", "135M", "8x7B", "17B-16E") × bytes
# per parameter. A limit too small gets the pod evicted mid-download, one too large costs nothing (it reserves
# no space), so it errs large: 4 bytes a parameter (fp32 checkpoints too) plus an eighth for the download's
# temporary files, experts counted as full models. A name that states no size gets no limit.
CACHE_BYTES_PER_PARAMETER = 4.5
_PARAMETERS = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?:-(\d+)[Ee])?(?![A-Za-z0-9])")

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


# --- model sources ------------------------------------------------------------------------------------


def parameters_in_name(repo: str) -> float | None:
    """Parameters a Hugging Face repository name states ("meta-llama/Llama-3.1-8B" → 8e9, "Mixtral-8x7B" → 5.6e10,
    "SmolLM2-135M" → 1.35e8); None when it states none."""
    match = _PARAMETERS.search(repo.rsplit("/", 1)[-1])
    if match is None:
        return None
    experts = int(match[1] or match[4] or 1)
    return experts * float(match[2]) * (1e9 if match[3] in "Bb" else 1e6)


def cache_size(repos: list[str]) -> str | None:
    """sizeLimit of the download volume for these repositories: `CACHE_BYTES_PER_PARAMETER` per parameter their
    names state, in whole Gi; None (no limit) when a name states none."""
    sizes = [parameters_in_name(repo) for repo in repos]
    if any(params is None for params in sizes):
        return None
    return f"{sum(max(1, math.ceil(p * CACHE_BYTES_PER_PARAMETER / 2**30)) for p in sizes if p is not None)}Gi"


@dataclass
class _Mounts:
    """Volumes, mounts and init containers the model sources need, collected in a stable order."""

    spec: InferenceServiceSpec
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    claims: dict[str, str] = field(default_factory=dict)  # claim → volume name
    repos: list[str] = field(default_factory=list)  # hf:// repositories downloaded

    def path_of(self, uri: str, revision: str | None, role: str) -> str:
        """The model directory inside the pod for `uri`, adding what it needs."""
        source = parse_model_uri(uri)
        if source.scheme == "path":
            return source.path
        if source.scheme == "pvc":
            if source.claim not in self.claims:
                volume = f"model-pvc-{len(self.claims)}"  # claims may hold dots, volume names may not
                self.claims[source.claim] = volume
                self.volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": source.claim,
                                                                               "readOnly": True}})
                self.mounts.append({"name": volume, "mountPath": f"{MODELS_DIR}/{source.claim}", "readOnly": True})
            return f"{MODELS_DIR}/{source.claim}{source.path}"
        if not self.repos:
            self.mounts.append({"name": MODEL_CACHE_VOLUME, "mountPath": HF_DIR, "readOnly": True})
        self.repos.append(source.repo)
        local_dir = f"{HF_DIR}/{source.repo}"
        rev = source.revision or revision or ""
        self.init_containers.append({
            "name": f"fetch-{role}",
            "image": self.spec.engine.image,
            # snapshot_download is stable across huggingface_hub releases; its CLI module names are not.
            "command": ["python", "-c", "import json, sys; from huggingface_hub import snapshot_download; "
                        "snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3], "
                        "allow_patterns=json.loads(sys.argv[4]), ignore_patterns=json.loads(sys.argv[5]))",
                        source.repo, rev, local_dir, json.dumps(DOWNLOAD_PATTERNS), json.dumps(SKIPPED_PATTERNS)],
            "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": HF_DIR}, _tmp_mount()],
            "env": _env(self.spec, []),
            **({"envFrom": _env_from(self.spec)} if self.spec.engine.env_from else {}),
            "resources": INIT_RESOURCES,
            "securityContext": CONTAINER_SECURITY,
        })
        return local_dir

    def cache_volume(self) -> dict[str, Any] | None:
        """The volume hf:// downloads go to: the spec's claim, else an emptyDir sized for the repositories."""
        if not self.repos:
            return None
        cache = self.spec.model.cache
        if cache is not None and cache.claim_name:
            return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
        size = cache.size if cache is not None and cache.size else cache_size(self.repos)
        return {"name": MODEL_CACHE_VOLUME, "emptyDir": {"sizeLimit": size} if size else {}}


# --- pod security ---------------------------------------------------------------------------------------

POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
                # a claim used as the model cache is chowned once, not on every mount
                "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def _tmp_mount() -> dict[str, Any]:
    return {"name": TMP_VOLUME, "mountPath": TMP_DIR}


def _env(spec: InferenceServiceSpec, operator_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The container's env: the operator's own, the writable locations, then the user's (`spec.engine.env`,
    which validation keeps off the names the operator sets)."""
    writable = [{"name": k, "value": v} for k, v in WRITABLE_ENV.items()]
    user = [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in spec.engine.env]
    return operator_env + writable + user


def _env_from(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [s.model_dump(mode="json", by_alias=True, exclude_none=True) for s in spec.engine.env_from]


# --- engine arguments ---------------------------------------------------------------------------------


def _engine_args(name: str, spec: InferenceServiceSpec, revision: str, mounts: _Mounts,
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
    if engine.speculative is not None:
        config: dict[str, Any] = {"method": engine.speculative.method,
                                  "num_speculative_tokens": engine.speculative.num_speculative_tokens}
        if engine.speculative.draft_model:
            config["model"] = mounts.path_of(engine.speculative.draft_model, None, "draft-model")
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
                args: list[str], mounts: _Mounts, replicas: int) -> dict[str, Any]:
    labels = _labels(name, revision)
    volumes = [{"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
               {"name": ADMIN_TOKEN_VOLUME, "secret": {"secretName": admin_secret_name(name), "defaultMode": 0o440,
                                                       "items": [{"key": ADMIN_TOKEN_KEY, "path": ADMIN_TOKEN_KEY}]}}]
    volume_mounts = [_tmp_mount(), {"name": ADMIN_TOKEN_VOLUME, "mountPath": ADMIN_TOKEN_DIR, "readOnly": True}]
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
        "env": _env(spec, operator_env),
        "resources": _resources(spec),
        "startupProbe": _http_probe("/health", 10, 180),  # up to 30 minutes to load a model
        "livenessProbe": _http_probe("/health", 10, 3),
        "readinessProbe": _http_probe("/ready", 5, 2),
        "volumeMounts": volume_mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    if spec.engine.env_from:
        container["envFrom"] = _env_from(spec)
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
    template_mounts = _Mounts(spec)
    args = _engine_args(name, spec, revision, template_mounts, {knob: f"$({knob_env(knob)})" for knob in started})
    # The same arguments with the knobs filled in, for humans: what the next pod will run.
    effective = _engine_args(name, spec, revision, _Mounts(spec),
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
