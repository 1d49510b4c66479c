"""The `InferenceService` API (governor.dev/v1alpha1): what users write, as pydantic models.

These models are the source of truth: the CRD in crds/ is generated from them (`governor crds`,
`governor.operator.crds`), and the operator reads every object through `validation.parse_spec`.

Python names are snake_case, the wire is camelCase (the alias generator). Parsing is strict like the
API server (`replicas: "3"` is an error, not 3) and accepts only the camelCase names. Null values are
dropped before validation, as the API server prunes nulls of non-nullable fields.

Validation in three layers: the schema (types, enums, bounds, patterns, defaults) and CEL rules
(x-kubernetes-validations, the cross-field checks), both enforced by the API server from the CRD; and
`validation.validate_spec`, the same cross-field checks in Python for objects stored before a rule existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from governor import contract
from governor.operator.kube_types import (
    Affinity,
    EnvFromSource,
    EnvVar,
    IntOrPercent,
    Kube,
    LabelValue,
    LocalObjectReference,
    ObjectName,
    Quantity,
    TopologySpreadConstraint,
    cel,
)
from governor.operator.pod_ownership import (
    FLAGS_CEL,
    OPERATOR_ANNOTATIONS,
    OPERATOR_ENV,
    OPERATOR_ENV_PREFIX,
    OPERATOR_FLAGS,
    OPERATOR_LABELS,
    cel_list,
    keys_rules,
)
from governor.tuner.signals import SLO

GROUP = "governor.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("infsvc",)

# --- durations ------------------------------------------------------------------------------------

DURATION_PATTERN = r"^[0-9]+(\.[0-9]+)?(ms|s|m)$"
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def duration_seconds(value: str) -> float:
    """Seconds in a duration string: "500ms" → 0.5, "2s" → 2.0, "1.5m" → 90.0."""
    match = re.fullmatch(DURATION_PATTERN, value)
    if match is None:
        raise ValueError(f"expected a duration like '500ms', '2s' or '1m' (number + ms|s|m), got {value!r}")
    return float(value[: match.start(2)]) * _DURATION_UNITS[match.group(2)]


Duration = Annotated[str, Field(pattern=DURATION_PATTERN)]
PositiveDuration = Annotated[str, Field(pattern=DURATION_PATTERN, json_schema_extra={"x-kubernetes-validations": [
    {"rule": "duration(self) > duration('0s')", "message": "must be longer than zero"}]})]

# --- model URIs -----------------------------------------------------------------------------------

# The CRD's pattern and `parse_model_uri` accept exactly the same URIs; the parser also takes them apart.
_PVC_CLAIM = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_HF_REPO = r"[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*"
_HF_REVISION = r"[-A-Za-z0-9_./]+"
MODEL_URI_PATTERN = rf"^(/\S+|pvc://{_PVC_CLAIM}(/\S*)?|hf://{_HF_REPO}(@{_HF_REVISION})?)$"
_PVC_URI = re.compile(rf"pvc://(?P<claim>{_PVC_CLAIM})(?P<path>/\S*)?")
_HF_URI = re.compile(rf"hf://(?P<repo>{_HF_REPO})(@(?P<revision>{_HF_REVISION}))?")
MODEL_URI_FORMS = "'/mounted/path', 'pvc://claim[/path]' or 'hf://org/name[@revision]'"


@dataclass(frozen=True)
class ModelURI:
    """A parsed `spec.model.uri`: where the weights come from."""

    scheme: Literal["path", "pvc", "hf"]
    path: str = ""  # path: the mounted directory; pvc: the directory inside the claim ("" = its root)
    claim: str = ""  # pvc only
    repo: str = ""  # hf only: "org/name"
    revision: str = ""  # hf only: the "@revision" part, if any


def parse_model_uri(uri: str) -> ModelURI:
    """Parse a model URI; raises ValueError naming the accepted forms."""
    if uri.startswith("/") and len(uri) > 1 and not re.search(r"\s", uri):
        return ModelURI(scheme="path", path=uri)
    if (m := _PVC_URI.fullmatch(uri)) is not None:
        return ModelURI(scheme="pvc", claim=m["claim"], path=(m["path"] or "").rstrip("/"))
    if (m := _HF_URI.fullmatch(uri)) is not None:
        return ModelURI(scheme="hf", repo=m["repo"], revision=m["revision"] or "")
    raise ValueError(f"unsupported model URI {uri!r}: expected {MODEL_URI_FORMS}")


# --- spec -------------------------------------------------------------------------------------------


class ModelCache(Kube):
    """Where hf:// downloads go: an emptyDir (fresh each pod start) or a PersistentVolumeClaim (kept)."""

    size: Quantity | None = Field(default=None, description=(
        "Space for the checkpoint and the draft model: the emptyDir's sizeLimit (past it the kubelet evicts the "
        "pod). Default: 4.5 bytes per parameter the repository names state ('Llama-3.1-8B' → 34Gi, "
        "'Mixtral-8x7B' → 235Gi), no limit when a name states none."))
    claim_name: ObjectName | None = Field(default=None, description=(
        "An existing PersistentVolumeClaim (same namespace) to download into instead: files already there are "
        "not fetched again when a pod restarts. Pods on several nodes need it ReadWriteMany."))


