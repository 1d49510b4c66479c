"""`tool_choice` "required" and named functions: the JSON Schema the output is constrained to, and the calls read
back from such output, streamed or whole.

With "required" the model writes a non-empty JSON array of `{"name": ..., "parameters": {...}}`, one per call; with a
named function it writes that call's arguments object and nothing else. Either way the engine's structured outputs
hold the model to the schema, so no tool-call format (and no parser) is involved. "auto" is the parser's
(`tool_parsers`); "none" is plain content.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from governor.engine.server.tool_calls import (
    FunctionDefinition,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
    resolve_tool_choice,
)
from governor.engine.server.tool_parsers import (
    JSON_WHITESPACE,
    JsonValueEnd,
    ToolCallStream,
    arguments_json,
    parse_json_object,
    tool_call_parser,
)

# A function declared without parameters takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Where a schema keeps the subschemas its "$ref"s point at (2019-09 and later, and draft 7).
_DEFINITIONS = ("$defs", "definitions")


def tool_choice_schema(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None,
                       parallel_tool_calls: bool | None = True) -> dict[str, Any] | None:
    """The JSON Schema the output is constrained to, or None when the output is free ("auto", "none").

    "required": a non-empty array (of one item when `parallel_tool_calls` is false) of
    `{"name": <a declared function>, "parameters": <that function's schema>}`. A named function: its parameters
    schema (the output is then the call's arguments). ValueError says what is wrong with tools or tool_choice.
    """
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        return copy.deepcopy(_parameters(_function(tools or [], choice.function.name)))
    if choice != "required":
        return None
    definitions: dict[str, dict[str, Any]] = {}
    items = []
    for tool in tools or []:
        parameters = copy.deepcopy(_parameters(tool.function))
        # A "$ref" resolves against the document's root, which is now this array schema: the definitions go there.
        for key in _DEFINITIONS:
            defs = parameters.pop(key, None) or {}
            if not isinstance(defs, dict):
                raise ValueError(f"tools[].function.parameters.{key} of {tool.function.name!r} must be an object of "
                                 f"schemas, got {type(defs).__name__}")
            for ref, subschema in defs.items():
                known = definitions.setdefault(key, {})
                if ref in known and known[ref] != subschema:
                    raise ValueError(f"tools define {key}/{ref} differently ({tool.function.name!r} is one); "
                                     "rename it in one of them")
                known[ref] = subschema
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"],
                      "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(definitions)
    return schema


def constrained_call_stream(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None,
                            parallel_tool_calls: bool | None = True) -> ToolCallStream:
    """The stream that reads calls out of output constrained by `tool_choice_schema` ("required" or named)."""
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        return NamedToolCallStream(_function(tools or [], choice.function.name).name)
    if choice == "required":
        return RequiredToolCallStream(parallel_tool_calls is not False)
    raise ValueError(f"tool_choice {choice!r} does not constrain the output: its calls are parsed from free text")


def calls_from_constrained_output(text: str, tools: Sequence[Tool] | None, tool_choice: ToolChoice | None,
                                  parallel_tool_calls: bool | None = True) -> list[ToolCall]:
    """The tool calls of a finished output constrained by `tool_choice_schema`.

    Output cut short (max_tokens) keeps what is whole: with "required", the array items completed before the cut;
    with a named function, the one call, its arguments as far as they got.
    """
    return constrained_call_stream(tools, tool_choice, parallel_tool_calls).read_whole(text)[1]


def tool_call_stream(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parser: str | None,
                     parallel_tool_calls: bool | None = True) -> ToolCallStream | None:
    """The stream that turns a choice's output into content and tool calls, or None when the output is content.

    "auto" uses the server's `parser` (None: the server parses no calls, so "auto" is refused with a ValueError
    when asked for explicitly, and is plain content when it is only the default); "required" and named functions
    read the constrained output; "none" is content.
    """
    choice = resolve_tool_choice(tools, tool_choice)
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            if tool_choice == "auto":
                raise ValueError('tool_choice "auto" needs the server started with a tool-call parser '
                                 "(--tool-call-parser hermes or llama3_json)")
            return None
        return tool_call_parser(parser)(parallel_tool_calls is not False)
    return constrained_call_stream(tools, choice, parallel_tool_calls)


class RequiredToolCallStream(ToolCallStream):
    """Reads `tool_choice="required"` output, `[{"name": ..., "parameters": {...}}, ...]`: each call is sent when
    its array item closes. It has no content. Anything the schema would not allow ends the calls."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""
        self._expect = "["  # "[", then "{" (an item), then "," (another item) or the end
        self._scan: JsonValueEnd | None = None  # the item being read, from the start of _buf

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while self._expect:
            if self._scan is None:
                self._buf = self._buf.lstrip(JSON_WHITESPACE)
                if not self._buf:
                    return
                c = self._buf[0]
                if c != self._expect:  # "]", or output the schema does not allow: no more calls
                    self._expect, self._buf = "", ""
                    return
                if c != "{":
                    self._buf, self._expect = self._buf[1:], "{"
                    continue
                self._scan = JsonValueEnd()
            end = self._scan.advance(self._buf)
            if end is None:
                return
            item = parse_json_object(self._buf[:end])
            self._buf, self._scan, self._expect = self._buf[end:], None, ","
            name = item.get("name") if item else None
            parameters = item.get("parameters") if item else None
            if not isinstance(name, str) or not isinstance(parameters, dict):
                self._expect, self._buf = "", ""
                return
            self._call(name, arguments_json(parameters))


class NamedToolCallStream(ToolCallStream):
    """Reads output constrained to one named function's parameters: the whole output is that call's arguments,
    streamed as it comes (the header first)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._index: int | None = None

    def _consume(self, text: str, final: bool) -> None:
        if self._index is None and (text or final):
            self._index = self._open_call(self._name)
        if self._index is not None:
            self._arguments(self._index, text)


def _function(tools: Sequence[Tool], name: str) -> FunctionDefinition:
    return next(t.function for t in tools if t.function.name == name)


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else _NO_PARAMETERS
