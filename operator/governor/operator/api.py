"""The `InferenceService` API (governor.dev/v1alpha1): what users write, as pydantic models.

These models are the source of truth: the CRD in crds/ is generated from them (`governor crds`,
`governor.operator.crds`), and the operator reads every object through `parse_spec`.

Python names are snake_case, the wire is camelCase (the alias generator). Parsing is strict like the
API server (`replicas: "3"` is an error, not 3) and accepts only the camelCase names. Null values are
dropped before validation, as the API server prunes nulls of non-nullable fields.

Two layers of validation:
- the schema (types, enums, bounds, patterns, defaults), which the API server also enforces from the CRD;
- `validate_spec`, the rules a schema cannot express (cross-field checks). `parse_spec` runs both and
  never raises: it returns the spec or a list of `FieldError`s with camelCase paths under "spec.".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.alias_generators import to_camel

from governor import contract
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

# --- model URIs -----------------------------------------------------------------------------------

# The CRD checks only the scheme set; `parse_model_uri` checks each form's structure, with messages.
MODEL_URI_PATTERN = r"^(/|pvc://|hf://)\S+$"
_PVC_URI = re.compile(r"pvc://(?P<claim>[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)(?P<path>/\S*)?")
_HF_URI = re.compile(r"hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<revision>[-A-Za-z0-9_./]+))?")
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


# --- Kubernetes quantities --------------------------------------------------------------------------

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


def _int_to_str(value: object) -> object:
    # `cpu: 4` in YAML is an integer; Kubernetes quantities accept both, like the native fields.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Quantity = Annotated[
    str,
    BeforeValidator(_int_to_str),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
    Field(pattern=QUANTITY_PATTERN),
]

# --- spec -------------------------------------------------------------------------------------------


class _Wire(BaseModel):
    """camelCase on the wire, strict types, no unknown fields, no NaN or infinity."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              extra="forbid", strict=True, allow_inf_nan=False)


class ModelSpec(_Wire):
    """The model to serve."""

    uri: str = Field(pattern=MODEL_URI_PATTERN, description=(
        "Where the checkpoint is: a path mounted in the pod ('/models/llama'), a PersistentVolumeClaim "
        "('pvc://claim/path/in/claim'), or a Hugging Face repository ('hf://org/name@revision')."))
    revision: str | None = Field(default=None, min_length=1, max_length=128, description=(
        "Digest or tag of the weights. Part of the service's identity: changing it rolls out a new revision, "
        "and the prefix cache never shares blocks across revisions."))
    served_name: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63,
                                    description="Model name clients send in OpenAI requests (default: the "
                                                "InferenceService's name). Lowercase letters, digits, '-', '.'.")


class Resources(_Wire):
    """Resources of one engine pod."""

    gpus: int = Field(default=1, ge=0, description="GPUs per pod (nvidia.com/gpu); 0 runs the engine on CPU.")
    memory: Quantity | None = Field(default=None, description="Memory request and limit, e.g. '64Gi'.")
    cpu: Quantity | None = Field(default=None, description="CPU request, e.g. '8' or '500m'.")


class Speculative(_Wire):
    """Speculative decoding."""

    method: Literal["ngram", "draft_model"] = Field(description=(
        "'ngram': draft tokens by prompt lookup (no extra model); 'draft_model': a small model of the same "
        "tokenizer drafts them (set draftModel)."))
    draft_model: str | None = Field(default=None, pattern=MODEL_URI_PATTERN, description=(
        "URI of the draft model (same forms as model.uri); required with method draft_model."))
    num_speculative_tokens: int = Field(ge=1, le=16, description=(
        "Draft tokens per step K: the initial value and the hard cap of the numSpeculativeTokens knob. "
        "To turn speculation off, leave out `speculative`."))


class Knobs(_Wire):
    """Starting values of the live knobs (the tuner may change them; tuned values live in status).

    Field names are `contract.KNOB_NAMES`, so `model_dump(exclude_none=True)` is a knob update."""

    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences running in one step "
                                                                      "(default: the engine's).")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description=(
        "Token budget of one step, i.e. the prefill chunk size (default: the engine's)."))
    num_speculative_tokens: int | None = Field(default=None, ge=0, description=(
        "Speculation depth K, at most speculative.numSpeculativeTokens (default: that cap; 0 = off)."))