class ModelSpec(Kube):
    """The model to serve."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.revision) || !self.uri.startsWith('hf://') || !self.uri.contains('@') "
         "|| self.uri.endsWith('@' + self.revision)",
         "revision disagrees with the uri's @revision: give the revision in one place, or the same in both")))

    uri: str = Field(pattern=MODEL_URI_PATTERN, max_length=1024, description=(
        "Where the checkpoint is: a path mounted in the pod ('/models/llama'), a PersistentVolumeClaim "
        "('pvc://claim/path/in/claim'), or a Hugging Face repository ('hf://org/name@revision')."))
    revision: str | None = Field(default=None, min_length=1, max_length=128, description=(
        "Digest or tag of the weights. Part of the service's identity: changing it rolls out a new revision, "
        "and the prefix cache never shares blocks across revisions."))
    served_name: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63,
                                    description="Model name clients send in OpenAI requests (default: the "
                                                "InferenceService's name). Lowercase letters, digits, '-', '.'.")
    cache: ModelCache | None = Field(default=None, description=(
        "Where hf:// models (and draft models) are downloaded: size and, optionally, a PersistentVolumeClaim "
        "that keeps them across pod restarts."))


DEFAULT_CPU_REQUEST = "2"
DEFAULT_MEMORY_REQUEST = "8Gi"


class Resources(Kube):
    """Resources of one engine pod. CPU and memory are always requested, so the pod is never BestEffort."""

    gpus: int = Field(default=1, ge=0, description="GPUs per pod (nvidia.com/gpu); 0 runs the engine on CPU.")
    memory: Quantity | None = Field(default=None, description=(
        f"Memory request and limit, e.g. '64Gi' (default: a request of {DEFAULT_MEMORY_REQUEST}, no limit)."))
    cpu: Quantity | None = Field(default=None, description=(
        f"CPU request, e.g. '8' or '500m' (default {DEFAULT_CPU_REQUEST}; never a limit: it would throttle the "
        "step loop)."))


class Speculative(Kube):
    """Speculative decoding."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("self.method != 'draft_model' || has(self.draftModel)",
         "method draft_model needs draftModel: the draft model's URI"),
        ("self.method != 'ngram' || !has(self.draftModel)",
         "method ngram takes no draftModel; remove it or use method draft_model"),
        ("self.method != 'ngram' || !has(self.quantization)",
         "method ngram takes no quantization: it runs no draft model")))

    method: Literal["ngram", "draft_model"] = Field(description=(
        "'ngram': draft tokens by prompt lookup (no extra model); 'draft_model': a small model of the same "
        "tokenizer drafts them (set draftModel)."))
    draft_model: str | None = Field(default=None, pattern=MODEL_URI_PATTERN, max_length=1024, description=(
        "URI of the draft model (same forms as model.uri); required with method draft_model."))
    num_speculative_tokens: int = Field(ge=1, le=16, description=(
        "Draft tokens per step K: the initial value and the hard cap of the numSpeculativeTokens knob. "
        "To turn speculation off, leave out `speculative`."))
    quantization: Literal["fp8", "awq", "gptq", "compressed-tensors"] | None = Field(default=None, description=(
        "The draft model's weight quantization, as engine.quantization is the target's (unset: the draft "
        "checkpoint's own; 'fp8' on an unquantized draft quantizes it at load). Method draft_model only; a method "
        "the draft checkpoint does not have fails the engine at load."))


