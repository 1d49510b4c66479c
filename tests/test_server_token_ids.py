"""vLLM's `return_token_ids` on a real server process (127.0.0.1, the `openai` client and raw SSE lines).

The model's vocabulary (8,192) is four times its tokenizer's (2,000), as with the llama3-8b preset over the
generated tokenizer: most greedy tokens decode to no text, so a stream timed by text alone skips them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from governor.engine.tokenizer import load_tokenizer
from tests.conftest import build_hf_checkpoint
from tests.test_server import Server, start_server

MODEL = "tiny-wide-vocab"
PROMPT = "The quick brown fox"
MAX_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
TOKEN_IDS = {"ignore_eos": True, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("wide"), "qwen3", vocab_size=8192)


@pytest.fixture(scope="module")
def server(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(wide_model, "--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "64",
                      log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(wide_model: Path) -> Any:
    return load_tokenizer(wide_model)


def sse_chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed request, as sent (without the [DONE] sentinel)."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_a_completion_returns_the_prompt_and_generated_token_ids(server: Server, tokenizer: Any) -> None:
    full = server.client().completions.create(model=MODEL, prompt=PROMPT, extra_body=TOKEN_IDS, **GREEDY)
    choice = full.choices[0]
    assert choice.prompt_token_ids == list(tokenizer.encode(PROMPT))
    assert len(choice.token_ids) == full.usage.completion_tokens == MAX_TOKENS
    assert tokenizer.decode(choice.token_ids) == choice.text


def test_streamed_token_ids_are_the_non_streamed_ones_one_chunk_per_token(server: Server, tokenizer: Any) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=TOKEN_IDS, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body=TOKEN_IDS,
                                            stream_options={"include_usage": True}, **GREEDY))
    token_chunks = [c for c in chunks if c.choices]
    streamed = [t for c in token_chunks for t in c.choices[0].token_ids]
    assert streamed == full.choices[0].token_ids
    assert len(token_chunks) == len(streamed) == chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].text for c in token_chunks) == full.choices[0].text
    assert token_chunks[0].choices[0].prompt_token_ids == list(tokenizer.encode(PROMPT))
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in token_chunks[1:])


def test_a_token_that_decodes_to_no_text_still_gets_a_chunk(server: Server, tokenizer: Any) -> None:
    chunks = sse_chunks(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True,
                                                    **GREEDY, **TOKEN_IDS})
    silent = [c["choices"][0] for c in chunks if c["choices"][0]["text"] == ""
              and c["choices"][0]["finish_reason"] is None]
    assert silent, "every greedy token of this model decoded to text; the test needs some that do not"
    assert all(len(ch["token_ids"]) == 1 and tokenizer.decode(ch["token_ids"]) == "" for ch in silent)


def test_chat_returns_token_ids_as_vllm_does(server: Server, tokenizer: Any) -> None:
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=TOKEN_IDS, **GREEDY)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    assert full.prompt_token_ids == prompt_ids  # on the response, not on the choice (vLLM's chat shape)
    assert len(full.choices[0].token_ids) == full.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, extra_body=TOKEN_IDS,
                                                 stream_options={"include_usage": True}, **GREEDY))
    role, *token_chunks = [c for c in chunks if c.choices]
    assert role.choices[0].delta.role == "assistant" and role.prompt_token_ids == prompt_ids
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == full.choices[0].token_ids
    assert len(token_chunks) == chunks[-1].usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == full.choices[0].message.content


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_without_the_flag_no_token_ids_and_no_empty_chunks(server: Server, path: str, body: dict[str, Any]) -> None:
    request = {"model": MODEL, **body, **GREEDY, "ignore_eos": True}
    full = httpx.post(f"{server.url}{path}", json=request, timeout=60).json()
    assert "prompt_token_ids" not in full and "token_ids" not in full["choices"][0]
    assert "prompt_token_ids" not in full["choices"][0]
    chunks = sse_chunks(server, path, {**request, "stream": True})
    assert not any("token_ids" in json.dumps(c) for c in chunks)
    choices = [ch for c in chunks for ch in c["choices"]][1 if path == "/v1/chat/completions" else 0:]  # no role
    # Tokens of no text are not sent on their own: every chunk has text or ends the stream.
    assert all(ch.get("text", ch.get("delta", {}).get("content")) or ch["finish_reason"] for ch in choices)
    assert len(choices) < MAX_TOKENS


@pytest.mark.parametrize("value", ["maybe", [True], {"on": True}])
def test_a_non_boolean_return_token_ids_is_a_400_naming_it(server: Server, value: Any) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"return_token_ids": value})
    assert e.value.body["param"] == "return_token_ids"
