"""The checks kube-apiserver applies when an apiextensions.k8s.io/v1 CustomResourceDefinition is created, in Python.

No API server runs where the tests do, so this module re-implements, from their semantics, the rules of
k8s.io/apiextensions-apiserver that decide whether a CRD is accepted on CREATE:

- ``pkg/apis/apiextensions/validation/validation.go``: ``ValidateCustomResourceDefinition`` and what it calls
  (group, scope, names, versions and the single storage version, ``metadata.name == <plural>.<group>``, the OpenAPI
  schema rules of ``ValidateCustomResourceDefinitionOpenAPISchema`` incl. ``x-kubernetes-list-type``,
  ``x-kubernetes-list-map-keys``, ``x-kubernetes-map-type`` and ``x-kubernetes-validations``, the root fields allowed
  with a status subresource, ``additionalPrinterColumns``, ``subresources.scale``, ``selectableFields``,
  ``conversion``, ``status.storedVersions``, API approval of protected groups, ``preserveUnknownFields``);
- ``pkg/apiserver/schema/validation.go`` and ``complete.go`` (``ValidateStructural``: structural invariants,
  metadata invariants, int-or-string/preserve-unknown-fields/embedded-resource consistency, forbidden keys in value
  validations, completeness), with the schema split of ``convert.go`` (``NewStructural``);
- ``pkg/apiserver/schema/defaulting/validation.go`` (``ValidateDefaults``) with ``pruning/algorithm.go``,
  ``objectmeta/coerce.go``, ``objectmeta/validation.go`` and ``defaulting/surroundingobject.go``; defaults are
  checked against their schema as ``pkg/apiserver/validation/validation.go`` does through kube-openapi's validator
  (type, nullable, enum, pattern, lengths, bounds, multipleOf, items, required, properties, formats, allOf/anyOf/
  oneOf/not) and with the error conversion of ``kubeOpenAPIResultToFieldErrors``;
- ``pkg/apis/apiextensions/v1/conversion.go`` and ``defaults.go``: the v1 object is defaulted and converted to the
  internal type before validation, so schemas, subresources, printer columns and selectable fields that are
  identical in every version are reported under ``spec.validation``, ``spec.subresources``,
  ``spec.additionalPrinterColumns`` and ``spec.selectableFields`` (as the real API server does; with versions that
  differ they are reported under ``spec.versions[i]``); ``pkg/registry/customresourcedefinition/strategy.go`` sets
  ``status.storedVersions`` from the storage version.

Errors are :class:`FieldError` values that print like ``k8s.io/apimachinery``'s ``field.Error``
(``<path>: Required value: ...``, ``<path>: Forbidden: ...``, ``<path>: Invalid value: <value>: ...``).

Where the port is knowingly partial:

- ``x-kubernetes-validations`` rules (and ``messageExpression``) are parsed with cel-python when it is importable;
  field selections on ``self``/``oldSelf`` are resolved against the schema (an unknown field is a compile error
  upstream), but CEL is not type-checked, so a rule that parses yet would not type-check (``self == true`` on a
  string) is not reported, and CEL cost limits are not estimated. cel-python lacks the optional syntax (``.?``,
  ``[?``), which is read as plain selection for the syntax check.
- Defaults are evaluated against ``x-kubernetes-validations`` rules with cel-python only where it can evaluate them:
  rules using Kubernetes CEL libraries it lacks (``quantity()``, ``url()``...) are skipped, not failed.
- ``pattern`` is checked with Python's ``re`` plus a scan for constructs RE2 refuses (look-arounds, back-references,
  atomic groups), not with RE2 itself.
- ObjectMeta inside defaults of embedded resources is checked for types, name, generateName, namespace, generation,
  labels, annotations and finalizers; owner references and managed fields only for their JSON types.
- A schema that ``NewSchemaValidator`` cannot build and the ``WarningsOnCreate`` warnings are out of scope.

Two checks go BEYOND the API server (it accepts CRDs that fail them) and are reported only by
:func:`beyond_upstream_errors` (``crd_errors`` includes them unless ``beyond_upstream=False``); their details say so:

- every ``additionalPrinterColumns[].jsonPath`` must resolve to a field of that version's schema (a path through an
  object with ``x-kubernetes-preserve-unknown-fields`` resolves; a filter such as
  ``.status.conditions[?(@.type=="Ready")].status`` resolves through the list's items and its ``@`` paths must
  resolve there too; ``.metadata`` resolves against ObjectMeta);
- ``subresources.scale``: ``specReplicasPath`` and ``statusReplicasPath`` must resolve to an ``integer`` field and
  ``labelSelectorPath`` to a ``string`` field, since ``/scale`` reads them with ``NestedInt64``/``NestedString``
  (``pkg/registry/customresource/etcd.go``) and fails on other types; validation.go only checks the path prefixes.

Unknown keys anywhere in the CRD are reported as ``Unknown field`` (what strict field validation, the default of
``kubectl apply``, rejects; the API server alone would drop them), unless ``strict=False``.
"""

from __future__ import annotations

import base64
import copy
import datetime
import ipaddress
import json
import math
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------------------------------------------------
# Field errors, printed as k8s.io/apimachinery/pkg/util/validation/field prints them.

OMIT: Any = type("OmitValue", (), {"__repr__": lambda self: "OMIT"})()

REQUIRED = "FieldValueRequired"
FORBIDDEN = "FieldValueForbidden"
INVALID = "FieldValueInvalid"
TYPE_INVALID = "FieldValueTypeInvalid"
NOT_SUPPORTED = "FieldValueNotSupported"
DUPLICATE = "FieldValueDuplicate"
TOO_LONG = "FieldValueTooLong"
TOO_MANY = "FieldValueTooMany"
INTERNAL = "InternalError"
UNKNOWN_FIELD = "UnknownField"  # not a field.ErrorType: strict decoding refuses the request before validation

_LABELS = {
    REQUIRED: "Required value", FORBIDDEN: "Forbidden", INVALID: "Invalid value", TYPE_INVALID: "Invalid value",
    NOT_SUPPORTED: "Unsupported value", DUPLICATE: "Duplicate value", TOO_LONG: "Too long", TOO_MANY: "Too many",
    INTERNAL: "Internal error", UNKNOWN_FIELD: "Unknown field",
}
_WITHOUT_VALUE = {REQUIRED, FORBIDDEN, TOO_LONG, INTERNAL, UNKNOWN_FIELD}


@dataclass(frozen=True)
class FieldError:
    """One validation error: the field path, the error type (a ``field.ErrorType`` name), the bad value, a detail."""

    path: str
    type: str
    detail: str = ""
    value: Any = OMIT

    def __str__(self) -> str:
        body = _LABELS[self.type]
        if self.type not in _WITHOUT_VALUE and self.value is not OMIT:
            body += ": " + render_value(self.value)
        if self.detail:
            body += ": " + self.detail
        return f"{self.path or '<nil>'}: {body}"


def render_value(value: Any) -> str:
    """A bad value as Go's field.Error prints it: scalars plainly, strings quoted, anything else as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def go_float(value: float) -> str:
    """A float64 as Go's %v prints it (integral values without a fraction, exponents from 1e21)."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return repr(value)


def _required(path: str, detail: str = "") -> FieldError:
    return FieldError(path, REQUIRED, detail)


def _forbidden(path: str, detail: str) -> FieldError:
    return FieldError(path, FORBIDDEN, detail)


def _invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, INVALID, detail, value)


def _not_supported(path: str, value: Any, valid: Iterable[str]) -> FieldError:
    quoted = ", ".join(json.dumps(str(v)) for v in valid)
    return FieldError(path, NOT_SUPPORTED, f"supported values: {quoted}" if quoted else "", value)


def _too_many(path: str, actual: int, maximum: int) -> FieldError:
    noun = "item" if maximum == 1 else "items"
    return FieldError(path, TOO_MANY, f"must have at most {maximum} {noun}", actual if actual >= 0 else OMIT)


def _child(path: str, *names: str) -> str:
    for name in names:
        path = f"{path}.{name}" if path else name
    return path


def _key(path: str, key: Any) -> str:
    return f"{path}[{key}]"


# --------------------------------------------------------------------------------------------------------------------
# Name formats of k8s.io/apimachinery/pkg/util/validation.

_DNS1035 = "[a-z]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + r"(\." + _DNS1123_LABEL + ")*"
_QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    shown = ",  or ".join(f"'{e}'" for e in examples)
    return f"{message} (e.g. {shown}, regex used for validation is '{fmt}')"


def _max_len(n: int) -> str:
    return f"must be no more than {n} characters"


def _name_errors(value: str, max_len: int, pattern: str, message: str, *examples: str) -> list[str]:
    """The length and format errors of one of the apimachinery name validators."""
    errs = [_max_len(max_len)] if len(value) > max_len else []
    if not re.fullmatch(pattern, value):
        errs.append(_regex_error(message, pattern, *examples))
    return errs


def dns1035_label_errors(value: str) -> list[str]:
    """IsDNS1035Label: lowercase alphanumerics and '-', starting with a letter, at most 63 characters."""
    return _name_errors(value, 63, _DNS1035, "a DNS-1035 label must consist of lower case alphanumeric characters "
                        "or '-', start with an alphabetic character, and end with an alphanumeric character",
                        "my-name", "abc-123")


def dns1123_label_errors(value: str) -> list[str]:
    """IsDNS1123Label: lowercase alphanumerics and '-', at most 63 characters (a subdomain's dots are named)."""
    if re.fullmatch(_DNS1123_SUBDOMAIN, value) and not re.fullmatch(_DNS1123_LABEL, value):
        return ([_max_len(63)] if len(value) > 63 else []) + ["must not contain dots"]
    return _name_errors(value, 63, _DNS1123_LABEL, "a lowercase RFC 1123 label must consist of lower case "
                        "alphanumeric characters or '-', and must start and end with an alphanumeric character",
                        "my-name", "123-abc")