class StartingKnobs(Kube):
    """Starting values of the live knobs (the tuner may change them; tuned values live in status).

    Field names are `contract.KNOB_NAMES`, so `model_dump(exclude_none=True)` is a knob update."""

    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences running in one step "
                                                                      "(default: the engine's).")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description=(
        "Token budget of one step, i.e. the prefill chunk size (default: the engine's)."))
    num_speculative_tokens: int | None = Field(default=None, ge=0, description=(
        "Speculation depth K, at most speculative.numSpeculativeTokens (default: that cap; 0 = off)."))


class Toleration(Kube):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists matches every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal "
                                                                                    "(Kubernetes default: Equal).")
    value: str | None = Field(default=None, description="Taint value to match (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(default=None, description=(
        "With effect NoExecute: how long the pod stays bound after the taint appears."))


class EngineSpec(Kube):
    """The engine pods: image, resources, static configuration, starting knob values and pod settings."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("self.resources.gpus == 0 || self.tensorParallelSize <= self.resources.gpus",
         "tensorParallelSize needs as many GPUs per pod: raise resources.gpus or lower tensorParallelSize"),
        ("!has(self.knobs.numSpeculativeTokens) || self.knobs.numSpeculativeTokens == 0 || "
         "(has(self.speculative) && self.knobs.numSpeculativeTokens <= self.speculative.numSpeculativeTokens)",
         "knobs.numSpeculativeTokens needs speculative decoding and at most speculative.numSpeculativeTokens "
         "(the hard cap of K)")))

    image: str = Field(min_length=1, max_length=1024, description="Engine container image, e.g. "
                                                                  "'ghcr.io/org/governor:0.1.0'.")
    resources: Resources = Field(default_factory=Resources, json_schema_extra={"default": {}},
                                 description="Resources of one engine pod.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight and activation dtype ('auto': the checkpoint's).")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(default="auto", description=(
        "KV cache element type: 'auto' (the model dtype) or 'fp8' (e4m3 with scales; twice the KV capacity)."))
    quantization: Literal["fp8", "awq", "gptq", "compressed-tensors"] | None = Field(default=None, description=(
        "Weight quantization. Unset: the checkpoint's own (its config.json's quantization_config, or none). 'fp8' "
        "on an unquantized checkpoint quantizes it at load; naming the checkpoint's own method checks it. The "
        "operator cannot see the checkpoint or the GPU: a method the checkpoint does not have fails the engine at "
        "load, with an error naming both."))
    prefix_caching: bool = Field(default=True, description="Reuse cached KV of shared prompt prefixes.")
    speculative: Speculative | None = Field(default=None, description="Speculative decoding (off when absent).")
    max_model_len: int | None = Field(default=None, ge=16, description="Longest context (prompt + output) in "
                                                                       "tokens (default: the model's).")
    tensor_parallel_size: int = Field(default=1, ge=1, le=8, description=(
        "Ranks the model is split over, one GPU each; needs resources.gpus ≥ this size on GPU."))
    knobs: StartingKnobs = Field(default_factory=StartingKnobs, json_schema_extra={"default": {}},
                         description="Starting values of the live knobs.")
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64,
        json_schema_extra=cel((f"self.all(a, !(a in {FLAGS_CEL}) && !{FLAGS_CEL}.exists(f, a.startsWith(f + '=')))",
                               "extraArgs must not set a flag the operator sets (" + ", ".join(OPERATOR_FLAGS)
                               + "): use the spec field for it")),
        description="Extra `governor serve` arguments, appended as given; flags the operator sets from the spec "
                    "(e.g. --port, --tensor-parallel-size, --admin-token-file) are refused.")
    env: list[EnvVar] = Field(default_factory=list, max_length=128, json_schema_extra=cel(
        (f"self.all(e, !e.name.startsWith('{OPERATOR_ENV_PREFIX}') && !(e.name in {cel_list(OPERATOR_ENV)}))",
         f"env must not set {OPERATOR_ENV_PREFIX}* or " + ", ".join(OPERATOR_ENV) + ": the operator sets them")),
        description="Environment variables of the engine container and of the model download, e.g. HF_TOKEN "
                    "from a Secret for gated Hugging Face models.")
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=32, description=(
        "Secrets and ConfigMaps whose keys become environment variables of the engine and the model download."))
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description=(
        "Secrets to pull the engine image with (a private registry)."))
    service_account_name: ObjectName | None = Field(default=None, description=(
        "ServiceAccount of the engine pods (default: the namespace's default). Its API token is never mounted."))
    affinity: Affinity | None = Field(default=None, description="Node and pod affinity of the engine pods.")
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list, max_length=8,
                                                                        description=(
        "How the engine pods spread over zones or nodes; a constraint without labelSelector counts this "
        "service's pods."))
    pod_annotations: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=64, json_schema_extra=keys_rules("podAnnotations", OPERATOR_ANNOTATIONS,
                                                                           "the operator sets them"),
        description="Annotations added to the engine pods (changing them rolls out a new revision).")
    pod_labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64, json_schema_extra=keys_rules("podLabels", OPERATOR_LABELS,
                                                                           "the operator's selectors use them"),
        description="Labels added to the engine pods (changing them rolls out a new revision).")
    priority_class_name: ObjectName | None = Field(default=None, description="PriorityClass of the engine pods.")
    runtime_class_name: ObjectName | None = Field(default=None, description=(
        "RuntimeClass of the engine pods (e.g. 'nvidia' where the GPU runtime is not the default)."))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")


class SLOSpec(Kube):
    """Latency and error targets the tuner holds the service to (p95 over `window`)."""

    ttft_p95: PositiveDuration = Field(description="Target p95 time to first token, e.g. '500ms'.")
    itl_p95: PositiveDuration = Field(description="Target p95 inter-token latency, e.g. '50ms'.")
    e2e_p95: PositiveDuration | None = Field(default=None, alias="e2eP95",  # to_camel would say e2EP95
                                             description="Target p95 end-to-end request latency, e.g. '30s'.")
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0, description=(
        "Ceiling on the fraction of requests that end in an error (0..1)."))
    window: PositiveDuration = Field(default="1m", description="Window the percentiles are computed over.")

    def targets(self) -> SLO:
        """These targets in seconds, as the tuner takes them."""
        return SLO(ttft_p95_s=duration_seconds(self.ttft_p95), itl_p95_s=duration_seconds(self.itl_p95),
                   e2e_p95_s=None if self.e2e_p95 is None else duration_seconds(self.e2e_p95),
                   error_rate=self.error_rate)


class KnobRange(Kube):
    """Inclusive range a knob may be tuned over."""

    model_config = ConfigDict(json_schema_extra=cel(("self.min <= self.max", "min must not exceed max")))

    min: int = Field(ge=0, description="Lowest value the tuner may set.")
    max: int = Field(ge=0, description="Highest value the tuner may set.")


class AutotuneBounds(Kube):
    """Ranges the tuner keeps each knob in; a knob left out keeps the tuner's default range.

    Field names are `contract.KNOB_NAMES`."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.maxNumSeqs) || self.maxNumSeqs.min >= 1", "maxNumSeqs cannot go below 1"),
        ("!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens.min >= 1",
         "maxNumBatchedTokens cannot go below 1")))

    max_num_seqs: KnobRange | None = Field(default=None, description="Range of maxNumSeqs.")
    max_num_batched_tokens: KnobRange | None = Field(default=None, description="Range of maxNumBatchedTokens.")
    num_speculative_tokens: KnobRange | None = Field(default=None, description="Range of numSpeculativeTokens.")

    def given(self) -> dict[str, tuple[int, int]]:
        """The ranges set here, by contract knob name."""
        return {name: (r.min, r.max) for name in contract.KNOB_NAMES if (r := getattr(self, name)) is not None}


