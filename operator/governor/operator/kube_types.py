"""Kubernetes core/v1 types an InferenceService embeds in its pod settings, as pydantic models.

Written out (rather than accepted as opaque objects) so the CRD carries their schema: `kubectl apply` refuses a
misspelt affinity or env entry at once, and `kubectl explain` documents them. The checks core/v1 validation makes
that are cheap to restate (selector operators and their values, topology-spread consistency, downward-API paths,
budget bounds) are CEL rules here and model validators for the operator; a Deployment the API server still
refuses is reported by reconcile (ChildRejected). Field names and meanings are core/v1's; each model names its
upstream type. Only what pods of an engine use is here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # object names: Secrets, ConfigMaps, ServiceAccounts, ...


def _int_to_str(value: object) -> object:
    # `cpu: 4` in YAML is an integer; Kubernetes quantities accept both, like the native fields.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Quantity = Annotated[
    str,
    BeforeValidator(_int_to_str),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
    Field(pattern=QUANTITY_PATTERN),
]

# A count or a percentage ("25%", at most 100%), as PodDisruptionBudget's minAvailable/maxUnavailable take it.
PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"


def _int_or_percent(value: object) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value):
        return value
    raise ValueError(f"expected a count (0, 1, ...) or a percentage like '25%' (at most 100%), got {value!r}")


IntOrPercent = Annotated[
    int | str,
    PlainValidator(_int_or_percent),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": PERCENT_PATTERN, "minimum": 0}),
]

# Label keys (an optional DNS-subdomain prefix and '/', then a name of up to 63 characters) and values.
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
# The pod fields the downward API serves as env vars (core/v1 validation refuses any other fieldRef path).
FIELD_PATH_PATTERN = (r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])"
                      r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$")


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """`x-kubernetes-validations` (CEL rules the API server evaluates on `kubectl apply`) as JSON Schema extra:
    (rule, message) pairs. Each rule restates a check the operator also makes in Python (a model validator or
    `validation.validate_spec`), the second line of defence for objects stored before a rule existed."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


def _rules(*rules: tuple[str, str]) -> ConfigDict:
    """A model config carrying these CEL rules."""
    return ConfigDict(json_schema_extra=cel(*rules))

ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]


class Kube(BaseModel):
    """camelCase on the wire, strict types, no unknown fields: like the API server with strict field validation."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              extra="forbid", strict=True, allow_inf_nan=False)


# --- env ------------------------------------------------------------------------------------------------


class KeySelector(Kube):
    """One key of a Secret or ConfigMap (core/v1 SecretKeySelector, ConfigMapKeySelector)."""

    name: ObjectName = Field(description="Name of the Secret or ConfigMap, in the service's namespace.")
    key: str = Field(min_length=1, max_length=253, description="The key whose value is taken.")
    optional: bool | None = Field(default=None, description="Start the pod even if the object or key is missing.")


class ObjectFieldSelector(Kube):
    """A field of the pod (core/v1 ObjectFieldSelector), e.g. metadata.name or status.podIP."""

    api_version: str | None = Field(default=None, description="Version of the schema the path is in (default v1).")
    field_path: str = Field(min_length=1, max_length=512, pattern=FIELD_PATH_PATTERN, description=(
        "Path of the field: metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
        "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP(s) or status.podIP(s)."))


class ResourceFieldSelector(Kube):
    """A resource request or limit of the container (core/v1 ResourceFieldSelector)."""

    container_name: str | None = Field(default=None, description="Container name (default: this one).")
    resource: str = Field(min_length=1, description="e.g. 'limits.memory' or 'requests.cpu'.")
    divisor: Quantity | None = Field(default=None, description="Unit of the value (default 1).")


class EnvVarSource(Kube):
    """Where an env var's value comes from (core/v1 EnvVarSource): exactly one of the fields."""

    model_config = _rules((
        "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), "
        "has(self.resourceFieldRef)].filter(x, x).size() == 1",
        "valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef"))

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret (e.g. HF_TOKEN).")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: ObjectFieldSelector | None = Field(default=None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(default=None, description="A resource of the "
                                                                                        "container.")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        given = [self.secret_key_ref, self.config_map_key_ref, self.field_ref, self.resource_field_ref]
        if sum(g is not None for g in given) != 1:
            raise ValueError("valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef, "
                             "resourceFieldRef")
        return self