class Toleration(_Wire):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists matches every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal "
                                                                                    "(Kubernetes default: Equal).")
    value: str | None = Field(default=None, description="Taint value to match (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(default=None, description=(
        "With effect NoExecute: how long the pod stays bound after the taint appears."))


class EngineSpec(_Wire):
    """The engine pods: image, resources, static configuration and starting knob values."""

    image: str = Field(min_length=1, description="Engine container image, e.g. 'ghcr.io/org/governor:0.1.0'.")
    resources: Resources = Field(default_factory=Resources, json_schema_extra={"default": {}},
                                 description="Resources of one engine pod.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight and activation dtype ('auto': the checkpoint's).")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(default="auto", description=(
        "KV cache element type: 'auto' (the model dtype) or 'fp8' (e4m3 with scales; twice the KV capacity)."))
    prefix_caching: bool = Field(default=True, description="Reuse cached KV of shared prompt prefixes.")
    speculative: Speculative | None = Field(default=None, description="Speculative decoding (off when absent).")
    max_model_len: int | None = Field(default=None, ge=16, description="Longest context (prompt + output) in "
                                                                       "tokens (default: the model's).")
    tensor_parallel_size: int = Field(default=1, ge=1, le=8, description=(
        "Ranks the model is split over, one GPU each; needs resources.gpus ≥ this size on GPU."))
    knobs: Knobs = Field(default_factory=Knobs, json_schema_extra={"default": {}},
                         description="Starting values of the live knobs.")
    extra_args: list[str] = Field(default_factory=list, description="Extra `governor serve` arguments, "
                                                                    "appended as given.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")


class SLOSpec(_Wire):
    """Latency and error targets the tuner holds the service to (p95 over `window`)."""

    ttft_p95: Duration = Field(description="Target p95 time to first token, e.g. '500ms'.")
    itl_p95: Duration = Field(description="Target p95 inter-token latency, e.g. '50ms'.")
    e2e_p95: Duration | None = Field(default=None, alias="e2eP95",  # to_camel would say e2EP95
                                     description="Target p95 end-to-end request latency, e.g. '30s'.")
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0, description=(
        "Ceiling on the fraction of requests that end in an error (0..1)."))
    window: Duration = Field(default="1m", description="Window the percentiles are computed over.")

    def targets(self) -> SLO:
        """These targets in seconds, as the tuner takes them."""
        return SLO(ttft_p95_s=duration_seconds(self.ttft_p95), itl_p95_s=duration_seconds(self.itl_p95),
                   e2e_p95_s=None if self.e2e_p95 is None else duration_seconds(self.e2e_p95),
                   error_rate=self.error_rate)


class KnobRange(_Wire):
    """Inclusive range a knob may be tuned over."""

    min: int = Field(ge=0, description="Lowest value the tuner may set.")
    max: int = Field(ge=0, description="Highest value the tuner may set.")


class AutotuneBounds(_Wire):
    """Ranges the tuner keeps each knob in; a knob left out keeps the tuner's default range.

    Field names are `contract.KNOB_NAMES`."""

    max_num_seqs: KnobRange | None = Field(default=None, description="Range of maxNumSeqs.")
    max_num_batched_tokens: KnobRange | None = Field(default=None, description="Range of maxNumBatchedTokens.")
    num_speculative_tokens: KnobRange | None = Field(default=None, description="Range of numSpeculativeTokens.")

    def given(self) -> dict[str, tuple[int, int]]:
        """The ranges set here, by contract knob name."""
        return {name: (r.min, r.max) for name in contract.KNOB_NAMES if (r := getattr(self, name)) is not None}


class AutotuneSpec(_Wire):
    """The SLO controller ("tuner") of this service."""

    enabled: bool = Field(default=False, description="Tune the live knobs to hold the SLO.")
    interval: Duration = Field(default="15s", description="How often the tuner observes and decides.")
    cooldown: Duration = Field(default="5m", description="Least time between two knob changes.")
    hysteresis: float = Field(default=0.1, ge=0.0, le=0.5, description=(
        "Relative band around each SLO target: act above target·(1+h), relax below target·(1−h)."))
    bounds: AutotuneBounds | None = Field(default=None, description="Ranges the tuner keeps each knob in.")