class AutotuneSpec(Kube):
    """The SLO controller ("tuner") of this service."""

    enabled: bool = Field(default=False, description="Tune the live knobs to hold the SLO.")
    interval: PositiveDuration = Field(default="15s", description="How often the tuner observes and decides.")
    cooldown: Duration = Field(default="5m", description="Least time between two knob changes.")
    hysteresis: float = Field(default=0.1, ge=0.0, le=0.5, description=(
        "Relative band around each SLO target: act above target·(1+h), relax below target·(1−h)."))
    bounds: AutotuneBounds | None = Field(default=None, description="Ranges the tuner keeps each knob in.")


class RolloutStep(Kube):
    """One canary step: shift `weight` percent of traffic to the new revision, then judge it for `pause`."""

    weight: int = Field(ge=1, le=100, description=(
        "Percent of traffic on the new revision during this step (by replica ratio behind the shared Service: "
        "the canary gets enough pods for about this share; status.rollout.canaryWeight reports the actual one)."))
    pause: Duration = Field(default="2m", description=(
        "How long the step is judged, counted from when the canary's pods are ready, before the next step."))


class RollbackTrigger(Kube):
    """A condition on the canary that rolls the rollout back, judged over the window `for` at every check."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("self.comparison != 'relative' || self.metric == 'throughput' || self.threshold >= 1.0",
         "a relative latency or error-rate threshold is a ratio to stable and must be at least 1 (1.2 = 20% worse)"),
        ("self.comparison != 'relative' || self.metric != 'throughput' || self.threshold <= 1.0",
         "a relative throughput threshold is a ratio to stable and must be at most 1 (0.8 = 20% less)"),
        ("self.comparison != 'absolute' || self.metric != 'error_rate' || self.threshold <= 1.0",
         "an absolute error-rate threshold is a fraction 0..1")))

    metric: Literal["ttft_p95", "itl_p95", "e2e_p95", "error_rate", "throughput"] = Field(
        description="Metric judged on the canary: p95 latencies in seconds, error rate 0..1, or generated "
                    "tokens/s per engine (throughput).")
    comparison: Literal["absolute", "relative"] = Field(default="relative", description=(
        "'absolute': fires when the canary's value passes `threshold` (above it; for throughput, below it). "
        "'relative': `threshold` is a ratio to stable: fires when canary > threshold × stable (1.2 = 20% worse; "
        "for throughput, canary < threshold × stable)."))
    threshold: float = Field(gt=0.0, description="The limit in the metric's unit (absolute), or the ratio to "
                                                 "stable (relative).")
    for_: Duration = Field(default="2m", alias="for", json_schema_extra=cel(
        ("duration(self) >= duration('1s')", "a trigger window must be at least 1s (a Prometheus rate window)")),
        description="Window the metric is computed over (canary and stable alike), e.g. '2m'.")


def _default_steps() -> list[RolloutStep]:
    return [RolloutStep(weight=10, pause="2m"), RolloutStep(weight=50, pause="2m")]


MAX_ROLLOUT_STEPS = 16
# Standard CEL has no ranges: the index list bounds the steps the rule can see, hence maxItems.
_STEP_INDEXES = "[" + ", ".join(str(i) for i in range(1, MAX_ROLLOUT_STEPS)) + "]"


class RolloutSpec(Kube):
    """How a change of the pod template (model revision, image, static engine config) is rolled out."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.httpRoute) || !has(self.rollbackOn) || "
         "self.rollbackOn.all(t, t.comparison != 'relative' || t.metric != 'throughput')",
         "with httpRoute, a throughput trigger must be absolute: tokens/s per engine depends on each revision's "
         "share of the route's traffic")))

    steps: list[RolloutStep] = Field(default_factory=_default_steps, max_length=MAX_ROLLOUT_STEPS,
                                     json_schema_extra={"default": [{"weight": 10, "pause": "2m"},
                                                                    {"weight": 50, "pause": "2m"}],
                                                        **cel(("self.all(s, s.weight < 100)",
                                                               "100 is not a step: the new revision is promoted to "
                                                               "all traffic after the last step passes"),
                                                              (f"{_STEP_INDEXES}.all(i, i >= size(self) || "
                                                               "self[i].weight > self[i - 1].weight)",
                                                               "step weights must strictly increase"))},
                                     description=(
        "Canary steps with strictly increasing weights below 100; after the last step passes, the new "
        "revision is promoted to all traffic. An empty list replaces the old revision at once."))
    rollback_on: list[RollbackTrigger] = Field(default_factory=list, max_length=16, description=(
        "Triggers judged at every step; the first that fires rolls back to the previous revision."))
    http_route: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253,
                                   description=(
        "Name of a Gateway API HTTPRoute (gateway.networking.k8s.io/v1, same namespace) whose rules send traffic "
        "to this service. When set, the operator splits traffic by weights on that route instead of by replica "
        "ratio: in every rule that references Service `<name>`, `<name>-stable` or `<name>-canary`, those "
        "backendRefs become `<name>-stable` and `<name>-canary` with the step's weights (100/0 outside a "
        "rollout). The route itself (parents, matches, filters) stays yours."))