def dns1123_subdomain_errors(value: str) -> list[str]:
    """IsDNS1123Subdomain: dot-separated DNS-1123 labels, at most 253 characters."""
    return _name_errors(value, 253, _DNS1123_SUBDOMAIN, "a lowercase RFC 1123 subdomain must consist of lower case "
                        "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                        "example.com")


def _qualified_name_errors(value: str) -> list[str]:
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errs: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        errs = ["prefix part must be non-empty"] if not prefix else [
            "prefix part " + e for e in dns1123_subdomain_errors(prefix)]
    else:
        return [_regex_error("a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
                             "start and end with an alphanumeric character", _QUALIFIED_NAME, "MyName", "my.name",
                             "123-abc") + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        return [*errs, "name part must be non-empty"]
    if len(name) > 63:
        errs.append("name part " + _max_len(63))
    if not re.fullmatch(_QUALIFIED_NAME, name):
        errs.append("name part " + _regex_error("must consist of alphanumeric characters, '-', '_' or '.', and must "
                                                "start and end with an alphanumeric character", _QUALIFIED_NAME,
                                                "MyName", "my.name", "123-abc"))
    return errs


def _label_value_errors(value: str) -> list[str]:
    errs = [_max_len(63)] if len(value) > 63 else []
    if not re.fullmatch(_LABEL_VALUE, value):
        errs.append(_regex_error("a valid label must be an empty string or consist of alphanumeric characters, '-', "
                                 "'_' or '.', and must start and end with an alphanumeric character", _LABEL_VALUE,
                                 "MyValue", "my_value", "12345"))
    return errs


def _path_segment_errors(name: str, prefix: bool) -> list[str]:
    errs = []
    if not prefix and name in (".", ".."):
        errs.append(f"may not be '{name}'")
    errs += [f"may not contain '{c}'" for c in ("/", "%") if c in name]
    return errs


# --------------------------------------------------------------------------------------------------------------------
# Decoding: the v1 JSON as Go's decoder reads it into apiextensions types (zero values dropped, nulls absent).

_STR, _PTR_STR, _BOOL, _PTR_BOOL, _NUM, _INT, _JSON = "str", "ptr_str", "bool", "ptr_bool", "num", "int", "json"
_STR_LIST, _JSON_LIST = "str_list", "json_list"

_SCHEMA_FIELDS: dict[str, str] = {
    "id": _STR, "$schema": _STR, "$ref": _PTR_STR, "description": _STR, "type": _STR, "format": _STR, "title": _STR,
    "default": _JSON, "maximum": _NUM, "exclusiveMaximum": _BOOL, "minimum": _NUM, "exclusiveMinimum": _BOOL,
    "maxLength": _INT, "minLength": _INT, "pattern": _STR, "maxItems": _INT, "minItems": _INT, "uniqueItems": _BOOL,
    "multipleOf": _NUM, "enum": _JSON_LIST, "maxProperties": _INT, "minProperties": _INT, "required": _STR_LIST,
    "items": "items", "allOf": "schemas", "oneOf": "schemas", "anyOf": "schemas", "not": "schema",
    "properties": "schema_map", "additionalProperties": "schema_or_bool", "patternProperties": "schema_map",
    "dependencies": "dependencies", "additionalItems": "schema_or_bool", "definitions": "schema_map",
    "externalDocs": "external_docs", "example": _JSON, "nullable": _BOOL,
    "x-kubernetes-preserve-unknown-fields": _PTR_BOOL, "x-kubernetes-embedded-resource": _BOOL,
    "x-kubernetes-int-or-string": _BOOL, "x-kubernetes-list-map-keys": _STR_LIST, "x-kubernetes-list-type": _PTR_STR,
    "x-kubernetes-map-type": _PTR_STR, "x-kubernetes-validations": "rules",
}
_RULE_FIELDS = {"rule": _STR, "message": _STR, "messageExpression": _STR, "reason": _PTR_STR, "fieldPath": _STR,
                "optionalOldSelf": _PTR_BOOL}

_JSON_TYPE_NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
                    list: "array", dict: "object"}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded value ('integer' for ints, 'number' for floats)."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def to_json(value: Any) -> Any:
    """YAML-loaded data as the API server sees it after YAML-to-JSON: string keys, timestamps as strings."""
    if isinstance(value, dict):
        return {_json_key(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    return value


def _json_key(key: Any) -> str:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)


class _Decoder:
    """Reads raw JSON into the shapes the API types have, recording what Go's strict decoder would refuse."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.errors: list[FieldError] = []

    def wrong_type(self, path: str, value: Any, expected: str) -> None:
        self.errors.append(FieldError(path, TYPE_INVALID, f"cannot be decoded: must be {expected}", json_type(value)))

    def unknown(self, path: str) -> None:
        if self.strict:
            self.errors.append(FieldError(path, UNKNOWN_FIELD, "strict field validation refuses keys the type lacks"))

    def scalar(self, path: str, value: Any, kind: str) -> tuple[bool, Any]:
        """(keep, value) for one scalar-ish field; zero values of non-pointer Go fields are not kept."""
        if value is None:
            return False, None
        if kind in (_STR, _PTR_STR):
            if not isinstance(value, str):
                self.wrong_type(path, value, "a string")
                return False, None
            return kind == _PTR_STR or value != "", value
        if kind in (_BOOL, _PTR_BOOL):
            if not isinstance(value, bool):
                self.wrong_type(path, value, "a boolean")
                return False, None
            return kind == _PTR_BOOL or value, value
        if kind == _NUM:
            if isinstance(value, bool) or not isinstance(value, int | float):
                self.wrong_type(path, value, "a number")
                return False, None
            return True, value
        if kind == _INT:
            if isinstance(value, bool) or not isinstance(value, int):
                self.wrong_type(path, value, "an integer")
                return False, None
            return True, value
        if kind == _STR_LIST:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                self.wrong_type(path, value, "a list of strings")
                return False, None
            return True, list(value)
        if kind == _JSON_LIST:
            if not isinstance(value, list):
                self.wrong_type(path, value, "a list")
                return False, None
            return True, copy.deepcopy(value)
        return True, copy.deepcopy(value)  # _JSON: any value

    def fields(self, raw: Any, path: str, spec: dict[str, str],
               custom: dict[str, Callable[[str, Any], Any]] | None = None) -> dict[str, Any]:
        if not isinstance(raw, dict):
            if raw is not None:
                self.wrong_type(path, raw, "an object")
            return {}
        out: dict[str, Any] = {}
        for key, value in raw.items():
            kind = spec.get(key)
            if kind is None:
                self.unknown(_child(path, key))
            elif custom and kind in custom:
                if value is not None:
                    decoded = custom[kind](_child(path, key), value)
                    if decoded is not None:
                        out[key] = decoded
            else:
                keep, decoded = self.scalar(_child(path, key), value, kind)
                if keep:
                    out[key] = decoded
        return out

    def schema(self, path: str, raw: Any) -> dict[str, Any] | None:
        custom = {
            "schema": self.schema,
            "schemas": self.schemas,
            "schema_map": self.schema_map,
            "items": self.items,
            "schema_or_bool": self.schema_or_bool,
            "dependencies": self.dependencies,
            "external_docs": lambda p, v: self.fields(v, p, {"description": _STR, "url": _STR}),
            "rules": self.rules,
        }
        if not isinstance(raw, dict):
            self.wrong_type(path, raw, "an object")
            return None
        return self.fields(raw, path, _SCHEMA_FIELDS, custom)

    def schemas(self, path: str, raw: Any) -> list[dict[str, Any]] | None:
        if not isinstance(raw, list):
            self.wrong_type(path, raw, "a list of schemas")
            return None
        return [self.schema(_key(path, i), r) or {} for i, r in enumerate(raw)]

    def schema_map(self, path: str, raw: Any) -> dict[str, dict[str, Any]] | None:
        if not isinstance(raw, dict):
            self.wrong_type(path, raw, "an object of schemas")
            return None
        return {k: self.schema(_key(path, k), v) or {} for k, v in raw.items()}

    def items(self, path: str, raw: Any) -> Any:
        return self.schemas(path, raw) if isinstance(raw, list) else self.schema(path, raw)

    def schema_or_bool(self, path: str, raw: Any) -> Any:
        return raw if isinstance(raw, bool) else self.schema(path, raw)

    def dependencies(self, path: str, raw: Any) -> Any:
        if not isinstance(raw, dict):
            self.wrong_type(path, raw, "an object")
            return None
        return {k: (list(v) if isinstance(v, list) else self.schema(_key(path, k), v)) for k, v in raw.items()}

    def rules(self, path: str, raw: Any) -> list[dict[str, Any]] | None:
        if not isinstance(raw, list):
            self.wrong_type(path, raw, "a list")
            return None
        out = []
        for i, entry in enumerate(raw):
            rule = self.fields(entry, _key(path, i), _RULE_FIELDS)
            for name in ("rule", "message", "messageExpression", "fieldPath"):
                rule.setdefault(name, "")
            rule.setdefault("reason", None)
            rule.setdefault("optionalOldSelf", None)
            out.append(rule)
        return out


_META_FIELDS_SPEC = {
    "name": _STR, "generateName": _STR, "namespace": _STR, "selfLink": _STR, "uid": _STR, "resourceVersion": _STR,
    "generation": _INT, "creationTimestamp": _JSON, "deletionTimestamp": _JSON, "deletionGracePeriodSeconds": _INT,
    "labels": _JSON, "annotations": _JSON, "ownerReferences": _JSON, "finalizers": _JSON, "managedFields": _JSON,
}


def _decode_crd(raw: Any, dec: _Decoder) -> dict[str, Any]:
    """The v1 CRD with every field typed, zero values dropped, and schemas decoded."""

    def names(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {"plural": _STR, "singular": _STR, "shortNames": _STR_LIST, "kind": _STR,
                                        "listKind": _STR, "categories": _STR_LIST})

    def column(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {"name": _STR, "type": _STR, "format": _STR, "description": _STR,
                                        "priority": _INT, "jsonPath": _STR})

    def listing(item: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
        def decode(path: str, value: Any) -> list[Any] | None:
            if not isinstance(value, list):
                dec.wrong_type(path, value, "a list")
                return None
            return [item(_key(path, i), v) for i, v in enumerate(value)]
        return decode

    def subresources(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {"status": "status", "scale": "scale"}, {
            "status": lambda p, v: dec.fields(v, p, {}),
            "scale": lambda p, v: dec.fields(v, p, {"specReplicasPath": _STR, "statusReplicasPath": _STR,
                                                    "labelSelectorPath": _PTR_STR}),
        })

    def validation(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {"openAPIV3Schema": "schema"}, {"schema": dec.schema})

    def version(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {
            "name": _STR, "served": _BOOL, "storage": _BOOL, "deprecated": _BOOL, "deprecationWarning": _PTR_STR,
            "schema": "validation", "subresources": "subresources", "additionalPrinterColumns": "columns",
            "selectableFields": "selectable",
        }, {
            "validation": validation, "subresources": subresources, "columns": listing(column),
            "selectable": listing(lambda p, v: dec.fields(v, p, {"jsonPath": _STR})),
        })

    def conversion(path: str, value: Any) -> dict[str, Any]:
        def client_config(p: str, v: Any) -> dict[str, Any]:
            return dec.fields(v, p, {"url": _PTR_STR, "service": "service", "caBundle": _STR}, {
                "service": lambda q, w: dec.fields(w, q, {"namespace": _STR, "name": _STR, "path": _PTR_STR,
                                                          "port": _INT}),
            })

        return dec.fields(value, path, {"strategy": _STR, "webhook": "webhook"}, {
            "webhook": lambda p, v: dec.fields(v, p, {"clientConfig": "cc", "conversionReviewVersions": _STR_LIST},
                                               {"cc": client_config}),
        })

    def spec(path: str, value: Any) -> dict[str, Any]:
        return dec.fields(value, path, {
            "group": _STR, "names": "names", "scope": _STR, "versions": "versions", "conversion": "conversion",
            "preserveUnknownFields": _BOOL,
        }, {"names": names, "versions": listing(version), "conversion": conversion})

    return dec.fields(raw, "", {"apiVersion": _STR, "kind": _STR, "metadata": "metadata", "spec": "spec",
                                "status": _JSON}, {
        "metadata": lambda p, v: dec.fields(v, p, _META_FIELDS_SPEC),
        "spec": spec,
    })


# --------------------------------------------------------------------------------------------------------------------
# Go regular expressions (RE2) approximated with Python's re.

_RE2_REFUSED = [
    (re.compile(r"\(\?<?[=!]"), "invalid or unsupported Perl syntax"),
    (re.compile(r"\(\?>"), "invalid or unsupported Perl syntax"),
    (re.compile(r"\(\?P="), "invalid or unsupported Perl syntax"),
    (re.compile(r"\(\?\("), "invalid or unsupported Perl syntax"),
    (re.compile(r"(?<!\\)(?:\\\\)*\\[1-9]"), "invalid escape sequence"),
    (re.compile(r"(?<!\\)(?:\\\\)*\\Z"), "invalid escape sequence"),
]


def go_regex_error(pattern: str) -> str | None:
    """Why Go's regexp.Compile would refuse the pattern, or None."""
    for construct, message in _RE2_REFUSED:
        found = construct.search(pattern)
        if found:
            return f"error parsing regexp: {message}: `{found.group(0).lstrip(chr(92) * 2)}`"
    try:
        re.compile(pattern.replace(r"\z", r"\Z"))
    except re.error as exc:
        return f"error parsing regexp: {exc}"
    return None


def _go_search(pattern: str, text: str) -> bool:
    return re.search(pattern.replace(r"\z", r"\Z"), text) is not None


# --------------------------------------------------------------------------------------------------------------------
# Structural schemas: pkg/apiserver/schema (convert.go, validation.go, complete.go).

_ROOT, _ITEM, _FIELD = "root", "item", "field"
_META_NAMES = ("apiVersion", "kind", "metadata")
_PRESERVE = "x-kubernetes-preserve-unknown-fields"
_EMBEDDED = "x-kubernetes-embedded-resource"
_INT_OR_STRING = "x-kubernetes-int-or-string"
_LIST_TYPE = "x-kubernetes-list-type"
_LIST_MAP_KEYS = "x-kubernetes-list-map-keys"
_MAP_TYPE = "x-kubernetes-map-type"
_VALIDATIONS = "x-kubernetes-validations"


def _props(s: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The properties a structural node has (an empty map is no map)."""
    return (s or {}).get("properties") or {}


def _ap_schema(s: dict[str, Any] | None) -> dict[str, Any] | None:
    ap = (s or {}).get("additionalProperties")
    return ap if isinstance(ap, dict) else None


def _has_ap(s: dict[str, Any] | None) -> bool:
    """Whether the structural node has additionalProperties at all (true, false or a schema)."""
    return (s or {}).get("additionalProperties") is not None


def decode_schema(raw: Any, path: str = "", *, strict: bool = False) -> tuple[dict[str, Any], list[FieldError]]:
    """A JSONSchemaProps as the API server decodes it (zero values dropped), with any decoding errors."""
    dec = _Decoder(strict)
    decoded = dec.schema(path, to_json(raw))
    return decoded or {}, dec.errors


def _ensure_decoded(schema: dict[str, Any]) -> dict[str, Any]:
    return decode_schema(schema)[0]


def new_structural_error(schema: dict[str, Any]) -> str | None:
    """Why NewStructural cannot convert the (decoded) schema, or None."""

    def unsupported(s: dict[str, Any]) -> str | None:
        for key, name in (("id", "id"), ("$schema", "schema")):
            if s.get(key):
                return f"OpenAPIV3Schema '{name}' is not supported"
        if s.get("$ref"):
            return "OpenAPIV3Schema '$ref' is not supported"
        for key in ("patternProperties", "dependencies"):
            if s.get(key):
                return f"OpenAPIV3Schema '{key}' is not supported"
        if s.get("additionalItems") is not None:
            return "OpenAPIV3Schema 'additionalItems' is not supported"
        if s.get("definitions"):
            return "OpenAPIV3Schema 'definitions' is not supported"
        return None

    def walk(s: dict[str, Any]) -> str | None:
        problem = unsupported(s)
        if problem:
            return problem
        for sub in [s.get("not"), *s.get("allOf", []), *s.get("anyOf", []), *s.get("oneOf", [])]:
            if sub is not None and (problem := walk(sub)):
                return problem
        if s.get(_PRESERVE) is False:
            return "internal error: 'x-kubernetes-preserve-unknown-fields' must be true or undefined"
        items = s.get("items")
        if isinstance(items, list) and items:
            return "OpenAPIV3Schema 'items' must be a schema, but is an array"
        if isinstance(items, dict) and (problem := walk(items)):
            return problem
        for name in sorted(s.get("properties") or {}):
            if problem := walk(s["properties"][name]):
                return problem
        ap = _ap_schema(s)
        return walk(ap) if ap is not None else None

    return walk(schema)


@dataclass(frozen=True)
class StructuralOptions:
    """ValidationOptions of pkg/apiserver/schema; all off for CRDs."""

    allow_nested_additional_properties: bool = False
    allow_nested_x_validations: bool = False
    allow_validation_properties_with_additional_properties: bool = False


def structural_errors(schema: dict[str, Any], path: str = "", options: StructuralOptions | None = None
                      ) -> list[FieldError]:
    """ValidateStructural: structural invariants (from the root) and completeness, sorted as upstream sorts them."""
    opts = options or StructuralOptions()
    s = _ensure_decoded(schema)
    errs = _structural_invariants(s, _ROOT, path, opts) + _completeness(s, path, opts)
    return sorted(errs, key=str)


def _nested_is_just_type(v: dict[str, Any], type_name: str) -> bool:
    """A nested value validation that sets nothing but `type` (the halves of the int-or-string anyOf)."""
    # Empty enum/allOf/anyOf/oneOf and additionalProperties: false convert to nothing in a nested schema.
    empty_ok = {"enum": [], "allOf": [], "anyOf": [], "oneOf": [], "additionalProperties": False}
    rest = {k: val for k, val in v.items() if k != "type" and empty_ok.get(k, object()) != val}
    return v.get("type") == type_name and not rest


def _is_int_or_string_any_of(any_of: list[dict[str, Any]] | None) -> bool:
    return bool(any_of) and len(any_of) == 2 and _nested_is_just_type(any_of[0], "integer") and \
        _nested_is_just_type(any_of[1], "string")


def _structural_invariants(s: dict[str, Any] | None, lvl: str, path: str, opts: StructuralOptions
                           ) -> list[FieldError]:
    if s is None:
        return []
    errs: list[FieldError] = []
    typ = s.get("type", "")
    items = s.get("items") if isinstance(s.get("items"), dict) else None
    if typ == "array" and items is None:
        errs.append(_required(_child(path, "items"), "must be specified"))
    errs += _structural_invariants(items, _ITEM, _child(path, "items"), opts)
    for name in sorted(_props(s)):
        errs += _structural_invariants(s["properties"][name], _FIELD, _key(_child(path, "properties"), name), opts)
    if _has_ap(s):
        if lvl == _ROOT:
            errs.append(_forbidden(_child(path, "additionalProperties"), "must not be used at the root"))
        errs += _structural_invariants(_ap_schema(s), _FIELD, _child(path, "additionalProperties"), opts)

    preserve, embedded, int_or_string = s.get(_PRESERVE) is True, bool(s.get(_EMBEDDED)), bool(s.get(_INT_OR_STRING))
    if int_or_string and preserve:
        errs.append(_invalid(_child(path, _PRESERVE), True, "must be false if x-kubernetes-int-or-string is true"))
    if int_or_string and embedded:
        errs.append(_invalid(_child(path, _EMBEDDED), True, "must be false if x-kubernetes-int-or-string is true"))

    all_of = s.get("allOf") or []
    skip_any_of = _is_int_or_string_any_of(s.get("anyOf"))
    skip_first_all_of_any_of = bool(all_of) and _is_int_or_string_any_of(all_of[0].get("anyOf"))
    errs += _value_validation(s, skip_any_of, skip_first_all_of_any_of, lvl, path, opts)

    check_metadata = lvl == _ROOT or embedded
    if embedded and typ != "object":
        detail = "must be object if x-kubernetes-embedded-resource is true"
        errs.append(_required(_child(path, "type"), detail) if not typ else _invalid(_child(path, "type"), typ, detail))
    elif not typ and not int_or_string and not preserve:
        where = {_ROOT: "at the root", _ITEM: "for specified array items", _FIELD: "for specified object fields"}[lvl]
        errs.append(_required(_child(path, "type"), f"must not be empty {where}"))
    if embedded and _has_ap(s):
        errs.append(_forbidden(_child(path, "additionalProperties"),
                               "must not be used if x-kubernetes-embedded-resource is set"))
    if lvl == _ROOT and typ and typ != "object":
        errs.append(_invalid(_child(path, "type"), typ, "must be object at the root"))

    props = _props(s)
    for name in ("kind", "apiVersion"):
        if name in props and check_metadata and props[name].get("type", "") != "string":
            errs.append(_invalid(_child(_key(_child(path, "properties"), name), "type"), props[name].get("type", ""),
                                 "must be string"))
    if "metadata" in props:
        errs += _metadata_invariants(props["metadata"], check_metadata, lvl, _key(_child(path, "properties"),
                                                                                    "metadata"))
    if embedded and not preserve and not props:
        errs.append(_required(_child(path, "properties"), "must not be empty if x-kubernetes-embedded-resource is "
                                                          "true without x-kubernetes-preserve-unknown-fields"))
    return errs


# What makes a structural node differ from the zero Structural{ValueValidation: &ValueValidation{}}.
_STRUCTURAL_SETTERS = ("items", "additionalProperties", "description", "title", "nullable", "externalDocs",
                       "example", _EMBEDDED, _INT_OR_STRING, _LIST_MAP_KEYS, _LIST_TYPE, _MAP_TYPE, _VALIDATIONS,
                       "format", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength",
                       "pattern", "maxItems", "minItems", "uniqueItems", "multipleOf", "maxProperties",
                       "minProperties", "required", "not")


def _metadata_invariants(m: dict[str, Any], check_metadata: bool, lvl: str, path: str) -> list[FieldError]:
    errs = []
    if check_metadata and m.get("type", "") != "object":
        errs.append(_invalid(_child(path, "type"), m.get("type", ""), "must be object"))
    if lvl == _ROOT:
        props = _props(m)
        only_names = bool(props) and set(props) <= {"name", "generateName"}
        extra = [k for k in _STRUCTURAL_SETTERS if m.get(k) is not None]
        extra += [k for k in ("enum", "allOf", "anyOf", "oneOf") if m.get(k)]
        if m.get(_PRESERVE) is True:
            extra.append(_PRESERVE)
        if (props and not only_names) or extra:
            errs.append(_forbidden(path, "must not specify anything other than name and generateName, but metadata "
                                         "is implicitly specified"))
    return errs


def _value_validation(v: dict[str, Any], skip_any_of: bool, skip_first_all_of_any_of: bool, lvl: str, path: str,
                      opts: StructuralOptions) -> list[FieldError]:
    errs: list[FieldError] = []
    # CEL rules stay forbidden under every junctor but allOf.
    no_cel = StructuralOptions(opts.allow_nested_additional_properties, False,
                               opts.allow_validation_properties_with_additional_properties)
    if not skip_any_of:
        for i, x in enumerate(v.get("anyOf") or []):
            errs += _nested_value_validation(x, False, False, lvl, _key(_child(path, "anyOf"), i), no_cel)
    for i, x in enumerate(v.get("allOf") or []):
        errs += _nested_value_validation(x, skip_first_all_of_any_of and i == 0, False, lvl,
                                         _key(_child(path, "allOf"), i), opts)
    for i, x in enumerate(v.get("oneOf") or []):
        errs += _nested_value_validation(x, False, False, lvl, _key(_child(path, "oneOf"), i), no_cel)
    if v.get("not") is not None:
        errs += _nested_value_validation(v["not"], False, False, lvl, _child(path, "not"), no_cel)
    pattern = v.get("pattern", "")
    if pattern and (problem := go_regex_error(pattern)):
        errs.append(_invalid(_child(path, "pattern"), pattern, f"must be a valid regular expression, but isn't: "
                                                               f"{problem}"))
    return errs


def _nested_ap(v: dict[str, Any]) -> dict[str, Any] | None:
    """additionalProperties of a nested value validation: a schema, {} for true, nothing for false."""
    ap = v.get("additionalProperties")
    if isinstance(ap, dict):
        return ap
    return {} if ap is True else None


def _nested_value_validation(v: dict[str, Any] | None, skip_any_of: bool, skip_all_of_any_of: bool, lvl: str,
                             path: str, opts: StructuralOptions) -> list[FieldError]:
    if v is None:
        return []
    errs = _value_validation(v, skip_any_of, skip_all_of_any_of, lvl, path, opts)
    if isinstance(v.get("items"), dict):
        errs += _nested_value_validation(v["items"], False, False, lvl, _child(path, "items"), opts)
    for name in sorted(v.get("properties") or {}):
        errs += _nested_value_validation(v["properties"][name], False, False, _FIELD,
                                         _key(_child(path, "properties"), name), opts)
    if v.get("type"):
        errs.append(_forbidden(_child(path, "type"), "must be empty to be structural"))
    ap = _nested_ap(v)
    if ap is not None and not opts.allow_nested_additional_properties:
        errs.append(_forbidden(_child(path, "additionalProperties"), "must be undefined to be structural"))
    else:
        errs += _nested_value_validation(ap, False, False, lvl, _child(path, "additionalProperties"), opts)
    if v.get("default") is not None:
        errs.append(_forbidden(_child(path, "default"), "must be undefined to be structural"))
    for key in ("title", "description"):
        if v.get(key):
            errs.append(_forbidden(_child(path, key), "must be empty to be structural"))
    for key in ("nullable", _PRESERVE, _EMBEDDED, _INT_OR_STRING):
        if v.get(key) is True:
            errs.append(_forbidden(_child(path, key), "must be false to be structural"))
    if v.get(_LIST_MAP_KEYS):
        errs.append(_forbidden(_child(path, _LIST_MAP_KEYS), "must be empty to be structural"))
    for key in (_LIST_TYPE, _MAP_TYPE):
        if v.get(key) is not None:
            errs.append(_forbidden(_child(path, key), "must be undefined to be structural"))
    if v.get(_VALIDATIONS) and not opts.allow_nested_x_validations:
        errs.append(_forbidden(_child(path, _VALIDATIONS), "must be empty to be structural"))
    # Restricting metadata from inside a junctor could narrow ObjectMeta, which the server does not allow.
    if "metadata" in (v.get("properties") or {}):
        errs.append(_forbidden(_key(_child(path, "properties"), "metadata"), "must not be specified in a nested "
                                                                            "context"))
    return errs


def completeness_errors(schema: dict[str, Any], path: str = "", options: StructuralOptions | None = None
                        ) -> list[FieldError]:
    """validateStructuralCompleteness: what a junctor validates must exist in the structural part of the schema."""
    return _completeness(_ensure_decoded(schema), path, options or StructuralOptions())


def _completeness(s: dict[str, Any], path: str, opts: StructuralOptions) -> list[FieldError]:
    return _value_validation_completeness(s, s, path, path, opts)


def _value_validation_completeness(v: dict[str, Any], s: dict[str, Any] | None, spath: str, vpath: str,
                                   opts: StructuralOptions) -> list[FieldError]:
    if s is None:
        return [_required(spath, f"because it is defined in {vpath or '<nil>'}")]
    errs: list[FieldError] = []
    if v.get("not") is not None:
        errs += _nested_completeness(v["not"], s, spath, _child(vpath, "not"), opts)
    for junctor in ("allOf", "anyOf", "oneOf"):
        for i, x in enumerate(v.get(junctor) or []):
            errs += _nested_completeness(x, s, spath, _key(_child(vpath, junctor), i), opts)
    return errs


def _nested_completeness(v: dict[str, Any] | None, s: dict[str, Any] | None, spath: str, vpath: str,
                         opts: StructuralOptions) -> list[FieldError]:
    if v is None:
        return []
    if s is None:
        return [_required(spath, f"because it is defined in {vpath}")]
    errs = _value_validation_completeness(v, s, spath, vpath, opts)
    if isinstance(v.get("items"), dict):
        s_items = s.get("items") if isinstance(s.get("items"), dict) else None
        errs += _nested_completeness(v["items"], s_items, _child(spath, "items"), _child(vpath, "items"), opts)
    s_ap = _ap_schema(s)
    for name in sorted(v.get("properties") or {}):
        vfield, vfield_path = v["properties"][name], _key(_child(vpath, "properties"), name)
        if name in _props(s):
            errs += _nested_completeness(vfield, _props(s)[name], _key(_child(spath, "properties"), name),
                                         vfield_path, opts)
        elif s_ap is None or not opts.allow_validation_properties_with_additional_properties:
            errs.append(_required(_key(_child(spath, "properties"), name), f"because it is defined in {vfield_path}"))
        else:
            errs += _nested_completeness(vfield, s_ap, _child(spath, "additionalProperties"), vfield_path, opts)
    if _nested_ap(v) is not None and opts.allow_nested_additional_properties:
        errs += _nested_completeness(_nested_ap(v), s_ap, _child(spath, "additionalProperties"),
                                     _child(vpath, "additionalProperties"), opts)
    return errs


# --------------------------------------------------------------------------------------------------------------------
# kube-openapi's schema validator, as used on defaults (pkg/apiserver/validation/validation.go).

_SUPPORTED_STRING_FORMATS = {
    "bsonobjectid", "uri", "email", "hostname", "ipv4", "ipv6", "cidr", "mac", "uuid", "uuid3", "uuid4", "uuid5",
    "isbn", "isbn10", "isbn13", "creditcard", "ssn", "hexcolor", "rgbcolor", "byte", "password", "date", "duration",
    "datetime", "k8sshortname", "k8slongname",
}
_UUID = r"(?i)[0-9a-f]{8}-?[0-9a-f]{4}-?{v}[0-9a-f]{3}-?{w}[0-9a-f]{3}-?[0-9a-f]{12}"
_DURATION = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s|m|h|d|w)(\s*(\d+(\.\d*)?|\.\d+)\s*"
                       r"(ns|us|µs|ms|s|m|h|d|w))*|0")
_HOSTNAME = re.compile(r"(?i)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.?")


def _format_ok(fmt: str, value: str) -> bool:
    """Whether a string conforms to one of go-openapi's default formats (unknown formats always conform)."""
    try:
        if fmt == "datetime":
            datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
            return bool(re.fullmatch(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value))
        if fmt == "date":
            datetime.date.fromisoformat(value)
            return bool(re.fullmatch(r"\d{4}-\d\d-\d\d", value))
        if fmt == "byte":
            base64.b64decode(value, validate=True)
            return True
        if fmt in ("ipv4", "ipv6"):
            return isinstance(ipaddress.ip_address(value), ipaddress.IPv4Address if fmt == "ipv4" else
                              ipaddress.IPv6Address)
        if fmt == "cidr":
            ipaddress.ip_network(value, strict=False)
            return "/" in value
    except ValueError:
        return False
    patterns = {
        "uuid": _UUID.replace("{v}", "[0-9a-f]").replace("{w}", "[0-9a-f]"),
        "uuid3": _UUID.replace("{v}", "3").replace("{w}", "[0-9a-f]"),
        "uuid4": _UUID.replace("{v}", "4").replace("{w}", "[89ab]"),
        "uuid5": _UUID.replace("{v}", "5").replace("{w}", "[89ab]"),
        "mac": r"(?i)([0-9a-f]{2}[:-]){5}[0-9a-f]{2}|([0-9a-f]{4}\.){2}[0-9a-f]{4}",
        "hexcolor": r"#?([0-9a-fA-F]{3}|[0-9a-fA-F]{6})",
        "rgbcolor": r"rgb\(\s*\d{1,3}\s*,\s*\d{1,3}\s*,\s*\d{1,3}\s*\)",
        "ssn": r"\d{3}[- ]?\d{2}[- ]?\d{4}",
        "bsonobjectid": r"[0-9a-fA-F]{24}",
        "email": r"[^@\s]+@[^@\s]+",
        "k8sshortname": _DNS1123_LABEL,
        "k8slongname": _DNS1123_SUBDOMAIN,
    }
    if fmt in patterns:
        return re.fullmatch(patterns[fmt], value) is not None
    if fmt == "duration":
        return _DURATION.fullmatch(value) is not None
    if fmt == "hostname":
        return len(value) <= 255 and _HOSTNAME.fullmatch(value) is not None
    if fmt == "uri":
        parsed = urllib.parse.urlparse(value)
        return bool(parsed.scheme) or value.startswith("/")
    return True


def _json_equal(a: Any, b: Any) -> bool:
    """Equality of decoded JSON values (1 == 1.0, but true != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class _OpenAPIError:
    kind: str  # required, enum, too_long, too_many, type, invalid, composite
    name: str
    value: Any
    message: str
    extra: Any = None


def _types_of(s: dict[str, Any]) -> list[str]:
    if s.get(_INT_OR_STRING):
        return ["integer", "string"]
    return [s["type"]] if s.get("type") else []


def _in_body(name: str) -> str:
    return f"{name} in body"


def _openapi_validate(data: Any, s: dict[str, Any] | None, name: str) -> list[_OpenAPIError]:
    if s is None:
        return []
    out: list[_OpenAPIError] = []
    types = _types_of(s)
    if data is None:
        if types and not s.get("nullable"):
            out.append(_OpenAPIError("type", name, "null", f'{_in_body(name)} must be of type {",".join(types)}: '
                                                           '"null"'))
        return out + _openapi_enum(data, s, name)

    kind = json_type(data)
    fmt = s.get("format", "")
    if types and not (fmt and kind in ("string", "array") and not {"integer", "number"} & set(types)):
        float_int = kind == "number" and float(data).is_integer() and "integer" in types
        int_float = kind == "integer" and "number" in types
        if kind not in types and not float_int and not int_float:
            out.append(_OpenAPIError("type", name, kind, f'{_in_body(name)} must be of type {",".join(types)}: '
                                                         f'"{kind}"'))

    out += _openapi_junctors(data, s, name)
    if isinstance(data, str):
        out += _openapi_string(data, s, name, fmt)
    elif kind in ("integer", "number"):
        out += _openapi_number(data, s, name, fmt)
    elif isinstance(data, list):
        if s.get("maxItems") is not None and len(data) > s["maxItems"]:
            out.append(_OpenAPIError("too_many", name, len(data), f"{_in_body(name)} should have at most "
                                                                  f"{s['maxItems']} items", s["maxItems"]))
        if s.get("minItems") is not None and len(data) < s["minItems"]:
            out.append(_OpenAPIError("invalid", name, len(data), f"{_in_body(name)} should have at least "
                                                                 f"{s['minItems']} items"))
        if s.get("uniqueItems") and any(_json_equal(a, b) for i, a in enumerate(data) for b in data[i + 1:]):
            out.append(_OpenAPIError("invalid", name, None, f"{_in_body(name)} shouldn't contain duplicates"))
        if isinstance(s.get("items"), dict):
            for i, item in enumerate(data):
                out += _openapi_validate(item, s["items"], f"{name}[{i}]")
    out += _openapi_enum(data, s, name)
    if isinstance(data, dict):
        out += _openapi_object(data, s, name)
    return out


def _openapi_enum(data: Any, s: dict[str, Any], name: str) -> list[_OpenAPIError]:
    enum = s.get("enum")
    if not enum or any(_json_equal(data, e) for e in enum):
        return []
    return [_OpenAPIError("enum", name, data, f"{_in_body(name)} should be one of {enum}", enum)]


def _openapi_junctors(data: Any, s: dict[str, Any], name: str) -> list[_OpenAPIError]:
    out: list[_OpenAPIError] = []
    label = json.dumps(name)
    # A failed anyOf/oneOf also reports the errors of its closest branch; fewest errors stands in for
    # kube-openapi's count of passed checks.
    if s.get("anyOf"):
        results = [_openapi_validate(data, sub, name) for sub in s["anyOf"]]
        if all(results):
            out.append(_OpenAPIError("composite", name, None, f"{label} must validate at least one schema (anyOf)"))
            out += min(results, key=len)
    if s.get("oneOf"):
        results = [_openapi_validate(data, sub, name) for sub in s["oneOf"]]
        valid = sum(not r for r in results)
        if valid != 1:
            found = f"Found {valid} valid alternatives" if valid else "Found none valid"
            out.append(_OpenAPIError("composite", name, None,
                                     f"{label} must validate one and only one schema (oneOf). {found}"))
            if not valid:
                out += min(results, key=len)
    if s.get("allOf"):
        results = [_openapi_validate(data, sub, name) for sub in s["allOf"]]
        out += [e for r in results for e in r]
        valid = sum(not r for r in results)
        if valid != len(results):
            none = ". None validated" if not valid else ""
            out.append(_OpenAPIError("composite", name, None, f"{label} must validate all the schemas (allOf){none}"))
    if s.get("not") is not None and not _openapi_validate(data, s["not"], name):
        out.append(_OpenAPIError("composite", name, None, f"{label} must not validate the schema (not)"))
    return out


def _openapi_string(data: str, s: dict[str, Any], name: str, fmt: str) -> list[_OpenAPIError]:
    out = []
    if s.get("maxLength") is not None and len(data) > s["maxLength"]:
        out.append(_OpenAPIError("too_long", name, data, f"{_in_body(name)} should be at most {s['maxLength']} chars "
                                                         "long", s["maxLength"]))
    if s.get("minLength") is not None and len(data) < s["minLength"]:
        out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should be at least {s['minLength']} chars "
                                                        "long"))
    pattern = s.get("pattern", "")
    if pattern:
        problem = go_regex_error(pattern)
        if problem:
            out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should match '{pattern}, but pattern is "
                                                            f"invalid: {problem}'"))
        elif not _go_search(pattern, data):
            out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should match '{pattern}'"))
    normalized = fmt.replace("-", "").lower()
    if normalized in _SUPPORTED_STRING_FORMATS and not _format_ok(normalized, data):
        out.append(_OpenAPIError("type", name, data, f'{_in_body(name)} must be of type {fmt}: {json.dumps(data)}'))
    return out


def _openapi_number(data: float, s: dict[str, Any], name: str, fmt: str) -> list[_OpenAPIError]:
    out = []
    maximum, minimum, multiple = s.get("maximum"), s.get("minimum"), s.get("multipleOf")
    if maximum is not None:
        exclusive = bool(s.get("exclusiveMaximum"))
        if data > maximum or (exclusive and data == maximum):
            relation = "less than" if exclusive else "less than or equal to"
            out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should be {relation} "
                                                            f"{go_float(float(maximum))}"))
    if minimum is not None:
        exclusive = bool(s.get("exclusiveMinimum"))
        if data < minimum or (exclusive and data == minimum):
            relation = "greater than" if exclusive else "greater than or equal to"
            out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should be {relation} "
                                                            f"{go_float(float(minimum))}"))
    if multiple is not None:
        if multiple <= 0:
            out.append(_OpenAPIError("invalid", name, multiple, f"factor MultipleOf declared for {name} must be "
                                                                f"positive: {go_float(float(multiple))}"))
        elif not float(data / multiple).is_integer():
            out.append(_OpenAPIError("invalid", name, data, f"{_in_body(name)} should be a multiple of "
                                                            f"{go_float(float(multiple))}"))
    ranges = {"int32": (-(2**31), 2**31 - 1, "integer"), "int64": (-(2**63), 2**63 - 1, "integer"),
              "float": (-3.4028234663852886e38, 3.4028234663852886e38, "number")}
    if fmt in ranges and not ranges[fmt][0] <= data <= ranges[fmt][1]:
        out.append(_OpenAPIError("composite", name, None, f"Checked value must be of type {ranges[fmt][2]} with "
                                                          f"format {fmt} in {name}"))
    return out


def _openapi_object(data: dict[str, Any], s: dict[str, Any], name: str) -> list[_OpenAPIError]:
    # A count of properties out of bounds is the only error reported for the object.
    if s.get("minProperties") is not None and len(data) < s["minProperties"]:
        return [_OpenAPIError("invalid", name, len(data), f"{_in_body(name)} should have at least "
                                                          f"{s['minProperties']} properties")]
    if s.get("maxProperties") is not None and len(data) > s["maxProperties"]:
        return [_OpenAPIError("too_many", name, len(data), f"{_in_body(name)} should have at most "
                                                           f"{s['maxProperties']} properties", s["maxProperties"])]
    out = []
    props = s.get("properties") or {}
    for required in s.get("required") or []:
        if required not in data:
            out.append(_OpenAPIError("required", f"{name}.{required}", None, f"{name}.{required} in body is required"))
    ap = s.get("additionalProperties")
    for key in sorted(data):
        if key in props:
            out += _openapi_validate(data[key], props[key], f"{name}.{key}" if name else key)
        elif ap is False:
            out.append(_OpenAPIError("invalid", name, key, f"{name}.{key} in body is a forbidden property"))
        elif isinstance(ap, dict):  # kube-openapi names these from the object's path even at the root
            out += _openapi_validate(data[key], ap, f"{name}.{key}")
    return out


def value_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[FieldError]:
    """ValidateCustomResource: a value checked against a (decoded) schema, errors as the API server words them."""
    errs = []
    for e in _openapi_validate(value, schema, ""):
        err_path = _child(path, e.name.lstrip(".")) if e.name and e.name != "." else path
        if e.kind == "required":
            errs.append(_required(err_path))
        elif e.kind == "enum":
            valid = [v if isinstance(v, str) else json.dumps(v, separators=(",", ":")) for v in e.extra]
            errs.append(_not_supported(err_path, e.value, valid))
        elif e.kind == "too_long":
            noun = "byte" if e.extra == 1 else "bytes"
            errs.append(FieldError(err_path, TOO_LONG, f"may not be more than {e.extra} {noun}"))
        elif e.kind == "too_many":
            errs.append(_too_many(err_path, e.value, e.extra))
        elif e.kind == "type":
            errs.append(FieldError(err_path, TYPE_INVALID, e.message, e.value if e.value is not None else ""))
        elif e.kind == "invalid":
            errs.append(_invalid(err_path, e.value if e.value is not None else "", e.message))
        else:
            errs.append(_invalid(path, "", e.message))
    return errs


# --------------------------------------------------------------------------------------------------------------------
# ObjectMeta and TypeMeta of embedded resources (pkg/apiserver/schema/objectmeta).

_GO_JSON_TYPES = {"null": "null", "boolean": "bool", "integer": "number", "number": "number", "string": "string",
                  "array": "array", "object": "object"}


def _objectmeta_decode_error(meta: Any) -> str | None:
    """The error Go's json.Unmarshal into metav1.ObjectMeta would give, or None."""
    if not isinstance(meta, dict):
        return f"json: cannot unmarshal {_GO_JSON_TYPES[json_type(meta)]} into Go value of type v1.ObjectMeta"

    def bad(field: str, value: Any, go_type: str) -> str:
        what = _GO_JSON_TYPES[json_type(value)]
        if what == "number":
            what = f"number {render_value(value)}" if go_type != "string" else what
        return f"json: cannot unmarshal {what} into Go struct field ObjectMeta.{field} of type {go_type}"

    for field in sorted(meta):
        value = meta[field]
        if value is None:
            continue
        if field in ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion"):
            if not isinstance(value, str):
                return bad(field, value, "string")
        elif field in ("generation", "deletionGracePeriodSeconds"):
            if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
                return bad(field, value, "int64")
        elif field in ("creationTimestamp", "deletionTimestamp"):
            if not isinstance(value, str):
                return bad(field, value, "string")
            if not _format_ok("datetime", value):
                return f'parsing time "{value}" as "2006-01-02T15:04:05Z07:00": cannot parse "{value}"'
        elif field in ("labels", "annotations"):
            if not isinstance(value, dict):
                return bad(field, value, "map[string]string")
            for v in value.values():
                if not isinstance(v, str):
                    return bad(field, v, "string")
        elif field == "finalizers":
            if not isinstance(value, list):
                return bad(field, value, "[]string")
            for v in value:
                if not isinstance(v, str):
                    return bad(field, v, "string")
        elif field in ("ownerReferences", "managedFields") and (
                not isinstance(value, list) or not all(isinstance(v, dict) for v in value)):
            element = "OwnerReference" if field == "ownerReferences" else "ManagedFieldsEntry"
            return bad(field, value, f"[]v1.{element}")
    return None


def objectmeta_errors(meta: dict[str, Any], path: str, *, requires_namespace: bool,
                      name_errors: Callable[[str, bool], list[str]]) -> list[FieldError]:
    """ValidateObjectMeta on a decoded ObjectMeta."""
    errs = []
    generate_name, name, namespace = meta.get("generateName") or "", meta.get("name") or "", meta.get("namespace") or ""
    if generate_name:
        errs += [_invalid(_child(path, "generateName"), generate_name, m) for m in name_errors(generate_name, True)]
    if not name:
        errs.append(_required(_child(path, "name"), "name or generateName is required"))
    else:
        errs += [_invalid(_child(path, "name"), name, m) for m in name_errors(name, False)]
    if requires_namespace:
        if not namespace:
            errs.append(_required(_child(path, "namespace")))
        else:
            errs += [_invalid(_child(path, "namespace"), namespace, m) for m in dns1123_label_errors(namespace)]
    elif namespace:
        errs.append(_forbidden(_child(path, "namespace"), "not allowed on this type"))
    if (meta.get("generation") or 0) < 0:
        errs.append(_invalid(_child(path, "generation"), meta["generation"], "must be greater than or equal to 0"))
    labels_path = _child(path, "labels")
    for key, value in sorted((meta.get("labels") or {}).items()):
        errs += [_invalid(labels_path, key, m) for m in _qualified_name_errors(key)]
        errs += [_invalid(labels_path, value, m) for m in _label_value_errors(value)]
    annotations = meta.get("annotations") or {}
    for key in sorted(annotations):
        errs += [_invalid(_child(path, "annotations"), key, m) for m in _qualified_name_errors(key.lower())]
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        errs.append(FieldError(_child(path, "annotations"), TOO_LONG, f"may not be more than {256 * 1024} bytes"))
    for i, finalizer in enumerate(meta.get("finalizers") or []):
        errs += [_invalid(_key(_child(path, "finalizers"), i), finalizer, m) for m in _qualified_name_errors(finalizer)]
    return errs


def _parse_group_version_error(api_version: str) -> str | None:
    if api_version.count("/") > 1:
        return f"unexpected GroupVersion string: {api_version}"
    return None


def _embedded_resource_errors(path: str, x: dict[str, Any]) -> list[FieldError]:
    errs = [_required(_child(path, key)) for key in ("apiVersion", "kind") if key not in x]
    for key in sorted(x):
        value = x[key]
        if key == "apiVersion":
            if not isinstance(value, str):
                errs.append(_invalid(_child(path, key), value, "must be a string"))
            elif not value:
                errs.append(_invalid(_child(path, key), value, "must not be empty"))
            elif problem := _parse_group_version_error(value):
                errs.append(_invalid(_child(path, key), value, problem))
        elif key == "kind":
            if not isinstance(value, str):
                errs.append(_invalid(_child(path, key), value, "must be a string"))
            elif not value:
                errs.append(_invalid(_child(path, key), value, "must not be empty"))
            elif problems := dns1035_label_errors(value.lower()):
                errs.append(_invalid(_child(path, key), value, "may have mixed case, but should otherwise match: " +
                                     ",".join(problems)))
        elif key == "metadata":
            problem = _objectmeta_decode_error(value)
            if problem:
                errs.append(_invalid(_child(path, key), value, problem))
            else:
                meta = {**value, "name": value.get("name") or "fakename"}
                errs += objectmeta_errors(meta, _child(path, key), requires_namespace=bool(value.get("namespace")),
                                          name_errors=_path_segment_errors)
    return errs


def _as_resource_root(s: dict[str, Any] | None) -> dict[str, Any]:
    s = s or {}
    return s if s.get(_EMBEDDED) else {**s, _EMBEDDED: True}


def _coerce_error(path: str, x: Any, s: dict[str, Any] | None, is_resource_root: bool) -> FieldError | None:
    """objectmeta.Coerce without dropping: the first wrongly typed TypeMeta or undecodable ObjectMeta."""

    def walk(path: str, x: Any, s: dict[str, Any] | None) -> FieldError | None:
        if s is None:
            return None
        if isinstance(x, dict):
            for key in sorted(x):
                value = x[key]
                if s.get(_EMBEDDED):
                    if key in ("apiVersion", "kind") and not isinstance(value, str):
                        return _invalid(_child(path, key), value, "must be a string")
                    if key == "metadata" and (problem := _objectmeta_decode_error(value)):
                        return _invalid(_child(path, key), value, problem)
                if key in _props(s):
                    found = walk(_child(path, key), value, _props(s)[key])
                elif _has_ap(s):
                    found = walk(_key(path, key), value, _ap_schema(s))
                else:
                    found = None
                if found:
                    return found
        elif isinstance(x, list):
            items = s.get("items") if isinstance(s.get("items"), dict) else None
            for i, value in enumerate(x):
                if found := walk(_key(path, i), value, items):
                    return found
        return None

    return walk(path, x, _as_resource_root(s) if is_resource_root else s)


def _embedded_meta_errors(path: str, x: Any, s: dict[str, Any] | None, is_resource_root: bool) -> list[FieldError]:
    """objectmeta.Validate: TypeMeta and ObjectMeta of every embedded resource in x."""

    def walk(path: str, x: Any, s: dict[str, Any] | None) -> list[FieldError]:
        if s is None:
            return []
        errs: list[FieldError] = []
        if isinstance(x, dict):
            if s.get(_EMBEDDED):
                errs += _embedded_resource_errors(path, x)
            for key in sorted(x):
                if key in _props(s):
                    errs += walk(_child(path, key), x[key], _props(s)[key])
                elif _has_ap(s):
                    errs += walk(_key(path, key), x[key], _ap_schema(s))
        elif isinstance(x, list):
            items = s.get("items") if isinstance(s.get("items"), dict) else None
            for i, value in enumerate(x):
                errs += walk(_key(path, i), value, items)
        return errs

    return walk(path, x, _as_resource_root(s) if is_resource_root else s)


# --------------------------------------------------------------------------------------------------------------------
# Pruning (pkg/apiserver/schema/pruning) and defaults (pkg/apiserver/schema/defaulting/validation.go).


def prune(value: Any, schema: dict[str, Any] | None, *, is_resource_root: bool) -> Any:
    """The value with the fields the schema does not specify removed (in place; also returned)."""
    _prune(value, _as_resource_root(schema) if is_resource_root else schema)
    return value


def _prune(x: Any, s: dict[str, Any] | None) -> None:
    if s is not None and s.get(_PRESERVE) is True:
        _skip_prune(x, s)
        return
    if isinstance(x, dict):
        if s is None:
            x.clear()
            return
        for key in list(x):
            if s.get(_EMBEDDED) and key in _META_NAMES:
                continue
            if key in _props(s):
                _prune(x[key], _props(s)[key])
            elif _has_ap(s):
                _prune(x[key], _ap_schema(s))
            else:
                del x[key]
    elif isinstance(x, list):
        items = s.get("items") if s is not None and isinstance(s.get("items"), dict) else None
        for value in x:
            _prune(value, items)


def _skip_prune(x: Any, s: dict[str, Any] | None) -> None:
    if s is None:
        return
    if isinstance(x, dict):
        for key, value in x.items():
            if s.get(_EMBEDDED) and key in _META_NAMES:
                continue
            if key in _props(s):
                _prune(value, _props(s)[key])
            elif _has_ap(s):
                _prune(value, _ap_schema(s))
    elif isinstance(x, list):
        items = s.get("items") if isinstance(s.get("items"), dict) else None
        for value in x:
            _skip_prune(value, items)


def _surround(value: Any, steps: list[str | None]) -> Any:
    """The default placed where it sits inside the resource (None steps are list items), with TypeMeta filled in."""
    for step in reversed(steps):
        value = [value] if step is None else {step: value}
    if isinstance(value, dict):
        value = {**value}
        value.setdefault("kind", "Validation")
        value.setdefault("apiVersion", "validation/v1")
    return value


def default_errors(schema: dict[str, Any], path: str = "", *, require_pruned_defaults: bool = True,
                   is_resource_root: bool = True, evaluate_cel: bool | None = None) -> list[FieldError]:
    """ValidateDefaults: every default must be pruned, carry valid TypeMeta/ObjectMeta and validate against its schema.

    ``evaluate_cel`` (default: whether cel-python is importable) also evaluates the schema's
    ``x-kubernetes-validations`` rules on the defaults, where cel-python can.
    """
    s = _ensure_decoded(schema)
    if is_resource_root:
        s = _as_resource_root(s)
    cel = _cel_available() if evaluate_cel is None else evaluate_cel
    return _defaults(path, s, s, [], False, require_pruned_defaults, cel)


def _defaults(path: str, s: dict[str, Any] | None, root: dict[str, Any], steps: list[str | None], inside_meta: bool,
              require_pruned: bool, cel: bool) -> list[FieldError]:
    if s is None:
        return []
    if s.get(_EMBEDDED):
        inside_meta, steps, root = False, [], s
    errs: list[FieldError] = []
    if s.get("default") is not None:
        default, default_path = s["default"], _child(path, "default")
        if inside_meta:
            whole = _surround(copy.deepcopy(default), steps)
            if problem := _coerce_error("", whole, root, True):
                errs.append(_invalid(default_path, default, f"must result in valid metadata: {problem}"))
            elif meta_errs := _embedded_meta_errors("", whole, root, True):
                detail = str(meta_errs[0]) if len(meta_errs) == 1 else "[" + ", ".join(map(str, meta_errs)) + "]"
                errs.append(_invalid(default_path, default, f"must result in valid metadata: {detail}"))
            elif found := value_errors(default, s, default_path):
                errs += found
            elif cel:
                errs += cel_value_errors(default, s, default_path, is_resource_root=s is root)
        else:
            if require_pruned and not _json_equal(prune(copy.deepcopy(default), s,
                                                        is_resource_root=bool(s.get(_EMBEDDED))), default):
                errs.append(_invalid(default_path, default, "must not have unknown fields"))
            # Each stage runs only when the previous one passed, as upstream chains them.
            if problem := _coerce_error(default_path, default, s, bool(s.get(_EMBEDDED))):
                errs.append(problem)
            elif (found := _embedded_meta_errors(default_path, default, s, bool(s.get(_EMBEDDED)))) or (
                    found := value_errors(default, s, default_path)):
                errs += found
            elif cel:
                errs += cel_value_errors(default, s, default_path, is_resource_root=s is root)
    # Defaults under additionalProperties are not visited: they are refused where they could matter.
    if isinstance(s.get("items"), dict):
        errs += _defaults(_child(path, "items"), s["items"], root, [*steps, None], inside_meta, require_pruned, cel)
    for name in sorted(_props(s)):
        sub_inside = inside_meta or (bool(s.get(_EMBEDDED)) and name in _META_NAMES)
        errs += _defaults(_key(_child(path, "properties"), name), s["properties"][name], root, [*steps, name],
                          sub_inside, require_pruned, cel)
    return errs


# --------------------------------------------------------------------------------------------------------------------
# CEL (x-kubernetes-validations) with cel-python.

_CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
                 "import", "let", "loop", "package", "namespace", "return"}
_CEL_ENV: Any = None


def _cel_available() -> bool:
    try:
        import celpy  # noqa: F401
    except ImportError:
        return False
    return True


def _cel_env() -> Any:
    global _CEL_ENV
    if _CEL_ENV is None:
        import celpy

        _CEL_ENV = celpy.Environment()
    return _CEL_ENV


def _cel_parse(expression: str) -> tuple[Any, str | None]:
    """(parse tree, None) or (None, why it does not compile). Optional selections are read as plain ones."""
    import celpy

    readable = expression.replace(".?", ".").replace("[?", "[")
    try:
        return _cel_env().compile(readable), None
    except celpy.CELParseError as exc:
        return None, f"ERROR: <input>:{getattr(exc, 'line', '?')}:{getattr(exc, 'column', '?')}: Syntax error"
    except Exception as exc:  # any other parser failure is a compile failure too
        return None, f"{type(exc).__name__}: {exc}"


def _cel_escape(name: str) -> str | None:
    """How a property is named in CEL, or None when it is not accessible."""
    if name in _CEL_RESERVED:
        return f"__{name}__"
    if not re.fullmatch(r"[a-zA-Z_.\-/][a-zA-Z0-9_.\-/]*", name):
        return None
    return (name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__")
            .replace("/", "__slash__"))


_OBJECT_META_IN_CEL = {"type": "object", "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}}}


def _cel_selection_chains(tree: Any) -> list[tuple[str, list[str | None]]]:
    """Every `self...`/`oldSelf...` chain of field selections (None for an index) in a parse tree."""
    from lark import Token, Tree

    chains = []

    def chain_of(node: Any) -> tuple[str, list[str | None]] | None:
        if not isinstance(node, Tree):
            return None
        if node.data == "member" and len(node.children) == 1:
            return chain_of(node.children[0])
        if node.data == "primary" and len(node.children) == 1:
            ident = node.children[0]
            if isinstance(ident, Tree) and ident.data == "ident" and isinstance(ident.children[0], Token) and \
                    ident.children[0].value in ("self", "oldSelf"):
                return ident.children[0].value, []
            return None
        if node.data == "member_dot" and len(node.children) == 2:
            base = chain_of(node.children[0])
            return None if base is None else (base[0], [*base[1], str(node.children[1])])
        if node.data == "member_index" and len(node.children) == 2:
            base = chain_of(node.children[0])
            return None if base is None else (base[0], [*base[1], None])
        return None

    for node in tree.iter_subtrees():
        if node.data in ("member_dot", "member_index"):
            found = chain_of(node)
            if found is not None:
                chains.append(found)
    return chains


def _cel_uses_old_self(tree: Any) -> bool:
    from lark import Tree

    return any(isinstance(n, Tree) and n.data == "ident" and str(n.children[0]) == "oldSelf"
               for n in tree.iter_subtrees())


def _cel_undefined_fields(tree: Any, schema: dict[str, Any], is_resource_root: bool) -> list[str]:
    """Fields a rule selects on self/oldSelf that the schema does not have (CEL refuses these at compile time)."""
    undefined = []
    for _, steps in _cel_selection_chains(tree):
        node: dict[str, Any] | None = schema
        resource = is_resource_root
        for step in steps:
            if node is None:
                break
            props = dict(_props(node))
            if resource:
                props.update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                              "metadata": _OBJECT_META_IN_CEL})
            if step is None:
                node = node.get("items") if node.get("type") == "array" else _ap_schema(node)
            elif node.get("type") == "object" and not _has_ap(node):
                # An object's CEL type has its declared fields only: preserved unknown fields are not accessible.
                match = next((p for p in sorted(props) if step in (p, _cel_escape(p))), None)
                if match is None:
                    undefined.append(step)
                    break
                node = props[match]
            elif _ap_schema(node) is not None:
                node = _ap_schema(node)
            else:
                break
            resource = bool(node and node.get(_EMBEDDED))
    return sorted(set(undefined))


def _rule_value(rule: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rule.items() if v not in ("", None)}


def cel_rule_errors(rule: dict[str, Any], index: int, schema: dict[str, Any], path: str, *, is_resource_root: bool,
                    uncorrelatable: str | None) -> list[FieldError]:
    """What compiling one x-kubernetes-validations entry reports: syntax, unknown fields, oldSelf placement."""
    errs: list[FieldError] = []
    base = _key(_child(path, _VALIDATIONS), index)
    if not rule.get("rule", "").strip():
        return errs
    tree, problem = _cel_parse(rule["rule"])
    if problem:
        errs.append(_invalid(_child(base, "rule"), _rule_value(rule), f"compilation failed: {problem}"))
    else:
        for name in _cel_undefined_fields(tree, schema, is_resource_root):
            errs.append(_invalid(_child(base, "rule"), _rule_value(rule), f"compilation failed: undefined field "
                                                                          f"'{name}'"))
    if rule.get("messageExpression", "").strip():
        _, message_problem = _cel_parse(rule["messageExpression"])
        if message_problem:
            errs.append(_invalid(_child(base, "messageExpression"), _rule_value(rule),
                                 f"messageExpression compilation failed: {message_problem}"))
    if tree is not None:
        if _cel_uses_old_self(tree):
            if uncorrelatable is not None:
                errs.append(_invalid(_child(base, "rule"), rule["rule"], "oldSelf cannot be used on the "
                                     f"uncorrelatable portion of the schema within {uncorrelatable}"))
        elif rule.get("optionalOldSelf") is not None:
            errs.append(_invalid(_child(base, "optionalOldSelf"), rule["optionalOldSelf"],
                                 "may not be set if oldSelf is not used in rule"))
    return errs


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as the CEL value the API server binds to `self` (UnstructuredToVal), typed by `schema`: `integer` as
    an int, `number` as a double even when written `1`, int-or-string as either, objects with a schema as maps."""
    import celpy
    from celpy import celtypes

    if value is None:
        return None
    if schema.get("x-kubernetes-int-or-string"):
        return celtypes.IntType(value) if isinstance(value, int) else celtypes.StringType(value)
    kind = schema.get("type")
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "number":
        return celtypes.DoubleType(value)
    if kind == "string":
        return celtypes.StringType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "array":
        return celtypes.ListType([to_cel(v, schema.get("items") or {}) for v in value])
    if kind == "object" and ("properties" in schema or isinstance(schema.get("additionalProperties"), dict)):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props.get(k, extra)) for k, v in value.items()})
    return celpy.json_to_cel(value)  # x-kubernetes-preserve-unknown-fields: untyped


def cel_value_errors(value: Any, schema: dict[str, Any], path: str, *, is_resource_root: bool = False
                     ) -> list[FieldError]:
    """The x-kubernetes-validations rules of a schema evaluated on a value, where cel-python can evaluate them.

    A rule using ``oldSelf``, or one cel-python cannot evaluate (missing Kubernetes CEL libraries, absent fields), is
    skipped rather than reported.
    """
    import celpy

    errs: list[FieldError] = []
    s = schema
    if value is None or s is None:
        return errs
    for rule in s.get(_VALIDATIONS) or []:
        tree, problem = _cel_parse(rule.get("rule", ""))
        if problem or tree is None or _cel_uses_old_self(tree):
            continue
        try:
            result = _cel_env().program(tree).evaluate({"self": to_cel(value, s)})
        except Exception:  # a rule cel-python cannot run is not a failed rule
            continue
        if not isinstance(result, celpy.celtypes.BoolType) or bool(result):
            continue
        detail = rule["message"].strip() if rule.get("message") else f"failed rule: {rule['rule'].strip()}"
        err_path = _child(path, rule["fieldPath"].lstrip(".")) if rule.get("fieldPath") else path
        shown = OMIT if s.get("type") in ("object", "array") else value
        reason = rule.get("reason")
        if reason == "FieldValueForbidden":
            errs.append(_forbidden(err_path, detail))
        elif reason == "FieldValueRequired":
            errs.append(_required(err_path, detail))
        elif reason == "FieldValueDuplicate":
            errs.append(FieldError(err_path, DUPLICATE, "", shown))
        else:
            errs.append(_invalid(err_path, shown, detail))
    if isinstance(value, dict):
        for key in sorted(value):
            if key in _props(s):
                errs += cel_value_errors(value[key], _props(s)[key], _child(path, key))
            elif _ap_schema(s) is not None:
                errs += cel_value_errors(value[key], _ap_schema(s), _key(path, key))
    elif isinstance(value, list) and isinstance(s.get("items"), dict):
        for i, item in enumerate(value):
            errs += cel_value_errors(item, s["items"], _key(path, i))
    return errs


def valid_field_path(json_path: str, schema: dict[str, Any] | None, *, allow_array_notation: bool = True
                     ) -> tuple[str, dict[str, Any] | None]:
    """cel.ValidFieldPath: the normalized path and the schema it reaches; ValueError says why it is invalid."""
    tokens = re.findall(r"'(?:[^'\\]|\\.)*'|[.\[\]]|[^.\[\]']+", json_path)
    if "".join(tokens) != json_path:
        raise ValueError(f"expected [ or . but got: {json_path}")
    out = ""
    node = schema
    i = 0

    def step(name: str) -> None:
        nonlocal out, node
        if node is None:
            raise ValueError("does not refer to a valid field")
        if _props(node):
            out = _child(out, name)
            if name not in _props(node):
                raise ValueError("does not refer to a valid field")
            node = _props(node)[name]
        elif _has_ap(node):
            out = _key(out, name)
            node = _ap_schema(node)
        else:
            raise ValueError("does not refer to a valid field")

    while i < len(tokens):
        token = tokens[i]
        if token == "[":
            if not allow_array_notation:
                raise ValueError("array notation is not allowed")
            if i + 1 >= len(tokens):
                raise ValueError("unexpected end of JSON path")
            quoted = tokens[i + 1]
            if len(quoted) < 2 or quoted[0] != "'" or quoted[-1] != "'":
                raise ValueError(f"expected single quoted string but got {quoted}")
            step(_unescape_single_quoted(quoted[1:-1]))
            if i + 2 >= len(tokens):
                raise ValueError("unexpected end of JSON path")
            if tokens[i + 2] != "]":
                raise ValueError(f"expected ] but got {tokens[i + 2]}")
            i += 3
        elif token == ".":
            if i + 1 >= len(tokens):
                raise ValueError("unexpected end of JSON path")
            step(tokens[i + 1])
            i += 2
        else:
            raise ValueError(f"expected [ or . but got: {token}")
    return out, node


def _unescape_single_quoted(text: str) -> str:
    escapes = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "'": "'", "\\": "\\"}

    def replace(match: re.Match[str]) -> str:
        if match.group(1) not in escapes:
            raise ValueError(f"invalid string literal: invalid escape char {match.group(0)}")
        return escapes[match.group(1)]

    return re.sub(r"\\(.)", replace, text)


# --------------------------------------------------------------------------------------------------------------------
# The OpenAPI schema of a CRD (validateCustomResourceDefinitionValidation, ...OpenAPISchema).

_OPENAPI_TYPES = ("array", "boolean", "integer", "number", "object", "string")
_SUPPORTED_REASONS = ("FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired")
# JSONSchemaProps fields in declaration order, with the Go names the status-subresource check reports.
_GO_FIELD_NAMES = [
    ("id", "ID"), ("$schema", "Schema"), ("$ref", "Ref"), ("description", "Description"), ("type", "Type"),
    ("nullable", "Nullable"), ("format", "Format"), ("title", "Title"), ("default", "Default"),
    ("maximum", "Maximum"), ("exclusiveMaximum", "ExclusiveMaximum"), ("minimum", "Minimum"),
    ("exclusiveMinimum", "ExclusiveMinimum"), ("maxLength", "MaxLength"), ("minLength", "MinLength"),
    ("pattern", "Pattern"), ("maxItems", "MaxItems"), ("minItems", "MinItems"), ("uniqueItems", "UniqueItems"),
    ("multipleOf", "MultipleOf"), ("enum", "Enum"), ("maxProperties", "MaxProperties"),
    ("minProperties", "MinProperties"), ("required", "Required"), ("items", "Items"), ("allOf", "AllOf"),
    ("oneOf", "OneOf"), ("anyOf", "AnyOf"), ("not", "Not"), ("properties", "Properties"),
    ("additionalProperties", "AdditionalProperties"), ("patternProperties", "PatternProperties"),
    ("dependencies", "Dependencies"), ("additionalItems", "AdditionalItems"), ("definitions", "Definitions"),
    ("externalDocs", "ExternalDocs"), ("example", "Example"), (_PRESERVE, "XPreserveUnknownFields"),
    (_EMBEDDED, "XEmbeddedResource"), (_INT_OR_STRING, "XIntOrString"), (_LIST_MAP_KEYS, "XListMapKeys"),
    (_LIST_TYPE, "XListType"), (_MAP_TYPE, "XMapType"), (_VALIDATIONS, "XValidations"),
]
_ALLOWED_AT_ROOT_WITH_STATUS = ["Description", "Type", "Format", "Title", "Maximum", "ExclusiveMaximum", "Minimum",
                                "ExclusiveMinimum", "MaxLength", "MinLength", "Pattern", "MaxItems", "MinItems",
                                "UniqueItems", "MultipleOf", "Required", "Items", "Properties", "ExternalDocs",
                                "Example", "XPreserveUnknownFields", "XValidations"]


@dataclass(frozen=True)
class SchemaOptions:
    """validationOptions of validation.go; the defaults are those of a CREATE."""

    allow_defaults: bool = True
    require_structural_schema: bool = True
    require_valid_property_type: bool = True
    require_pruned_defaults: bool = True
    require_atomic_set_type: bool = True
    require_map_list_keys_map_set_validation: bool = True
    compile_cel: bool | None = None  # None: when cel-python is importable


@dataclass(frozen=True)
class _SpecValidator:
    allow_defaults: bool
    disallow_reason: str
    inside_resource_meta: bool
    require_valid_property_type: bool
    uncorrelatable: str | None

    def forbid_defaults(self, reason: str) -> _SpecValidator:
        return _SpecValidator(False, reason, self.inside_resource_meta, self.require_valid_property_type,
                              self.uncorrelatable)

    def inside_meta(self) -> _SpecValidator:
        return _SpecValidator(self.allow_defaults, self.disallow_reason, True, self.require_valid_property_type,
                              self.uncorrelatable)

    def forbid_old_self(self, path: str) -> _SpecValidator:
        if self.uncorrelatable is not None:  # the highest uncorrelatable ancestor is the one reported
            return self
        return _SpecValidator(self.allow_defaults, self.disallow_reason, self.inside_resource_meta,
                              self.require_valid_property_type, path)


def schema_errors(validation: dict[str, Any] | None, path: str = "spec.validation", *, status_enabled: bool = False,
                  options: SchemaOptions | None = None) -> list[FieldError]:
    """validateCustomResourceDefinitionValidation for a ``{"openAPIV3Schema": ...}`` (v1 JSON, decoded here)."""
    opts = options or SchemaOptions()
    if validation is None:
        return []
    schema = validation.get("openAPIV3Schema")
    if schema is None:
        return []
    schema = _ensure_decoded(schema)
    root_path = _child(path, "openAPIV3Schema")
    errs: list[FieldError] = []
    if status_enabled:
        for key, go_name in _GO_FIELD_NAMES:
            if schema.get(key) is None:
                continue
            if go_name == "Type":
                if schema["type"] != "object":
                    errs.append(_invalid(_child(path, "openAPIV3Schema.type"), schema["type"], 'only "object" is '
                                         "allowed as the type at the root of the schema if the status subresource is "
                                         "enabled"))
                    break
                continue
            if go_name not in _ALLOWED_AT_ROOT_WITH_STATUS:
                errs.append(_invalid(root_path, schema, f"only [{' '.join(_ALLOWED_AT_ROOT_WITH_STATUS)}] fields are "
                                                        "allowed at the root of the schema if the status subresource "
                                                        "is enabled"))
                break
    if schema.get("nullable"):
        errs.append(_forbidden(_child(path, "openAPIV3Schema.nullable"), "nullable cannot be true at the root"))

    compile_cel = _cel_available() if opts.compile_cel is None else opts.compile_cel
    cel_ready = False
    init_errs = []
    if opts.require_structural_schema:
        if problem := new_structural_error(schema):
            init_errs.append(_invalid(root_path, "", problem))
        elif (found := structural_errors(schema, root_path)) or (found := default_errors(
                schema, root_path, require_pruned_defaults=opts.require_pruned_defaults, evaluate_cel=compile_cel)):
            errs += found  # defaults are only checked on a structural schema, and CEL only when both pass
        else:
            cel_ready = compile_cel
    ssv = _SpecValidator(opts.allow_defaults, "", False, opts.require_valid_property_type, None)
    schema_errs, cel_errs = _openapi_schema(schema, root_path, ssv, True, opts, cel_ready, True)
    errs += schema_errs + cel_errs
    if not errs:
        errs += init_errs
    return errs


def _openapi_schema(schema: dict[str, Any] | None, path: str, ssv: _SpecValidator, is_root: bool,
                    opts: SchemaOptions, cel: bool, cel_resource_root: bool
                    ) -> tuple[list[FieldError], list[FieldError]]:
    """ValidateCustomResourceDefinitionOpenAPISchema: (schema errors, CEL errors) of one node and below."""
    if schema is None:
        return [], []
    errs = _spec_standard_errors(schema, path, ssv)
    cel_errs: list[FieldError] = []

    def add(found: tuple[list[FieldError], list[FieldError]]) -> None:
        errs.extend(found[0])
        cel_errs.extend(found[1])

    if schema.get("uniqueItems"):
        errs.append(_forbidden(_child(path, "uniqueItems"), "uniqueItems cannot be set to true since the runtime "
                                                            "complexity becomes quadratic"))
    ap = schema.get("additionalProperties")
    if ap is not None:
        # Properties are for structs, additionalProperties for maps: both would contradict pruning of unknown fields.
        if schema.get("properties") and (ap is False or isinstance(ap, dict)):
            errs.append(_forbidden(_child(path, "additionalProperties"), "additionalProperties and properties are "
                                                                         "mutual exclusive"))
        sub = ssv.forbid_defaults("inside additionalProperties applying to object metadata") \
            if ssv.inside_resource_meta else ssv
        if isinstance(ap, dict):
            add(_openapi_schema(ap, _child(path, "additionalProperties"), sub, False, opts, cel,
                                bool(ap.get(_EMBEDDED))))
    for name in sorted(schema.get("properties") or {}):
        sub = ssv
        if schema.get(_MAP_TYPE) not in (None, "granular", "atomic"):
            sub = sub.forbid_old_self(path)
        if (is_root or schema.get(_EMBEDDED)) and name in _META_NAMES:
            sub = sub.inside_meta()
            if is_root:
                sub = sub.forbid_defaults(f"in top-level {name}")
        prop = schema["properties"][name]
        add(_openapi_schema(prop, _key(_child(path, "properties"), name), sub, False, opts, cel,
                            bool(prop.get(_EMBEDDED))))
    if schema.get("not") is not None:
        add(_openapi_schema(schema["not"], _child(path, "not"), ssv, False, opts, False, False))
    for junctor in ("allOf", "oneOf", "anyOf"):
        for i, sub_schema in enumerate(schema.get(junctor) or []):
            add(_openapi_schema(sub_schema, _key(_child(path, junctor), i), ssv, False, opts, False, False))
    for name in sorted(schema.get("definitions") or {}):
        add(_openapi_schema(schema["definitions"][name], _key(_child(path, "definitions"), name), ssv, False, opts,
                            False, False))
    items = schema.get("items")
    if items is not None:
        sub = ssv if schema.get(_LIST_TYPE) == "map" else ssv.forbid_old_self(path)
        if isinstance(items, dict):
            add(_openapi_schema(items, _child(path, "items"), sub, False, opts, cel, bool(items.get(_EMBEDDED))))
        else:
            for i, item in enumerate(items):
                add(_openapi_schema(item, _key(_child(path, "items"), i), sub, False, opts, cel,
                                    bool(item.get(_EMBEDDED))))
    for name in sorted(schema.get("dependencies") or {}):
        dependency = schema["dependencies"][name]
        if isinstance(dependency, dict):
            add(_openapi_schema(dependency, _key(_child(path, "dependencies"), name), ssv, False, opts, False, False))

    errs += _extension_errors(schema, path, opts)
    errs += _rule_errors(schema, path)
    if schema.get(_VALIDATIONS) and not errs and cel:
        for i, rule in enumerate(schema[_VALIDATIONS]):
            cel_errs += cel_rule_errors(rule, i, schema, path, is_resource_root=cel_resource_root,
                                        uncorrelatable=ssv.uncorrelatable)
    return errs, cel_errs


def _spec_standard_errors(schema: dict[str, Any], path: str, ssv: _SpecValidator) -> list[FieldError]:
    errs = []
    typ = schema.get("type", "")
    if ssv.require_valid_property_type and typ and typ not in _OPENAPI_TYPES:
        errs.append(_not_supported(_child(path, "type"), typ, _OPENAPI_TYPES))
    if schema.get("default") is not None and not ssv.allow_defaults:
        detail = "must not be set" + (f" {ssv.disallow_reason}" if ssv.disallow_reason else "")
        errs.append(_forbidden(_child(path, "default"), detail))
    if schema.get("id"):
        errs.append(_forbidden(_child(path, "id"), "id is not supported"))
    if schema.get("additionalItems") is not None:
        errs.append(_forbidden(_child(path, "additionalItems"), "additionalItems is not supported"))
    if schema.get("patternProperties"):
        errs.append(_forbidden(_child(path, "patternProperties"), "patternProperties is not supported"))
    if schema.get("definitions"):
        errs.append(_forbidden(_child(path, "definitions"), "definitions is not supported"))
    if schema.get("dependencies") is not None:
        errs.append(_forbidden(_child(path, "dependencies"), "dependencies is not supported"))
    if schema.get("$ref") is not None:
        errs.append(_forbidden(_child(path, "$ref"), "$ref is not supported"))
    if typ == "null":
        errs.append(_forbidden(_child(path, "type"), "type cannot be set to null, use nullable as an alternative"))
    if isinstance(schema.get("items"), list) and schema["items"]:
        errs.append(_forbidden(_child(path, "items"), "items must be a schema object and not an array"))
    if ssv.inside_resource_meta and schema.get(_EMBEDDED):
        errs.append(_forbidden(_child(path, _EMBEDDED), "must not be used inside of resource meta"))
    return errs


def _extension_errors(schema: dict[str, Any], path: str, opts: SchemaOptions) -> list[FieldError]:
    errs = []
    typ = schema.get("type", "")
    list_type, map_type, keys = schema.get(_LIST_TYPE), schema.get(_MAP_TYPE), schema.get(_LIST_MAP_KEYS) or []
    items = schema.get("items")
    if schema.get(_PRESERVE) is False:
        errs.append(_invalid(_child(path, _PRESERVE), False, "must be true or undefined"))
    if map_type is not None and typ != "object":
        detail = "must be object if x-kubernetes-map-type is specified"
        errs.append(_invalid(_child(path, "type"), typ, detail) if typ else _required(_child(path, "type"), detail))
    if map_type is not None and map_type not in ("atomic", "granular"):
        errs.append(_not_supported(_child(path, _MAP_TYPE), map_type, ["atomic", "granular"]))
    if list_type is not None and typ != "array":
        detail = "must be array if x-kubernetes-list-type is specified"
        errs.append(_invalid(_child(path, "type"), typ, detail) if typ else _required(_child(path, "type"), detail))
    elif opts.require_atomic_set_type and list_type == "set" and isinstance(items, dict):
        detail = "must be atomic as item of a list with x-kubernetes-list-type=set"
        if items.get("type") == "array" and items.get(_LIST_TYPE) not in (None, "atomic"):
            errs.append(_invalid(_child(path, "items", _LIST_TYPE), items.get(_LIST_TYPE), detail))
        elif items.get("type") == "object" and items.get(_MAP_TYPE) != "atomic":
            # Upstream reports the items' list type here, whatever the map type is.
            errs.append(_invalid(_child(path, "items", _MAP_TYPE), items.get(_LIST_TYPE), detail))
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        errs.append(_not_supported(_child(path, _LIST_TYPE), list_type, ["atomic", "set", "map"]))
    if keys:
        if list_type is None:
            errs.append(_required(_child(path, _LIST_TYPE), "must be map if x-kubernetes-list-map-keys is non-empty"))
        elif list_type != "map":
            errs.append(_invalid(_child(path, _LIST_TYPE), list_type, "must be map if x-kubernetes-list-map-keys is "
                                                                      "non-empty"))
    if list_type == "map":
        if not keys:
            errs.append(_required(_child(path, _LIST_MAP_KEYS), "must not be empty if x-kubernetes-list-type is map"))
        if items is None:
            errs.append(_required(_child(path, "items"), "must have a schema if x-kubernetes-list-type is map"))
        elif isinstance(items, list):
            errs.append(_invalid(_child(path, "items"), items, "must only have a single schema if "
                                                               "x-kubernetes-list-type is map"))
        elif items.get("type", "") != "object":
            errs.append(_invalid(_child(path, "items", "type"), items.get("type", ""), "must be object if parent "
                                                                                      "array's x-kubernetes-list-type "
                                                                                      "is map"))
        else:
            seen: set[str] = set()
            for key in keys:
                if key in (items.get("properties") or {}):
                    if items["properties"][key].get("type") in ("array", "object"):
                        # Upstream shows the items' type as the bad value.
                        errs.append(_invalid(_child(_key(_child(path, "items", "properties"), key), "type"), "object",
                                             "must be a scalar type if parent array's x-kubernetes-list-type is map"))
                else:
                    errs.append(_invalid(_child(path, _LIST_MAP_KEYS), keys, "entries must all be names of item "
                                                                             "properties"))
                if key in seen:
                    errs.append(_invalid(_child(path, _LIST_MAP_KEYS), keys, "must not contain duplicate entries"))
                seen.add(key)
    if opts.require_map_list_keys_map_set_validation:
        errs += map_list_keys_map_set_errors(schema, path)
    return errs


def map_list_keys_map_set_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """validateMapListKeysMapSet: set/map items not nullable; map keys required or defaulted, never nullable."""
    items, list_type = schema.get("items"), schema.get(_LIST_TYPE)
    if not isinstance(items, dict) or list_type not in ("set", "map"):
        return []
    errs = []
    if items.get("nullable"):
        errs.append(_forbidden(_child(path, "items", "nullable"), f"cannot be nullable when x-kubernetes-list-type "
                                                                  f"is {list_type}"))
    if list_type == "map":
        required = set(items.get("required") or [])
        for key in schema.get(_LIST_MAP_KEYS) or []:
            prop = (items.get("properties") or {}).get(key)
            if prop is None:
                continue
            key_path = _key(_child(path, "items", "properties"), key)
            if key not in required and prop.get("default") is None:
                errs.append(_required(_child(key_path, "default"), "this property is in x-kubernetes-list-map-keys, "
                                                                   "so it must have a default or be a required "
                                                                   "property"))
            if prop.get("nullable"):
                errs.append(_forbidden(_child(key_path, "nullable"), "this property is in x-kubernetes-list-map-keys, "
                                                                     "so it cannot be nullable"))
    return errs


def _has_newlines(text: str) -> bool:
    return re.search(r"[\n\r]+", text) is not None


def _rule_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    errs = []
    for i, rule in enumerate(schema.get(_VALIDATIONS) or []):
        base = _key(_child(path, _VALIDATIONS), i)
        text, message, message_expression = rule.get("rule", ""), rule.get("message", ""), \
            rule.get("messageExpression", "")
        if not text.strip():
            errs.append(_required(_child(base, "rule"), "rule is not specified"))
        elif message and not message.strip():
            errs.append(_invalid(_child(base, "message"), message, "must be non-empty if specified"))
        elif _has_newlines(message.strip()):
            errs.append(_invalid(_child(base, "message"), message, "must not contain line breaks"))
        elif _has_newlines(text.strip()) and not message.strip():
            errs.append(_required(_child(base, "message"), "message must be specified if rule contains line breaks"))
        if message_expression and not message_expression.strip():
            errs.append(_required(_child(base, "messageExpression"), "messageExpression must be non-empty if "
                                                                     "specified"))
        reason = rule.get("reason")
        if reason is not None and reason not in _SUPPORTED_REASONS:
            errs.append(_not_supported(_child(base, "reason"), reason, _SUPPORTED_REASONS))
        field_path = rule.get("fieldPath", "")
        if field_path and not field_path.strip():
            errs.append(_invalid(_child(base, "fieldPath"), field_path, "must be non-empty if specified"))
        if _has_newlines(field_path):
            errs.append(_invalid(_child(base, "fieldPath"), field_path, "must not contain line breaks"))
        if field_path and not _field_path_valid(schema, field_path):
            errs.append(_invalid(_child(base, "fieldPath"), field_path, "must be a valid path"))
    return errs


def _field_path_valid(schema: dict[str, Any], field_path: str) -> bool:
    if new_structural_error(schema):
        return True
    try:
        valid_field_path(field_path, schema)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------------------------------
# Names, printer columns, subresources, selectable fields, conversion.

_PRINTER_COLUMN_TYPES = ("boolean", "date", "integer", "number", "string")
_PRINTER_COLUMN_FORMATS = ("byte", "date", "date-time", "double", "float", "int32", "int64", "password")


def names_errors(names: dict[str, Any], path: str) -> list[FieldError]:
    """ValidateCustomResourceDefinitionNames (format only; spec requires them separately)."""
    errs = []
    for key in ("plural", "singular"):
        value = names.get(key, "")
        if value and (problems := dns1035_label_errors(value)):
            errs.append(_invalid(_child(path, key), value, ",".join(problems)))
    for key in ("kind", "listKind"):
        value = names.get(key, "")
        if value and (problems := dns1035_label_errors(value.lower())):
            errs.append(_invalid(_child(path, key), value, "may have mixed case, but should otherwise match: " +
                                 ",".join(problems)))
    for i, short_name in enumerate(names.get("shortNames") or []):
        if problems := dns1035_label_errors(short_name):
            errs.append(_invalid(_key(_child(path, "shortNames"), i), short_name, ",".join(problems)))
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        errs.append(_invalid(_child(path, "listKind"), names["listKind"], "kind and listKind may not be the same"))
    for i, category in enumerate(names.get("categories") or []):
        if problems := dns1035_label_errors(category):
            errs.append(_invalid(_key(_child(path, "categories"), i), category, ",".join(problems)))
    return errs


def _simple_json_path_errors(text: str, path: str) -> list[FieldError]:
    if not text:
        return [_invalid(path, text, "must not be empty")]
    if text[0] != ".":
        return [_invalid(path, text, "must be a simple json path starting with .")]
    return []


def column_errors(column: dict[str, Any], path: str) -> list[FieldError]:
    """ValidateCustomResourceColumnDefinition."""
    errs = []
    if not column.get("name"):
        errs.append(_required(_child(path, "name")))
    typ = column.get("type", "")
    allowed = f"must be one of {','.join(_PRINTER_COLUMN_TYPES)}"
    if not typ:
        errs.append(_required(_child(path, "type"), allowed))
    elif typ not in _PRINTER_COLUMN_TYPES:
        errs.append(_invalid(_child(path, "type"), typ, allowed))
    fmt = column.get("format", "")
    if fmt and fmt not in _PRINTER_COLUMN_FORMATS:
        errs.append(_invalid(_child(path, "format"), fmt, f"must be one of {','.join(_PRINTER_COLUMN_FORMATS)}"))
    json_path = column.get("jsonPath", "")
    if not json_path:
        errs.append(_required(_child(path, "JSONPath")))
    else:
        errs += _simple_json_path_errors(json_path, _child(path, "JSONPath"))
    return errs


def subresources_errors(subresources: dict[str, Any] | None, path: str) -> list[FieldError]:
    """ValidateCustomResourceDefinitionSubresources: the scale paths' syntax and prefixes."""
    scale = (subresources or {}).get("scale")
    if scale is None:
        return []
    errs = []
    for key, prefix, where in (("specReplicasPath", ".spec.", ".spec"), ("statusReplicasPath", ".status.", ".status")):
        value, field_path = scale.get(key, ""), _child(path, f"scale.{key}")
        if not value:
            errs.append(_required(field_path))
        elif problems := _simple_json_path_errors(value, field_path):
            errs += problems
        elif not value.startswith(prefix):
            errs.append(_invalid(field_path, value, f"should be a json path under {where}"))
    selector = scale.get("labelSelectorPath")
    if selector:
        field_path = _child(path, "scale.labelSelectorPath")
        if problems := _simple_json_path_errors(selector, field_path):
            errs += problems
        elif not selector.startswith((".spec.", ".status.")):
            errs.append(_invalid(field_path, selector, "should be a json path under either .spec or .status"))
    return errs


def selectable_fields_errors(fields: list[dict[str, Any]], schema: dict[str, Any] | None, path: str
                             ) -> list[FieldError]:
    """ValidateCustomResourceSelectableFields."""
    errs: list[FieldError] = []
    seen: set[str] = set()
    for i, entry in enumerate(fields):
        field_path = _child(_key(path, i), "jsonPath")
        json_path = entry.get("jsonPath", "")
        if not json_path:
            errs.append(_required(field_path))
            continue
        try:
            normalized, found = valid_field_path(json_path, schema, allow_array_notation=False)
        except ValueError as exc:
            errs.append(_invalid(field_path, json_path, f"is an invalid path: {exc}"))
            continue
        if re.split(r"[.\[]", normalized, maxsplit=1)[0] == "metadata":
            errs.append(_invalid(field_path, json_path, "must not point to fields in metadata"))
        if (found or {}).get("type") not in ("string", "boolean", "integer"):
            errs.append(_invalid(field_path, json_path, "must point to a field of type string, boolean or integer. "
                                                        "Enum string fields and strings with formats are allowed."))
        if normalized in seen:
            errs.append(FieldError(field_path, DUPLICATE, "", json_path))
        seen.add(normalized)
    if len(seen) > 8:
        errs.append(_too_many(path, len(seen), 8))
    return errs


def _webhook_url_errors(url: str, path: str) -> list[FieldError]:
    parsed = urllib.parse.urlsplit(url)
    if not parsed.scheme:
        return [_invalid(path, url, "url must be an absolute URL")]
    problems = []
    if parsed.scheme != "https":
        problems.append("'https' is the only allowed URL scheme")
    if not parsed.hostname:
        problems.append("host must be specified")
    if parsed.username or parsed.password:
        problems.append("user information is not permitted in the URL")
    if parsed.fragment or url.endswith("#"):
        problems.append("fragments are not permitted in the URL")
    if parsed.query or url.endswith("?"):
        problems.append("query parameters are not permitted in the URL")
    return [_invalid(path, url, p) for p in problems]


def _webhook_service_errors(service: dict[str, Any], path: str) -> list[FieldError]:
    errs = []
    for key in ("name", "namespace"):
        value = service.get(key, "")
        if not value:
            errs.append(_required(_child(path, key), f"service {key} is required"))
        elif problems := dns1123_label_errors(value):
            errs.append(_invalid(_child(path, key), value, ",".join(problems)))
    service_path = service.get("path")
    if service_path is not None and not service_path.startswith("/"):
        errs.append(_invalid(_child(path, "path"), service_path, "must start with a '/'"))
    port = service.get("port", 443)
    if not 1 <= port <= 65535:
        errs.append(_invalid(_child(path, "port"), port, "port is not valid: must be between 1 and 65535, inclusive"))
    return errs


def conversion_errors(conversion: dict[str, Any] | None, path: str) -> list[FieldError]:
    """validateCustomResourceConversion on the internal form (webhookClientConfig, conversionReviewVersions)."""
    if conversion is None:
        return []
    errs = []
    strategy = conversion.get("strategy", "")
    if not strategy:
        errs.append(_required(_child(path, "strategy")))
    elif strategy not in ("None", "Webhook"):
        errs.append(_not_supported(_child(path, "strategy"), strategy, ["None", "Webhook"]))
    config, review_versions = conversion.get("webhookClientConfig"), conversion.get("conversionReviewVersions")
    if strategy == "Webhook":
        config_path = _child(path, "webhookClientConfig")
        if config is None:
            errs.append(_required(config_path, "required when strategy is set to Webhook"))
        elif (config.get("url") is None) == (config.get("service") is None):
            errs.append(_required(config_path, "exactly one of url or service is required"))
        elif config.get("url") is not None:
            errs += _webhook_url_errors(config["url"], _child(config_path, "url"))
        else:
            errs += _webhook_service_errors(config["service"], _child(config_path, "service"))
        versions_path = _child(path, "conversionReviewVersions")
        if not review_versions:
            errs.append(_required(versions_path))
        else:
            seen: set[str] = set()
            for i, version in enumerate(review_versions):
                if version in seen:
                    errs.append(_invalid(_key(versions_path, i), version, "duplicate version"))
                    continue
                seen.add(version)
                errs += [_invalid(_key(versions_path, i), version, m) for m in dns1035_label_errors(version)]
            if not seen & {"v1", "v1beta1"}:
                errs.append(_invalid(versions_path, review_versions, "must include at least one of v1, v1beta1"))
    else:
        if config is not None:
            errs.append(_forbidden(_child(path, "webhookClientConfig"), "should not be set when strategy is not set "
                                                                        "to Webhook"))
        if review_versions:
            errs.append(_forbidden(_child(path, "conversionReviewVersions"), "should not be set when strategy is not "
                                                                             "set to Webhook"))
    return errs


def _deprecation_warning_errors(version: dict[str, Any]) -> list[str]:
    warning = version.get("deprecationWarning")
    if not version.get("deprecated") and warning is not None:
        return ["can only be set for deprecated versions"]
    if warning is None:
        return []
    problems = []
    if len(warning.encode()) > 256:
        problems.append("must be <= 256 characters long")
    if not warning:
        problems.append("must not be an empty string")
    for i, char in enumerate(warning):
        if not char.isprintable():
            problems.append(f"must only contain printable UTF-8 characters; non-printable character found at index "
                            f"{len(warning[:i].encode())}")
            break
    return problems


# --------------------------------------------------------------------------------------------------------------------
# The whole CRD: v1 defaulting and conversion, then ValidateCustomResourceDefinition.


def _semantic_equal(a: Any, b: Any) -> bool:
    """apiequality.Semantic.DeepEqual on decoded values: empty and absent collections are the same."""

    def canonical(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: canonical(v) for k, v in x.items() if v not in ({}, [], None)}
        if isinstance(x, list):
            return [canonical(v) for v in x]
        return x

    return _json_equal(canonical(a), canonical(b))


def to_internal(crd: dict[str, Any]) -> dict[str, Any]:
    """The decoded v1 CRD defaulted, converted to the internal form and prepared for create, as the server does."""
    spec = copy.deepcopy(crd.get("spec") or {})
    names = spec.setdefault("names", {})
    if not names.get("singular") and names.get("kind"):
        names["singular"] = names["kind"].lower()
    if not names.get("listKind") and names.get("kind"):
        names["listKind"] = names["kind"] + "List"
    conversion = spec.get("conversion") or {"strategy": "None"}
    webhook = conversion.pop("webhook", None)
    if webhook is not None:
        if webhook.get("conversionReviewVersions") is not None:
            conversion["conversionReviewVersions"] = webhook["conversionReviewVersions"]
        client_config = webhook.get("clientConfig")
        if client_config is not None:
            client_config = {**client_config}
            if client_config.get("service") is not None:
                client_config["service"] = {"port": 443, **client_config["service"]}
            conversion["webhookClientConfig"] = client_config
    spec["conversion"] = conversion
    spec["preserveUnknownFields"] = bool(spec.get("preserveUnknownFields"))
    versions = spec.setdefault("versions", [])
    if versions:
        spec["version"] = versions[0].get("name", "")
        for key, top in (("subresources", "subresources"), ("schema", "validation"),
                         ("additionalPrinterColumns", "additionalPrinterColumns"),
                         ("selectableFields", "selectableFields")):
            first = versions[0].get(key)
            if all(_semantic_equal(v.get(key), first) for v in versions):
                if first is not None:
                    spec[top] = first
                for v in versions:
                    v.pop(key, None)
    storage = next((v.get("name", "") for v in versions if v.get("storage")), None)
    status = {"storedVersions": [storage] if storage is not None else [], "acceptedNames": {}}
    return {"metadata": copy.deepcopy(crd.get("metadata") or {}), "spec": spec, "status": status}


def _subresources_for_version(spec: dict[str, Any], name: str) -> dict[str, Any] | None:
    if not any(v.get("subresources") is not None for v in spec["versions"]):
        return spec.get("subresources")
    return next((v.get("subresources") for v in spec["versions"] if v.get("name") == name), None)


def _has_status(subresources: dict[str, Any] | None) -> bool:
    return subresources is not None and subresources.get("status") is not None


def _schema_has(schema: dict[str, Any] | None, predicate: Callable[[dict[str, Any]], bool]) -> bool:
    """SchemaHas: whether any node of the schema satisfies the predicate."""
    if schema is None:
        return False
    if predicate(schema):
        return True
    items = schema.get("items")
    subs: list[Any] = items if isinstance(items, list) else [items]
    subs += [*(schema.get("allOf") or []), *(schema.get("anyOf") or []), *(schema.get("oneOf") or []),
             schema.get("not"), *(schema.get("properties") or {}).values(),
             *(schema.get("patternProperties") or {}).values(), *(schema.get("definitions") or {}).values()]
    subs += [schema.get("additionalProperties"), schema.get("additionalItems")]
    subs += [d for d in (schema.get("dependencies") or {}).values() if isinstance(d, dict)]
    return any(_schema_has(s, predicate) for s in subs if isinstance(s, dict))


def _spec_schemas(spec: dict[str, Any]) -> list[dict[str, Any]]:
    found = [(spec.get("validation") or {}).get("openAPIV3Schema")]
    found += [(v.get("schema") or {}).get("openAPIV3Schema") for v in spec["versions"]]
    return [s for s in found if s is not None]


def _validate_spec(spec: dict[str, Any], opts: SchemaOptions) -> list[FieldError]:
    errs = []
    path = "spec"
    group = spec.get("group", "")
    if not group:
        errs.append(_required(_child(path, "group")))
    elif problems := dns1123_subdomain_errors(group):
        errs.append(_invalid(_child(path, "group"), group, ",".join(problems)))
    elif len(group.split(".")) < 2:
        errs.append(_invalid(_child(path, "group"), group, "should be a domain with at least one dot"))
    scope = spec.get("scope", "")
    if not scope:
        errs.append(_required(_child(path, "scope")))
    elif scope not in ("Cluster", "Namespaced"):
        errs.append(_not_supported(_child(path, "scope"), scope, ["Cluster", "Namespaced"]))

    versions = spec["versions"]
    validation = spec.get("validation")
    if validation is None or validation.get("openAPIV3Schema") is None:
        for i, v in enumerate(versions):
            if (v.get("schema") or {}).get("openAPIV3Schema") is None:
                errs.append(_required(_child(_key(_child(path, "versions"), i), "schema", "openAPIV3Schema")))
    if opts.allow_defaults and any(_schema_has(s, lambda n: n.get("default") is not None) for s in
                                   _spec_schemas(spec)) and spec["preserveUnknownFields"]:
        errs.append(_invalid(_child(path, "preserveUnknownFields"), True, "must be false in order to use defaults in "
                                                                          "the schema"))

    seen: set[str] = set()
    unique = True
    for i, version in enumerate(versions):
        version_path = _key(_child(path, "versions"), i)
        name = version.get("name", "")
        unique = unique and name not in seen
        seen.add(name)
        if problems := dns1035_label_errors(name):
            errs.append(_invalid(_child(version_path, "name"), name, ",".join(problems)))
        status_enabled = _has_status(_subresources_for_version(spec, name))
        errs += [_invalid(_child(version_path, "deprecationWarning"), version.get("deprecationWarning"), p)
                 for p in _deprecation_warning_errors(version)]
        errs += schema_errors(version.get("schema"), _child(version_path, "schema"), status_enabled=status_enabled,
                              options=opts)
        errs += subresources_errors(version.get("subresources"), _child(version_path, "subresources"))
        for j, column in enumerate(version.get("additionalPrinterColumns") or []):
            errs += column_errors(column, _key(_child(version_path, "additionalPrinterColumns"), j))
        if version.get("selectableFields"):
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if schema is None:
                errs.append(_invalid(_child(version_path, "selectableFields"), "", "may only be set when "
                                                                                   "`version.schema.openAPIV3Schema` "
                                                                                   "is not included"))
            elif problem := new_structural_error(schema):
                errs.append(_invalid(_child(version_path, "schema.openAPIV3Schema"), "", problem))
            else:
                errs += selectable_fields_errors(version["selectableFields"], schema,
                                                 _child(version_path, "selectableFields"))

    if validation is not None and any(v.get("schema") is not None for v in versions):
        errs.append(_forbidden(_child(path, "validation"), "top-level and per-version schemas are mutually exclusive"))
    if spec.get("subresources") is not None and any(v.get("subresources") is not None for v in versions):
        errs.append(_forbidden(_child(path, "subresources"), "top-level and per-version subresources are mutually "
                                                             "exclusive"))
    if spec.get("additionalPrinterColumns") and any(v.get("additionalPrinterColumns") for v in versions):
        errs.append(_forbidden(_child(path, "additionalPrinterColumns"), "top-level and per-version "
                                                                         "additionalPrinterColumns are mutually "
                                                                         "exclusive"))
    if not unique:
        errs.append(_invalid(_child(path, "versions"), versions, "must contain unique version names"))
    if sum(bool(v.get("storage")) for v in versions) != 1:
        errs.append(_invalid(_child(path, "versions"), versions, "must have exactly one version marked as storage "
                                                                 "version"))
    if spec.get("version") and (problems := dns1035_label_errors(spec["version"])):
        errs.append(_invalid(_child(path, "version"), spec["version"], ",".join(problems)))

    names = spec.get("names") or {}
    for key in ("plural", "singular", "kind", "listKind"):
        if not names.get(key):
            errs.append(_required(_child(path, "names", key)))
    errs += names_errors(names, _child(path, "names"))
    any_status = _has_status(spec.get("subresources")) or any(_has_status(v.get("subresources")) for v in versions)
    errs += schema_errors(validation, _child(path, "validation"), status_enabled=any_status, options=opts)
    errs += subresources_errors(spec.get("subresources"), _child(path, "subresources"))
    for j, column in enumerate(spec.get("additionalPrinterColumns") or []):
        errs += column_errors(column, _key(_child(path, "additionalPrinterColumns"), j))
    if spec.get("selectableFields"):
        schema = (validation or {}).get("openAPIV3Schema")
        if validation is None:
            errs.append(_invalid(_child(path, "selectableFields"), "", "may only be set when validations.schema is "
                                                                       "included"))
        elif schema is not None and not new_structural_error(schema):
            errs += selectable_fields_errors(spec["selectableFields"], schema, _child(path, "selectableFields"))
    conversion = spec.get("conversion")
    if conversion is not None and conversion.get("strategy") != "None" and spec["preserveUnknownFields"]:
        errs.append(_invalid(_child(path, "conversion", "strategy"), conversion.get("strategy"),
                             "must be None if spec.preserveUnknownFields is true"))
    errs += conversion_errors(conversion, _child(path, "conversion"))
    return errs


def _is_protected_group(group: str) -> bool:
    return group in ("k8s.io", "kubernetes.io") or group.endswith((".k8s.io", ".kubernetes.io"))


def _api_approval_errors(crd: dict[str, Any]) -> list[FieldError]:
    if not _is_protected_group(crd["spec"].get("group", "")):
        return []
    annotation_name = "api-approved.kubernetes.io"
    path = _key("metadata.annotations", annotation_name)
    value = (crd["metadata"].get("annotations") or {}).get(annotation_name, "")
    if not value:
        return [_required(path, f'protected groups must have approval annotation "{annotation_name}", see '
                                "https://github.com/kubernetes/enhancements/pull/1111")]
    parsed = urllib.parse.urlparse(value)
    if value.startswith("unapproved") or (parsed.scheme and parsed.netloc):
        return []
    return [_invalid(path, value, f'protected groups must have approval annotation "{annotation_name}" with either a '
                                  'URL or a reason starting with "unapproved", see '
                                  "https://github.com/kubernetes/enhancements/pull/1111")]


def validate_internal(crd: dict[str, Any], options: SchemaOptions | None = None) -> list[FieldError]:
    """ValidateCustomResourceDefinition on a CRD already in internal form (see :func:`to_internal`)."""
    opts = options or SchemaOptions()
    spec = crd["spec"]
    required_name = f"{(spec.get('names') or {}).get('plural', '')}.{spec.get('group', '')}"

    def name_errors(name: str, prefix: bool) -> list[str]:
        problems = dns1123_subdomain_errors(name[:-1] + "a" if prefix and name.endswith("-") else name)
        if name != required_name:
            problems.append('must be spec.names.plural+"."+spec.group')
        return problems

    meta = crd["metadata"]
    errs = []
    problem = _objectmeta_decode_error(meta)
    if problem:
        errs.append(_invalid("metadata", "", problem))
    else:
        errs += objectmeta_errors(meta, "metadata", requires_namespace=False, name_errors=name_errors)
    errs += _validate_spec(spec, opts)
    stored = crd["status"]["storedVersions"]
    if not stored:
        errs.append(_invalid("status.storedVersions", stored, "must have at least one stored version"))
    errs += _api_approval_errors(crd)
    if spec["preserveUnknownFields"]:
        errs.append(_invalid("spec.preserveUnknownFields", True, "cannot set to true, set "
                                                                 "x-kubernetes-preserve-unknown-fields to true in "
                                                                 "spec.versions[*].schema instead"))
    return errs


def crd_field_errors(crd: dict[str, Any], *, strict: bool = True, beyond_upstream: bool = True,
                     options: SchemaOptions | None = None) -> list[FieldError]:
    """Every error creating the v1 CRD would meet (plus the documented checks beyond the API server)."""
    raw = to_json(crd)
    dec = _Decoder(strict)
    decoded = _decode_crd(raw, dec)
    errs = list(dec.errors)
    if decoded.get("apiVersion") != "apiextensions.k8s.io/v1":
        errs.append(_invalid("apiVersion", decoded.get("apiVersion", ""), "must be apiextensions.k8s.io/v1"))
    if decoded.get("kind") != "CustomResourceDefinition":
        errs.append(_invalid("kind", decoded.get("kind", ""), "must be CustomResourceDefinition"))
    errs += validate_internal(to_internal(decoded), options)
    if beyond_upstream:
        errs += beyond_upstream_errors(decoded)
    return errs


def crd_errors(crd: dict[str, Any], *, strict: bool = True, beyond_upstream: bool = True) -> list[str]:
    """Every error creating the v1 CRD would meet, as text; empty when the API server would accept it."""
    return [str(e) for e in crd_field_errors(crd, strict=strict, beyond_upstream=beyond_upstream)]


# --------------------------------------------------------------------------------------------------------------------
# Beyond the API server: printer-column paths and scale paths must resolve in the schema.

_OBJECT_META_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    **{k: {"type": "string"} for k in ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                                       "creationTimestamp", "deletionTimestamp")},
    "generation": {"type": "integer"}, "deletionGracePeriodSeconds": {"type": "integer"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    "finalizers": {"type": "array", "items": {"type": "string"}},
    "ownerReferences": {"type": "array", "items": {"type": "object", "properties": {
        **{k: {"type": "string"} for k in ("apiVersion", "kind", "name", "uid")},
        "controller": {"type": "boolean"}, "blockOwnerDeletion": {"type": "boolean"}}}},
    "managedFields": {"type": "array", "items": {"type": "object", _PRESERVE: True}},
}}
_UNKNOWN: dict[str, Any] = {_PRESERVE: True}  # what a path through preserved unknown fields reaches