class RolloutStep(_Wire):
    """One canary step: shift `weight` percent of traffic to the new revision, then judge it for `pause`."""

    weight: int = Field(ge=1, le=100, description=(
        "Percent of traffic on the new revision during this step (by replica ratio behind the shared Service: "
        "the canary gets enough pods for about this share; status.rollout.canaryWeight reports the actual one)."))
    pause: Duration = Field(default="2m", description=(
        "How long the step is judged, counted from when the canary's pods are ready, before the next step."))


class RollbackTrigger(_Wire):
    """A condition on the canary that rolls the rollout back, judged over the window `for` at every check."""

    metric: Literal["ttft_p95", "itl_p95", "e2e_p95", "error_rate", "throughput"] = Field(
        description="Metric judged on the canary: p95 latencies in seconds, error rate 0..1, or generated "
                    "tokens/s per engine (throughput).")
    comparison: Literal["absolute", "relative"] = Field(default="relative", description=(
        "'absolute': fires when the canary's value passes `threshold` (above it; for throughput, below it). "
        "'relative': `threshold` is a ratio to stable: fires when canary > threshold × stable (1.2 = 20% worse; "
        "for throughput, canary < threshold × stable)."))
    threshold: float = Field(gt=0.0, description="The limit in the metric's unit (absolute), or the ratio to "
                                                 "stable (relative).")
    for_: Duration = Field(default="2m", alias="for", description=(
        "Window the metric is computed over (canary and stable alike), e.g. '2m'."))


def _default_steps() -> list[RolloutStep]:
    return [RolloutStep(weight=10, pause="2m"), RolloutStep(weight=50, pause="2m")]


class RolloutSpec(_Wire):
    """How a change of the pod template (model revision, image, static engine config) is rolled out."""

    steps: list[RolloutStep] = Field(default_factory=_default_steps,
                                     json_schema_extra={"default": [{"weight": 10, "pause": "2m"},
                                                                    {"weight": 50, "pause": "2m"}]},
                                     description=(
        "Canary steps with strictly increasing weights below 100; after the last step passes, the new "
        "revision is promoted to all traffic. An empty list replaces the old revision at once."))
    rollback_on: list[RollbackTrigger] = Field(default_factory=list, description=(
        "Triggers judged at every step; the first that fires rolls back to the previous revision."))
    http_route: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253,
                                   description=(
        "Name of a Gateway API HTTPRoute (gateway.networking.k8s.io/v1, same namespace) whose rules send traffic "
        "to this service. When set, the operator splits traffic by weights on that route instead of by replica "
        "ratio: in every rule that references Service `<name>`, `<name>-stable` or `<name>-canary`, those "
        "backendRefs become `<name>-stable` and `<name>-canary` with the step's weights (100/0 outside a "
        "rollout). The route itself (parents, matches, filters) stays yours."))


class InferenceServiceSpec(_Wire):
    """Desired state of an InferenceService: a model served by engine pods within latency SLOs."""

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(description="The engine pods.")
    replicas: int = Field(default=1, ge=0, description="Engine pods of the stable revision.")
    slo: SLOSpec = Field(description="Latency and error targets.")
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec, json_schema_extra={"default": {}},
                                   description="The SLO controller (off by default).")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}},
                                 description="Canary rollout of pod-template changes.")


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


class InferenceServiceStatus(_Status):
    """Observed state, written by the operator and the tuner."""

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    replicas: int | None = Field(default=None, description="Engine pods that exist, all revisions.")
    ready_replicas: int | None = Field(default=None, description="Engine pods that are ready, all revisions.")
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"] | None = Field(
        default=None, description="Summary: Pending, Progressing, Ready, Degraded or Failed.")
    revision: str | None = Field(default=None, description="Revision serving the stable traffic.")
    conditions: list[Condition] = Field(default_factory=list, description="Current conditions.")
    tuning: dict[str, Any] | None = Field(default=None, description="The tuner's state: effective knob values "
                                                                    "and recent decision records.")
    rollout: dict[str, Any] | None = Field(default=None, description=(
        "The current or last rollout: phase, step, canaryWeight, stable and canary revisions with their "
        "pod-template hashes, the last trigger verdicts, and lastRollback (see docs/rollouts.md)."))