class DisruptionSpec(Kube):
    """The PodDisruptionBudget over the service's pods (every revision), kept while spec.replicas > 1. Budgets that
    would never allow an eviction (maxUnavailable 0, minAvailable 100%) are refused: they block node drains."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!(has(self.maxUnavailable) && has(self.minAvailable))", "give maxUnavailable or minAvailable, not both"),
        ("!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? self.maxUnavailable != 0 : "
         "self.maxUnavailable != '0%')",
         "maxUnavailable 0 would block every node drain for good"),
        ("!has(self.minAvailable) || type(self.minAvailable) == int || self.minAvailable != '100%'",
         "minAvailable 100% would block every node drain for good")))

    max_unavailable: IntOrPercent | None = Field(default=None, description=(
        "Most pods a voluntary disruption (a node drain) may take down at once, e.g. 1 or '25%' (default 1)."))
    min_available: IntOrPercent | None = Field(default=None, description=(
        "Or: least pods that must stay up, e.g. 2 or '50%'."))

    @model_validator(mode="after")
    def _one_of(self) -> DisruptionSpec:
        if self.max_unavailable is not None and self.min_available is not None:
            raise ValueError("give maxUnavailable or minAvailable, not both")
        if self.max_unavailable in (0, "0%"):
            raise ValueError("maxUnavailable 0 would block every node drain for good")
        if self.min_available == "100%":
            raise ValueError("minAvailable 100% would block every node drain for good")
        return self


class InferenceServiceSpec(Kube):
    """Desired state of an InferenceService: a model served by engine pods within latency SLOs."""

    model_config = ConfigDict(json_schema_extra=cel(
        *[(f"!has(self.autotune.bounds) || !has(self.autotune.bounds.{wire}) || !has(self.engine.knobs.{wire}) || "
           f"(self.engine.knobs.{wire} >= self.autotune.bounds.{wire}.min && "
           f"self.engine.knobs.{wire} <= self.autotune.bounds.{wire}.max)",
           f"engine.knobs.{wire} must lie inside autotune.bounds.{wire}")
          for wire in ("maxNumSeqs", "maxNumBatchedTokens", "numSpeculativeTokens")],
        ("!has(self.autotune.bounds) || !has(self.autotune.bounds.numSpeculativeTokens) || "
         "!has(self.engine.speculative) || "
         "self.autotune.bounds.numSpeculativeTokens.max <= self.engine.speculative.numSpeculativeTokens",
         "autotune.bounds.numSpeculativeTokens.max must not exceed engine.speculative.numSpeculativeTokens (the "
         "hard cap of K)")))

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(description="The engine pods.")
    replicas: int = Field(default=1, ge=0, description=(
        "Engine pods of the stable revision; the scale subresource sets it (`kubectl scale`, autoscalers)."))
    slo: SLOSpec = Field(description="Latency and error targets.")
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec, json_schema_extra={"default": {}},
                                   description="The SLO controller (off by default).")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}},
                                 description="Canary rollout of pod-template changes.")
    disruption: DisruptionSpec = Field(default_factory=DisruptionSpec, json_schema_extra={"default": {}},
                                       description=(
        "The PodDisruptionBudget kept while spec.replicas > 1 (default maxUnavailable 1)."))


# --- status -----------------------------------------------------------------------------------------


class _Status(BaseModel):
    """Written by the operator; read leniently (unknown fields kept, e.g. kopf's own bookkeeping)."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              extra="allow")


class Condition(_Status):
    """One status condition (Ready, Progressing, Degraded, Tuning)."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="Machine-readable reason in CamelCase.")
    message: str | None = Field(default=None, description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation this was computed "
                                                                      "from.")


class RolloutStatus(_Status):
    """`status.rollout`: the current or last rollout (docs/rollouts.md), written by the operator."""

    phase: str | None = Field(default=None, description="Progressing, Paused, Promoted, RolledBack or Aborted.")
    reason: str | None = Field(default=None, description="Why it is in this phase (CamelCase).")
    message: str | None = Field(default=None, description="Human-readable details.")
    step: int | None = Field(default=None, description="Index of the current step in spec.rollout.steps.")
    steps: int | None = Field(default=None, description="Number of steps.")
    requested_weight: int | None = Field(default=None, description="Weight the current step asks for (percent).")
    canary_weight: int | None = Field(default=None, description="Share of traffic the canary gets (percent).")
    stable_revision: str | None = Field(default=None, description="Revision rolled out from.")
    canary_revision: str | None = Field(default=None, description="Revision rolled out.")
    stable_template_hash: str | None = Field(default=None, description="sha256 of the stable pod template.")
    canary_template_hash: str | None = Field(default=None, description="sha256 of the canary pod template.")
    started_at: str | None = Field(default=None, description="When the rollout started (RFC 3339).")
    step_started_at: str | None = Field(default=None, description="When the current step's judging started.")
    ended_at: str | None = Field(default=None, description="When the rollout ended.")
    analysis: list[dict[str, Any]] = Field(default_factory=list, description="The last verdict of each trigger.")
    last_rollback: dict[str, Any] | None = Field(default=None, description=(
        "The trigger that fired last: metric, observed value, threshold, window."))
    traffic: str | None = Field(default=None, description="How traffic is split: replicas or httpRoute.")
    plan: str | None = Field(default=None, description="The steps walked, e.g. '10%/2m,50%/2m'.")
    superseded: bool | None = Field(default=None, description="Ended unpromoted, and the spec has moved on since.")


class InferenceServiceStatus(_Status):
    """Observed state, written by the operator and the tuner."""

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    replicas: int | None = Field(default=None, description=(
        "Pods of the stable revision (what spec.replicas sets; the scale subresource reports it)."))
    ready_replicas: int | None = Field(default=None, description="Ready pods of the stable revision.")
    selector: str | None = Field(default=None, description=(
        "Label selector of the stable revision's pods, for the scale subresource (autoscalers read their "
        "metrics)."))
    canary_weight: int | None = Field(default=None, description=(
        "Percent of traffic on the canary revision now (0 outside a rollout)."))
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"] | None = Field(
        default=None, description="Summary: Pending, Progressing, Ready, Degraded or Failed.")
    revision: str | None = Field(default=None, description="Revision serving the stable traffic.")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Current conditions, one per type.")
    tuning: dict[str, Any] | None = Field(default=None, description="The tuner's state: effective knob values "
                                                                    "and recent decision records.")
    rollout: RolloutStatus | None = Field(default=None, description=(
        "The current or last rollout: phase, step, canaryWeight, stable and canary revisions with their "
        "pod-template hashes, the last trigger verdicts, and lastRollback (see docs/rollouts.md)."))
    traffic_routing: dict[str, Any] | None = Field(default=None, description=(
        "The HTTPRoute that splits traffic (spec.rollout.httpRoute) and what, if anything, makes it unusable."))
