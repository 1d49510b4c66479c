"""Tool calls out of a model's text, streamed or whole: the `hermes` and `llama3_json` formats.

A parser is a per-choice state: `feed(text_delta)` returns the deltas that text completes, shaped as OpenAI's
streamed `choices[0].delta`, and `finish()` flushes what was held back. `extract(text)` is the same machine run
over a finished output at once, so a streamed response and a whole one always say the same thing.

A call is sent only once its text is complete and parses: a call, once streamed, cannot be taken back, and text
that merely looks like a call (malformed JSON, an unclosed block cut by max_tokens) must stay content. So a call
arrives as its header (`id`, `name`, empty `arguments`) followed by its whole arguments, while plain text streams
as it comes, less a tail that could be the start of a call.

Whitespace that touches a call is not content: the newlines a template puts between text and calls, and between
calls, are layout. Everything else outside calls is content, verbatim.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeAlias

from governor.engine.server.tool_calls import FunctionCall, ToolCall, new_tool_call_id

Delta: TypeAlias = dict[str, Any]  # one streamed `choices[i].delta`, less its role
JSON_WHITESPACE = " \t\r\n"  # JSON's whitespace


class ToolCallStream(ABC):
    """Turns one choice's text into content and tool-call deltas.

    Invariants: the deltas of `feed`s and `finish` concatenate (content to content, each call's argument fragments
    to its arguments) to `extract` of the whole text, however the text was split; call indexes count 0, 1, ... in
    the order the calls appear.
    """

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self._parallel = parallel_tool_calls
        self._out: list[Delta] = []
        self._num_calls = 0
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text` (the next piece of output) completes."""
        if self._finished:
            raise RuntimeError("feed() after finish(): this stream has ended")
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """The deltas held back until the end of the output (a partial marker, an unclosed call)."""
        if not self._finished:
            self._consume("", final=True)
            self._finished = True
        return self._take()

    @property
    def called(self) -> bool:
        """Whether any tool call was sent (the finish_reason depends on it)."""
        return self._num_calls > 0

    def read_whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output's content (None when empty) and its tool calls: `text` fed at once, then finished."""
        return merge_deltas(self.feed(text) + self.finish())

    @classmethod
    def extract(cls, text: str, parallel_tool_calls: bool = True) -> tuple[str | None, list[ToolCall]]:
        """A finished output's content (None when empty) and its tool calls, read by a fresh parser."""
        return cls(parallel_tool_calls=parallel_tool_calls).read_whole(text)

    @abstractmethod
    def _consume(self, text: str, final: bool) -> None:
        """Take in `text` and emit what it completes through `_content` and `_call`; `final`: no text follows."""

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:  # one content delta per feed, not one per piece
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _open_call(self, name: str) -> int | None:
        """Send a call's header; its index, or None when parallel calls are off and one was already sent."""
        if self._num_calls and not self._parallel:
            return None
        index = self._num_calls
        self._num_calls += 1
        self._out.append({"tool_calls": [{"index": index, "id": new_tool_call_id(), "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        return index

    def _arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def _call(self, name: str, arguments: str) -> None:
        index = self._open_call(name)
        if index is not None:
            self._arguments(index, arguments)

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def merge_deltas(deltas: list[Delta]) -> tuple[str | None, list[ToolCall]]:
    """What a client assembles from streamed deltas: the content (None when empty) and the calls, by index."""
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.get("id", call["id"])
            call["name"] = piece["function"].get("name", call["name"])
            call["arguments"] += piece["function"].get("arguments", "")
    return content or None, [ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
                             for _, c in sorted(calls.items())]


# --- hermes ---------------------------------------------------------------------------------------------------


class HermesToolCallStream(ToolCallStream):
    """Hermes 2 Pro, Qwen2.5 and Qwen3: calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
    possibly several, possibly after text. A block left unclosed at the end still counts when its JSON is whole
    (the model stopped right after it)."""

    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""  # not yet emitted: a possible partial START in text, or the open block from its START on
        self._in_block = False
        self._end_from = 0  # where to resume looking for END in the open block (what is before cannot hold it)
        self._held_ws = ""  # trailing whitespace of the text so far: content unless a call follows
        self._after_call = False  # leading whitespace after a call is layout, not content

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while True:
            if not self._in_block:
                start = self._buf.find(self.START)
                if start < 0:
                    cut = len(self._buf) - (0 if final else _partial_suffix(self._buf, self.START))
                    self._text(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                self._text(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_block, self._end_from = True, len(self.START)
            end = self._buf.find(self.END, self._end_from)
            if end < 0:
                if not final:
                    self._end_from = max(len(self.START), len(self._buf) - len(self.END) + 1)
                    break
                body = self._buf[len(self.START):]
                self._block(body[:len(body) - _partial_suffix(body, self.END)], raw=self._buf)
                self._buf, self._in_block = "", False
                break
            self._block(self._buf[len(self.START):end], raw=self._buf[:end + len(self.END)])
            self._buf, self._in_block = self._buf[end + len(self.END):], False
        if final and self._held_ws:
            self._content(self._held_ws)  # trailing whitespace no call follows
            self._held_ws = ""

    def _text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._content(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _block(self, body: str, raw: str) -> None:
        call = _hermes_call(body)
        if call is None:
            self._text(raw)  # not a call: the block is text, tags and all
            return
        self._held_ws, self._after_call = "", True
        self._call(*call)


def _hermes_call(body: str) -> tuple[str, str] | None:
    obj = parse_json_object(body)
    if obj is None:
        return None
    name, arguments = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments_json(arguments)


# --- llama3_json ----------------------------------------------------------------------------------------------


class Llama3JsonToolCallStream(ToolCallStream):
    """Llama 3.1/3.2 JSON tool calling: the output is `{"name": ..., "parameters": {...}}` (or `"arguments"`),
    optionally after `<|python_tag|>`, several separated by `;`. An output that starts otherwise is content.
    Calls end at the first thing that is not one: from there on, the rest is content."""

    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""  # not yet emitted
        self._state = "start"  # "start": what the output is, undecided; "calls": between or in calls; "text"
        self._lead = ""  # leading whitespace and tag before the first call: content if no call comes
        self._scan: JsonValueEnd | None = None  # the object being read, from the start of _buf

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        if self._state == "start":
            self._start(final)
        if self._state == "calls":
            self._calls(final)
        if self._state == "text":
            self._content(self._buf)
            self._buf = ""

    def _start(self, final: bool) -> None:
        rest = self._buf.lstrip(JSON_WHITESPACE)
        if not rest:
            if final:
                self._state = "text"
            return
        lead = self._buf[:len(self._buf) - len(rest)]
        if rest.startswith(self.PYTHON_TAG):
            self._lead, self._buf, self._state = lead + self.PYTHON_TAG, rest[len(self.PYTHON_TAG):], "calls"
        elif self.PYTHON_TAG.startswith(rest) and not final:
            return  # maybe the tag, still arriving
        elif rest.startswith("{"):
            self._lead, self._buf, self._state = lead, rest, "calls"
        else:
            self._state = "text"

    def _calls(self, final: bool) -> None:
        while True:
            if self._scan is None:
                # Between calls: separators and whitespace are layout; what follows is a call or the content.
                rest = self._buf.lstrip(JSON_WHITESPACE + ";" if self.called else JSON_WHITESPACE)
                if not rest.startswith("{"):
                    if rest or final:
                        self._to_text(rest)
                    return
                if not self.called:
                    self._lead += self._buf[:len(self._buf) - len(rest)]
                self._buf, self._scan = rest, JsonValueEnd()
            end = self._scan.advance(self._buf)
            if end is None:
                if final:
                    self._to_text(self._buf)  # an object cut short is text
                return
            call = _llama3_call(self._buf[:end])
            if call is None:
                self._to_text(self._buf)
                return
            self._call(*call)
            self._buf, self._scan, self._lead = self._buf[end:], None, ""

    def _to_text(self, rest: str) -> None:
        # Before any call the output is plain text from its first character; after calls, from `rest` on.
        self._buf = rest if self.called else self._lead + self._buf
        self._state, self._scan, self._lead = "text", None, ""


def _llama3_call(text: str) -> tuple[str, str] | None:
    obj = parse_json_object(text)
    if obj is None:
        return None
    name = obj.get("name")
    arguments = obj["parameters"] if "parameters" in obj else obj.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, arguments_json(arguments)


# --- shared -------------------------------------------------------------------------------------------------------


TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesToolCallStream,
    "llama3_json": Llama3JsonToolCallStream,
}


def tool_call_parser(name: str) -> type[ToolCallStream]:
    """The parser named as vLLM's `--tool-call-parser` names it. ValueError lists the known names."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}") from None


class JsonValueEnd:
    """Finds where the JSON object or array at the start of a growing text ends, reading each character once.

    Only nesting and strings are tracked (enough to find the end); whether the value is valid is json's to say.
    """

    _IN_STRING = re.compile(r'["\\]')
    _OUTSIDE = re.compile(r'["{}\[\]]')

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False

    def advance(self, text: str) -> int | None:
        """The end (exclusive) of the value that `text` starts with, or None while it is incomplete. `text` must
        extend the text of earlier calls."""
        while True:
            m = (self._IN_STRING if self._in_string else self._OUTSIDE).search(text, self._pos)
            if m is None:
                self._pos = len(text)
                return None
            c = m.group()
            if self._in_string:
                if c == "\\":
                    if m.end() == len(text):  # the escaped character has not arrived yet
                        self._pos = m.start()
                        return None
                    self._pos = m.end() + 1
                    continue
                self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return m.end()
            self._pos = m.end()


def parse_json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one (invalid, another kind of value, NaN, too deep)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity; clients' parsers do not


def arguments_json(value: Any) -> str:
    """A call's arguments as the JSON text a response carries.

    Spaced as json.dumps and the chat template's tojson write it, so a call sent back renders as it was generated.
    """
    return json.dumps(value, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
