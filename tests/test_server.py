"""`governor serve` end to end: a real server process on 127.0.0.1, driven by the real `openai` client.

Three servers, each started once per module:
- `server`: the tiny Qwen3 of conftest (weights scaled, so greedy text is varied, not one repeated
  token) with an admin token, a served model name and a revision, for the API, metrics and knobs;
- `queue_server`: a `governor make-model` checkpoint (2048 positions, so requests can run for seconds)
  with --max-queue 1 --max-num-seqs 1 and no admin token, for overload, timeouts and the disabled
  admin API;
- the drain test starts its own, since SIGTERM ends it.
Every equality check is greedy; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from governor import contract
from governor.cli import main as governor_main
from governor.engine.config import EngineConfig
from governor.engine.server.serve import read_admin_token
from governor.engine.tokenizer import load_tokenizer

ADMIN_TOKEN = "test-admin-token"
MODEL = "tiny-qwen3"
REVISION = "r1"
NAMESPACE = "team-a"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 256
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["The quick brown fox", "Once upon a time", "water runs down the hill", "my father said",
           "three small birds", "a long story about the sea", "North of the river", "read the page"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


# --- the server process ---------------------------------------------------------------------------


Sample = tuple[str, dict[str, str], float]  # (name, labels, value) of one /metrics series


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The real OpenAI client; no retries, so a 429 or 503 reaches the test as it was sent."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10, **kwargs)

    def metrics(self) -> list[Sample]:
        text = self.get("/metrics").text
        return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]

    def metric(self, name: str, /, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def metric_value(samples: list[Sample], name: str, /, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 when there is none yet)."""
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def start_server(model: Path, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`python -m governor.engine serve model args` on 127.0.0.1 and a free port; yields once /ready is 200
    and kills the process on the way out. `env` adds to a copy of the environment without an admin token."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    full_env = {k: v for k, v in os.environ.items() if k != contract.ADMIN_TOKEN_ENV} | (env or {})
    cmd = [sys.executable, "-m", "governor.engine", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before it was ready:\n{server.log_tail()}")
        try:
            return server.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "the server's /ready", timeout=90)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def chat_model(hf_checkpoint: Callable[[str], Path]) -> Path:
    return hf_checkpoint("qwen3")


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(chat_model, "--served-model-name", MODEL, "--revision", REVISION,
                      "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                      "--max-num-seqs", "8", "--max-num-seqs-cap", "16",
                      "--max-num-batched-tokens", "128", "--max-num-batched-tokens-cap", "512",
                      "--drain-grace-s", "5", log_dir=tmp_path_factory.mktemp("logs"),
                      env={contract.ADMIN_TOKEN_ENV: ADMIN_TOKEN, contract.NAMESPACE_ENV: NAMESPACE}) as s:
        yield s


@pytest.fixture(scope="module")
def queue_server(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(long_model, "--served-model-name", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "256",
                      "--max-queue", "1", "--max-num-seqs", "1", "--drain-grace-s", "5",
                      log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Any:
    return load_tokenizer(chat_model)


# --- helpers --------------------------------------------------------------------------------------


def complete(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 32, **kwargs: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **(GREEDY | kwargs))


def stream_completion(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 32,
                      **kwargs: Any) -> tuple[str, str | None, Any]:
    """(concatenated text, last finish_reason, usage) of a streamed completion."""
    text, finish, usage = "", None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}, **(GREEDY | kwargs)):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def greedy_completions(base_url: str, model: str, count: int, prefix: str, max_tokens: int = 8) -> None:
    """`count` sequential greedy completions of `max_tokens` tokens each (ignore_eos); asserts each got 200."""
    with httpx.Client(timeout=60) as client:
        for i in range(count):
            r = client.post(f"{base_url}/v1/completions",
                            json={"model": model, "prompt": f"{prefix} {i}", "max_tokens": max_tokens,
                                  "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text


def admin(server: Server, method: str, token: str | None = ADMIN_TOKEN, headers: dict[str, str] | None = None,
          **kwargs: Any) -> httpx.Response:
    auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.request(method, f"{server.url}{contract.ADMIN_KNOBS_PATH}", headers=auth | (headers or {}),
                         timeout=10, **kwargs)


@contextlib.contextmanager
def knobs_restored(server: Server) -> Iterator[dict[str, Any]]:
    """The knobs as they are now; put back afterwards, so tests that change them leave no trace."""
    before = admin(server, "GET").json()
    try:
        yield before
    finally:
        admin(server, "PUT", json={k: before[k] for k in contract.KNOB_NAMES})


def sse_data_lines(server: Server, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


# --- the command ----------------------------------------------------------------------------------


def test_serve_takes_every_engine_setting_as_a_kebab_case_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        governor_main(["serve", "--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--host", "--port", "--served-model-name", "--admin-token-file", "--max-queue", "--drain-grace-s",
                 *("--" + name.replace("_", "-") for name in EngineConfig.model_fields if name != "model")):
        assert flag in usage


# --- the OpenAI API -------------------------------------------------------------------------------


def test_models_lists_the_served_model_name(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_health_and_ready_answer_200_while_serving(server: Server) -> None:
    assert server.get("/health").json() == {"status": "ok"}
    ready = server.get("/ready")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


def test_streamed_and_non_streamed_greedy_completions_are_identical(server: Server, tokenizer: Any) -> None:
    client = server.client()
    prompt = PROMPTS[0]
    full = complete(client, prompt, max_tokens=40)
    text, finish, usage = stream_completion(client, prompt, max_tokens=40)
    assert full.choices[0].text and text == full.choices[0].text
    assert finish == full.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (n_prompt, 40,
                                                                                                  n_prompt + 40)
    assert usage == full.usage


def test_a_token_id_prompt_completes_like_its_text(server: Server, tokenizer: Any) -> None:
    client = server.client()
    ids = list(tokenizer.encode(PROMPTS[1]))
    by_ids = complete(client, ids, max_tokens=24)
    assert by_ids.choices[0].text == complete(client, PROMPTS[1], max_tokens=24).choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.completion_tokens == 24


def test_streams_end_with_the_done_sentinel(server: Server) -> None:
    completion = sse_data_lines(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                            "stream": True})
    chat = sse_data_lines(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    assert completion[-1] == "[DONE]" and completion.count("[DONE]") == 1
    assert chat[-1] == "[DONE]" and chat.count("[DONE]") == 1


def test_chat_renders_the_template_and_streams_the_same_greedy_text(server: Server, tokenizer: Any) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed == full.choices[0].message.content != ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason == "length"
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    assert full.usage.prompt_tokens == len(ids) and chunks[-1].usage == full.usage
    # A chat completion is a completion of the rendered template.
    assert complete(client, ids, max_tokens=30).choices[0].text == full.choices[0].message.content


def test_concurrent_streams_match_sequential_greedy_outputs(server: Server) -> None:
    client = server.client()
    expected = [complete(client, p, max_tokens=48).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streamed = list(pool.map(lambda p: stream_completion(client, p, max_tokens=48), PROMPTS, timeout=60))
    assert [s[0] for s in streamed] == expected
    assert {s[1] for s in streamed} == {"length"}
    assert [s[2].completion_tokens for s in streamed] == [48] * len(PROMPTS)


def test_a_stop_string_ends_the_text_before_it(server: Server) -> None:
    client = server.client()
    text = complete(client, PROMPTS[2], max_tokens=40).choices[0].text
    stop = next(w for w in text.split()[2:] if w.isascii() and w.isalpha() and len(w) >= 3)
    cut = text[:text.index(stop)]
    full = complete(client, PROMPTS[2], max_tokens=40, stop=[stop])
    streamed, finish, _ = stream_completion(client, PROMPTS[2], max_tokens=40, stop=[stop])
    assert (full.choices[0].text, full.choices[0].finish_reason) == (cut, "stop")
    assert full.choices[0].model_extra["stop_reason"] == stop
    assert (streamed, finish) == (cut, "stop")


def test_greedy_logprobs_rank_the_chosen_token_first(server: Server) -> None:
    out = complete(server.client(), PROMPTS[3], max_tokens=8, logprobs=3).choices[0].logprobs
    assert len(out.tokens) == len(out.token_logprobs) == len(out.top_logprobs) == 8
    for chosen, top in zip(out.token_logprobs, out.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))
        assert chosen <= 0.0


def test_seeded_sampling_repeats_across_calls_and_streaming(server: Server) -> None:
    client = server.client()
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 1234,
                "extra_body": {"top_k": 50, "min_p": 0.01, "ignore_eos": True}}
    first = complete(client, PROMPTS[4], max_tokens=24, **sampling).choices[0].text
    assert complete(client, PROMPTS[4], max_tokens=24, **sampling).choices[0].text == first
    assert stream_completion(client, PROMPTS[4], max_tokens=24, **sampling)[0] == first


# --- bad input: OpenAI error JSON, never a 500 ----------------------------------------------------

# name: (endpoint, body overrides, status, error param). The base bodies are valid.
BAD_REQUESTS: dict[str, tuple[str, dict[str, Any], int, str | None]] = {
    "negative max_tokens": ("completions", {"max_tokens": -1}, 400, "max_tokens"),
    "temperature below 0": ("completions", {"temperature": -0.5}, 400, "temperature"),
    "top_p of 0": ("completions", {"top_p": 0}, 400, "top_p"),
    "prompt + max_tokens beyond max_model_len": ("completions", {"max_tokens": MAX_MODEL_LEN}, 400, None),
    "empty token prompt": ("completions", {"prompt": []}, 400, None),
    "token id outside the vocabulary": ("completions", {"prompt": [10**6]}, 400, None),
    "unknown field": ("completions", {"best_of_n": 3}, 400, "best_of_n"),
    "n above 128": ("completions", {"n": 129}, 400, "n"),
    "best_of below n": ("completions", {"n": 3, "best_of": 2}, 400, None),
    "best_of above n, streamed": ("completions", {"n": 1, "best_of": 2, "stream": True}, 400, None),
    "echo with logprobs": ("completions", {"echo": True, "logprobs": 1}, 400, "echo"),
    "a suffix": ("completions", {"suffix": "the end"}, 400, None),
    "store true": ("completions", {"store": True}, 400, None),
    "stream_options without stream": ("completions", {"stream_options": {"include_usage": True}}, 400, None),
    "logit_bias on a token outside the vocabulary": ("completions", {"logit_bias": {"1000000": 5}}, 400, None),
    "logit_bias above 100": ("completions", {"logit_bias": {"5": 101}}, 400, None),
    "min_tokens above max_tokens": ("completions", {"min_tokens": 9, "max_tokens": 4}, 400, None),
    "presence_penalty above 2": ("completions", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    "seed beyond 64 bits": ("completions", {"seed": 2**64}, 400, "seed"),
    "top_k beyond int64": ("completions", {"top_k": 2**64}, 400, "top_k"),
    "empty stop string": ("completions", {"stop": [""]}, 400, None),
    "non-positive timeout": ("completions", {"timeout": 0}, 400, "timeout"),
    "unknown model": ("completions", {"model": "gpt-5"}, 404, "model"),
    "chat without messages": ("chat", {"messages": []}, 400, "messages"),
    "chat role no API has": ("chat", {"messages": [{"role": "narrator", "content": "x"}]}, 400, "messages.0.role"),
    "chat tool message without its call id": ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400,
                                              "messages.0"),
    "chat top_logprobs without logprobs": ("chat", {"top_logprobs": 2}, 400, None),
    "chat stream_options without stream": ("chat", {"stream_options": {"include_usage": True}}, 400, None),
    "chat audio output": ("chat", {"modalities": ["text", "audio"]}, 400, None),
    "chat max_completion_tokens beyond max_model_len": ("chat", {"max_completion_tokens": MAX_MODEL_LEN}, 400, None),
    "chat temperature above 2": ("chat", {"temperature": 2.5}, 400, "temperature"),
    "chat unknown model": ("chat", {"model": "gpt-5"}, 404, "model"),
}


def post_openai(client: openai.OpenAI, endpoint: str, overrides: dict[str, Any]) -> Any:
    """POST through the openai client with `overrides` on top of a valid body (so any field can be sent)."""
    if endpoint == "completions":
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4} | overrides
        return client.completions.create(model=body.pop("model"), prompt=body.pop("prompt"), extra_body=body)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | overrides
    return client.chat.completions.create(model=body.pop("model"), messages=body.pop("messages"), extra_body=body)


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_json(server: Server, case: str) -> None:
    endpoint, overrides, status, param = BAD_REQUESTS[case]
    with pytest.raises(openai.APIStatusError) as raised:
        post_openai(server.client(), endpoint, overrides)
    err = raised.value
    assert err.status_code == status, err.body
    assert set(err.body) == {"message", "type", "param", "code"}
    assert err.body["type"] == "invalid_request_error" and err.body["message"]
    assert err.body["param"] == param
    if status == 404:
        assert err.body["code"] == "model_not_found"


def test_prompt_beyond_max_model_len_error_names_the_limit(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        complete(server.client(), "hello", max_tokens=MAX_MODEL_LEN)
    assert f"exceeds max_model_len={MAX_MODEL_LEN}" in raised.value.body["message"]


# JSON may escape a lone UTF-16 surrogate ("\ud800"), which no tokenizer or hash can take (on the step
# thread it would fail the request with a 500). The openai client cannot even encode one: raw JSON text.
LONE_SURROGATES = {
    "prompt": ("/v1/completions", {"model": MODEL, "prompt": "bad \ud800 text"}),
    "cache_salt": ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": "\udfff"}),
    "messages.0.content": ("/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "\ud83d"}]}),
}


@pytest.mark.parametrize("param", LONE_SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(server: Server, param: str) -> None:
    path, body = LONE_SURROGATES[param]
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert "unicode" in r.json()["error"]["message"].lower()


@pytest.mark.parametrize("body", [b'{"model": "tiny-qwen3", "prompt": "hi"', b"\xff\xfe", b"[1, 2]", b"null"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_a_json_object_is_a_400(server: Server, path: str, body: bytes) -> None:
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_refused_requests_are_counted_by_kind(server: Server) -> None:
    errors = contract.REQUEST_ERRORS
    before = {k: server.metric(errors, kind=k) for k in ("bad_request", "not_found")}
    client = server.client()
    for overrides in ({"max_tokens": -1}, {"temperature": -1}, {"model": "nope"}):
        with pytest.raises(openai.APIStatusError):
            post_openai(client, "completions", overrides)
    assert server.metric(errors, kind="bad_request") - before["bad_request"] == 2
    assert server.metric(errors, kind="not_found") - before["not_found"] == 1


# --- disconnects ----------------------------------------------------------------------------------


def test_client_disconnect_aborts_the_request_and_frees_its_kv_blocks(server: Server) -> None:
    aborted_before = server.metric(contract.REQUESTS_FINISHED, finish_reason="abort")
    client = server.client()
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_MODEL_LEN - 16, stream=True, **GREEDY)
               for p in PROMPTS[:4]]
    for s in streams:
        list(itertools.islice(s, 3))  # a few tokens in: the request is running
    assert server.metric(contract.KV_BLOCKS_USED) > 0
    for s in streams:
        s.close()
    wait_until(lambda: server.metric(contract.KV_BLOCKS_USED) == 0, "governor_kv_blocks_used to return to 0")
    assert server.metric(contract.REQUESTS_RUNNING) == 0
    assert server.metric(contract.REQUESTS_FINISHED, finish_reason="abort") - aborted_before == 4


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_count_known_traffic_exactly(server: Server, tokenizer: Any) -> None:
    names = [contract.REQUESTS_FINISHED, contract.PROMPT_TOKENS, contract.GENERATION_TOKENS,
             f"{contract.TTFT_SECONDS}_count", f"{contract.ITL_SECONDS}_count", f"{contract.E2E_SECONDS}_count",
             f"{contract.QUEUE_SECONDS}_count"]

    def snapshot() -> dict[str, float]:
        samples = server.metrics()
        values = {n: metric_value(samples, n) for n in names}
        values["length"] = metric_value(samples, contract.REQUESTS_FINISHED, finish_reason="length")
        return values

    before = snapshot()
    client = server.client()
    prompts, n_tokens = PROMPTS[:3], 5
    for p in prompts:
        complete(client, p, max_tokens=n_tokens)
    expected = {"length": 3, contract.REQUESTS_FINISHED: 3,
                contract.PROMPT_TOKENS: sum(len(tokenizer.encode(p)) for p in prompts),
                contract.GENERATION_TOKENS: 3 * n_tokens,
                f"{contract.TTFT_SECONDS}_count": 3, f"{contract.ITL_SECONDS}_count": 3 * (n_tokens - 1),
                f"{contract.E2E_SECONDS}_count": 3, f"{contract.QUEUE_SECONDS}_count": 3}

    def deltas() -> dict[str, float]:
        now = snapshot()
        return {k: now[k] - before[k] for k in expected}

    # Token counters advance just after the step that answered the client: give that a moment, then
    # compare (so a count that overshoots fails with the values, not with a timeout).
    with contextlib.suppress(AssertionError):
        wait_until(lambda: deltas() == expected, "the metrics to count the 3 requests", timeout=5)
    assert deltas() == expected


def test_kv_gauges_report_the_configured_pool(server: Server) -> None:
    assert server.metric(contract.KV_BLOCKS_TOTAL) == NUM_KV_BLOCKS
    assert 0 <= server.metric(contract.KV_BLOCKS_USED) <= NUM_KV_BLOCKS


def test_every_series_carries_the_scope_labels(server: Server) -> None:
    samples = server.metrics()
    assert samples
    for name, labels, _ in samples:
        scope = tuple(labels.get(label) for label in contract.SCOPE_LABELS)
        assert scope == (MODEL, REVISION, NAMESPACE), name  # the namespace from env GOVERNOR_NAMESPACE


def test_engine_info_identifies_model_and_tokenizer(server: Server) -> None:
    [(_, labels, info)] = [s for s in server.metrics() if s[0] == contract.ENGINE_INFO]
    assert info == 1
    assert labels["served_model_name"] == MODEL
    assert labels["model_digest"].startswith("sha256:") and labels["tokenizer_digest"].startswith("sha256:")
    assert labels["kv_cache_dtype"] == "float32"
    assert labels["quantization"] == "none"  # the test model's weights are unquantized


def test_every_contract_metric_is_exported_and_documented(server: Server) -> None:
    exported = {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                for name, _, _ in server.metrics()}
    contract_names = {v for k, v in vars(contract).items()
                      if isinstance(v, str) and v.startswith(contract.METRIC_PREFIX) and k != "METRIC_PREFIX"}
    # Per-position acceptance has a series per draft position; this server does not speculate, so it has
    # none (tests/test_server_spec_and_salt.py checks them on a speculating server).
    assert contract_names - {contract.SPEC_ACCEPTED_BY_POSITION} <= exported
    docs = DOCS.read_text()
    undocumented = sorted(n for n in exported if f"`{n}`" not in docs)
    assert not undocumented, f"docs/metrics.md does not document {undocumented}"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server: Server, tokenizer: Any) -> None:
    prompt = " ".join(PROMPTS)  # several full 16-token blocks
    n_prompt = len(tokenizer.encode(prompt))
    before = {m: server.metric(m) for m in (contract.PREFIX_CACHE_QUERIES, contract.PREFIX_CACHE_HIT_TOKENS)}
    client = server.client()
    cold = complete(client, prompt, max_tokens=16, extra_body={"ignore_eos": True, "cache_salt": "prefix-test"})
    hits_after_cold = server.metric(contract.PREFIX_CACHE_HIT_TOKENS)
    warm = complete(client, prompt, max_tokens=16, extra_body={"ignore_eos": True, "cache_salt": "prefix-test"})
    hits = server.metric(contract.PREFIX_CACHE_HIT_TOKENS) - hits_after_cold
    assert warm.choices[0].text == cold.choices[0].text
    assert hits_after_cold == before[contract.PREFIX_CACHE_HIT_TOKENS]  # a fresh salt shares nothing
    assert 0 < hits <= n_prompt and hits % 16 == 0  # whole blocks of the default --block-size
    assert server.metric(contract.PREFIX_CACHE_QUERIES) - before[contract.PREFIX_CACHE_QUERIES] == 2 * n_prompt


def test_speculative_counters_are_zero_until_speculation_lands(server: Server) -> None:
    assert server.metric(contract.SPEC_PROPOSED_TOKENS) == 0
    assert server.metric(contract.SPEC_ACCEPTED_TOKENS) == 0


# --- admin knobs ----------------------------------------------------------------------------------


def test_admin_knobs_need_the_bearer_token(server: Server) -> None:
    for token in (None, "wrong-token"):
        r = admin(server, "GET", token=token)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert admin(server, "PUT", token="wrong-token", json={"max_num_seqs": 2}).status_code == 401
    r = admin(server, "GET")
    assert r.status_code == 200
    assert r.json() == {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_speculative_tokens": 0,
                        "bounds": {"max_num_seqs": {"min": 1, "max": 16},
                                   "max_num_batched_tokens": {"min": 1, "max": 512},
                                   "num_speculative_tokens": {"min": 0, "max": 0}}}


@pytest.mark.parametrize(("change", "bound"), [
    ({"max_num_seqs": 17}, "[1, 16]"),
    ({"max_num_batched_tokens": 513}, "[1, 512]"),
    ({"num_speculative_tokens": 1}, "[0, 0]"),
    ({"max_num_seqs": 0}, "greater than or equal to 1"),
])
def test_an_out_of_cap_knob_is_a_422_naming_the_bound(server: Server, change: dict[str, int], bound: str) -> None:
    with knobs_restored(server) as before:
        r = admin(server, "PUT", json=change)
        assert r.status_code == 422
        error = r.json()["error"]
        assert bound in error["message"] and error["param"] == next(iter(change))
        assert admin(server, "GET").json() == before


@pytest.mark.parametrize("body", [b'{"max_num_seqs": 2', b"\xff\xfe"])
def test_a_knob_body_that_is_not_json_is_a_400(server: Server, body: bytes) -> None:
    r = admin(server, "PUT", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("malformed JSON body")


def test_a_knob_change_is_exported_as_the_knob_gauge(server: Server) -> None:
    with knobs_restored(server):
        r = admin(server, "PUT", json={"max_num_seqs": 3})
        assert r.status_code == 200 and r.json()["max_num_seqs"] == 3
        assert server.metric(contract.KNOB, name="max_num_seqs") == 3
        assert server.metric(contract.KNOB, name="max_num_batched_tokens") == 128
    assert server.metric(contract.KNOB, name="max_num_seqs") == 8


def test_a_knob_change_under_load_leaves_greedy_outputs_unchanged(server: Server) -> None:
    client = server.client()
    prompts, n_tokens = PROMPTS[:6], 160
    expected = [complete(client, p, max_tokens=n_tokens).choices[0].text for p in prompts]
    progress = [0] * len(prompts)

    def run(i: int) -> str:
        text = ""
        for chunk in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n_tokens, stream=True,
                                               **GREEDY):
            text += chunk.choices[0].text
            progress[i] += 1
        return text

    with knobs_restored(server), ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        wait_until(lambda: min(progress) >= 5, "every stream to be under way")
        r = admin(server, "PUT", json={"max_num_seqs": 2, "max_num_batched_tokens": 16})
        assert r.status_code == 200
        in_flight_at_change = [not f.done() for f in futures]
        texts = [f.result(timeout=60) for f in futures]
    assert all(in_flight_at_change)
    assert texts == expected


def test_the_admin_api_is_404_without_a_configured_token(queue_server: Server) -> None:
    for method in ("GET", "PUT"):
        r = admin(queue_server, method, json={"max_num_seqs": 1})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"


def test_the_admin_token_comes_from_the_file_before_the_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ADMIN_TOKEN_ENV, "from-env")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert read_admin_token(str(token_file)) == "from-file"
    assert read_admin_token(None) == "from-env"
    monkeypatch.delenv(contract.ADMIN_TOKEN_ENV)
    assert read_admin_token(None) is None


# --- overload, deadlines, draining ----------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(queue_server: Server) -> None:
    client = queue_server.client()
    long_request = {"model": MODEL, "prompt": "hello", "max_tokens": 2000, "stream": True, **GREEDY}
    running = client.completions.create(**long_request)
    next(iter(running))  # the one sequence slot is taken
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.completions.create, **long_request)  # answers once it is scheduled
        wait_until(lambda: queue_server.metric(contract.REQUESTS_WAITING) == 1, "one request waiting")
        with pytest.raises(openai.RateLimitError) as raised:
            complete(client, "one more", max_tokens=4)
        running.close()
        queued.result(timeout=30).close()
    err = raised.value
    assert err.status_code == 429
    assert err.response.headers["retry-after"] == "1"
    assert (err.body["type"], err.body["code"]) == ("rate_limit_error", "queue_full")
    wait_until(lambda: queue_server.metric(contract.KV_BLOCKS_USED) == 0, "both long requests to be aborted")


def test_a_request_timeout_ends_it_with_finish_reason_timeout(queue_server: Server) -> None:
    client = queue_server.client()
    timeouts_before = queue_server.metric(contract.REQUESTS_FINISHED, finish_reason="timeout")
    timed = {"extra_body": {"ignore_eos": True, "timeout": 0.3}}
    full = complete(client, "hello", max_tokens=2000, **timed)
    _, finish, usage = stream_completion(client, "hello", max_tokens=2000, **timed)
    assert full.choices[0].finish_reason == "timeout" and full.usage.completion_tokens < 2000
    assert finish == "timeout" and usage.completion_tokens < 2000
    assert queue_server.metric(contract.REQUESTS_FINISHED, finish_reason="timeout") - timeouts_before == 2


def test_sigterm_drains_the_in_flight_stream_then_exits_zero(long_model: Path, tmp_path: Path) -> None:
    # A grace far past the stream's length on a loaded 2-core machine: the drain ends when the stream does.
    with start_server(long_model, "--max-model-len", "2048", "--num-kv-blocks", "256", "--drain-grace-s", "120",
                      log_dir=tmp_path) as server:
        stream = server.client().completions.create(model="qwen3-tiny", prompt="hello", max_tokens=600, stream=True,
                                                    stream_options={"include_usage": True}, **GREEDY)
        chunks = iter(stream)
        next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        ready = wait_until(lambda: (r := server.get("/ready")).status_code == 503 and r, "/ready to turn 503")
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "qwen3-tiny", "prompt": "x"}, timeout=10)
        rest = list(chunks)
        exit_code = server.proc.wait(timeout=150)
    assert ready.json() == {"status": "draining"}
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert rest[-1].usage.completion_tokens == 600
    assert exit_code == 0, server.log_tail()
    assert "draining (1 in flight" in server.log_tail()  # the stream was in flight when the signal came
