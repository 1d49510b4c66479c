"""Tool calling for the chat endpoint: request shapes, the `hermes` and `llama3_json` parsers (whole and streamed),
tool_choice's output schemas, and the generated tokenizer's chat template with tools."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import TypeAdapter

from governor.engine.models.tokenizer_builder import write_tokenizer
from governor.engine.server.tool_calls import (
    AssistantMessage,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    finish_reason,
    messages_for_template,
    resolve_tool_choice,
    tools_for_template,
)
from governor.engine.server.tool_choice import (
    NamedToolCallStream,
    RequiredToolCallStream,
    calls_from_constrained_output,
    constrained_call_stream,
    tool_call_stream,
    tool_choice_schema,
)
from governor.engine.server.tool_parsers import (
    HermesToolCallStream,
    Llama3JsonToolCallStream,
    ToolCallStream,
    merge_deltas,
    tool_call_parser,
)

transformers = pytest.importorskip("transformers")

ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                      "filters": {"type": "object"}},
                                     "required": ["query"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters
TOOLS = [Tool.model_validate(t) for t in (WEATHER, SEARCH, CLOCK)]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def calls_of(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


# --- request shapes ---------------------------------------------------------------------------------------------


def test_tool_accepts_what_openai_clients_send() -> None:
    tool = Tool.model_validate({"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": True}})
    assert tool.function.strict is True
    assert Tool.model_validate(CLOCK).function.parameters is None


def test_a_tool_of_another_type_is_refused_with_a_sentence() -> None:
    with pytest.raises(ValueError, match="tools entries must be of type 'function', got 'custom'"):
        Tool.model_validate({"type": "custom", "custom": {"name": "grep"}})


def test_unknown_tool_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="extra"):
        Tool.model_validate({"type": "function", "function": {"name": "f", "paramters": {}}})


@pytest.mark.parametrize("value", ["none", "auto", "required"])
def test_tool_choice_takes_the_three_modes(value: str) -> None:
    assert TypeAdapter(ToolChoice).validate_python(value) == value


def test_tool_choice_takes_a_named_function() -> None:
    choice = TypeAdapter(ToolChoice).validate_python({"type": "function", "function": {"name": "search"}})
    assert isinstance(choice, NamedToolChoice) and choice.function.name == "search"


def test_tool_choice_refuses_other_modes() -> None:
    with pytest.raises(ValueError):
        TypeAdapter(ToolChoice).validate_python("any")


def test_assistant_message_may_only_call() -> None:
    m = AssistantMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}, "index": 0}]})
    assert m.tool_calls is not None and m.tool_calls[0].model_dump() == {
        "id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


def test_assistant_message_needs_content_or_calls() -> None:
    with pytest.raises(ValueError, match="needs content or tool_calls"):
        AssistantMessage.model_validate({"role": "assistant", "content": None})


def test_tool_message_needs_the_call_it_answers() -> None:
    with pytest.raises(ValueError, match="tool_call_id"):
        ToolMessage.model_validate({"role": "tool", "content": "12C"})


def test_messages_for_template_gives_arguments_as_dicts() -> None:
    call = ToolCall.model_validate({"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}})
    parts = [TextPart(type="text", text="12"), TextPart(type="text", text="C")]
    messages: list[AssistantMessage | ToolMessage] = [
        AssistantMessage(role="assistant", content=None, tool_calls=[call]),
        ToolMessage(role="tool", content=parts, tool_call_id="c1")]
    assert messages_for_template(messages) == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "12C", "tool_call_id": "c1"}]


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", ""])
def test_messages_for_template_turns_unusable_arguments_into_an_empty_object(arguments: str) -> None:
    call = ToolCall.model_validate({"id": "c1", "function": {"name": "clock", "arguments": arguments}})
    [msg] = messages_for_template([AssistantMessage(role="assistant", tool_calls=[call])])
    assert msg["tool_calls"][0]["function"]["arguments"] == {}


def test_messages_for_template_drops_an_empty_call_list() -> None:
    [msg] = messages_for_template([AssistantMessage(role="assistant", content="Hi", tool_calls=[])])
    assert msg == {"role": "assistant", "content": "Hi"}


def test_tools_for_template_leave_out_strict() -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "strict": True}})
    assert tools_for_template([tool]) == [{"type": "function", "function": {"name": "f"}}]
    assert tools_for_template([]) is None


# --- parsers on whole outputs ------------------------------------------------------------------------------------

# (output, content, calls): what each format's parser must make of a finished output.
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>\n',
     None, [("get_weather", '{"city": "Paris"}'), ("clock", "{}")]),
    ('Let me look that up.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "rust"}}\n</tool_call>',
     "Let me look that up.", [("search", '{"query": "rust"}')]),
    ('<tool_call>\n{"name": "search", "arguments": {"query": "a", "filters": {"year": [2024, 2025], '
     '"lang": {"in": ["en", "fr"]}}}}\n</tool_call>',
     None, [("search", '{"query": "a", "filters": {"year": [2024, 2025], "lang": {"in": ["en", "fr"]}}}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 🙂", "note": "a \\"quote\\" and \\\\"}}'
     '\n</tool_call>',
     None, [("get_weather", '{"city": "Zürich 東京 🙂", "note": "a \\"quote\\" and \\\\"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\u00e9"}}\n</tool_call>',
     None, [("get_weather", '{"city": "é"}')]),
    # Not calls: malformed JSON, no arguments object, NaN; the text stays content, tags and all.
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
     'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>', []),
    ('<tool_call>{"name": "clock"}</tool_call>', '<tool_call>{"name": "clock"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    # A bad block does not spoil the good one after it.
    ('<tool_call>oops</tool_call>\n<tool_call>{"name": "clock", "arguments": {}}</tool_call>',
     "<tool_call>oops</tool_call>", [("clock", "{}")]),
    # Unclosed at the end: a whole JSON object still counts (the model stopped right after it); a cut one is text.
    ('<tool_call>\n{"name": "clock", "arguments": {}}\n', None, [("clock", "{}")]),
    ('<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_', None, [("clock", "{}")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
     []),
    # Plain text, including what merely starts like a marker, is content verbatim.
    ("The answer is 4.\n", "The answer is 4.\n", []),
    ("a < b and <tool but not a call <tool_cal", "a < b and <tool but not a call <tool_cal", []),
    ("  \n", "  \n", []),
    ("", None, []),
    # Text between and after calls is content; the whitespace around calls is layout.
    ('<tool_call>{"name": "clock", "arguments": {}}</tool_call>\nThen done.  \n',
     "Then done.  \n", [("clock", "{}")]),
]

LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "clock", "parameters": {}}',
     None, [("get_weather", '{"city": "Paris"}'), ("clock", "{}")]),
    ('\n{"name": "clock", "arguments": {}}', None, [("clock", "{}")]),
    ('{"name": "search", "parameters": {"query": "x } y { \\" z", "filters": {"tags": [{"k": "v"}, []]}}}',
     None, [("search", '{"query": "x } y { \\" z", "filters": {"tags": [{"k": "v"}, []]}}')]),
    ('{"name": "get_weather", "parameters": {"city": "Zürich 東京 🙂"}}',
     None, [("get_weather", '{"city": "Zürich 東京 🙂"}')]),
    ('{"name": "search", "parameters": {"query": "a}b]c\\"}\\\\"}}', None, [("search", '{"query": "a}b]c\\"}\\\\"}')]),
    # Not calls: the whole output is content.
    ('{"name": "get_weather", "parameters": {"city": "Paris"}',
     '{"name": "get_weather", "parameters": {"city": "Paris"}', []),
    ('{"name": "get_weather", "parameters": {"city": Paris}}',
     '{"name": "get_weather", "parameters": {"city": Paris}}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    (' <|python_tag|> {"oops": 1}', ' <|python_tag|> {"oops": 1}', []),
    ("<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")", []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('Call {"name": "clock", "parameters": {}}', 'Call {"name": "clock", "parameters": {}}', []),
    ("<|python", "<|python", []),
    ("", None, []),
    # After the calls, the first thing that is not one starts the content.
    ('{"name": "clock", "parameters": {}}; \nThat is all.', "That is all.", [("clock", "{}")]),
    ('{"name": "clock", "parameters": {}}; {"name": bad}', '{"name": bad}', [("clock", "{}")]),
]

PARSERS: list[tuple[type[ToolCallStream], tuple[str, str | None, list[tuple[str, str]]]]] = (
    [(HermesToolCallStream, s) for s in HERMES] + [(Llama3JsonToolCallStream, s) for s in LLAMA3])
PARSER_IDS = [f"{cls.__name__[:6]}-{i}" for i, (cls, _) in enumerate(PARSERS)]


@pytest.mark.parametrize(("parser", "sample"), PARSERS, ids=PARSER_IDS)
def test_extract_finds_content_and_calls(parser: type[ToolCallStream],
                                         sample: tuple[str, str | None, list[tuple[str, str]]]) -> None:
    text, content, calls = sample
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    for call in got_calls:
        assert json.loads(call.function.arguments) is not None


def test_calls_get_unique_vllm_shaped_ids() -> None:
    _, calls = HermesToolCallStream.extract(HERMES[1][0])
    assert all(ID.fullmatch(c.id) for c in calls)
    assert len({c.id for c in calls}) == 2


def test_parsers_are_found_by_their_vllm_names() -> None:
    assert tool_call_parser("hermes") is HermesToolCallStream
    assert tool_call_parser("llama3_json") is Llama3JsonToolCallStream
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; choose one of hermes, llama3_json"):
        tool_call_parser("mistral")


def test_parallel_tool_calls_off_keeps_the_first_call() -> None:
    content, calls = HermesToolCallStream.extract(HERMES[1][0], parallel_tool_calls=False)
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]


# --- streaming ----------------------------------------------------------------------------------------------------


def stream_pieces(stream: ToolCallStream, pieces: list[str]) -> list[dict[str, Any]]:
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish()


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_streams_as_whole(make: Any, text: str) -> None:
    """However `text` is split, the merged deltas say what `extract` says of it whole (ids aside)."""
    content, calls = merge_deltas(stream_pieces(make(), [text]))
    expected = (content, calls_of(calls))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(f"{text}")
    splits += [random_chunks(text, rng) for _ in range(30)]
    for pieces in splits:
        got_content, got_calls = merge_deltas(stream_pieces(make(), pieces))
        assert (got_content, calls_of(got_calls)) == expected, pieces


@pytest.mark.parametrize(("parser", "sample"), PARSERS, ids=PARSER_IDS)
def test_streamed_deltas_equal_the_whole_output(parser: type[ToolCallStream],
                                                sample: tuple[str, str | None, list[tuple[str, str]]]) -> None:
    text, content, calls = sample
    content_whole, calls_whole = parser.extract(text)
    assert (content_whole, calls_of(calls_whole)) == (content, calls)
    assert_streams_as_whole(parser, text)


def test_a_streamed_call_is_a_header_then_its_arguments() -> None:
    stream = HermesToolCallStream()
    deltas = stream_pieces(stream, ["Checking.\n<tool", '_call>\n{"name": "clock", ', '"arguments": {}}\n</tool_call>'])
    assert deltas[0] == {"content": "Checking."}
    header, arguments = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert ID.fullmatch(header.pop("id"))
    assert header == {"index": 0, "type": "function", "function": {"name": "clock", "arguments": ""}}
    assert arguments == {"index": 0, "function": {"arguments": "{}"}}
    assert len(deltas) == 3 and stream.called


def test_text_streams_as_it_comes_less_a_possible_marker() -> None:
    stream = HermesToolCallStream()
    assert stream.feed("The sky ") == [{"content": "The sky"}]  # the space waits: a call may follow it
    assert stream.feed("is blue <tool") == [{"content": " is blue"}]
    assert stream.feed("s> are fine") == [{"content": " <tools> are fine"}]
    assert stream.finish() == []
    assert not stream.called


def test_a_call_is_sent_only_once_it_is_complete() -> None:
    stream = Llama3JsonToolCallStream()
    assert stream.feed('{"name": "get_weather", "parameters": {"city": ') == []
    [header, arguments] = stream.feed('"Oslo"}}')
    assert header["tool_calls"][0]["function"]["name"] == "get_weather"
    assert arguments["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_feed_after_finish_is_an_error() -> None:
    stream = HermesToolCallStream()
    stream.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("x")


# --- tool_choice -------------------------------------------------------------------------------------------------


def test_tool_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert resolve_tool_choice(TOOLS, None) == "auto"
    assert resolve_tool_choice(None, None) == "none"
    assert resolve_tool_choice([], "auto") == "none"


def test_a_named_function_must_be_declared() -> None:
    with pytest.raises(ValueError, match="tool_choice names function 'send_mail', which is not in tools "
                                         r"\(declared: 'get_weather', 'search', 'clock'\)"):
        tool_choice_schema(TOOLS, named("send_mail"))


def test_required_needs_tools() -> None:
    with pytest.raises(ValueError, match='tool_choice "required" needs at least one function in tools'):
        tool_choice_schema([], "required")


def test_functions_must_have_distinct_names() -> None:
    with pytest.raises(ValueError, match="tools declare function 'clock' more than once"):
        resolve_tool_choice([Tool.model_validate(CLOCK)] * 2, "auto")


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_free_output_has_no_schema(choice: ToolChoice | None) -> None:
    assert tool_choice_schema(TOOLS, choice) is None


REQUIRED_GOOD = [
    [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, {"name": "clock", "parameters": {}},
     {"name": "search", "parameters": {"query": "q", "filters": {"a": 1}}}],
]
REQUIRED_BAD = [
    [],  # no call
    {"name": "clock", "parameters": {}},  # not an array
    [{"name": "send_mail", "parameters": {}}],  # not a declared function
    [{"name": "get_weather", "parameters": {}}],  # a required argument missing
    [{"name": "get_weather", "parameters": {"city": 3}}],  # an argument of the wrong type
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "K"}}],  # not in the enum
    [{"name": "clock"}],  # no parameters
    [{"name": "clock", "parameters": {}, "why": "x"}],  # an extra key
]


@pytest.mark.parametrize("output", REQUIRED_GOOD)
def test_required_schema_accepts_calls_of_declared_functions(output: Any) -> None:
    schema = tool_choice_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(output, schema)


@pytest.mark.parametrize("output", REQUIRED_BAD)
def test_required_schema_refuses_anything_else(output: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(output, tool_choice_schema(TOOLS, "required"))


def test_required_schema_allows_one_call_when_parallel_calls_are_off() -> None:
    schema = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    jsonschema.validate(REQUIRED_GOOD[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(REQUIRED_GOOD[1], schema)


def test_named_schema_is_the_functions_parameters() -> None:
    schema = tool_choice_schema(TOOLS, named("get_weather"))
    assert schema == WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Paris"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "C"}, schema)


def test_a_function_without_parameters_takes_an_empty_object() -> None:
    schema = tool_choice_schema(TOOLS, named("clock"))
    assert schema == {"type": "object", "properties": {}}


def test_required_schema_keeps_references_resolvable() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = Tool.model_validate({"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": point}}}})
    schema = tool_choice_schema([tool, *TOOLS], "required")
    assert schema is not None and schema["$defs"] == {"point": point}
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {"y": 1}}}], schema)


def test_conflicting_definitions_are_refused() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "$defs": {"p": {"type": kind}}}}}) for name, kind in (("a", "string"), ("b", "number"))]
    with pytest.raises(ValueError, match=r"tools define \$defs/p differently"):
        tool_choice_schema(tools, "required")


def test_calls_from_required_output() -> None:
    text = json.dumps(REQUIRED_GOOD[1], ensure_ascii=False, indent=2)
    calls = calls_from_constrained_output(text, TOOLS, "required")
    assert calls_of(calls) == [("get_weather", '{"city": "Paris", "unit": "C"}'), ("clock", "{}"),
                               ("search", '{"query": "q", "filters": {"a": 1}}')]
    assert all(ID.fullmatch(c.id) for c in calls)


def test_required_output_may_hold_brackets_in_strings() -> None:
    text = '[{"name": "search", "parameters": {"query": "]}\\"]}"}}, {"name": "clock", "parameters": {}}]'
    assert calls_of(calls_from_constrained_output(text, TOOLS, "required")) == [
        ("search", '{"query": "]}\\"]}"}'), ("clock", "{}")]


def test_required_output_cut_short_keeps_the_whole_calls() -> None:
    text = '[{"name": "clock", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    assert calls_of(calls_from_constrained_output(text, TOOLS, "required")) == [("clock", "{}")]


def test_calls_from_named_output_are_the_output() -> None:
    calls = calls_from_constrained_output('{"city": "Zürich"}', TOOLS, named("get_weather"))
    assert calls_of(calls) == [("get_weather", '{"city": "Zürich"}')]


def test_named_call_arguments_stream_as_they_come() -> None:
    stream = constrained_call_stream(TOOLS, named("get_weather"))
    [header, first] = stream.feed('{"ci')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": "Oslo"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]
    assert stream.finish() == []


@pytest.mark.parametrize("text", [json.dumps(REQUIRED_GOOD[1]), ' [ {"name": "clock", "parameters": {"a": "]}"}} ] ',
                                  '[{"name": "clock", "parameters": {}}, {"name": "cl'])
def test_required_calls_stream_as_whole(text: str) -> None:
    assert_streams_as_whole(RequiredToolCallStream, text)


def test_named_call_streams_as_whole() -> None:
    assert_streams_as_whole(lambda: NamedToolCallStream("get_weather"), '{"city": "Zürich", "unit": "C"}')


def test_tool_call_stream_follows_tool_choice() -> None:
    assert tool_call_stream(TOOLS, "none", "hermes") is None
    assert isinstance(tool_call_stream(TOOLS, "auto", "hermes"), HermesToolCallStream)
    assert isinstance(tool_call_stream(TOOLS, None, "llama3_json"), Llama3JsonToolCallStream)
    assert isinstance(tool_call_stream(TOOLS, "required", None), RequiredToolCallStream)
    assert isinstance(tool_call_stream(TOOLS, named("clock"), None), NamedToolCallStream)
    assert tool_call_stream(TOOLS, None, None) is None  # tools, but a server that parses no calls
    with pytest.raises(ValueError, match='tool_choice "auto" needs the server started with a tool-call parser'):
        tool_call_stream(TOOLS, "auto", None)


@pytest.mark.parametrize(("engine", "called", "choice", "expected"), [
    ("stop", True, "auto", "tool_calls"),
    ("stop", True, "required", "tool_calls"),
    ("stop", True, named("clock"), "stop"),
    ("stop", False, "auto", "stop"),
    ("length", True, "auto", "length"),
    (None, False, "auto", None),
])
def test_finish_reason(engine: str | None, called: bool, choice: ToolChoice, expected: str | None) -> None:
    assert finish_reason(engine, called, choice) == expected


# --- the generated tokenizer's chat template ---------------------------------------------------------------------

# The template as it was before it knew tools: conversations without tools must render exactly as with it.
PLAIN_CHATML = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- else %}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "naïve 你好 🙂\n<tool_call>"}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, model_max_length=512)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_conversations_without_tools_render_as_before(tokenizer: Any, messages: list[dict[str, Any]],
                                                      generation_prompt: bool) -> None:
    before = tokenizer.apply_chat_template(messages, chat_template=PLAIN_CHATML, tokenize=False,
                                           add_generation_prompt=generation_prompt)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == before
    assert tokenizer.apply_chat_template(messages, tools=None, tokenize=False,
                                         add_generation_prompt=generation_prompt) == before


TOOLS_BLOCK = (
    "# Tools\n\nYou can call functions to help with the request. Their signatures, in JSON Schema, are inside "
    "<tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", '
    '"enum": ["C", "F"]}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "clock"}}\n'
    "</tools>\n\nTo call functions, answer with one <tool_call></tool_call> block per call, each holding a JSON "
    "object with the function name and its arguments:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)


def test_template_lists_the_tools_in_a_system_turn(tokenizer: Any) -> None:
    tools = tools_for_template([Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather?"}], tools=tools, tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == ("<|begin_of_text|><|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n"
                      "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_template_puts_the_tools_after_the_system_message(tokenizer: Any) -> None:
    tools = tools_for_template([Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)])
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Weather?"}], tools=tools, tokenize=False)
    assert prompt == ("<|begin_of_text|><|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK + "<|im_end|>\n"
                      "<|im_start|>user\nWeather?<|im_end|>\n")


def conversation_with_calls(content: str | None) -> list[Any]:
    calls = [ToolCall.model_validate({"id": f"c{i}", "function": {"name": "get_weather", "arguments": args}})
             for i, args in enumerate(['{"city": "Zürich"}', '{"city": "Bern", "unit": "C"}'])]
    return [AssistantMessage(role="assistant", content=content, tool_calls=calls),
            ToolMessage(role="tool", content="12C", tool_call_id="c0"),
            ToolMessage(role="tool", content="10C", tool_call_id="c1")]


def test_template_renders_tool_calls_and_tool_responses(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Zürich and Bern?"},
                *messages_for_template(conversation_with_calls("Checking both.")),
                {"role": "assistant", "content": "Zürich 12C, Bern 10C."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert prompt == (
        "<|begin_of_text|><|im_start|>user\nWeather in Zürich and Bern?<|im_end|>\n"
        "<|im_start|>assistant\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "unit": "C"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12C\n</tool_response>\n<tool_response>\n10C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nZürich 12C, Bern 10C.<|im_end|>\n")


@pytest.mark.parametrize("content", [None, "Checking both."])
def test_parsed_calls_render_back_as_they_were_generated(tokenizer: Any, content: str | None) -> None:
    # What the model writes after "<|im_start|>assistant\n" and what its parsed calls render to are the same
    # text, so the next turn's prompt extends this turn's (its cached prefix is reused).
    messages = messages_for_template(conversation_with_calls(content))[:1]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    generated = rendered.removeprefix("<|begin_of_text|><|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed_content, calls = HermesToolCallStream.extract(generated)
    assert parsed_content == content
    again = messages_for_template([AssistantMessage(role="assistant", content=parsed_content, tool_calls=calls)])
    assert tokenizer.apply_chat_template(again, tokenize=False) == rendered


def test_template_refuses_a_tool_message_that_answers_no_call(tokenizer: Any) -> None:
    with pytest.raises(Exception, match="or tool, answering an assistant message with tool_calls"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"},
                                       {"role": "tool", "content": "12C", "tool_call_id": "c0"}], tokenize=False)


def test_template_still_refuses_unknown_roles(tokenizer: Any) -> None:
    with pytest.raises(Exception, match=r"role must be system, user or assistant .*got critic"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)