# --- validation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldError:
    """One problem with a spec: the camelCase path of the field ("spec.engine.knobs.maxNumSeqs") and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _wire_name(model: type[BaseModel], field: str) -> str:
    return model.model_fields[field].alias or field


def validate_spec(spec: InferenceServiceSpec) -> list[FieldError]:
    """The rules the schema cannot express; an empty list means the spec is valid.

    - model.uri (and speculative.draftModel) must have one of the supported forms;
    - an hf:// URI's @revision must agree with model.revision when both are given;
    - speculative method draft_model needs draftModel, ngram takes none;
    - knobs.numSpeculativeTokens needs `speculative` and stays within its numSpeculativeTokens (the hard cap);
    - on GPU (gpus > 0) each pod needs at least tensorParallelSize GPUs;
    - each autotune bound has min ≤ max (min ≥ 1 for maxNumSeqs and maxNumBatchedTokens), and a knob's
      starting value lies inside its bound;
    - SLO targets and tuner intervals are positive durations;
    - rollout step weights strictly increase and stay below 100 (promotion to 100 is implicit);
    - a relative rollback trigger's threshold is a ratio pointing the worse way (≥ 1; ≤ 1 for throughput),
      an absolute error-rate threshold is a fraction, and every trigger window is at least 1s.
    """
    errors: list[FieldError] = []
    err = errors.append

    uri = None
    try:
        uri = parse_model_uri(spec.model.uri)
    except ValueError as e:
        err(FieldError("spec.model.uri", str(e)))
    if uri is not None and uri.revision and spec.model.revision and uri.revision != spec.model.revision:
        err(FieldError("spec.model.revision", f"{spec.model.revision!r} disagrees with the URI's @{uri.revision}; "
                                              "give the revision in one place, or the same in both"))

    engine = spec.engine
    spec_path = "spec.engine.speculative"
    if engine.speculative is not None:
        draft = engine.speculative.draft_model
        if engine.speculative.method == "draft_model" and not draft:
            err(FieldError(f"{spec_path}.draftModel", "method draft_model needs draftModel: the draft model's URI"))
        if engine.speculative.method == "ngram" and draft:
            err(FieldError(f"{spec_path}.draftModel", "method ngram takes no draftModel; remove it or use "
                                                      "method draft_model"))
        if draft:
            try:
                parse_model_uri(draft)
            except ValueError as e:
                err(FieldError(f"{spec_path}.draftModel", str(e)))
    k = engine.knobs.num_speculative_tokens
    if k is not None and k > 0:
        if engine.speculative is None:
            err(FieldError("spec.engine.knobs.numSpeculativeTokens",
                           f"{k} needs speculative decoding: set spec.engine.speculative, or use 0"))
        elif k > engine.speculative.num_speculative_tokens:
            err(FieldError("spec.engine.knobs.numSpeculativeTokens",
                           f"{k} exceeds speculative.numSpeculativeTokens={engine.speculative.num_speculative_tokens}"
                           ", the hard cap of K"))

    gpus = engine.resources.gpus
    if gpus > 0 and engine.tensor_parallel_size > gpus:
        err(FieldError("spec.engine.tensorParallelSize",
                       f"{engine.tensor_parallel_size} ranks need as many GPUs per pod, but resources.gpus is {gpus}"))

    bounds = spec.autotune.bounds.given() if spec.autotune.bounds is not None else {}
    for name, (lo, hi) in bounds.items():
        wire = _wire_name(AutotuneBounds, name)
        if lo > hi:
            err(FieldError(f"spec.autotune.bounds.{wire}", f"min {lo} exceeds max {hi}"))
        if name != "num_speculative_tokens" and lo < 1:
            err(FieldError(f"spec.autotune.bounds.{wire}.min", f"{wire} cannot go below 1, got min {lo}"))
        start = getattr(engine.knobs, name)
        if start is not None and lo <= hi and not lo <= start <= hi:
            err(FieldError(f"spec.engine.knobs.{_wire_name(Knobs, name)}",
                           f"starting value {start} lies outside autotune.bounds.{wire} [{lo}, {hi}]"))
    k_range = bounds.get("num_speculative_tokens")
    k_cap = engine.speculative.num_speculative_tokens if engine.speculative is not None else None
    if k_range is not None and k_cap is not None and k_range[1] > k_cap:
        err(FieldError("spec.autotune.bounds.numSpeculativeTokens.max",
                       f"{k_range[1]} exceeds speculative.numSpeculativeTokens={k_cap}, the hard cap of K"))

    for path, value in (("spec.slo.ttftP95", spec.slo.ttft_p95), ("spec.slo.itlP95", spec.slo.itl_p95),
                        ("spec.slo.e2eP95", spec.slo.e2e_p95), ("spec.slo.window", spec.slo.window),
                        ("spec.autotune.interval", spec.autotune.interval)):
        if value is not None and duration_seconds(value) <= 0:
            err(FieldError(path, f"must be longer than zero, got {value!r}"))

    for i, trigger in enumerate(spec.rollout.rollback_on):
        path = f"spec.rollout.rollbackOn[{i}]"
        if duration_seconds(trigger.for_) < 1:
            err(FieldError(f"{path}.for", f"must be at least 1s (a Prometheus rate window), got {trigger.for_!r}"))
        if trigger.comparison == "relative" and trigger.metric != "throughput" and trigger.threshold < 1:
            err(FieldError(f"{path}.threshold", f"a relative {trigger.metric} threshold is a ratio to stable and must "
                                                f"be ≥ 1 (1.2 = 20% worse), got {trigger.threshold:g}"))
        if trigger.comparison == "relative" and trigger.metric == "throughput" and trigger.threshold > 1:
            err(FieldError(f"{path}.threshold", "a relative throughput threshold is a ratio to stable and must be "
                                                f"≤ 1 (0.8 = 20% less), got {trigger.threshold:g}"))
        if trigger.comparison == "relative" and trigger.metric == "throughput" and spec.rollout.http_route:
            err(FieldError(f"{path}.comparison", "a relative throughput trigger compares tokens/s per engine, which "
                                                 "with httpRoute weights depends on the step (the canary's pods get a "
                                                 "different share of load than stable's): use absolute"))
        if trigger.comparison == "absolute" and trigger.metric == "error_rate" and trigger.threshold > 1:
            err(FieldError(f"{path}.threshold", f"an error rate is a fraction 0..1, got {trigger.threshold:g}"))

    steps = spec.rollout.steps
    for i, step in enumerate(steps):
        if i > 0 and step.weight <= steps[i - 1].weight:
            err(FieldError(f"spec.rollout.steps[{i}].weight",
                           f"weights must strictly increase: {step.weight} follows {steps[i - 1].weight}"))
        if step.weight == 100:
            err(FieldError(f"spec.rollout.steps[{i}].weight", "100 is not a step: the new revision is promoted to "
                                                              "all traffic after the last step passes"))
    return errors


def drop_nulls(value: Any) -> Any:
    """`value` without null map entries, recursively: what the API server does to nulls of non-nullable
    fields (none is nullable here) before defaulting."""
    if isinstance(value, Mapping):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def _path(loc: tuple[int | str, ...]) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _message(error: Any) -> str:
    pattern = (error.get("ctx") or {}).get("pattern")
    got = error.get("input")
    if pattern == DURATION_PATTERN:
        return f"expected a duration like '500ms', '2s' or '1m' (number + ms|s|m), got {got!r}"
    if pattern == MODEL_URI_PATTERN:
        return f"unsupported model URI {got!r}: expected {MODEL_URI_FORMS}"
    if pattern == QUANTITY_PATTERN:
        return f"expected a Kubernetes quantity like '64Gi', '8' or '500m', got {got!r}"
    if error["type"] == "extra_forbidden":
        return "unknown field (names are camelCase; see `kubectl explain inferenceservice.spec`)"
    return str(error["msg"])


def parse_spec(raw: object) -> InferenceServiceSpec | list[FieldError]:
    """Validate a wire spec (camelCase dict, as stored in the cluster): the spec with defaults applied, or
    every schema error — else every `validate_spec` error — as `FieldError`s. Never raises."""
    if not isinstance(raw, Mapping):
        return [FieldError("spec", f"expected an object, got {type(raw).__name__}")]
    try:
        spec = InferenceServiceSpec.model_validate(drop_nulls(raw), by_alias=True, by_name=False)
    except ValidationError as e:
        return [FieldError(_path(tuple(err["loc"])), _message(err)) for err in e.errors()]
    return validate_spec(spec) or spec
