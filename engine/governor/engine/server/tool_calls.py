"""OpenAI tool calling: the request fields (`tools`, `tool_choice`, `parallel_tool_calls`), the messages a
conversation with tools carries, and what chat templates take from them.

A tool call travels three ways: the client declares functions (`Tool`), the model answers with calls (parsed
from its text by `tool_parsers`, or constrained by `tool_choice`), and the client sends the calls and their
results back in the next request (`AssistantMessage.tool_calls`, `ToolMessage`), which the chat template renders.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FunctionDefinition(BaseModel):
    """A function the model may call. `parameters` is a JSON Schema object; omitted, the function takes none."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools`. Only function tools exist here."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        # Checked before the fields so that a custom tool gets this sentence, not "extra field 'custom'".
        if isinstance(data, dict) and data.get("type", "function") != "function":
            raise ValueError(f"tools entries must be of type 'function', got {data['type']!r}: "
                             "Governor serves function tools only")
        return data


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the model must call exactly that one."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice: TypeAlias = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call's function: `arguments` is the arguments object as JSON text (as OpenAI sends it)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call, as a response carries it and as the client sends it back in an assistant message."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # Clients that rebuild a message from streamed deltas sometimes keep the delta's index; it means nothing here.
    index: int | None = Field(default=None, exclude=True)


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's list form of `content`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class AssistantMessage(BaseModel):
    """An earlier answer of the model: text, tool calls, or both (`content` is null when it only called)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None  # OpenAI's responses carry it; replayed histories send it back

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(BaseModel):
    """The result of one tool call, answering the call whose id is `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str = Field(min_length=1)
    name: str | None = None


def new_tool_call_id() -> str:
    """A fresh call id, shaped as vLLM's: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# --- what chat templates take -----------------------------------------------------------------------------------


class _Text(Protocol):
    @property
    def text(self) -> str: ...


class _Function(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def arguments(self) -> str: ...


class _Call(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def function(self) -> _Function: ...


class _Message(Protocol):
    """What `messages_for_template` reads of a message: these models, or any with the same attributes."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str | Sequence[_Text] | None: ...


def messages_for_template(messages: Sequence[_Message]) -> list[dict[str, Any]]:
    """The conversation as Hugging Face chat templates take it.

    Content becomes one string (text parts joined; null content is ""). `developer` is rendered as `system`.
    An assistant's `tool_calls` keep their ids, and their `arguments` become a dict, as templates expect: arguments
    that are not a JSON object become `{}`, so a malformed call in the history does not fail every later turn.
    A tool message keeps its `tool_call_id` (and `name`, when given).
    """
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _text(m.content)}
        name = getattr(m, "name", None)
        if name is not None:
            msg["name"] = name
        calls: Sequence[_Call] | None = getattr(m, "tool_calls", None)
        if calls:  # an empty list is no calls: the template takes the plain assistant path
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in calls]
        call_id = getattr(m, "tool_call_id", None)
        if call_id is not None:
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def tools_for_template(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    """`tools` as chat templates take them (OpenAI's shape; `strict` left out: it means nothing to the model)."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in tools]


def _text(content: str | Sequence[_Text] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):  # nested past the parser's depth: not arguments either
        return {}
    return value if isinstance(value, dict) else {}


# --- tool_choice --------------------------------------------------------------------------------------------------


def resolve_tool_choice(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """The effective `tool_choice`, checked against `tools`. ValueError (a 400) says what is wrong.

    Unset, it is "auto" with tools and "none" without, as OpenAI's. "auto" without tools has nothing to call
    and resolves to "none".
    """
    tools = tools or []
    names = [t.function.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tools declare function {', '.join(map(repr, repeated))} more than once; "
                         "give each function one entry")
    if tool_choice is None or tool_choice == "auto":
        return "auto" if tools else "none"
    if tool_choice == "required" and not tools:
        raise ValueError('tool_choice "required" needs at least one function in tools')
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        known = ", ".join(map(repr, names)) or "none"
        raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not in tools "
                         f"(declared: {known}); declare it in tools or name one of those")
    return tool_choice


def finish_reason(engine_reason: str | None, called: bool, tool_choice: ToolChoice) -> str | None:
    """A choice's finish_reason once its tool calls are known.

    "tool_calls" replaces "stop" when the model called tools on its own ("auto" or "required"), as OpenAI's. A
    call forced by name keeps "stop" (OpenAI's too), and "length", "timeout" or "abort" are kept: the client must
    know the output was cut short, calls or not.
    """
    if called and engine_reason == "stop" and not isinstance(tool_choice, NamedToolChoice):
        return "tool_calls"
    return engine_reason
