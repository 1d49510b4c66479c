"""`governor serve` under abuse, from outside: huge bodies and prompts, clients that leave, bursts, strict admin
input and a drain that must cut requests. A real server process on 127.0.0.1; every wait and loop is bounded."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from governor import contract
from governor.engine.server.state import fingerprint
from tests.test_server import Server, start_server, wait_until

ADMIN_TOKEN = "robustness-admin-token"
MODEL = "m"
FINISHED = contract.REQUESTS_FINISHED


@pytest.fixture(scope="module")
def server(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(long_model, "--served-model-name", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "512",
                      "--max-num-seqs", "8", "--max-queue", "4", "--max-request-body-bytes", str(8 * 2**20),
                      log_dir=tmp_path_factory.mktemp("logs"), env={contract.ADMIN_TOKEN_ENV: ADMIN_TOKEN}) as s:
        yield s


def body(max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}


def health_while(server: Server, work: threading.Thread) -> list[float]:
    """Latencies of /health polled while `work` runs (bounded: at most 60 s)."""
    latencies = []
    deadline = time.monotonic() + 60
    while work.is_alive() and time.monotonic() < deadline:
        t0 = time.monotonic()
        assert server.get("/health").status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    return latencies


def idle(server: Server) -> bool:
    return (server.metric(contract.REQUESTS_RUNNING) == 0 and server.metric(contract.REQUESTS_WAITING) == 0)


# --- bodies and prompts ---------------------------------------------------------------------------


def test_a_50_mb_body_gets_413_and_health_answers_within_1_s_meanwhile(server: Server) -> None:
    prompt = "word " * (10 * 2**20)  # 50 MiB of JSON
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["r"] = httpx.post(f"{server.url}/v1/completions", json=body(prompt=prompt), timeout=60)

    work = threading.Thread(target=send)
    work.start()
    latencies = health_while(server, work)
    work.join(timeout=60)
    r = result["r"]
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and "8388608" in r.json()["error"]["message"]
    assert max(latencies) < 1.0, latencies


def test_a_body_without_content_length_is_cut_at_the_limit(server: Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(10 * 16):  # 10 MiB in 64 KiB chunks, past the 8 MiB limit
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_far_beyond_max_model_len_is_refused_without_stalling_a_stream(server: Server) -> None:
    """5 MB of text (about a million tokens) against a 2,048-token context: a 400 naming max_model_len, while a
    running stream keeps its pace and /health answers."""
    gaps: list[float] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body(200, stream=True), timeout=60) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: len(gaps) >= 5, "the stream's first tokens", timeout=30)
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", json=body(prompt="the quick brown fox " * 250_000), timeout=60)
    refused_s = time.monotonic() - t0
    streamer.join(timeout=60)
    assert r.status_code == 400 and "max_model_len=2048" in r.json()["error"]["message"]
    assert refused_s < 5.0, refused_s  # a probe of its head is tokenized, not 5 MB
    assert max(gaps[1:]) < 1.0, max(gaps[1:])


# --- clients that leave ---------------------------------------------------------------------------


def send_raw(server: Server, payload: dict[str, object]) -> socket.socket:
    """POST a completion over a bare socket, so the test decides when the client goes away (close)."""
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    data = json.dumps(payload).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_abandoned_non_streaming_requests_are_aborted_at_once(server: Server) -> None:
    wait_until(lambda: idle(server), "an idle server")
    aborted = server.metric(FINISHED, finish_reason="abort")
    clients = [send_raw(server, body(1900, prompt=f"abandoned {i}")) for i in range(8)]
    wait_until(lambda: server.metric(contract.REQUESTS_RUNNING) == 8, "8 running")
    for c in clients:
        c.close()
    wait_until(lambda: server.metric(FINISHED, finish_reason="abort") - aborted == 8, "8 aborts", timeout=10)
    wait_until(lambda: idle(server), "the aborted requests' slots freed", timeout=10)
    assert server.metric(contract.KV_BLOCKS_USED) == 0
    r = httpx.post(f"{server.url}/v1/completions", json=body(4), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_streaming_client_that_leaves_while_queued_is_not_counted_waiting(server: Server) -> None:
    """Fill the 8 running slots, queue a stream behind them, drop its connection: it leaves the queue."""
    wait_until(lambda: idle(server), "an idle server")
    aborted = server.metric(FINISHED, finish_reason="abort")
    holders = [send_raw(server, body(1900, prompt=f"holder {i}", stream=True)) for i in range(8)]
    wait_until(lambda: server.metric(contract.REQUESTS_RUNNING) == 8, "8 running")
    queued = send_raw(server, body(4, prompt="queued", stream=True))
    wait_until(lambda: server.metric(contract.REQUESTS_WAITING) == 1, "the stream queued")
    queued.close()
    wait_until(lambda: server.metric(contract.REQUESTS_WAITING) == 0, "the queued stream gone", timeout=5)
    assert server.metric(FINISHED, finish_reason="abort") - aborted == 1
    for s in holders:
        s.close()
    wait_until(lambda: server.metric(FINISHED, finish_reason="abort") - aborted == 9, "9 aborts", timeout=10)
    wait_until(lambda: idle(server), "an idle server again", timeout=10)


# --- admission ------------------------------------------------------------------------------------


def test_a_burst_that_fits_running_plus_queue_is_admitted_whole(server: Server) -> None:
    """max_num_seqs 8 + max_queue 4 = 12 at once on an idle server: all 200; the 13th and 14th of a larger burst
    can be refused, never those that fit."""
    wait_until(lambda: idle(server), "an idle server")
    barrier = threading.Barrier(12)

    def send(i: int) -> int:
        barrier.wait(timeout=10)
        return httpx.post(f"{server.url}/v1/completions", json=body(64, prompt=f"burst {i}"), timeout=60).status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(send, range(12)))
    assert statuses == [200] * 12


# --- the admin API --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, "4", 4.0, None])
def test_admin_knob_values_are_not_coerced(server: Server, value: object) -> None:
    r = httpx.put(f"{server.url}{contract.ADMIN_KNOBS_PATH}", json={"max_num_seqs": value}, timeout=10,
                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    if value is None:  # null means "leave it": an empty update
        assert r.status_code == 200
        return
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "max_num_seqs"


def test_each_knob_change_is_one_structured_log_line_naming_the_token_by_fingerprint(server: Server) -> None:
    url = f"{server.url}{contract.ADMIN_KNOBS_PATH}"
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    before = httpx.get(url, headers=auth, timeout=10).json()["max_num_batched_tokens"]
    r = httpx.put(url, json={"max_num_batched_tokens": before // 2}, headers=auth, timeout=10)
    assert r.status_code == 200
    httpx.put(url, json={"max_num_batched_tokens": before}, headers=auth, timeout=10)
    lines = [json.loads(line[line.index("{"):]) for line in server.log.read_text().splitlines()
             if "knobs_changed" in line]
    assert lines[-2:] == [
        {"event": "knobs_changed", "who": f"admin-token:{fingerprint(ADMIN_TOKEN)}",
         "changes": {"max_num_batched_tokens": {"from": before, "to": before // 2}}},
        {"event": "knobs_changed", "who": f"admin-token:{fingerprint(ADMIN_TOKEN)}",
         "changes": {"max_num_batched_tokens": {"from": before // 2, "to": before}}}]
    assert ADMIN_TOKEN not in server.log.read_text()


# --- drain ----------------------------------------------------------------------------------------


def test_a_stream_cut_by_the_drain_deadline_gets_an_error_event_and_the_exit_code_says_so(
        long_model: Path, tmp_path: Path) -> None:
    with start_server(long_model, "--max-model-len", "2048", "--num-kv-blocks", "256", "--drain-grace-s", "1",
                      log_dir=tmp_path) as server:
        events: list[dict[str, object]] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"model": "qwen3-tiny", "prompt": "hi", "max_tokens": 2000, "temperature": 0.0,
                                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(timeout=30)
    assert events[-1] == {"error": {"message": "the server shut down before this request finished (drain deadline)",
                                    "type": "server_error", "param": None, "code": "server_shutdown"}}
    assert exit_code == 3, server.log_tail()


def test_unknown_paths_and_methods_are_counted_as_errors(server: Server) -> None:
    errors = contract.REQUEST_ERRORS
    before = (server.metric(errors, kind="unknown_route"), server.metric(errors, kind="method_not_allowed"))
    assert httpx.get(f"{server.url}/v2/nothing", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/v1/completions", timeout=10).status_code == 405
    after = (server.metric(errors, kind="unknown_route"), server.metric(errors, kind="method_not_allowed"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"guided_json": "[" * 5000}),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "$defs": [1]}}}]}),
])
def test_pathological_constraints_are_400s_not_500s(server: Server, path: str, extra: dict[str, object]) -> None:
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text


def test_a_deeply_nested_replayed_tool_call_is_not_a_500(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "max_tokens": 2, "messages": messages})
    assert r.status_code in (200, 400), r.text


def test_a_client_that_leaves_is_counted_as_499_not_500(server: Server) -> None:
    wait_until(lambda: idle(server), "an idle server")
    http = contract.HTTP_REQUESTS
    before = (server.metric(http, status="499"), server.metric(http, status="500"))
    client = send_raw(server, body(1900, prompt="leaving"))
    wait_until(lambda: server.metric(contract.REQUESTS_RUNNING) == 1, "1 running")
    client.close()
    wait_until(lambda: server.metric(http, status="499") - before[0] == 1, "a 499", timeout=10)
    assert server.metric(http, status="500") == before[1]
