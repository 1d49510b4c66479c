"""`governor serve` keeps its memory flat under a long stream of short requests.

A real server process on 127.0.0.1 (the tiny `governor make-model` checkpoint) answers short greedy requests in a
bounded loop: completions and chat, streamed and not, over a kept-alive connection and (every third) over a new
connection. Each prompt carries words the tokenizer has never seen, as user traffic does. After a warm-up, the test
samples the server's resident set size (VmRSS in /proc/<pid>/status) and asserts that over the second half of the
requests it grew by less than `MAX_GROWTH_PER_REQUEST` bytes a request.

What the bound separates (this workload, RSS sampled as here, bytes per request over the measured second half):
- a server that keeps nothing per request: 220-260 B. Its Python heap (tracemalloc, sys.getallocatedblocks) and
  malloc's bytes in use stay flat meanwhile: the allocators are still touching pages of their free lists for the
  first time, which levels off after ~2,000 requests (under 25 B a request from there on, in runs of up to 50,000);
- the tokenizer's word cache taking every new word, as it did before `load_tokenizer` capped it: 1,700-1,800 B
  (it stops only at 10,000 words, ~4 MB);
- a finished request's engine state kept (its RequestState): 3,700-4,100 B.
600 B is more than twice that warm-up rise and about a third of the smallest of those growths.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from governor.cli import main as governor_main
from tests.test_server import Server, start_server

WARM_UP_REQUESTS = 400  # fills the tokenizer's word cache (4 new words a request) and the allocator's free lists
# Measured after the warm-up; 1,600 in all take ~15 s of server and client CPU on two cores. A long run:
# GOVERNOR_MEMORY_TEST_REQUESTS=50000 python -m pytest -q -s tests/test_server_memory.py
REQUESTS = int(os.environ.get("GOVERNOR_MEMORY_TEST_REQUESTS", "1200"))
SAMPLES = 12  # RSS samples over the measured requests, one every REQUESTS / SAMPLES
MAX_GROWTH_PER_REQUEST = 600  # bytes; see the module docstring for how it was chosen
MODEL = "tiny"
WORDS = ("the", "river", "ran", "down", "past", "old", "mill", "and", "under", "stone", "bridge", "at", "night")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "qwen3-tiny"
    assert governor_main(["make-model", str(path), "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32"]) == 0
    return path


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid`, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line in /proc/{pid}/status")


def new_words(i: int) -> str:
    """Four words of letters no other request uses (each one pre-token to a byte-level BPE tokenizer)."""
    stem = "".join(chr(ord("a") + i // 26**k % 26) for k in range(4))
    return " ".join(f"zq{stem}{suffix}" for suffix in "abcd")


def request(i: int) -> tuple[str, dict[str, object]]:
    """Request i of the loop: the path and body. Completions and chat, streamed and not, 1 to 4 greedy tokens."""
    prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6)) + " " + new_words(i)
    body: dict[str, object] = {"model": MODEL, "max_tokens": 1 + i % 4, "temperature": 0.0, "ignore_eos": True,
                               "stream": i % 4 >= 2}
    if i % 2:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def send(kept_alive: httpx.Client, new_connection: httpx.Client, server: Server, requests: range) -> None:
    """Send each request and read its whole response; every third goes over a new connection."""
    for i in requests:
        client = new_connection if i % 3 == 0 else kept_alive
        path, body = request(i)
        if body["stream"]:
            with client.stream("POST", f"{server.url}{path}", json=body) as r:
                assert r.status_code == 200, r.read()
                lines = list(r.iter_lines())
            assert "data: [DONE]" in lines
        else:
            r = client.post(f"{server.url}{path}", json=body)
            assert r.status_code == 200, r.text


@pytest.fixture(params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def server(request: pytest.FixtureRequest, model: Path, tmp_path: Path) -> Iterator[Server]:
    caching = "--enable-prefix-caching" if request.param else "--no-enable-prefix-caching"
    # One torch thread: on a shared machine more threads only spin; memory is what is measured here.
    with start_server(model, "--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "64",
                      "--max-num-seqs", "4", caching, log_dir=tmp_path, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def test_server_rss_stays_flat_over_many_short_requests(server: Server) -> None:
    pid = server.proc.pid
    every = REQUESTS // SAMPLES
    with (httpx.Client(timeout=30) as kept_alive,
          httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as new_connection):
        send(kept_alive, new_connection, server, range(WARM_UP_REQUESTS))
        rss = [rss_bytes(pid)]
        for k in range(SAMPLES):
            start = WARM_UP_REQUESTS + k * every
            send(kept_alive, new_connection, server, range(start, start + every))
            rss.append(rss_bytes(pid))
    half = SAMPLES // 2
    per_request = (rss[-1] - rss[half]) / (REQUESTS - half * every)
    trace = ", ".join(f"{(r - rss[0]) // 1024:+d}" for r in rss)
    assert per_request < MAX_GROWTH_PER_REQUEST, (
        f"the server's RSS grew by {per_request:.0f} B a request over the last {REQUESTS - half * every} of "
        f"{WARM_UP_REQUESTS + REQUESTS} short requests (bound {MAX_GROWTH_PER_REQUEST} B); KiB after warm-up, every "
        f"{every} requests: {trace}. Something outlives its request: compare tracemalloc snapshots of the server")
    assert server.proc.poll() is None, server.log_tail()
    print(f"RSS {per_request:.0f} B a request over the last {REQUESTS - half * every} requests; KiB: {trace}")
