"""Drop-in for OpenAI and vLLM clients: what real clients send is accepted, what users rely on works, with the
real `openai` client against a real `governor serve` on 127.0.0.1 (started with --api-key, so every call here
also proves the key is checked)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.test_server import Server, start_server

MODEL = "compat"
API_KEY = "sk-compat-test"
SAMPLED = {"temperature": 1.0, "seed": 1234}


@pytest.fixture(scope="module")
def server(hf_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--api-key", API_KEY,
                      "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16",
                      "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                      log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8} | kwargs
    return client.completions.create(**args)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | kwargs
    return client.chat.completions.create(**args)


# --- what clients send ----------------------------------------------------------------------------

NO_OPS = {
    "logit_bias {}": {"logit_bias": {}},
    "tools []": {"tools": []},
    "metadata {}": {"metadata": {}},
    "store false": {"store": False},
    "response_format text": {"response_format": {"type": "text"}},
    "tool_choice none": {"tool_choice": "none"},
    "parallel_tool_calls": {"parallel_tool_calls": True},
    "service_tier": {"service_tier": "auto"},
    "logprobs null": {"logprobs": None},
    "user": {"user": "u-1"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "modalities text": {"modalities": ["text"]},
}


@pytest.mark.parametrize("case", NO_OPS)
def test_a_no_op_value_clients_send_is_accepted(client: openai.OpenAI, case: str) -> None:
    plain = chat(client, temperature=0.0)
    resp = chat(client, temperature=0.0, **NO_OPS[case])
    assert resp.choices[0].message.content == plain.choices[0].message.content


def test_best_of_1_and_a_list_of_prompts_are_accepted(client: openai.OpenAI) -> None:
    resp = complete(client, prompt=["one", "two"], best_of=1, temperature=0.0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[1].text == complete(client, prompt="two", temperature=0.0).choices[0].text


def test_the_developer_role_is_rendered_as_system(client: openai.OpenAI) -> None:
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (chat(client, messages=msgs, temperature=0.0).choices[0].message.content
            == chat(client, messages=as_system, temperature=0.0).choices[0].message.content)


def test_a_request_without_the_api_key_gets_401(server: Server) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}):
        for body in ({"model": MODEL, "prompt": "x"}, {"prompt": 5}):  # checked before the body: 401, not 400
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # health stays open


def test_a_model_is_retrieved_by_id(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


# --- parallel sampling ----------------------------------------------------------------------------


def test_n_choices_are_each_the_request_alone_with_seed_plus_index(client: openai.OpenAI) -> None:
    resp = complete(client, n=3, max_tokens=12, **SAMPLED)
    alone = [complete(client, max_tokens=12, temperature=1.0, seed=1234 + i).choices[0].text for i in range(3)]
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == alone
    assert len(set(alone)) > 1
    assert resp.usage.prompt_tokens == complete(client, max_tokens=1).usage.prompt_tokens
    assert resp.usage.completion_tokens == 36


def test_n_choices_stream_with_their_indexes(client: openai.OpenAI) -> None:
    texts = ["", "", ""]
    for chunk in complete(client, n=3, max_tokens=12, stream=True, **SAMPLED):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in sorted(complete(client, n=3, max_tokens=12, **SAMPLED).choices,
                                            key=lambda c: c.index)]


def test_best_of_returns_the_choice_of_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    best = complete(client, best_of=4, n=1, max_tokens=6, **SAMPLED).choices[0].text
    candidates = [complete(client, max_tokens=6, logprobs=0, temperature=1.0, seed=1234 + i).choices[0]
                  for i in range(4)]
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    assert best == max(scores, key=lambda t: scores[t])


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = complete(client, temperature=0.0).choices[0].text
    assert complete(client, echo=True, temperature=0.0).choices[0].text == "The quick brown fox" + plain


def test_completion_text_offsets_count_the_characters_before_each_token(client: openai.OpenAI) -> None:
    choice = complete(client, logprobs=1, temperature=0.0, max_tokens=10).choices[0]
    lp = choice.logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == choice.text


def test_continuous_usage_stats_put_usage_on_every_chunk(client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    every_token = {"ignore_eos": True, "return_token_ids": True}  # a chunk per token, even one without text
    usages = [chunk.usage for chunk in complete(client, max_tokens=5, stream=True, temperature=0.0,
                                                extra_body=every_token, stream_options=options)]
    assert all(u is not None for u in usages)
    assert [u.completion_tokens for u in usages[:5]] == [1, 2, 3, 4, 5]


# --- penalties, bias, min_tokens ------------------------------------------------------------------


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    resp = complete(client, temperature=1.0, seed=7, max_tokens=5, logit_bias={"100": 100},
                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.choices[0].model_extra["token_ids"] == [100] * 5


def test_a_frequency_penalty_breaks_a_repetition(client: openai.OpenAI) -> None:
    """A bias makes token 100 the greedy pick every time; a frequency penalty of 2 per occurrence overtakes it."""
    def ids(**kw: Any) -> list[int]:
        resp = complete(client, temperature=0.0, max_tokens=24, logit_bias={"100": 20},
                        extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
        return list(resp.choices[0].model_extra["token_ids"])

    assert ids() == [100] * 24
    penalised = ids(frequency_penalty=2.0)
    assert 1 <= penalised.count(100) < 24


def test_min_tokens_holds_off_eos(client: openai.OpenAI) -> None:
    resp = complete(client, temperature=0.0, max_tokens=12, logit_bias={"1": 100},
                    extra_body={"min_tokens": 6, "return_token_ids": True})
    ids = resp.choices[0].model_extra["token_ids"]
    assert len(ids) == 7 and 1 not in ids[:6] and resp.choices[0].finish_reason == "stop"


# --- structured outputs and tools -----------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_is_valid_against_the_schema(client: openai.OpenAI, seed: int) -> None:
    resp = chat(client, max_tokens=200, temperature=1.0, seed=seed,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)


def test_guided_choice_and_regex(client: openai.OpenAI) -> None:
    pick = complete(client, max_tokens=10, temperature=1.0, seed=5, extra_body={"guided_choice": ["red", "blue"]})
    assert pick.choices[0].text in ("red", "blue")
    code = complete(client, max_tokens=20, temperature=1.0, seed=5, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert len(code.choices[0].text) == 6 and code.choices[0].text[3] == "-"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                          "required": ["city"], "additionalProperties": False}}}


def test_a_named_tool_choice_gives_a_call_with_valid_arguments(client: openai.OpenAI) -> None:
    resp = chat(client, max_tokens=60, temperature=1.0, seed=3, tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_calls_stream_as_deltas_that_add_up(client: openai.OpenAI) -> None:
    kwargs = {"max_tokens": 160, "temperature": 1.0, "seed": 4, "tools": [WEATHER], "tool_choice": "required",
              "parallel_tool_calls": False}
    whole = chat(client, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for chunk in chat(client, stream=True, **kwargs):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert [names[i] for i in sorted(names)] == [c.function.name for c in whole.message.tool_calls]
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in whole.message.tool_calls]


def test_a_conversation_replaying_a_tool_call_and_its_result_is_accepted(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "4 degrees, rain"}]
    resp = chat(client, messages=messages, tools=[WEATHER], temperature=0.0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert resp.usage.prompt_tokens > chat(client, temperature=0.0).usage.prompt_tokens
