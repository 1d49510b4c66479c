"""The Python port of the API server's CRD create checks (tests/apiserver_crd_rules.py), then the project's CRD.

First the port must agree with upstream: cases come from the unit tests of k8s.io/apiextensions-apiserver,
``pkg/apis/apiextensions/validation/validation_test.go`` and ``pkg/apiserver/schema/validation_test.go``, and each
id names the file, the Go test function and the case. Upstream builds internal objects; here each case is the v1
object that converts to it (a schema shared by every version lands in ``spec.validation``, as on a real server).
A case asserts exactly upstream's set of (field path, error type), so both a missing and an extra error fail it;
"adapted" marks where a v1 CREATE differs from the internal object upstream validates, and says how.

Then the checks the port makes beyond the API server (printer-column and scale paths must resolve in the schema),
and finally the CRD files in crds/ and the chart, and the CRD generated from the models now, must be accepted.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from governor.operator.crds import FILENAME, crd_manifest
from tests.apiserver_crd_rules import (
    DUPLICATE,
    FORBIDDEN,
    INVALID,
    NOT_SUPPORTED,
    REQUIRED,
    TOO_LONG,
    TOO_MANY,
    TYPE_INVALID,
    UNKNOWN_FIELD,
    FieldError,
    SchemaOptions,
    StructuralOptions,
    beyond_upstream_errors,
    column_errors,
    completeness_errors,
    crd_errors,
    crd_field_errors,
    default_errors,
    resolve_json_path,
    schema_errors,
    structural_errors,
    subresources_errors,
    value_errors,
)

Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[1]
V = "spec.validation.openAPIV3Schema"  # where a schema shared by all versions is reported
NAMES = {"plural": "plural", "singular": "singular", "kind": "Plural", "listKind": "PluralList"}


def crd(schema: Obj | None = None, *, versions: list[Obj] | None = None, metadata: Obj | None = None,
        **spec: Any) -> Obj:
    """A v1 CRD plural.group.com with one served storage version "version" carrying `schema`."""
    if versions is None:
        version: Obj = {"name": "version", "served": True, "storage": True}
        if schema is not None:
            version["schema"] = {"openAPIV3Schema": schema}
        versions = [version]
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": metadata if metadata is not None else {"name": "plural.group.com"},
        "spec": {"group": "group.com", "scope": "Namespaced", "names": dict(NAMES), "versions": versions, **spec},
    }


def at(*parts: str) -> str:
    """A field path from its parts, as field.NewPath(parts...) renders it."""
    return ".".join(parts)


def found(errors: list[FieldError]) -> list[tuple[str, str]]:
    return sorted((e.path, e.type) for e in errors)


def obj(**props: Obj) -> Obj:
    return {"type": "object", "properties": props}


# --------------------------------------------------------------------------------------------------------------------
# validation_test.go TestValidateCustomResourceDefinition: whole CRDs.

def upstream_crd(name: str, resource: Obj, *expected: tuple[str, str]) -> Any:
    return pytest.param(resource, sorted(expected),
                        id=f"validation_test.go:TestValidateCustomResourceDefinition/{name}")


EMBEDDED_OBJECT = {"type": "object", "x-kubernetes-embedded-resource": True,
                   "properties": {"something": {"type": "string"}}}
POD_META = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "foo", "unknown": 42}}
VALID_SCHEMA = {  # validValidationSchema: every field allowed at the root with a status subresource
    "description": "This is a description", "type": "object", "format": "date-time", "title": "This is a title",
    "maximum": 10, "exclusiveMaximum": True, "minimum": 5, "exclusiveMinimum": True, "maxLength": 10, "minLength": 5,
    "pattern": "^[a-z]$", "maxItems": 10, "minItems": 5, "multipleOf": 3, "required": ["spec", "status"],
    "properties": {"spec": {"type": "object", "items": {"description": "This is a schema nested under Items",
                                                        "type": "string"}},
                   "status": {"type": "object"}},
    "externalDocs": {"description": "This is an external documentation description"}, "example": "This is an example",
}
UNSTRUCTURAL_SCHEMA = {  # validUnstructuralValidationSchema
    **{k: v for k, v in VALID_SCHEMA.items() if k != "properties"},
    "items": {"description": "This is a schema nested under Items"}, "properties": {"spec": {}, "status": {}},
}


def two_versions(first: Obj | None, second: Obj | None) -> list[Obj]:
    versions = [{"name": "version", "served": True, "storage": True}, {"name": "version2", "served": True,
                                                                       "storage": False}]
    for version, schema in zip(versions, (first, second), strict=True):
        if schema is not None:
            version["schema"] = {"openAPIV3Schema": schema}
    return versions


PRINTER_FORMATS_CRD = crd(versions=[{
    "name": "version", "served": True, "storage": True,
    "schema": {"openAPIV3Schema": obj(shortName={"type": "string", "format": "k8s-short-name"},
                                      longName={"type": "string", "format": "k8s-long-name"})},
    "additionalPrinterColumns": [{"name": "primaryName", "type": "string", "jsonPath": ".metadata.name"},
                                 {"name": "shortName", "type": "string", "jsonPath": ".spec.shortName"},
                                 {"name": "longName", "type": "string", "jsonPath": ".spec.longName"}]}],
    scope="Cluster")


def scaled(name: str, storage: bool, selector: str | None) -> Obj:
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
    if selector is not None:
        scale["labelSelectorPath"] = selector
    return {"name": name, "served": True, "storage": storage, "schema": {"openAPIV3Schema": {"type": "object"}},
            "subresources": {"scale": scale}}


CRD_CASES = [
    # Adapted: a v1 CRD has versions, and on CREATE status.storedVersions is recomputed from the storage version.
    upstream_crd("missing values", {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                                    "metadata": {"name": "plural.group.com"}, "spec": {}},
                 ("status.storedVersions", INVALID), ("metadata.name", INVALID), ("spec.versions", INVALID),
                 ("spec.group", REQUIRED), ("spec.scope", REQUIRED), ("spec.names.plural", REQUIRED),
                 ("spec.names.singular", REQUIRED), ("spec.names.kind", REQUIRED), ("spec.names.listKind", REQUIRED)),
    upstream_crd("mismatched name", {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "plural.not.group.com"}, "spec": {"group": "group.com", "names": {"plural": "plural"}}},
        ("status.storedVersions", INVALID), ("metadata.name", INVALID), ("spec.versions", INVALID),
        ("spec.scope", REQUIRED), ("spec.names.singular", REQUIRED), ("spec.names.kind", REQUIRED),
        ("spec.names.listKind", REQUIRED)),
    # Adapted: the bad version name is versions[0].name (v1 has no spec.version), reported there and as spec.version;
    # status.acceptedNames is cleared on CREATE.
    upstream_crd("bad names 01", {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "plural.group"},
        "spec": {"group": "group", "scope": "foo", "versions": [
            {"name": "ve()*rsion", "served": True, "storage": True,
             "schema": {"openAPIV3Schema": {"type": "object"}}}],
            "names": {"plural": "pl()*ural", "singular": "value()*a", "kind": "value()*a", "listKind": "value()*a"}}},
        ("metadata.name", INVALID), ("spec.group", INVALID), ("spec.scope", NOT_SUPPORTED),
        ("spec.names.plural", INVALID), ("spec.names.singular", INVALID), ("spec.names.kind", INVALID),
        ("spec.names.listKind", INVALID), ("spec.names.listKind", INVALID), ("spec.versions[0].name", INVALID),
        ("spec.version", INVALID)),
    upstream_crd("bad names 02", {
        **crd({"type": "object"}, metadata={"name": "plural.group"}),
        "spec": {**crd({"type": "object"})["spec"], "group": "group.c(*&om", "scope": "",
                 "names": {"plural": "plural", "singular": "singular", "kind": "matching", "listKind": "matching"}}},
        ("metadata.name", INVALID), ("spec.group", INVALID), ("spec.scope", REQUIRED),
        ("spec.names.listKind", INVALID)),
    # Adapted: with no storage version CREATE records no stored version either.
    upstream_crd("no_storage_version", crd(versions=[
        {"name": "version", "served": True, "storage": False, "schema": {"openAPIV3Schema": {"type": "object"}}},
        {"name": "version2", "served": True, "storage": False, "schema": {"openAPIV3Schema": {"type": "object"}}}]),
        ("spec.versions", INVALID), ("status.storedVersions", INVALID)),
    # Adapted: CREATE stores the first storage version, so status.storedVersions is consistent.
    upstream_crd("multiple_storage_version", crd(versions=[
        {"name": "version", "served": True, "storage": True, "schema": {"openAPIV3Schema": {"type": "object"}}},
        {"name": "version2", "served": True, "storage": True, "schema": {"openAPIV3Schema": {"type": "object"}}}]),
        ("spec.versions", INVALID)),
    upstream_crd("additionalProperties and properties forbidden", crd(obj(
        foo={"type": "object", "properties": {"bar": {"type": "object"}}, "additionalProperties": False})),
        (at(V, "properties[foo]", "additionalProperties"), FORBIDDEN)),
    upstream_crd("additionalProperties without properties allowed (map[string]string)", crd(obj(
        foo={"type": "object", "additionalProperties": {"type": "string"}}))),
    upstream_crd("x-kubernetes-preserve-unknown-field: false", crd({"x-kubernetes-preserve-unknown-fields": False}),
                 (at(V, "x-kubernetes-preserve-unknown-fields"), INVALID)),
    upstream_crd("preserveUnknownFields with unstructural global schema",
                 crd(versions=two_versions(UNSTRUCTURAL_SCHEMA, UNSTRUCTURAL_SCHEMA)),
                 (at(V, "properties[spec]", "type"), REQUIRED), (at(V, "properties[status]", "type"), REQUIRED),
                 (at(V, "items", "type"), REQUIRED)),
    upstream_crd("preserveUnknownFields with unstructural schema in one version",
                 crd(versions=two_versions(VALID_SCHEMA, UNSTRUCTURAL_SCHEMA)),
                 ("spec.versions[1].schema.openAPIV3Schema.properties[spec].type", REQUIRED),
                 ("spec.versions[1].schema.openAPIV3Schema.properties[status].type", REQUIRED),
                 ("spec.versions[1].schema.openAPIV3Schema.items.type", REQUIRED)),
    upstream_crd("schema is required", crd(versions=two_versions(None, None)),
                 ("spec.versions[0].schema.openAPIV3Schema", REQUIRED),
                 ("spec.versions[1].schema.openAPIV3Schema", REQUIRED)),
    upstream_crd("preserveUnknownFields: true", crd({"type": "object"}, preserveUnknownFields=True),
                 ("spec.preserveUnknownFields", INVALID)),
    upstream_crd("labelSelectorPath outside of .spec and .status", crd(versions=[
        scaled("version0", True, None), scaled("version1", False, ".status.labelSelector"),
        scaled("version2", False, ".spec.labelSelector"), scaled("version3", False, ".labelSelector")]),
        ("spec.versions[3].subresources.scale.labelSelectorPath", INVALID)),
    upstream_crd("defaults with enabled feature gate, structural schema",
                 crd(obj(a={"type": "number", "default": 42.0}))),
    upstream_crd("defaults with enabled feature gate, unstructural schema",
                 crd({"properties": {"a": {"default": 42.0}}}),
                 (at(V, "properties[a]", "type"), REQUIRED), (at(V, "type"), REQUIRED)),
    upstream_crd("defaults in value validation with enabled feature gate, structural schema", crd(obj(
        a={"type": "number", "not": {"default": 42.0}, "anyOf": [{"default": 42.0}], "allOf": [{"default": 42.0}],
           "oneOf": [{"default": 42.0}]})),
        (at(V, "properties[a]", "not", "default"), FORBIDDEN),
        (at(V, "properties[a]", "allOf[0]", "default"), FORBIDDEN),
        (at(V, "properties[a]", "anyOf[0]", "default"), FORBIDDEN),
        (at(V, "properties[a]", "oneOf[0]", "default"), FORBIDDEN)),
    upstream_crd("invalid defaults with enabled feature gate, structural schema", crd(obj(
        a={"type": "object", "properties": {"foo": {"type": "string"}}, "default": {"foo": "abc", "bar": 42}},
        b={"type": "object", "properties": {"foo": {"type": "string"}}, "default": {"foo": "abc"}},
        c={"type": "object", "properties": {"foo": {"type": "string"}}, "default": {"foo": 42}},
        d={"type": "object", "properties": {"good": {"type": "string", "pattern": "a"},
                                            "bad": {"type": "string", "pattern": "b"}},
           "default": {"good": "a", "bad": "a"}},
        e={"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
            "preserveUnknownFields": {"type": "object", "default": {"foo": "abc", "bar": 42}},
            "nestedProperties": {"type": "object", "properties": {"foo": {"type": "string"}},
                                 "default": {"foo": "abc", "bar": 42}}}},
        **{"embedded-fine": {**EMBEDDED_OBJECT, "properties": {"foo": {"type": "string"}}, "default": {
            "foo": "abc", "apiVersion": "foo/v1", "kind": "v1", "metadata": {"name": "foo"}}},
           "embedded-preserve": {**EMBEDDED_OBJECT, "properties": {"foo": {"type": "string"}},
                                 "x-kubernetes-preserve-unknown-fields": True, "default": {
                                     "foo": "abc", "apiVersion": "foo/v1", "kind": "v1", "metadata": {"name": "foo"},
                                     "bar": 42}},
           "embedded-preserve-unpruned-objectmeta": {
               **EMBEDDED_OBJECT, "properties": {"foo": {"type": "string"}},
               "x-kubernetes-preserve-unknown-fields": True, "default": {
                   "foo": "abc", "apiVersion": "foo/v1", "kind": "v1",
                   "metadata": {"name": "foo", "unspecified": "bar"}, "bar": 42}}})),
        (at(V, "properties[a]", "default"), INVALID), (at(V, "properties[c]", "default", "foo"), TYPE_INVALID),
        (at(V, "properties[d]", "default", "bad"), INVALID),
        (at(V, "properties[e]", "properties[preserveUnknownFields]", "default"), INVALID),
        (at(V, "properties[e]", "properties[nestedProperties]", "default"), INVALID)),
    upstream_crd("x-kubernetes-embedded-resource with pruning and empty properties", crd({
        "type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
            "nil": {"type": "object", "x-kubernetes-embedded-resource": True},
            "empty": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {}}}}),
        (at(V, "properties[nil]", "properties"), REQUIRED), (at(V, "properties[empty]", "properties"), REQUIRED)),
    upstream_crd("x-kubernetes-embedded-resource inside resource meta", crd(obj(embedded={
        "type": "object", "x-kubernetes-embedded-resource": True, "properties": {
            "metadata": {"type": "object", "x-kubernetes-embedded-resource": True,
                         "x-kubernetes-preserve-unknown-fields": True},
            "apiVersion": {"type": "string", "properties": {"foo": {
                "type": "object", "x-kubernetes-embedded-resource": True,
                "x-kubernetes-preserve-unknown-fields": True}}},
            "kind": {"type": "string", "properties": {"foo": {
                "type": "object", "x-kubernetes-embedded-resource": True,
                "x-kubernetes-preserve-unknown-fields": True}}}}})),
        (at(V, "properties[embedded]", "properties[metadata]", "x-kubernetes-embedded-resource"), FORBIDDEN),
        (at(V, "properties[embedded]", "properties[apiVersion]", "properties[foo]", "x-kubernetes-embedded-resource"),
         FORBIDDEN),
        (at(V, "properties[embedded]", "properties[kind]", "properties[foo]", "x-kubernetes-embedded-resource"),
         FORBIDDEN)),
    upstream_crd("x-kubernetes-validations access metadata name", crd(versions=[{
        "name": "version", "served": True, "storage": True, "subresources": {"status": {}},
        "schema": {"openAPIV3Schema": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "x-kubernetes-validations": [{"rule": "size(self.metadata.name) > 3"}],
            "properties": {"metadata": {"type": "object", "properties": {"name": {"type": "string"}}}}}}}])),
    upstream_crd("additionalProperties at resource root", crd(obj(
        embedded1={"type": "object", "x-kubernetes-embedded-resource": True,
                   "additionalProperties": {"type": "string"}},
        embedded2={"type": "object", "x-kubernetes-embedded-resource": True,
                   "x-kubernetes-preserve-unknown-fields": True, "additionalProperties": {"type": "string"}})),
        (at(V, "properties[embedded1]", "additionalProperties"), FORBIDDEN),
        (at(V, "properties[embedded1]", "properties"), REQUIRED),
        (at(V, "properties[embedded2]", "additionalProperties"), FORBIDDEN)),
    upstream_crd("v1.15 era tests for metadata defaults", crd(versions=[
        {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": obj(
            metadata={"type": "object", "default": {"name": "foo"}},
            embedded={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "metadata": {"type": "object", "default": {"name": "foo", "unknown": 42}}}})}},
        {"name": "v2", "served": True, "storage": False, "schema": {"openAPIV3Schema": obj(
            metadata=obj(name={"type": "string", "default": "foo"}),
            embedded={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "apiVersion": {"type": "string", "default": "v1"}, "kind": {"type": "string", "default": "Pod"},
                "metadata": obj(name={"type": "string", "default": "foo"})}})}},
        {"name": "v3", "served": True, "storage": False, "schema": {"openAPIV3Schema": obj(
            embedded={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "apiVersion": {"type": "string", "default": "v1"}, "kind": {"type": "string", "default": "%"},
                "metadata": {"type": "object", "default": {"labels": {"bar": "x y"}}}}})}},
        {"name": "v4", "served": True, "storage": False, "schema": {"openAPIV3Schema": obj(
            embedded={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "metadata": obj(name={"type": "string", "default": 42},
                                labels=obj(bar={"type": "string", "default": 42}))}})}}]),
        ("spec.versions[0].schema.openAPIV3Schema.properties[metadata].default", FORBIDDEN),
        ("spec.versions[1].schema.openAPIV3Schema.properties[metadata].properties[name].default", FORBIDDEN),
        ("spec.versions[2].schema.openAPIV3Schema.properties[embedded].properties[metadata].default", INVALID),
        ("spec.versions[2].schema.openAPIV3Schema.properties[embedded].properties[kind].default", INVALID),
        ("spec.versions[3].schema.openAPIV3Schema.properties[embedded].properties[metadata].properties[labels]"
         ".properties[bar].default", INVALID),
        ("spec.versions[3].schema.openAPIV3Schema.properties[embedded].properties[metadata].properties[name].default",
         INVALID)),
    upstream_crd("default inside additionalSchema", crd(obj(embedded={
        "type": "object", "x-kubernetes-embedded-resource": True, "properties": {"metadata": obj(annotations={
            "type": "object", "additionalProperties": {"type": "string", "default": "abc"}})}})),
        (at(V, "properties[embedded]", "properties[metadata]", "properties[annotations]", "additionalProperties",
            "default"), FORBIDDEN)),
    upstream_crd("top-level metadata default", crd(obj(metadata={"type": "object", "default": {"name": "foo"}})),
                 (at(V, "properties[metadata]", "default"), FORBIDDEN)),
    # A selection of the properties of the upstream case, with their expected errors.
    upstream_crd("embedded metadata defaults", crd(obj(**{
        "embedded": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
            "metadata": {"type": "object", "default": {"name": "foo"}}}},
        "allowed-object-defaults": {**EMBEDDED_OBJECT, "default": POD_META},
        "unknown-field-object-defaults": {**EMBEDDED_OBJECT, "default": {**POD_META, "unknown": 42}},
        "wrongly-typed-object-defaults-kind": {**EMBEDDED_OBJECT, "default": {"kind": 42}},
        "wrongly-typed-object-defaults-name": {**EMBEDDED_OBJECT, "default": {"metadata": {"name": 42}}},
        "invalid-object-defaults-labels": {**EMBEDDED_OBJECT, "default": {
            "apiVersion": "foo/v1", "kind": "Foo", "metadata": {"labels": {"foo": "x y"}}}},
        "object-defaults-with-invalid-constraints-kind": {
            "type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "apiVersion": {"type": "string", "enum": ["foo/v1"]}, "kind": {"type": "string", "enum": ["Foo"]}},
            "default": {"apiVersion": "foo/v1", "kind": "Bar", "metadata": {"name": "foo"}}},
        "object-defaults-with-missing-typemeta": {
            "type": "object", "x-kubernetes-embedded-resource": True, "properties": {
                "apiVersion": {"type": "string", "enum": ["foo/v1"]}, "kind": {"type": "string", "enum": ["Foo"]}},
            "default": {"metadata": {"name": "bar"}}}})),
        (at(V, "properties[unknown-field-object-defaults]", "default"), INVALID),
        (at(V, "properties[wrongly-typed-object-defaults-kind]", "default", "kind"), INVALID),
        (at(V, "properties[wrongly-typed-object-defaults-name]", "default", "metadata"), INVALID),
        (at(V, "properties[invalid-object-defaults-labels]", "default", "metadata", "labels"), INVALID),
        (at(V, "properties[object-defaults-with-invalid-constraints-kind]", "default", "kind"), NOT_SUPPORTED),
        (at(V, "properties[object-defaults-with-missing-typemeta]", "default", "apiVersion"), REQUIRED),
        (at(V, "properties[object-defaults-with-missing-typemeta]", "default", "kind"), REQUIRED)),
    upstream_crd("contradicting meta field types", crd(obj(
        apiVersion={"type": "number"}, kind={"type": "number"},
        metadata={"type": "number", "properties": {"name": {"type": "string", "pattern": "abc"},
                                                   "generateName": {"type": "string", "pattern": "abc"},
                                                   "generation": {"type": "integer"}}},
        valid={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "metadata": obj(name={"type": "string", "pattern": "abc"},
                            generation={"type": "integer", "minimum": 42.0})}},
        invalid={"type": "object", "x-kubernetes-embedded-resource": True, "properties": {
            "apiVersion": {"type": "number"}, "kind": {"type": "number"}, "metadata": {"type": "number"}}},
        noEmbeddedObject=obj(apiVersion={"type": "number"}, kind={"type": "number"}, metadata={"type": "number"}))),
        (at(V, "properties[metadata]"), FORBIDDEN), (at(V, "properties[apiVersion]", "type"), INVALID),
        (at(V, "properties[kind]", "type"), INVALID), (at(V, "properties[metadata]", "type"), INVALID),
        (at(V, "properties[invalid]", "properties[apiVersion]", "type"), INVALID),
        (at(V, "properties[invalid]", "properties[kind]", "type"), INVALID),
        (at(V, "properties[invalid]", "properties[metadata]", "type"), INVALID)),
    upstream_crd("x-kubernetes-validations should be forbidden under oneOf/anyOf/allOf/not, structural schema", crd(obj(
        a={"type": "number", "not": {"x-kubernetes-validations": [{"rule": "should be forbidden"}]},
           **{j: [{"x-kubernetes-validations": [{"rule": "should be forbidden"}]}] for j in ("anyOf", "allOf", "oneOf")}
           })),
        (at(V, "properties[a]", "not", "x-kubernetes-validations"), FORBIDDEN),
        (at(V, "properties[a]", "allOf[0]", "x-kubernetes-validations"), FORBIDDEN),
        (at(V, "properties[a]", "anyOf[0]", "x-kubernetes-validations"), FORBIDDEN),
        (at(V, "properties[a]", "oneOf[0]", "x-kubernetes-validations"), FORBIDDEN)),
    upstream_crd("x-kubernetes-validations should have valid reason and fieldPath", crd({
        "type": "object", "x-kubernetes-validations": [{"rule": "self.a > 0", "reason": "InternalError",
                                                        "fieldPath": ".a"}],
        "properties": {"a": {"type": "number", "x-kubernetes-validations": [
            {"rule": "true", "reason": r} for r in ("FieldValueRequired", "FieldValueInvalid", "FieldValueDuplicate",
                                                    "FieldValueForbidden")]}}}),
        (at(V, "x-kubernetes-validations[0]", "reason"), NOT_SUPPORTED)),
    upstream_crd("x-kubernetes-validations should have valid fieldPath for array", crd({
        "type": "object",
        "x-kubernetes-validations": [{"rule": "true", "fieldPath": p} for p in (
            ".foo['b.c']['c\\a']", "['a.c']", ".a.c", ".list[0]", "   ", ".", "..")],
        "properties": {"a.c": {"type": "number"}, "foo": obj(**{"b.c": obj(**{"c\a": {"type": "number"}})}),
                       "list": {"type": "array", "items": obj(a={"type": "number"})}}}),
        *[(at(V, f"x-kubernetes-validations[{i}]", "fieldPath"), INVALID) for i in (2, 3, 4, 4, 5, 6)]),
    upstream_crd("x-kubernetes-validations have invalid fieldPath", crd({
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.a.b.c > 0.0", "fieldPath": p} for p in (
            ".list[0].b", ".list[0.b", ".list0].b", ".a.c", ".a.b.d")],
        "properties": {"a": obj(b=obj(c={"type": "number"})),
                       "list": {"type": "array", "items": obj(a={"type": "number"})}}}),
        *[(at(V, f"x-kubernetes-validations[{i}]", "fieldPath"), INVALID) for i in range(5)]),
    upstream_crd("valid name printer column formats", PRINTER_FORMATS_CRD),
    # Adapted: v1 requires conversionReviewVersions, which the upstream test fills in itself.
    upstream_crd("webhookconfig: both service and URL provided", crd(
        versions=two_versions({"type": "object"}, {"type": "object"}), scope="Cluster", conversion={
            "strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1beta1"], "clientConfig": {
                "url": "https://example.com/webhook", "service": {"name": "n", "namespace": "ns"}}}}),
        ("spec.conversion.webhookClientConfig", REQUIRED)),
]


@pytest.mark.parametrize(("resource", "expected"), CRD_CASES)
def test_crd_gets_upstream_errors(resource: Obj, expected: list[tuple[str, str]]) -> None:
    assert found(crd_field_errors(resource, beyond_upstream=False)) == expected


# --------------------------------------------------------------------------------------------------------------------
# validation_test.go TestValidateCustomResourceDefinitionValidation: one schema under chosen validationOptions.

NONE = SchemaOptions(allow_defaults=False, require_structural_schema=False, require_valid_property_type=False,
                     require_pruned_defaults=False, require_atomic_set_type=False,
                     require_map_list_keys_map_set_validation=False)  # upstream's zero validationOptions
STRUCTURAL = replace(NONE, require_structural_schema=True)
ATOMIC_SET = replace(NONE, require_atomic_set_type=True)
MAP_KEYS = replace(NONE, require_map_list_keys_map_set_validation=True)
S = "spec.validation.openAPIV3Schema"


def upstream_schema(name: str, schema: Obj, *expected: tuple[str, str], options: SchemaOptions = NONE,
                    status: bool = False) -> Any:
    return pytest.param(schema, options, status, sorted(expected),
                        id=f"validation_test.go:TestValidateCustomResourceDefinitionValidation/{name}")


def list_map(items: Obj, keys: list[str] | None = None, **extra: Any) -> Obj:
    return {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": keys or ["key"],
            "items": items, **extra}


def rules(*entries: Obj, **schema: Any) -> Obj:
    return {**schema, "x-kubernetes-validations": list(entries)}


SCHEMA_CASES = [
    upstream_schema("root type having invalid value, with status", {"type": "string"}, (at(S, "type"), INVALID),
                    status=True),
    upstream_schema("non-allowed root field with status", {"anyOf": [{"description": "First schema"},
                                                                     {"description": "Second schema"}]},
                    (S, INVALID), status=True),
    upstream_schema("all allowed fields at the root of the schema with status", VALID_SCHEMA, status=True),
    upstream_schema("null type", {"properties": {"null": {"type": "null"}}}, (at(S, "properties[null]", "type"),
                                                                               FORBIDDEN)),
    upstream_schema("nullable at the root", {"type": "object", "nullable": True}, (at(S, "nullable"), FORBIDDEN)),
    upstream_schema("must be structural, but isn't", {}, (at(S, "type"), REQUIRED), options=STRUCTURAL),
    upstream_schema("require valid types, invalid", {"type": "null"}, (at(S, "type"), NOT_SUPPORTED),
                    (at(S, "type"), FORBIDDEN), (at(S, "type"), INVALID),
                    options=replace(STRUCTURAL, require_valid_property_type=True)),
    upstream_schema("invalid type with list type extension set", {"type": "object", "x-kubernetes-list-type": "set"},
                    (at(S, "type"), INVALID)),
    upstream_schema("unset type with list type extension set", {"x-kubernetes-list-type": "set"},
                    (at(S, "type"), REQUIRED)),
    upstream_schema("invalid list type extension", {"type": "array", "x-kubernetes-list-type": "invalid"},
                    (at(S, "x-kubernetes-list-type"), NOT_SUPPORTED)),
    upstream_schema("invalid list type extension with list map keys extension non-empty", {
        "type": "array", "x-kubernetes-list-type": "set", "x-kubernetes-list-map-keys": ["key"]},
        (at(S, "x-kubernetes-list-type"), INVALID)),
    upstream_schema("unset list type extension with list map keys extension non-empty",
                    {"x-kubernetes-list-map-keys": ["key"]}, (at(S, "x-kubernetes-list-type"), REQUIRED)),
    upstream_schema("empty list map keys extension with list type extension map",
                    {"type": "array", "x-kubernetes-list-type": "map"},
                    (at(S, "x-kubernetes-list-map-keys"), REQUIRED), (at(S, "items"), REQUIRED)),
    upstream_schema("multiple schema items with list type extension map",
                    list_map([{"type": "string"}, {"type": "integer"}]),
                    (at(S, "items"), FORBIDDEN), (at(S, "items"), INVALID)),
    upstream_schema("non object item with list type extension map", list_map({"type": "string"}),
                    (at(S, "items", "type"), INVALID)),
    upstream_schema("items with key missing from properties with list type extension map",
                    list_map({"type": "object"}), (at(S, "x-kubernetes-list-map-keys"), INVALID)),
    upstream_schema("items with non scalar key property type with list type extension map",
                    list_map(obj(key={"type": "object"})), (at(S, "items", "properties[key]", "type"), INVALID)),
    upstream_schema("duplicate map keys with list type extension map",
                    list_map(obj(key={"type": "string"}), ["key", "key"]),
                    (at(S, "x-kubernetes-list-map-keys"), INVALID)),
    upstream_schema("allowed schema with list type extension map",
                    list_map(obj(keyA={"type": "string"}, keyB={"type": "integer"}), ["keyA", "keyB"])),
    upstream_schema("allowed list-type set with atomic map items", {
        "type": "array", "x-kubernetes-list-type": "set",
        "items": {**obj(foo={"type": "string"}), "x-kubernetes-map-type": "atomic"}}, options=ATOMIC_SET),
    upstream_schema("invalid list-type set with non-atomic map items", {
        "type": "array", "x-kubernetes-list-type": "set",
        "items": {**obj(foo={"type": "string"}), "x-kubernetes-map-type": "granular"}},
        (at(S, "items", "x-kubernetes-map-type"), INVALID), options=ATOMIC_SET),
    upstream_schema("invalid list-type set with unspecified map-type for map items", {
        "type": "array", "x-kubernetes-list-type": "set", "items": obj(foo={"type": "string"})},
        (at(S, "items", "x-kubernetes-map-type"), INVALID), options=ATOMIC_SET),
    upstream_schema("invalid list-type set with with non-atomic list items", {
        "type": "array", "x-kubernetes-list-type": "set",
        "items": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}},
        (at(S, "items", "x-kubernetes-list-type"), INVALID), options=ATOMIC_SET),
    upstream_schema("invalid type with map type extension (granular)", {"type": "array",
                                                                         "x-kubernetes-map-type": "granular"},
                    (at(S, "type"), INVALID)),
    upstream_schema("unset type with map type extension (atomic)", {"x-kubernetes-map-type": "atomic"},
                    (at(S, "type"), REQUIRED)),
    upstream_schema("invalid map type", {"type": "object", "x-kubernetes-map-type": "invalid"},
                    (at(S, "x-kubernetes-map-type"), NOT_SUPPORTED)),
    upstream_schema("invalid map with non-required key and no default", list_map(obj(key={"type": "string"})),
                    (at(S, "items", "properties[key]", "default"), REQUIRED), options=MAP_KEYS),
    upstream_schema("allowed map with required key and no default",
                    list_map({**obj(key={"type": "string"}), "required": ["key"]}), options=MAP_KEYS),
    upstream_schema("invalid map with nullable key", list_map(obj(key={"type": "string", "nullable": True})),
                    (at(S, "items", "properties[key]", "default"), REQUIRED),
                    (at(S, "items", "properties[key]", "nullable"), FORBIDDEN), options=MAP_KEYS),
    upstream_schema("invalid map with nullable items", list_map({**obj(key={"type": "string"}), "nullable": True}),
                    (at(S, "items", "nullable"), FORBIDDEN), (at(S, "items", "properties[key]", "default"), REQUIRED),
                    options=MAP_KEYS),
    upstream_schema("valid map with some required, some defaulted, and non-key fields", list_map(
        {**obj(key={"type": "string"}, a={"type": "string"}, b={"type": "string", "default": "stuff"},
               c={"type": "int"}), "required": ["a", "c"]}, ["a"]),
        (at(S, "items", "properties[b]", "default"), FORBIDDEN), options=MAP_KEYS),
    upstream_schema("invalid set with nullable items", {"type": "array", "x-kubernetes-list-type": "set",
                                                         "items": {"nullable": True}},
                    (at(S, "items", "nullable"), FORBIDDEN), options=MAP_KEYS),
    upstream_schema("invalid x-kubernetes-validations with empty rule", rules({"message": "empty rule"},
                                                                             type="object"),
                    (at(S, "x-kubernetes-validations[0]", "rule"), REQUIRED), options=STRUCTURAL),
    upstream_schema("valid x-kubernetes-validations with empty validators", rules(type="object"), options=STRUCTURAL),
    upstream_schema("invalid x-kubernetes-validations for unknown property",
                    rules({"rule": "self.unknownProp > 0"}, type="object"),
                    (at(S, "x-kubernetes-validations[0]", "rule"), INVALID), options=STRUCTURAL),
    upstream_schema("rule is empty or not specified", obj(value=rules(
        {"message": "something"}, {"rule": "   ", "message": "something"}, type="integer")),
        (at(S, "properties[value]", "x-kubernetes-validations[0]", "rule"), REQUIRED),
        (at(S, "properties[value]", "x-kubernetes-validations[1]", "rule"), REQUIRED)),
    upstream_schema("multiline rule with message", obj(value=rules(
        {"rule": "self >= 0 &&\nself <= 100", "message": "value must be between 0 and 100 (inclusive)"},
        type="integer"))),
    upstream_schema("invalid and required messages", obj(value=rules(
        {"rule": "self >= 0 &&\nself <= 100"},
        {"rule": "self == 50", "message": "value requirements:\nmust be >= 0\nmust be <= 100 "},
        {"rule": "self == 50", "message": " "}, type="integer")),
        (at(S, "properties[value]", "x-kubernetes-validations[0]", "message"), REQUIRED),
        (at(S, "properties[value]", "x-kubernetes-validations[1]", "message"), INVALID),
        (at(S, "properties[value]", "x-kubernetes-validations[2]", "message"), INVALID)),
    upstream_schema("forbid transition rule on element of list of type atomic", obj(value={
        "type": "array", "x-kubernetes-list-type": "atomic",
        "items": rules({"rule": "self == oldSelf"}, type="string", maxLength=10)}),
        (at(S, "properties[value]", "items", "x-kubernetes-validations[0]", "rule"), INVALID), options=STRUCTURAL),
    upstream_schema("forbid transition rule on element of list of type set", obj(value={
        "type": "array", "maxItems": 10, "x-kubernetes-list-type": "set",
        "items": rules({"rule": "self == oldSelf"}, type="string", maxLength=10)}),
        (at(S, "properties[value]", "items", "x-kubernetes-validations[0]", "rule"), INVALID), options=STRUCTURAL),
    upstream_schema("allow transition rule on element of list of type map", obj(value=list_map(
        {**rules({"rule": "self == oldSelf"}, **obj(name={"type": "string", "maxLength": 5})), "required": ["name"]},
        ["name"])), options=STRUCTURAL),
    upstream_schema("skip CEL expression validation when OpenAPIv3 schema is an invalid structural schema", rules(
        {"rule": "self.invalidFieldName > 50"}, **obj(field={"type": "integer"}),
        additionalProperties={"type": "string"}),
        (at(S, "additionalProperties"), FORBIDDEN), (at(S, "additionalProperties"), FORBIDDEN), options=STRUCTURAL),
    upstream_schema("skip CEL expression validation when OpenAPIv3 schema is an invalid structural schema at level "
                    "below", rules({"rule": "self.invalidFieldName > 50"}, **obj(field={
                        **obj(field={"type": "integer"}), "additionalProperties": {"type": "string"}})),
                    (at(S, "properties[field]", "additionalProperties"), FORBIDDEN), options=STRUCTURAL),
    upstream_schema("x-kubernetes-validations rule allows both message and messageExpression", obj(f=rules(
        {"rule": 'self == "string value"', "message": 'string should be set to "string value"',
         "messageExpression": 'self + " should be \\"string value\\""'}, type="string")), options=STRUCTURAL),
    upstream_schema("x-kubernetes-validations rule invalidated by messageExpression syntax error", obj(f=rules(
        {"rule": 'self == "string value"', "messageExpression": 'self + " '}, type="string")),
        (at(S, "properties[f]", "x-kubernetes-validations[0]", "messageExpression"), INVALID), options=STRUCTURAL),
    upstream_schema("x-kubernetes-validations rule invalidated by messageExpression being only empty spaces",
                    obj(f=rules({"rule": 'self == "string value"', "messageExpression": "     "}, type="string")),
                    (at(S, "properties[f]", "x-kubernetes-validations[0]", "messageExpression"), REQUIRED),
                    options=STRUCTURAL),
    upstream_schema("forbid setting optionalOldSelf to true if oldSelf is not used", obj(value=rules(
        {"rule": 'self == "foo"', "optionalOldSelf": True}, type="string", maxLength=10)),
        (at(S, "properties[value]", "x-kubernetes-validations[0]", "optionalOldSelf"), INVALID), options=STRUCTURAL),
]


@pytest.mark.parametrize(("schema", "options", "status", "expected"), SCHEMA_CASES)
def test_schema_gets_upstream_errors(schema: Obj, options: SchemaOptions, status: bool,
                                     expected: list[tuple[str, str]]) -> None:
    errors = schema_errors({"openAPIV3Schema": schema}, "spec.validation", status_enabled=status, options=options)
    assert found(errors) == expected


# --------------------------------------------------------------------------------------------------------------------
# pkg/apiserver/schema/validation_test.go: ValidateStructural and its parts, with upstream's exact messages.

STRING = {"type": "string"}


def test_root_metadata_of_another_type_than_object_is_invalid() -> None:
    # validation_test.go TestValidateStructuralMetadataInvariants "check that type must be object"
    errors = structural_errors(obj(metadata={"type": "string"}))
    assert [str(e) for e in errors] == ['properties[metadata].type: Invalid value: "string": must be object']


@pytest.mark.parametrize(("properties", "forbidden"), [
    ({"name": STRING}, False), ({"generateName": STRING}, False), ({"name": STRING, "generateName": STRING}, False),
    ({"labels": STRING}, True), ({"namespace": STRING}, True), ({"name": STRING, "uid": STRING}, True),
], ids=["name", "generateName", "name and generateName", "labels", "namespace", "name and uid"])
def test_root_metadata_may_restrict_only_name_and_generate_name(properties: Obj, forbidden: bool) -> None:
    # validation_test.go TestValidateStructuralMetadataInvariants "anything other than name and generateName of
    # ObjectMeta in metadata properties is forbidden".
    errors = structural_errors(obj(metadata={"type": "object", "properties": properties}))
    expected = [("properties[metadata]", FORBIDDEN)] if forbidden else []
    assert found(errors) == expected


@pytest.mark.parametrize("extra", [
    {"description": "ObjectMeta"}, {"title": "t"}, {"nullable": True}, {"example": {}}, {"externalDocs": {}},
    {"required": []}, {"x-kubernetes-validations": []}, {"x-kubernetes-map-type": "atomic"}, {"maxProperties": 3},
    {"additionalProperties": {"type": "string"}}, {"x-kubernetes-preserve-unknown-fields": True},
], ids=lambda extra: next(iter(extra)))
def test_root_metadata_with_anything_but_type_and_name_properties_is_forbidden(extra: Obj) -> None:
    # validation_test.go TestValidateStructuralMetadataInvariants "anything other than type and properties in
    # metadata is forbidden" (empty but present lists count, as Go's DeepEqual tells nil from empty slices).
    errors = structural_errors(obj(metadata={"type": "object", **extra}))
    assert ("properties[metadata]", FORBIDDEN) in found(errors)


@pytest.mark.parametrize(("schema", "options", "expected"), [
    pytest.param({"additionalProperties": obj(bar={"type": "string"}),
                  "allOf": [{"properties": {"foo": {"minLength": 2}}}]},
                 StructuralOptions(allow_validation_properties_with_additional_properties=True), [],
                 id="validation_test.go:TestValidateStructuralCompleteness/allowed properties valuevalidation, "
                    "additional properties structure"),
    pytest.param({"additionalProperties": obj(bar={"type": "string"}),
                  "allOf": [{"properties": {"foo": {"minLength": 2}}}]}, StructuralOptions(),
                 ["properties[foo]: Required value: because it is defined in allOf[0].properties[foo]"],
                 id="validation_test.go:TestValidateStructuralCompleteness/disallowed properties valuevalidation, "
                    "additional properties structure"),
    pytest.param({"properties": {"bar": {"type": "string"}}, "allOf": [{"additionalProperties": {"minLength": 2}}]},
                 StructuralOptions(allow_nested_additional_properties=True),
                 ["additionalProperties: Required value: because it is defined in allOf[0].additionalProperties"],
                 id="validation_test.go:TestValidateStructuralCompleteness/disallowed additionalproperties "
                    "valuevalidation, properties structure"),
    pytest.param({"properties": {"foo": {"type": "string"}}, "allOf": [{"properties": {"foo": {"minLength": 2}}}]},
                 StructuralOptions(), [],
                 id="validation_test.go:TestValidateStructuralCompleteness/allowed property in valuevalidation, and "
                    "in structure"),
    pytest.param({"properties": {"foo": {"type": "string"}}, "allOf": [{"properties": {"notfoo": {"minLength": 2}}}]},
                 StructuralOptions(),
                 ["properties[notfoo]: Required value: because it is defined in allOf[0].properties[notfoo]"],
                 id="validation_test.go:TestValidateStructuralCompleteness/disallowed property in valuevalidation, "
                    "and in structure"),
    pytest.param({"type": "array", "items": {"type": "string"}, "allOf": [{"items": {"minLength": 2}}]},
                 StructuralOptions(), [],
                 id="validation_test.go:TestValidateStructuralCompleteness/allowed items in valuevalidation, and in "
                    "structure"),
    pytest.param({**obj(foo={"type": "string"}), "allOf": [{"items": {"minLength": 2}}]}, StructuralOptions(),
                 ["items: Required value: because it is defined in allOf[0].items"],
                 id="validation_test.go:TestValidateStructuralCompleteness/disallowed items in valuevalidation, and "
                    "not in structure"),
])
def test_value_validations_need_their_fields_in_the_structural_schema(schema: Obj, options: StructuralOptions,
                                                                      expected: list[str]) -> None:
    assert [str(e) for e in completeness_errors(schema, options=options)] == expected


def test_generic_and_extension_keys_are_forbidden_inside_junctors() -> None:
    # validation_test.go TestValidateNestedValueValidationComplete: every forbidden generic and extension field
    nested = {"type": "string", "default": "x", "title": "t", "description": "d", "nullable": True,
              "x-kubernetes-preserve-unknown-fields": True, "x-kubernetes-embedded-resource": True,
              "x-kubernetes-int-or-string": True, "x-kubernetes-list-map-keys": ["k"],
              "x-kubernetes-list-type": "atomic", "x-kubernetes-map-type": "atomic",
              "x-kubernetes-validations": [{"rule": "true"}], "additionalProperties": True, "example": "x",
              "externalDocs": {"url": "https://example.com"}}
    errors = structural_errors({"type": "object", "allOf": [nested]})
    assert [str(e) for e in errors] == [
        "allOf[0].additionalProperties: Forbidden: must be undefined to be structural",
        "allOf[0].default: Forbidden: must be undefined to be structural",
        "allOf[0].description: Forbidden: must be empty to be structural",
        "allOf[0].nullable: Forbidden: must be false to be structural",
        "allOf[0].title: Forbidden: must be empty to be structural",
        "allOf[0].type: Forbidden: must be empty to be structural",
        "allOf[0].x-kubernetes-embedded-resource: Forbidden: must be false to be structural",
        "allOf[0].x-kubernetes-int-or-string: Forbidden: must be false to be structural",
        "allOf[0].x-kubernetes-list-map-keys: Forbidden: must be empty to be structural",
        "allOf[0].x-kubernetes-list-type: Forbidden: must be undefined to be structural",
        "allOf[0].x-kubernetes-map-type: Forbidden: must be undefined to be structural",
        "allOf[0].x-kubernetes-preserve-unknown-fields: Forbidden: must be false to be structural",
        "allOf[0].x-kubernetes-validations: Forbidden: must be empty to be structural",
    ]


def test_metadata_is_forbidden_in_a_nested_context() -> None:
    errors = structural_errors({**obj(metadata={"type": "object"}), "anyOf": [{"properties": {"metadata": {}}}]})
    assert [str(e) for e in errors] == [
        "anyOf[0].properties[metadata]: Forbidden: must not be specified in a nested context"]


@pytest.mark.parametrize(("schema", "expected"), [
    ({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}, []),
    ({"x-kubernetes-int-or-string": True, "allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]},
                                                    {"minLength": 1}]}, []),
    ({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "string"}, {"type": "integer"}]},
     [("properties[v].anyOf[0].type", FORBIDDEN), ("properties[v].anyOf[1].type", FORBIDDEN)]),
    ({"x-kubernetes-int-or-string": True, "x-kubernetes-preserve-unknown-fields": True},
     [("properties[v].x-kubernetes-preserve-unknown-fields", INVALID)]),
    ({"x-kubernetes-int-or-string": True, "type": "object", "x-kubernetes-embedded-resource": True,
      "properties": {"a": {"type": "string"}}},
     [("properties[v].x-kubernetes-embedded-resource", INVALID)]),
    ({"x-kubernetes-embedded-resource": True, "x-kubernetes-preserve-unknown-fields": True},
     [("properties[v].type", REQUIRED)]),
    ({}, [("properties[v].type", REQUIRED)]),
    ({"x-kubernetes-preserve-unknown-fields": True}, []),
    ({"type": "array"}, [("properties[v].items", REQUIRED)]),
], ids=["int-or-string anyOf", "int-or-string allOf-anyOf", "int-or-string anyOf swapped",
        "int-or-string and preserve", "int-or-string and embedded", "embedded without type", "no type",
        "no type but preserve", "array without items"])
def test_int_or_string_preserve_and_embedded_extensions_are_consistent(schema: Obj,
                                                                       expected: list[tuple[str, str]]) -> None:
    # The two int-or-string shapes are those ValidateStructural documents in validation.go (its unit tests have no
    # case for them); embedded resources are covered by the TestValidateCustomResourceDefinition cases above.
    assert found(structural_errors(obj(v=schema))) == sorted(expected)


def test_pattern_must_be_a_go_regular_expression() -> None:
    errors = structural_errors(obj(a={"type": "string", "pattern": "^(?!x)"}))
    assert [(e.path, e.type, e.value) for e in errors] == [("properties[a].pattern", INVALID, "^(?!x)")]
    assert "invalid or unsupported Perl syntax" in errors[0].detail


# --------------------------------------------------------------------------------------------------------------------
# Defaults against their schema (pkg/apiserver/validation and defaulting/validation.go), with upstream's wording.

D = "properties[v].default"


# kube-openapi names the value being validated "" (hence "Invalid value: ...:  in body"), a property by its
# dotted path from there and an item by its index.
@pytest.mark.parametrize(("schema", "default", "expected"), [
    ({"type": "integer"}, "x", [f'{D}: Invalid value: "string":  in body must be of type integer: "string"']),
    ({"type": "string", "enum": ["a", "b"]}, "c", [f'{D}: Unsupported value: "c": supported values: "a", "b"']),
    ({"type": "string", "maxLength": 2}, "abc", [f"{D}: Too long: may not be more than 2 bytes"]),
    ({"type": "string", "minLength": 2}, "a", [f'{D}: Invalid value: "a":  in body should be at least 2 chars long']),
    ({"type": "integer", "minimum": 1}, 0, [f"{D}: Invalid value: 0:  in body should be greater than or equal to 1"]),
    ({"type": "number", "maximum": 1, "exclusiveMaximum": True}, 1,
     [f"{D}: Invalid value: 1:  in body should be less than 1"]),
    ({"type": "integer", "multipleOf": 3}, 4, [f"{D}: Invalid value: 4:  in body should be a multiple of 3"]),
    ({"type": "array", "items": {"type": "string"}, "maxItems": 1}, ["a", "b"],
     [f"{D}: Too many: 2: must have at most 1 item"]),
    (obj(list={"type": "array", "items": {"type": "integer"}}), {"list": [1, "x"]},
     [f'{D}.list[1]: Invalid value: "string": list[1] in body must be of type integer: "string"']),
    ({**obj(a={"type": "string"}), "required": ["a", "b"]}, {"a": "x"}, [f"{D}.b: Required value"]),
    ({"type": "string", "format": "date-time"}, "yesterday",
     [f'{D}: Invalid value: "yesterday":  in body must be of type date-time: "yesterday"']),
    ({"x-kubernetes-int-or-string": True}, 1.5,
     [f'{D}: Invalid value: "number":  in body must be of type integer,string: "number"']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"k": "x"},
     [f'{D}.k: Invalid value: "string": .k in body must be of type integer: "string"']),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 1}]}, 3,
     [f'{D}: Invalid value: "": "" must validate at least one schema (anyOf)',
      f"{D}: Invalid value: 3:  in body should be greater than or equal to 5"]),
], ids=["type", "enum", "maxLength", "minLength", "minimum", "exclusiveMaximum", "multipleOf", "maxItems", "items",
        "required", "format", "int-or-string", "additionalProperties", "anyOf"])
def test_default_must_validate_against_its_schema(schema: Obj, default: Any, expected: list[str]) -> None:
    errors = default_errors(obj(v={**schema, "default": default}))
    assert [str(e) for e in errors] == expected


def test_type_errors_are_reported_with_the_json_type_of_the_value() -> None:
    # validation/validation_test.go TestValidateCustomResource "enum": the type and the enum both fail.
    schema = obj(field={**obj(nestedint={"type": "integer", "enum": [1, 2]},
                              nestedstring={"type": "string", "enum": ["a", "b"]}),
                        "required": ["nestedint", "nestedstring"]})
    errors = value_errors({"field": {"nestedint": "x", "nestedstring": True}}, schema)
    assert sorted(map(str, errors)) == [
        'field.nestedint: Invalid value: "string": field.nestedint in body must be of type integer: "string"',
        'field.nestedint: Unsupported value: "x": supported values: "1", "2"',
        'field.nestedstring: Invalid value: "boolean": field.nestedstring in body must be of type string: "boolean"',
        'field.nestedstring: Unsupported value: true: supported values: "a", "b"',
    ]


def test_defaults_are_forbidden_when_unknown_fields_are_preserved_crd_wide() -> None:
    resource = crd(obj(a={"type": "integer", "default": 1}), preserveUnknownFields=True)
    assert [str(e) for e in crd_field_errors(resource, beyond_upstream=False)] == [
        "spec.preserveUnknownFields: Invalid value: true: must be false in order to use defaults in the schema",
        "spec.preserveUnknownFields: Invalid value: true: cannot set to true, set x-kubernetes-preserve-unknown-fields "
        "to true in spec.versions[*].schema instead",
    ]


def test_defaults_are_pruned_but_not_under_preserve_unknown_fields() -> None:
    schema = obj(open={"type": "object", "x-kubernetes-preserve-unknown-fields": True, "default": {"anything": 1}},
                 closed={"type": "object", "default": {"anything": 1}})
    assert [str(e) for e in default_errors(schema)] == [
        'properties[closed].default: Invalid value: {"anything":1}: must not have unknown fields']


def test_default_failing_a_cel_rule_of_its_schema_is_reported() -> None:
    pytest.importorskip("celpy")
    schema = obj(replicas=rules({"rule": "self <= 8", "message": "at most 8"}, type="integer", default=9))
    assert [str(e) for e in default_errors(schema)] == ["properties[replicas].default: Invalid value: 9: at most 8"]


# --------------------------------------------------------------------------------------------------------------------
# Printer columns, scale, names, CEL compilation: messages as upstream words them.

@pytest.mark.parametrize(("column", "expected"), [
    ({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}, []),
    ({"type": "string", "jsonPath": ".spec.x"}, ["c.name: Required value"]),
    ({"name": "X", "jsonPath": ".spec.x"},
     ["c.type: Required value: must be one of boolean,date,integer,number,string"]),
    ({"name": "X", "type": "int", "jsonPath": ".spec.x"},
     ['c.type: Invalid value: "int": must be one of boolean,date,integer,number,string']),
    ({"name": "X", "type": "integer", "format": "uint8", "jsonPath": ".spec.x"},
     ['c.format: Invalid value: "uint8": must be one of byte,date,date-time,double,float,int32,int64,password']),
    ({"name": "X", "type": "string", "jsonPath": "spec.x"},
     ['c.JSONPath: Invalid value: "spec.x": must be a simple json path starting with .']),
    ({"name": "X", "type": "string"}, ["c.JSONPath: Required value"]),
], ids=["valid", "no name", "no type", "bad type", "bad format", "path without dot", "no path"])
def test_printer_column_rules(column: Obj, expected: list[str]) -> None:
    assert [str(e) for e in column_errors(column, "c")] == expected


@pytest.mark.parametrize(("scale", "expected"), [
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
      "labelSelectorPath": ".status.selector"}, []),
    ({"statusReplicasPath": ".status.replicas"}, ["s.scale.specReplicasPath: Required value"]),
    ({"specReplicasPath": ".status.replicas", "statusReplicasPath": ".spec.replicas"},
     ['s.scale.specReplicasPath: Invalid value: ".status.replicas": should be a json path under .spec',
      's.scale.statusReplicasPath: Invalid value: ".spec.replicas": should be a json path under .status']),
    ({"specReplicasPath": ".spec", "statusReplicasPath": ".status.replicas"},
     ['s.scale.specReplicasPath: Invalid value: ".spec": should be a json path under .spec']),
    ({"specReplicasPath": "spec.replicas", "statusReplicasPath": ".status.replicas"},
     ['s.scale.specReplicasPath: Invalid value: "spec.replicas": must be a simple json path starting with .']),
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".sel"},
     ['s.scale.labelSelectorPath: Invalid value: ".sel": should be a json path under either .spec or .status']),
], ids=["valid", "no spec path", "swapped", "bare .spec", "no leading dot", "selector outside"])
def test_scale_subresource_paths(scale: Obj, expected: list[str]) -> None:
    assert [str(e) for e in subresources_errors({"scale": scale}, "s")] == expected


def test_names_follow_dns_1035_and_listkind_differs_from_kind() -> None:
    resource = crd({"type": "object"})
    resource["spec"]["names"] = {"plural": "Plurals", "singular": "plural", "kind": "Plural", "listKind": "Plural",
                                 "shortNames": ["p_l"], "categories": ["all", "1st"]}
    resource["metadata"]["name"] = "Plurals.group.com"
    assert found(crd_field_errors(resource, beyond_upstream=False)) == sorted([
        ("metadata.name", INVALID), ("spec.names.plural", INVALID), ("spec.names.listKind", INVALID),
        ("spec.names.shortNames[0]", INVALID), ("spec.names.categories[1]", INVALID)])


def test_cel_rule_that_does_not_parse_is_named_in_the_error() -> None:
    pytest.importorskip("celpy")
    errors = schema_errors({"openAPIV3Schema": obj(a=rules({"rule": "self.size( >"}, type="string"))})
    assert [(e.path, e.type, e.value) for e in errors] == [
        ("spec.validation.openAPIV3Schema.properties[a].x-kubernetes-validations[0].rule", INVALID,
         {"rule": "self.size( >"})]
    assert errors[0].detail.startswith("compilation failed: ")


def test_cel_rules_see_only_name_and_generate_name_of_metadata() -> None:
    pytest.importorskip("celpy")
    schema = rules({"rule": "self.metadata.name.size() > 1"}, {"rule": "has(self.metadata.labels)"},
                   **obj(metadata={"type": "object"}, spec=obj(size={"type": "integer"})))
    errors = schema_errors({"openAPIV3Schema": schema})
    assert [str(e) for e in errors] == [
        'spec.validation.openAPIV3Schema.x-kubernetes-validations[1].rule: Invalid value: '
        '{"rule":"has(self.metadata.labels)"}: compilation failed: undefined field \'labels\'']


def test_cel_optional_field_selection_is_accepted() -> None:
    pytest.importorskip("celpy")
    schema = obj(spec=rules({"rule": "self.?size.orValue(0) >= 0"}, **obj(size={"type": "integer"})))
    assert schema_errors({"openAPIV3Schema": schema}) == []


# --------------------------------------------------------------------------------------------------------------------
# How errors print, and strict decoding.

def test_errors_print_as_apimachinery_field_errors() -> None:
    assert [str(e) for e in (
        FieldError("a.b", REQUIRED, "why"), FieldError("a", FORBIDDEN, "no", "ignored"),
        FieldError("a", INVALID, "bad", "x"), FieldError("a", INVALID, "bad", 1.0), FieldError("a", INVALID, "", True),
        FieldError("a", TYPE_INVALID, "t", "string"), FieldError("a", NOT_SUPPORTED, "supported values: \"b\"", "c"),
        FieldError("a", DUPLICATE, "", ".x"), FieldError("a", TOO_LONG, "may not be more than 2 bytes"),
        FieldError("a", TOO_MANY, "must have at most 8 items", 9), FieldError("a", INVALID, "d", ["k", "k"]),
    )] == [
        "a.b: Required value: why", "a: Forbidden: no", 'a: Invalid value: "x": bad', "a: Invalid value: 1: bad",
        "a: Invalid value: true", 'a: Invalid value: "string": t', 'a: Unsupported value: "c": supported values: "b"',
        'a: Duplicate value: ".x"', "a: Too long: may not be more than 2 bytes",
        "a: Too many: 9: must have at most 8 items", 'a: Invalid value: ["k","k"]: d',
    ]


def test_unknown_keys_are_refused_only_by_strict_decoding() -> None:
    resource = crd(obj(a={"type": "string", "defualt": "x"}))
    resource["spec"]["versions"][0]["servd"] = True
    assert found(crd_field_errors(resource)) == [
        ("spec.versions[0].schema.openAPIV3Schema.properties[a].defualt", UNKNOWN_FIELD),
        ("spec.versions[0].servd", UNKNOWN_FIELD)]
    assert crd_field_errors(resource, strict=False) == []


def test_scalar_of_the_wrong_json_type_cannot_be_decoded() -> None:
    resource = crd(obj(a={"type": "string", "maxLength": "10"}))
    assert found(crd_field_errors(resource)) == [
        ("spec.versions[0].schema.openAPIV3Schema.properties[a].maxLength", TYPE_INVALID)]


# --------------------------------------------------------------------------------------------------------------------
# Beyond the API server: printer-column and scale paths must resolve in the schema.

STATUS = obj(replicas={"type": "integer"}, selector={"type": "string"}, phase={"type": "string"},
             conditions={"type": "array", "items": obj(type={"type": "string"}, status={"type": "string"})},
             tuning={"type": "object", "x-kubernetes-preserve-unknown-fields": True})
RESOURCE = obj(spec=obj(replicas={"type": "integer"}, labels={"type": "object",
                                                              "additionalProperties": {"type": "string"}}),
               status=STATUS)


@pytest.mark.parametrize("path", [
    ".spec.replicas", ".status.conditions[?(@.type==\"Ready\")].status", ".status.conditions[0].type",
    ".status.conditions[*].status", ".status.tuning.anything.below", ".metadata.creationTimestamp",
    ".metadata.labels.app", ".spec.labels.team", ".kind",
])
def test_printer_column_path_resolves(path: str) -> None:
    assert resolve_json_path(path, RESOURCE) is not None


@pytest.mark.parametrize("path", [
    ".spec.replica", ".status.conditions.status", ".status.conditions[?(@.typo==\"Ready\")].status",
    ".status.phase.x", ".metadata.nope",
])
def test_printer_column_path_that_reaches_no_field_does_not_resolve(path: str) -> None:
    assert resolve_json_path(path, RESOURCE) is None


def test_printer_column_outside_the_schema_is_refused_beyond_upstream() -> None:
    # The upstream case "valid name printer column formats" is accepted by the API server, yet its columns
    # .spec.shortName and .spec.longName point where its schema has nothing (the fields are at the root).
    resource = PRINTER_FORMATS_CRD
    assert crd_field_errors(resource, beyond_upstream=False) == []
    assert [(e.path, e.value) for e in beyond_upstream_errors(resource)] == [
        ("spec.versions[0].additionalPrinterColumns[1].jsonPath", ".spec.shortName"),
        ("spec.versions[0].additionalPrinterColumns[2].jsonPath", ".spec.longName")]
    assert all("beyond the API server" in e.detail for e in beyond_upstream_errors(resource))


@pytest.mark.parametrize(("scale", "expected"), [
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
      "labelSelectorPath": ".status.selector"}, []),
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.phase"},
     [("statusReplicasPath", "resolves to a field of type string, but /scale reads an integer there")]),
    ({"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.replicas"},
     [("specReplicasPath", "does not resolve to a field of the version's schema; /scale reads an integer there")]),
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
      "labelSelectorPath": ".status.replicas"},
     [("labelSelectorPath", "resolves to a field of type integer, but /scale reads a string there")]),
    ({"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.tuning.replicas"}, []),
], ids=["valid", "status path to a string", "spec path to nothing", "selector to an integer", "through preserved"])
def test_scale_paths_must_reach_fields_of_the_type_scale_reads(scale: Obj, expected: list[tuple[str, str]]) -> None:
    version = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": RESOURCE},
               "subresources": {"status": {}, "scale": scale}}
    errors = beyond_upstream_errors(crd(versions=[version]))
    assert [(e.path.rsplit(".", 1)[1], e.detail.split(" (")[0]) for e in errors] == expected


# --------------------------------------------------------------------------------------------------------------------
# The project's CRD.

def test_root_metadata_with_a_description_is_refused() -> None:
    # A single-version v1 CRD is reported under spec.validation, as the API server words it for kubectl.
    resource = crd(obj(metadata={"type": "object", "description": "Standard object metadata."}))
    assert crd_errors(resource) == [
        "spec.validation.openAPIV3Schema.properties[metadata]: Forbidden: must not specify anything other than name "
        "and generateName, but metadata is implicitly specified"]


@pytest.mark.parametrize("path", [Path("crds") / FILENAME, Path("charts/governor/crds") / FILENAME], ids=str)
def test_crd_file_would_be_accepted(path: Path) -> None:
    resource = yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))
    assert crd_errors(resource) == []


def test_generated_crd_would_be_accepted() -> None:
    assert crd_errors(crd_manifest()) == []


def test_generated_crd_with_a_broken_default_would_be_refused() -> None:
    # The check above can fail: the same CRD with one default of the wrong type is refused.
    resource = copy.deepcopy(crd_manifest())
    spec = resource["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["replicas"]["default"] = "one"
    assert crd_errors(resource) == [
        'spec.validation.openAPIV3Schema.properties[spec].properties[replicas].default: Invalid value: "string":  '
        'in body must be of type integer: "string"']
