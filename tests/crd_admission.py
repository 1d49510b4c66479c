"""What the API server does to a custom object of a CRD on `kubectl apply`: prune, default, validate the schema,
evaluate the `x-kubernetes-validations` rules (CEL, with cel-python). Nothing here knows the InferenceService:
it reads the CRD.

As in apiextensions-apiserver: unknown fields are pruned, then defaults fill missing fields of objects that are
present (recursively, in lists too), then the value is validated against the schema, and every rule is
evaluated with `self` bound to the value at its node (only where the value is present), typed by the schema:
`integer` as a CEL int, `number` as a double (even when written `1`), objects as maps. A rule that fails to
evaluate (e.g. a missing field) refuses the object, as the API server's does.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
from celpy import celtypes

from tests.apiserver_crd_rules import prune, to_cel, value_errors

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def version_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema of the CRD's storage version."""
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return dict(version["schema"]["openAPIV3Schema"])


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing properties of objects that are present, recursively."""
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def rule_failures(value: Any, schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """(path, message) of every x-kubernetes-validations rule `value` fails, depth first."""
    if value is None:
        return []
    out: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            ok = _program(rule["rule"]).evaluate({"self": to_cel(value, schema)})
        except celpy.CELEvalError as e:  # the API server refuses an object whose rule errs
            ok = e
        if ok is not True and not (isinstance(ok, celtypes.BoolType) and bool(ok)):
            out.append((path or ".", rule.get("message") or f"failed rule: {rule['rule']}"))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                out += rule_failures(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += rule_failures(item, extra, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += rule_failures(item, schema["items"], f"{path}[{i}]")
    return out


def admit(obj: dict[str, Any], crd: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The object as the API server would store it, and every reason it would refuse it (empty: accepted)."""
    schema = version_schema(crd)
    stored = apply_defaults(schema, prune(copy.deepcopy(obj), schema, is_resource_root=True))
    errors = [str(e) for e in value_errors(stored, schema)]
    errors += [f"{path}: Invalid value: {message}" for path, message in rule_failures(stored, schema)]
    return stored, errors
