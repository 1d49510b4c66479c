"""`governor bench serve` (governor.loadgen): pure workload/percentile functions, and the client against a
fake OpenAI-compatible streaming server started in the test on 127.0.0.1.

The fake server is a fixture for the client only: it streams a known number of SSE chunks with known
delays, can answer some requests with an error status or slowly, and records its peak concurrency.
Timing assertions are loose (within 3x) so a loaded CI machine does not make them flaky.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from governor.loadgen import SLO, BenchConfig, run
from governor.loadgen.client import chunk_text, chunk_token_ids, endpoint_url
from governor.loadgen.report import percentile, summarize_ms
from governor.loadgen.workload import WORDS, Workload, arrival_offsets, parse_range

# ---------------------------------------------------------------------------------------------------
# The fake server


@dataclass
class FakeBehaviour:
    """How the fake server answers request number n (in arrival order)."""

    first_delay: float = 0.03  # seconds before the first text chunk
    gap: float = 0.01  # seconds between text chunks
    max_chunks: int | None = None  # text chunks per response; None: one per requested token
    usage: bool = True  # send the usage chunk when the client asks for it
    statuses: tuple[int, ...] = (200,)  # request n gets statuses[n % len]
    slow_every: int = 0  # requests n with n % slow_every == 0 wait slow_extra longer before the first chunk
    slow_extra: float = 0.0
    prompt_tokens_per_word: int = 2  # the fake tokenizer, so reported input tokens differ from word counts
    textless_tokens: int = 0  # the first tokens of each response decode to no text: no chunk of their own
    token_ids: bool = True  # honour return_token_ids: a chunk per token, with its id (False: ignore the field)


@dataclass
class FakeServer:
    behaviour: FakeBehaviour
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


def _sse(obj: Any) -> bytes:
    data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
    event = b"data: " + data + b"\n\n"
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"  # one HTTP/1.1 chunk per SSE event


async def _respond(server: FakeServer, writer: asyncio.StreamWriter, path: str, headers: dict[str, str],
                   body: dict[str, Any]) -> None:
    b = server.behaviour
    n = len(server.bodies)
    server.bodies.append(body)
    server.headers.append(headers)
    server.in_flight += 1
    server.peak = max(server.peak, server.in_flight)
    status = b.statuses[n % len(b.statuses)]
    if status != 200:
        payload = json.dumps({"error": {"message": "fake error", "code": status}}).encode()
        server.in_flight -= 1  # before the client can see the answer, so it cannot send the next one first
        writer.write(f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
                     f"\r\n\r\n".encode() + payload)
        await writer.drain()
        return
    chat = path.endswith("/chat/completions")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    if chat:  # like real servers: a role-only first chunk that carries no text
        writer.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    await writer.drain()
    await asyncio.sleep(b.first_delay + (b.slow_extra if b.slow_every and n % b.slow_every == 0 else 0.0))
    chunks = body["max_tokens"] if b.max_chunks is None else min(b.max_chunks, body["max_tokens"])
    with_ids = b.token_ids and body.get("return_token_ids") is True
    for k in range(chunks):
        if k:
            await asyncio.sleep(b.gap)
        text = "" if k < b.textless_tokens else f" t{k}"
        if not text and not with_ids:
            continue
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        if with_ids:
            choice["token_ids"] = [100 + k]
        writer.write(_sse({"choices": [choice]}))
        await writer.drain()
    if b.usage and body.get("stream_options", {}).get("include_usage"):
        text = body["messages"][0]["content"] if chat else body["prompt"]
        writer.write(_sse({"choices": [], "usage": {"prompt_tokens": len(text.split()) * b.prompt_tokens_per_word,
                                                    "completion_tokens": chunks}}))
    server.in_flight -= 1
    writer.write(_sse("[DONE]") + b"0\r\n\r\n")
    await writer.drain()


async def _handle(server: FakeServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while request_line := await reader.readline():  # keep-alive: several requests per connection
            _method, path, _version = request_line.decode().split(" ", 2)
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
            await _respond(server, writer, path, headers, body)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client closed the connection (e.g. after its timeout)
    finally:
        writer.close()


@pytest.fixture
def fake_server() -> Iterator[Any]:
    """`fake_server(FakeBehaviour(...))` → a running FakeServer on 127.0.0.1 (its own thread and event loop)."""
    running: list[tuple[asyncio.AbstractEventLoop, threading.Thread, asyncio.Server]] = []

    def start(behaviour: FakeBehaviour | None = None) -> FakeServer:
        server = FakeServer(behaviour or FakeBehaviour())
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        listening = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(lambda r, w: _handle(server, r, w), "127.0.0.1", 0), loop).result(5)
        server.url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
        running.append((loop, thread, listening))
        return server

    yield start

    async def shutdown(listening: asyncio.Server) -> None:
        listening.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in handlers:  # e.g. responses still sleeping after the client timed out
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    for loop, thread, listening in running:
        asyncio.run_coroutine_threadsafe(shutdown(listening), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def config(server: FakeServer, **kwargs: Any) -> BenchConfig:
    defaults: dict[str, Any] = dict(num_prompts=8, input_len=(5, 20), output_len=(4, 4), timeout_s=10.0)
    return BenchConfig(server.url, "fake-model", **(defaults | kwargs))


# ---------------------------------------------------------------------------------------------------
# Pure functions


def test_percentile_matches_numpy_linear_interpolation() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.25, 8.0]
    for q in (0, 10, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([4.0], 99) == 4.0


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_summary_is_in_milliseconds_and_empty_summary_is_none() -> None:
    assert summarize_ms([0.010, 0.020, 0.030]) == pytest.approx({"mean": 20.0, "p50": 20.0, "p95": 29.0, "p99": 29.8})
    assert summarize_ms([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_parse_range_accepts_a_b_and_n_and_rejects_nonsense() -> None:
    assert parse_range("100:1024") == (100, 1024)
    assert parse_range("128") == (128, 128)
    for bad in ("0", "5:3", "x", "1:y"):
        with pytest.raises(ValueError, match="a:b"):
            parse_range(bad)


def test_workload_is_deterministic_in_range_and_built_from_the_word_list() -> None:
    w = Workload(input_len=(10, 30), output_len=(5, 9), seed=7)
    reqs = list(w.requests(50))
    assert reqs == list(Workload((10, 30), (5, 9), seed=7).requests(50))
    assert reqs[13] == w.request(13)  # request i does not depend on the ones before it
    assert [r.prompt for r in reqs] != [r.prompt for r in Workload((10, 30), (5, 9), seed=8).requests(50)]
    for r in reqs:
        words = r.prompt.split()
        assert len(words) == r.prompt_words and 10 <= r.prompt_words <= 30
        assert set(words) <= set(WORDS)
        assert 5 <= r.max_tokens <= 9
    assert len({r.prompt_words for r in reqs}) > 5 and len({r.max_tokens for r in reqs}) > 2


def test_shared_prefix_starts_every_prompt_and_precedes_the_input_words() -> None:
    w = Workload(input_len=(8, 8), output_len=(1, 1), shared_prefix_len=16, seed=3)
    prefix = " ".join(w.prefix())
    reqs = list(w.requests(10))
    assert all(r.prompt.startswith(prefix + " ") and r.prompt_words == 24 for r in reqs)
    assert len({r.prompt for r in reqs}) == 10
    assert Workload((8, 8), (1, 1), shared_prefix_len=16, seed=4).prefix() != w.prefix()


def test_poisson_arrivals_are_deterministic_from_the_seed_with_the_requested_mean_rate() -> None:
    a = list(arrival_offsets(4000, rate=20.0, seed=1))
    assert a == list(arrival_offsets(4000, rate=20.0, seed=1))
    assert a != list(arrival_offsets(4000, rate=20.0, seed=2))
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential: std == mean
    assert list(arrival_offsets(5, rate=math.inf)) == [0.0] * 5


def test_endpoint_urls_and_chunk_text() -> None:
    assert endpoint_url("http://h:8000/", "completions") == "http://h:8000/v1/completions"
    assert endpoint_url("http://h:8000/v1", "chat") == "http://h:8000/v1/chat/completions"
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert chunk_token_ids({"choices": [{"text": "", "token_ids": [7, 8]}]}) == [7, 8]
    assert chunk_token_ids({"choices": [{"delta": {"role": "assistant"}, "token_ids": []}]}) == []
    assert chunk_token_ids({"choices": [{"text": "ab"}]}) is None


def test_config_rejects_bad_values_naming_each_problem() -> None:
    with pytest.raises(ValueError) as e:
        BenchConfig("localhost:8000", "m", request_rate=0, max_concurrency=0, endpoint="embeddings")
    for problem in ("base_url", "request_rate", "max_concurrency", "endpoint"):
        assert problem in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Against the fake server


def test_completions_stream_counts_tokens_and_times_ttft_itl_e2e(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.05, gap=0.02))
    result = run(config(server, num_prompts=6, output_len=(5, 5), max_concurrency=3))
    assert (result.completed, result.failed, result.failures) == (6, 0, {})
    assert result.total_output_tokens == 30 and result.usage_reported == 6
    # Input tokens are the server's usage count (2 per word here), not the client's word count.
    assert result.total_input_tokens == 2 * sum(r.prompt_words for r in result.records)
    for r in result.records:
        assert r.status == 200 and r.output_tokens == 5 and len(r.itl) == 4
        assert r.ttft is not None and r.ttft >= 0.05
        assert r.e2e is not None and r.e2e >= 0.05 + 4 * 0.02
    # Lower bounds only: the fake server's sleeps guarantee them; upper bounds would time the machine.
    assert result.ttft_ms["p50"] is not None and result.ttft_ms["p50"] >= 50
    assert result.itl_ms["mean"] is not None and result.itl_ms["mean"] >= 20 / 3
    assert result.output_token_throughput == pytest.approx(30 / result.duration_s)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["model"] == "fake-model"
    assert sorted(b["prompt"] for b in server.bodies) == sorted(r.prompt for r in config(server).workload.requests(6))


def test_chat_endpoint_sends_messages_and_ignores_role_only_chunks(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.03, gap=0.01))
    result = run(config(server, endpoint="chat", num_prompts=3, output_len=(3, 3), ignore_eos=False,
                        api_key="secret"))
    assert (result.completed, result.total_output_tokens) == (3, 9)
    assert all(r.ttft is not None and r.ttft >= 0.03 and len(r.itl) == 2 for r in result.records)
    assert server.bodies[0]["messages"][0]["role"] == "user" and "ignore_eos" not in server.bodies[0]
    assert server.headers[0]["authorization"] == "Bearer secret"


def test_without_usage_output_tokens_are_counted_from_text_chunks(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(usage=False, max_chunks=3))
    result = run(config(server, num_prompts=4, output_len=(6, 6)))
    assert result.completed == 4 and result.usage_reported == 0
    assert all(r.prompt_tokens is None and r.output_tokens == 3 for r in result.records)
    assert result.total_input_tokens == sum(r.prompt_words for r in result.records)  # the word-count estimate


def test_token_ids_time_ttft_and_itl_at_every_token_even_without_text(fake_server: Any) -> None:
    # 3 of 6 tokens carry no text; each token follows the previous one by >= 20 ms.
    server = fake_server(FakeBehaviour(first_delay=0.03, gap=0.02, textless_tokens=3))
    result = run(config(server, num_prompts=3, output_len=(6, 6), return_token_ids=True))
    assert server.bodies[0]["return_token_ids"] is True
    assert (result.completed, result.timing, result.total_output_tokens) == (3, "token_ids", 18)
    for r in result.records:
        assert r.ttft is not None and r.ttft >= 0.03 and len(r.itl) == 5 and r.token_ids_received == 6
        assert sum(r.itl[:3]) >= 0.06  # the first text came >= 3 gaps after the first token: TTFT did not wait
    by_text = run(config(server, num_prompts=3, output_len=(6, 6)))
    assert "return_token_ids" not in server.bodies[-1] and by_text.timing == "text_chunks"
    assert all(r.ttft is not None and r.ttft >= 0.03 + 3 * 0.02 and len(r.itl) == 2 for r in by_text.records)


def test_without_usage_output_tokens_are_counted_from_token_ids(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(usage=False, textless_tokens=2))
    result = run(config(server, num_prompts=2, endpoint="chat", output_len=(5, 5), return_token_ids=True))
    assert result.usage_reported == 0 and result.total_output_tokens == 10  # 3 text chunks each: ids count all 5


def test_a_server_that_ignores_return_token_ids_is_timed_by_text(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(token_ids=False, textless_tokens=1))
    result = run(config(server, num_prompts=2, output_len=(4, 4), return_token_ids=True))
    assert server.bodies[0]["return_token_ids"] is True
    assert result.timing == "text_chunks" and all(len(r.itl) == 2 for r in result.records)


def test_429_and_500_are_failures_counted_by_status(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(statuses=(200, 429, 200, 500)))
    result = run(config(server, num_prompts=8, max_concurrency=2))
    assert (result.completed, result.failed) == (4, 4)
    assert result.failures == {"http_429": 2, "http_500": 2}
    failed = [r for r in result.records if not r.ok]
    assert {r.status for r in failed} == {429, 500} and all("fake error" in (r.error or "") for r in failed)
    assert result.total_output_tokens == 4 * 4  # failed requests add no tokens


def test_connection_refused_and_timeouts_are_failures_not_crashes(fake_server: Any) -> None:
    refused = run(BenchConfig("http://127.0.0.1:9", "m", num_prompts=3, input_len=(2, 2), output_len=(1, 1)))
    assert (refused.completed, refused.failures) == (0, {"ConnectError": 3})
    server = fake_server(FakeBehaviour(first_delay=5.0))
    t = time.perf_counter()
    slow = run(config(server, num_prompts=3, timeout_s=0.3))
    assert slow.failures == {"timeout": 3} and time.perf_counter() - t < 4.5  # cut well before the 5 s reply


def test_max_concurrency_is_never_exceeded(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.02, gap=0.005))
    result = run(config(server, num_prompts=12, max_concurrency=3, output_len=(3, 3)))
    assert result.completed == 12
    assert server.peak == 3 and result.peak_in_flight == 3  # reached, never passed
    uncapped_server = fake_server(FakeBehaviour(first_delay=0.15, gap=0.005))
    assert run(config(uncapped_server, num_prompts=6, output_len=(2, 2))).completed == 6
    assert uncapped_server.peak == 6  # rate inf and no cap: all at once


def test_poisson_rate_spreads_sends_over_the_schedule(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.0, gap=0.0))
    result = run(config(server, num_prompts=10, request_rate=40.0, seed=5, output_len=(1, 1)))
    expected = list(arrival_offsets(10, 40.0, seed=5))
    records = sorted(result.records, key=lambda r: r.index)
    assert [r.scheduled_s for r in records] == pytest.approx(expected)
    assert all(r.start_s is not None and r.start_s >= r.scheduled_s for r in records)  # never early


def test_goodput_counts_only_requests_meeting_every_slo(fake_server: Any) -> None:
    # Every second request waits 3 s more for its first token: half meet a 1.5 s TTFT objective. The fast
    # ones take ~20 ms; the wide margin is for a CI machine busy with other work (300 ms once failed there).
    server = fake_server(FakeBehaviour(first_delay=0.02, gap=0.005, slow_every=2, slow_extra=3.0,
                                       statuses=(200, 200, 200, 200, 200, 200, 200, 429)))
    result = run(config(server, num_prompts=8, output_len=(3, 3),
                        slo=SLO(ttft_ms=1500, itl_ms=1000, e2e_ms=10000)))
    # Arrivals 0, 2, 4, 6 are slow; arrival 7 is a 429; so 1, 3, 5 are the good ones.
    assert (result.completed, result.failed, result.good_requests) == (7, 1, 3)
    assert result.goodput == pytest.approx(3 / result.duration_s)
    assert result.slo_attainment == pytest.approx(3 / 8)
    no_slo = run(config(server, num_prompts=2))
    assert (no_slo.good_requests, no_slo.goodput, no_slo.slo_attainment) == (None, None, None)


def test_duration_stops_sending_and_bounds_the_run(fake_server: Any) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.01, gap=0.0))
    t = time.perf_counter()
    result = run(config(server, num_prompts=10_000, request_rate=40.0, duration_s=0.5, output_len=(1, 1)))
    assert time.perf_counter() - t < 5.0  # bounded by the 0.5 s duration, not by the 10 000 prompts
    sent = len(server.bodies)
    assert 5 <= sent <= 60 and result.completed == sent  # ~20 expected; never the 10 000 asked for
    assert all(r.scheduled_s < 0.5 for r in result.records)


def test_cli_writes_the_envelope_without_importing_torch(fake_server: Any, tmp_path: Path) -> None:
    server = fake_server(FakeBehaviour(first_delay=0.01, gap=0.005, statuses=(200, 200, 429)))
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", server.url + "/v1", "--model", "fake-model", "--num-prompts", "6",
            "--input-len", "4:8", "--output-len", "3", "--max-concurrency", "2", "--slo-ttft-ms", "1000",
            "--api-key", "secret", "--output-json", str(out), "--save-requests"]
    code = ("import sys; from governor.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'bench serve imported torch'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Completed requests" in proc.stdout and "TTFT p99 (ms)" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["completed"] == 4  # the results JSON line
    env = json.loads(out.read_text())
    assert env["benchmark"] == "serve" and env["model"] == "fake-model"
    assert env["server"] == {"base_url": server.url + "/v1", "url": server.url + "/v1/completions"}
    assert env["args"]["api_key"] == "<redacted>" and "secret" not in out.read_text()
    assert env["args"]["request_rate"] == "inf" and env["args"]["num_prompts"] == 6
    assert {"host", "platform", "python"} <= env["client"].keys()
    results = env["results"]
    assert (results["completed"], results["failed"], results["failures"]) == (4, 2, {"http_429": 2})
    assert results["good_requests"] == 4 and results["slo"] == {"ttft_ms": 1000.0, "itl_ms": None, "e2e_ms": None}
    assert {"ttft_ms", "itl_ms", "e2e_ms", "goodput", "request_throughput", "output_token_throughput",
            "total_token_throughput", "duration_s"} <= results.keys()
    assert len(env["requests"]) == 6 and {"ttft", "itl", "e2e", "status", "error_kind"} <= env["requests"][0].keys()


def test_cli_return_token_ids_sends_the_field_and_reports_token_timing(
        fake_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from governor.loadgen.cli import main

    server = fake_server(FakeBehaviour(first_delay=0.0, gap=0.0, textless_tokens=1))
    assert main(["--base-url", server.url, "--model", "m", "--num-prompts", "2", "--input-len", "3",
                 "--output-len", "4", "--return-token-ids"]) == 0
    out = capsys.readouterr().out
    assert all(b["return_token_ids"] is True for b in server.bodies)
    assert "TTFT/ITL timed at" in out and json.loads(out.strip().splitlines()[-1])["timing"] == "token_ids"


def test_cli_exits_1_when_nothing_completes_and_2_on_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from governor.loadgen.cli import main

    assert main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2", "--input-len", "2",
                 "--output-len", "1"]) == 1
    assert main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--input-len", "9:3"]) == 2
    assert "1 <= a <= b" in capsys.readouterr().err


def test_dispatcher_sends_bench_throughput_to_the_engine_and_bench_serve_to_loadgen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import governor.loadgen.cli
    from governor.cli import main

    calls: list[tuple[str, list[str]]] = []

    def recorder(name: str) -> Any:
        def main(argv: list[str]) -> int:
            calls.append((name, argv))
            return 0
        return main

    monkeypatch.setitem(sys.modules, "governor.engine.cli", types.SimpleNamespace(main=recorder("engine")))
    monkeypatch.setattr(governor.loadgen.cli, "main", recorder("loadgen"))
    assert main(["bench", "throughput", "--model", "x"]) == 0
    assert main(["bench", "serve", "--model", "x"]) == 0
    assert calls == [("engine", ["bench", "throughput", "--model", "x"]), ("loadgen", ["--model", "x"])]


def test_the_client_drops_idle_connections_before_the_server_does() -> None:
    """The load generator's idle connections expire before `governor serve` (uvicorn's default keep-alive,
    which serve.py does not change) closes them; otherwise a request written to a connection the server is
    closing fails with a ReadError of the client's making."""
    import uvicorn

    from governor.loadgen.benchmark import KEEPALIVE_EXPIRY_S

    server_keep_alive_s = uvicorn.Config(app=lambda *args: None).timeout_keep_alive
    assert 0 < KEEPALIVE_EXPIRY_S < server_keep_alive_s - 1