class EnvVar(Kube):
    """An environment variable of the engine container and of the model download (core/v1 EnvVar)."""

    model_config = _rules(("!(has(self.value) && has(self.valueFrom))",
                           "an env var takes value or valueFrom, not both"))

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Variable name, e.g. 'HF_TOKEN'.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: EnvVarSource | None = Field(default=None, description="Value taken from a Secret, ConfigMap or the "
                                                                      "pod.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("an env var takes value or valueFrom, not both")
        return self


class ObjectReference(Kube):
    """A Secret or ConfigMap as a whole (core/v1 SecretEnvSource, ConfigMapEnvSource)."""

    name: ObjectName = Field(description="Name of the object, in the service's namespace.")
    optional: bool | None = Field(default=None, description="Start the pod even if the object is missing.")


class EnvFromSource(Kube):
    """Every key of a Secret or ConfigMap as env vars (core/v1 EnvFromSource): one of the two."""

    model_config = _rules(("has(self.secretRef) != has(self.configMapRef)",
                           "envFrom takes exactly one of secretRef and configMapRef"))

    prefix: str | None = Field(default=None, max_length=256, description="Prepended to every key.")
    secret_ref: ObjectReference | None = Field(default=None, description="The Secret.")
    config_map_ref: ObjectReference | None = Field(default=None, description="The ConfigMap.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("envFrom takes exactly one of secretRef and configMapRef")
        return self


class LocalObjectReference(Kube):
    """An object in the service's namespace, by name (core/v1 LocalObjectReference)."""

    name: ObjectName = Field(description="Name of the object (e.g. an image pull Secret).")


# --- scheduling -----------------------------------------------------------------------------------------


_SET_OPERATORS = ("In", "NotIn")


def _values_fit(operator: str, values: list[str]) -> str | None:
    """Why `values` do not suit `operator` (None when they do): In/NotIn need some, Exists/DoesNotExist none,
    Gt/Lt one integer."""
    if operator in _SET_OPERATORS:
        return None if values else f"operator {operator}: In and NotIn need values"
    if operator in ("Gt", "Lt"):
        return None if len(values) == 1 and re.fullmatch(r"-?[0-9]+", values[0]) else \
            f"operator {operator}: Gt and Lt need exactly one integer value"
    return None if not values else f"operator {operator}: Exists and DoesNotExist take no values"


_VALUES_RULE = ("(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
                "operators In and NotIn need values; Exists and DoesNotExist take no values")


class LabelSelectorRequirement(Kube):
    """One requirement on labels (meta/v1 LabelSelectorRequirement)."""

    model_config = _rules(_VALUES_RULE)

    key: LabelKey = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="In, NotIn, Exists or "
                                                                                   "DoesNotExist.")
    values: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=64, description=(
        "Values (In, NotIn: non-empty; else empty)."))

    @model_validator(mode="after")
    def _values_suit_the_operator(self) -> LabelSelectorRequirement:
        if (why := _values_fit(self.operator, self.values)) is not None:
            raise ValueError(why)
        return self


class LabelSelector(Kube):
    """A label query over pods (meta/v1 LabelSelector); requirements are ANDed."""

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64,
        json_schema_extra=cel((f"self.all(k, k.matches('{LABEL_KEY_PATTERN}'))",
                               "matchLabels keys must be valid label keys")),
        description="Labels that must equal these values.")
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16,
                                                              description="Further requirements.")

    @model_validator(mode="after")
    def _keys_are_labels(self) -> LabelSelector:
        bad = [k for k in self.match_labels if not re.fullmatch(LABEL_KEY_PATTERN, k)]
        if bad:
            raise ValueError(f"matchLabels keys must be valid label keys, got {bad}")
        return self

    def keys(self) -> set[str]:
        """Every label key the selector constrains."""
        return set(self.match_labels) | {e.key for e in self.match_expressions}


class NodeSelectorRequirement(Kube):
    """One requirement on node labels or fields (core/v1 NodeSelectorRequirement)."""

    model_config = _rules((
        "self.operator in ['Gt', 'Lt'] ? (has(self.values) && size(self.values) == 1 && "
        "self.values[0].matches('^-?[0-9]+$')) : " + _VALUES_RULE[0],
        "operators In and NotIn need values; Gt and Lt need exactly one integer value; Exists and DoesNotExist take "
        "no values"))

    key: str = Field(min_length=1, max_length=317, description="Label key (or field name in matchFields).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt.")
    values: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=64, description=(
        "Values (one integer for Gt and Lt)."))

    @model_validator(mode="after")
    def _values_suit_the_operator(self) -> NodeSelectorRequirement:
        if (why := _values_fit(self.operator, self.values)) is not None:
            raise ValueError(why)
        return self


class NodeSelectorTerm(Kube):
    """Requirements a node must meet, ANDed (core/v1 NodeSelectorTerm)."""

    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list,
                                                             description="Requirements on node labels.")
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list,
                                                        description="Requirements on node fields.")


