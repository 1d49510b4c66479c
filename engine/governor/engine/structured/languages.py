"""The five ways a request names its output language, as one canonical key and as xgrammar compiles it.

The key is the compile cache's: two requests whose params say the same thing share a compiled grammar. JSON keeps its
properties' order in the key, because the grammar emits properties in the schema's order.
"""

from __future__ import annotations

import json
import re
from typing import Any

from governor.engine.sampling_params import StructuredOutputsParams

LanguageKey = tuple[str, str]
JSON_KINDS = frozenset({"json", "json_object"})

# xgrammar's errors start with a time and the C++ source line ("[01:04:07] /project/cpp/x.cc:83: "), and some with the
# failed check's text; a user needs neither.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")

_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
               "grammar": "EBNF grammar"}


def language_key(params: StructuredOutputsParams) -> LanguageKey:
    """(kind, canonical text) of what `params` constrains the output to. ValueError for a schema that is not JSON."""
    if params.json is not None:
        try:
            return "json", json.dumps(_schema_dict(params.json), ensure_ascii=False, separators=(",", ":"))
        except TypeError as e:
            raise ValueError(f"invalid JSON schema: it is not JSON-serializable ({e})") from None
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice, ensure_ascii=False)
    if params.grammar is not None:
        return "grammar", params.grammar
    return "json_object", ""


def compile_language(compiler: Any, key: LanguageKey) -> Any:
    """The xgrammar CompiledGrammar for `key` (from `language_key`); ValueError naming the problem when it is invalid.

    JSON allows no whitespace beyond the separators ", " and ": ": a model could otherwise emit whitespace until it
    runs out of tokens, and bounded whitespace makes xgrammar's masks many times slower (docs/design/
    structured-outputs.md). A choice is an EBNF alternation of JSON-escaped string literals, whose escapes EBNF shares.
    """
    kind, text = key
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                      for c in choices))
        return compiler.compile_grammar(text)
    except RuntimeError as e:
        detail = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
        hint = (' (GBNF-style EBNF: rules "name ::= ...", starting at "root")' if kind == "grammar" else "")
        raise ValueError(f"invalid {_KIND_NAMES[kind]}{hint}: {detail}") from None


def _schema_dict(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: it is not JSON ({e})") from None
        except RecursionError:
            raise ValueError("invalid JSON schema: nested deeper than the JSON parser goes") from None
    if not isinstance(schema, dict):
        raise ValueError(f"invalid JSON schema: expected a JSON object, got {type(schema).__name__}")
    return schema
