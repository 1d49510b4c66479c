"""Validation of an InferenceService spec as the operator reads it: the schema (by the pydantic models of `api`)
and the checks a schema cannot express (`validate_spec`, which restates the CRD's CEL rules for objects stored
before a rule existed). `parse_spec` runs both and never raises: it returns the spec or a list of `FieldError`s
with camelCase paths under "spec.".

Parsing is strict like the API server (`replicas: "3"` is an error, not 3) and accepts only the camelCase names.
Null values are dropped before validation, as the API server prunes nulls of non-nullable fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from governor.operator.api import (
    DURATION_PATTERN,
    MODEL_URI_FORMS,
    MODEL_URI_PATTERN,
    AutotuneBounds,
    EngineSpec,
    InferenceServiceSpec,
    StartingKnobs,
    duration_seconds,
    parse_model_uri,
)
from governor.operator.kube_types import LABEL_KEY_PATTERN, QUANTITY_PATTERN
from governor.operator.pod_ownership import (
    OPERATOR_ANNOTATIONS,
    OPERATOR_ENV,
    OPERATOR_ENV_PREFIX,
    OPERATOR_FLAGS,
    OPERATOR_KEY_PREFIX,
    OPERATOR_LABELS,
)


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
    - extraArgs set no flag the operator sets (`OPERATOR_FLAGS`), env no variable it sets, podLabels and
      podAnnotations no key it sets, and their keys are valid label keys;
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
        if engine.speculative.method == "ngram" and engine.speculative.quantization:
            err(FieldError(f"{spec_path}.quantization", "method ngram takes no quantization: it runs no draft model"))
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
    errors += _pod_setting_errors(engine)

    bounds = spec.autotune.bounds.given() if spec.autotune.bounds is not None else {}
    for name, (lo, hi) in bounds.items():
        wire = _wire_name(AutotuneBounds, name)
        if lo > hi:
            err(FieldError(f"spec.autotune.bounds.{wire}", f"min {lo} exceeds max {hi}"))
        if name != "num_speculative_tokens" and lo < 1:
            err(FieldError(f"spec.autotune.bounds.{wire}.min", f"{wire} cannot go below 1, got min {lo}"))
        start = getattr(engine.knobs, name)
        if start is not None and lo <= hi and not lo <= start <= hi:
            err(FieldError(f"spec.engine.knobs.{_wire_name(StartingKnobs, name)}",
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


def _pod_setting_errors(engine: EngineSpec) -> list[FieldError]:
    """What the operator owns among the pod settings a user may add to, and label syntax."""
    errors = []
    for i, arg in enumerate(engine.extra_args):
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_FLAGS:
            errors.append(FieldError(f"spec.engine.extraArgs[{i}]", f"{flag} is set by {OPERATOR_FLAGS[flag]}; "
                                                                     "remove it from extraArgs"))
    for i, var in enumerate(engine.env):
        if var.name.startswith(OPERATOR_ENV_PREFIX) or var.name in OPERATOR_ENV:
            errors.append(FieldError(f"spec.engine.env[{i}].name", f"{var.name} is set by the operator (it owns "
                                                                   f"{OPERATOR_ENV_PREFIX}* and "
                                                                   f"{', '.join(OPERATOR_ENV)})"))
    for field, owned, keys in (("podLabels", OPERATOR_LABELS, engine.pod_labels),
                               ("podAnnotations", OPERATOR_ANNOTATIONS, engine.pod_annotations)):
        for key in keys:
            if key.startswith(OPERATOR_KEY_PREFIX) or key in owned:
                errors.append(FieldError(f"spec.engine.{field}[{key}]", f"{key} is set by the operator; use "
                                                                        "another key"))
            elif not re.fullmatch(LABEL_KEY_PATTERN, key):
                errors.append(FieldError(f"spec.engine.{field}[{key}]", "not a valid key: an optional DNS "
                                                                        "subdomain prefix and '/', then up to 63 "
                                                                        "letters, digits, '-', '_', '.'"))
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