class NodeSelector(Kube):
    """Terms of which a node must meet at least one (core/v1 NodeSelector)."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, description="Terms, ORed.")


class PreferredSchedulingTerm(Kube):
    """A weighted node preference (core/v1 PreferredSchedulingTerm)."""

    weight: int = Field(ge=1, le=100, description="Weight 1-100 added to a matching node's score.")
    preference: NodeSelectorTerm = Field(description="The term a node should meet.")


class NodeAffinity(Kube):
    """Node affinity of the engine pods (core/v1 NodeAffinity)."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes the pods may only be scheduled on.")
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, description="Nodes the scheduler prefers.")


class PodAffinityTerm(Kube):
    """Pods near which (or away from which) to schedule (core/v1 PodAffinityTerm)."""

    label_selector: LabelSelector | None = Field(default=None, description="The pods this term is about.")
    namespaces: list[str] = Field(default_factory=list, description="Namespaces of those pods (default: the "
                                                                    "service's).")
    namespace_selector: LabelSelector | None = Field(default=None, description="Namespaces of those pods, by label.")
    topology_key: str = Field(min_length=1, max_length=317, description="Node label whose value defines 'near', "
                                                                        "e.g. 'kubernetes.io/hostname'.")
    match_label_keys: list[str] = Field(default_factory=list, description="Pod label keys whose values are "
                                                                          "added to labelSelector (In).")
    mismatch_label_keys: list[str] = Field(default_factory=list, description="Pod label keys whose values are "
                                                                             "added to labelSelector (NotIn).")


class WeightedPodAffinityTerm(Kube):
    """A weighted pod (anti-)affinity preference (core/v1 WeightedPodAffinityTerm)."""

    weight: int = Field(ge=1, le=100, description="Weight 1-100 added to a matching node's score.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(Kube):
    """Schedule near pods that match (core/v1 PodAffinity and PodAntiAffinity have this shape)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, description="Terms every node must meet.")
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, description="Terms the scheduler prefers.")


class Affinity(Kube):
    """Scheduling constraints of the engine pods (core/v1 Affinity)."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Which nodes.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Near which pods.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Away from which pods (e.g. one engine "
                                                                            "per node).")


DEFAULT_SPREAD_KEY = "governor.dev/service"  # what a constraint without labelSelector counts (render.py)


class TopologySpreadConstraint(Kube):
    """How the engine pods spread over a topology (core/v1 TopologySpreadConstraint)."""

    model_config = _rules(
        ("!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
         "minDomains needs whenUnsatisfiable DoNotSchedule"),
        ("!has(self.matchLabelKeys) || (has(self.labelSelector) ? "
         "self.matchLabelKeys.all(k, !(has(self.labelSelector.matchLabels) && k in self.labelSelector.matchLabels) "
         "&& !(has(self.labelSelector.matchExpressions) && self.labelSelector.matchExpressions.exists(e, e.key == k)))"
         f" : !('{DEFAULT_SPREAD_KEY}' in self.matchLabelKeys))",
         "a matchLabelKeys key must not be in labelSelector (without one: not governor.dev/service)"))

    max_skew: int = Field(ge=1, description="Most the pod count may differ between two domains.")
    topology_key: str = Field(min_length=1, max_length=317, description="Node label defining the domains, e.g. "
                                                                        "'topology.kubernetes.io/zone'.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule (a hard rule) or ScheduleAnyway (a preference).")
    label_selector: LabelSelector | None = Field(default=None, description=(
        "The pods counted (default: this service's engine pods, label governor.dev/service)."))
    min_domains: int | None = Field(default=None, ge=1, description="Least number of eligible domains "
                                                                    "(DoNotSchedule only).")
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description=(
        "Whether the pods' node affinity limits the domains (default Honor)."))
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description=(
        "Whether node taints limit the domains (default Ignore)."))
    match_label_keys: list[LabelKey] = Field(default_factory=list, max_length=8, description=(
        "Pod label keys whose values narrow the pods counted, e.g. ['governor.dev/revision'] to spread each "
        "revision on its own."))

    @model_validator(mode="after")
    def _consistent(self) -> TopologySpreadConstraint:
        if self.min_domains is not None and self.when_unsatisfiable != "DoNotSchedule":
            raise ValueError("minDomains needs whenUnsatisfiable DoNotSchedule")
        selected = self.label_selector.keys() if self.label_selector is not None else {DEFAULT_SPREAD_KEY}
        if both := sorted(selected & set(self.match_label_keys)):
            raise ValueError(f"matchLabelKeys {both} must not be in labelSelector (without one: not "
                             f"{DEFAULT_SPREAD_KEY})")
        return self