_JSONPATH_TOKEN = re.compile(r"""
    \.\.(?P<descend>[^.\[\]]+)              # ..name
  | \.(?P<field>[^.\[\]]+)                  # .name
  | \[\?\((?P<filter>.*?)\)\]               # [?(@.type=="Ready")]
  | \[(?P<quoted>'[^']*'|"[^"]*")\]         # ['name']
  | \[(?P<index>\*|-?\d*(:-?\d*){0,2})\]    # [*], [0], [1:3]
""", re.VERBOSE)


def _jsonpath_steps(path: str) -> list[tuple[str, str]]:
    """A printer-column JSONPath as (kind, text) steps; ValueError when it is not one the resolver understands."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    steps, pos = [], 0
    while pos < len(text):
        match = _JSONPATH_TOKEN.match(text, pos)
        if not match:
            raise ValueError(f"cannot parse {text[pos:]!r}")
        kind = next(k for k in ("descend", "field", "filter", "quoted", "index") if match.group(k) is not None)
        value = match.group(kind)
        steps.append(("field", value[1:-1]) if kind == "quoted" else (kind, value))
        pos = match.end()
    return steps


def _descendants(s: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield s
    children = [*_props(s).values(), _ap_schema(s), s.get("items") if isinstance(s.get("items"), dict) else None]
    for child in children:
        if child is not None:
            yield from _descendants(child)


def resolve_json_path(path: str, schema: dict[str, Any], *, resource_root: bool = True) -> dict[str, Any] | None:
    """The schema node a JSONPath reaches (``_UNKNOWN`` through preserved fields), or None when it reaches nothing.

    At a resource root (and in embedded resources) ``apiVersion``, ``kind`` and ``metadata`` (ObjectMeta) resolve.
    """
    node: dict[str, Any] = _as_resource_root(schema) if resource_root else schema
    for kind, text in _jsonpath_steps(path):
        if node.get(_PRESERVE) is True and not _props(node) and _ap_schema(node) is None and \
                node.get("type") in (None, "object", "array"):
            return _UNKNOWN
        if node.get(_INT_OR_STRING):
            return None
        if kind == "field" and text == "*":
            return _UNKNOWN  # a wildcard over fields: nothing more to check statically
        if kind == "field":
            if node.get(_EMBEDDED) and text == "metadata":
                node = _OBJECT_META_SCHEMA
            elif node.get(_EMBEDDED) and text in ("apiVersion", "kind"):
                node = {"type": "string"}
            elif text in _props(node):
                node = _props(node)[text]
            elif _ap_schema(node) is not None:
                node = _ap_schema(node)  # type: ignore[assignment]
            elif node.get(_PRESERVE) is True or node.get("additionalProperties") is True:
                return _UNKNOWN
            else:
                return None
        elif kind == "descend":
            matches = [d for d in _descendants(node) if text in _props(d)]
            if not matches:
                return _UNKNOWN if any(d.get(_PRESERVE) for d in _descendants(node)) else None
            node = _props(matches[0])[text]
        else:  # an index, slice, wildcard or filter selects list items
            if node.get("type") != "array" or not isinstance(node.get("items"), dict):
                return None
            node = node["items"]
            if kind == "filter":
                for reference in re.findall(r"@((?:\.[A-Za-z0-9_-]+|\['[^']*'\])+)", text):
                    if resolve_json_path(reference, node, resource_root=False) is None:
                        return None
    return node


def _resolve_beyond(path: str, json_path: str, schema: dict[str, Any], errs: list[FieldError],
                    unresolved: str) -> Any:
    """The schema `json_path` reaches in `schema`, or None after adding to `errs` why it reaches none."""
    try:
        found = resolve_json_path(json_path, schema)
    except ValueError as exc:
        errs.append(_invalid(path, json_path, f"is not a JSONPath this check understands ({exc}); beyond the API "
                                              "server"))
        return None
    if found is None:
        errs.append(_invalid(path, json_path, unresolved))
    return found


def beyond_upstream_errors(crd: dict[str, Any]) -> list[FieldError]:
    """Checks the API server does NOT make: printer columns and scale paths must resolve in each version's schema.

    Paths are those of the v1 object (``spec.versions[i]...``) since no upstream code reports these.
    """
    errs = []
    for i, version in enumerate((crd.get("spec") or {}).get("versions") or []):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            continue
        version_path = _key("spec.versions", i)
        for j, column in enumerate(version.get("additionalPrinterColumns") or []):
            json_path = column.get("jsonPath", "")
            if not json_path.startswith("."):
                continue  # upstream already refuses it
            path = _child(_key(_child(version_path, "additionalPrinterColumns"), j), "jsonPath")
            _resolve_beyond(path, json_path, schema, errs, "does not resolve to a field of the version's schema (a "
                            "check beyond the API server, which accepts it and prints <none>)")
        scale = (version.get("subresources") or {}).get("scale")
        if scale is None:
            continue
        for key, wanted in (("specReplicasPath", "an integer"), ("statusReplicasPath", "an integer"),
                            ("labelSelectorPath", "a string")):
            json_path = scale.get(key) or ""
            if not json_path.startswith("."):
                continue
            path = _child(version_path, "subresources", "scale", key)
            found = _resolve_beyond(path, json_path, schema, errs, "does not resolve to a field of the version's "
                                    f"schema; /scale reads {wanted} there (a check beyond the API server)")
            if found is not None and found is not _UNKNOWN and found.get("type") != wanted.split()[-1]:
                errs.append(_invalid(path, json_path, f"resolves to a field of type {found.get('type') or 'unset'}, "
                                                      f"but /scale reads {wanted} there (a check beyond the API "
                                                      "server)"))
    return errs
