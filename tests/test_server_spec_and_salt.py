"""A server with speculative decoding and per-API-key prefix-cache salts (real process, openai client)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server import Server, start_server

MODEL = "spec"
TOKEN = "admin-secret"


@pytest.fixture(scope="module")
def spec_server(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    # One step at a time, so that prompt lookup runs every step: with async scheduling a proposer that finds nothing
    # sits out steps, and this random model's outputs repeat its prompt only now and then.
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(start_server(
            hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--salt-per-api-key", "--block-size", "8",
            "--speculative-config", spec, "--no-async-scheduling", log_dir=tmp_path_factory.mktemp("logs"),
            env={"GOVERNOR_ADMIN_TOKEN": TOKEN}))


def complete(server: Server, api_key: str, prompt: str, max_tokens: int = 8) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    return str(out.choices[0].text)


def test_prefix_cache_is_shared_within_an_api_key_and_not_across(spec_server: Server) -> None:
    prompt = "the model serves a queue of requests " * 6
    hits = lambda: spec_server.metric("governor_prefix_cache_hit_tokens_total")  # noqa: E731
    complete(spec_server, "key-a", prompt)
    h0 = hits()
    complete(spec_server, "key-b", prompt)
    assert hits() == h0  # another tenant: nothing reused
    complete(spec_server, "key-a", prompt)
    assert hits() > h0  # the same tenant: the cached prefix is reused


def test_speculation_is_counted_in_metrics(spec_server: Server) -> None:
    before = spec_server.metric("governor_spec_verification_steps_total")
    complete(spec_server, "key-c", "a b c a b c a b c a b c a b c", max_tokens=24)
    steps = spec_server.metric("governor_spec_verification_steps_total") - before
    assert steps > 0
    proposed = spec_server.metric("governor_spec_proposed_tokens_total")
    accepted = spec_server.metric("governor_spec_accepted_tokens_total")
    first = spec_server.metric("governor_spec_accepted_by_position_total", position="1")
    assert 0 <= accepted <= proposed and proposed > 0
    assert first <= spec_server.metric("governor_spec_verification_steps_total")
    assert accepted == sum(spec_server.metric("governor_spec_accepted_by_position_total", position=str(p))
                           for p in (1, 2, 3))


@pytest.fixture(scope="module")
def trained_spec_server(trained_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """n-gram speculation on the trained test model, whose greedy text repeats itself, so drafts are accepted."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    with start_server(trained_llama, "--served-model-name", MODEL, "--speculative-config", spec,
                      log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


def test_tokens_that_arrive_together_share_the_wait_in_the_inter_token_histogram(trained_spec_server: Server
                                                                                 ) -> None:
    """A speculative step hands a request its accepted drafts with the verified token: each is one observation of
    the inter-token histogram (one per token after the first), and together they sum to the request's decode
    time, in a real server. How a burst's wait is split among its tokens is
    tests/test_server_metrics.py::test_tokens_that_arrive_together_share_the_wait_since_the_last_one's."""
    server = trained_spec_server
    itl = "governor_inter_token_latency_seconds"
    tpot = "governor_request_time_per_output_token_seconds"
    before = {name: server.metric(name) for name in (f"{itl}_count", f"{itl}_sum", f"{tpot}_sum",
                                                       "governor_spec_accepted_tokens_total")}
    complete(server, "key-d", "def __init__(self, ", max_tokens=24)
    after = {name: server.metric(name) for name in before}
    assert after["governor_spec_accepted_tokens_total"] > before["governor_spec_accepted_tokens_total"]
    assert after[f"{itl}_count"] - before[f"{itl}_count"] == 23
    # TPOT is the request's decode time over its 23 gaps: the gaps sum to 23 times it (the server's clock).
    decode_s = 23 * (after[f"{tpot}_sum"] - before[f"{tpot}_sum"])
    assert after[f"{itl}_sum"] - before[f"{itl}_sum"] == pytest.approx(decode_s, rel=1e-6, abs=1e-6)


def test_k_is_tunable_through_the_admin_api_within_its_cap(spec_server: Server) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    r = httpx.put(f"{spec_server.url}/admin/knobs", json={"num_speculative_tokens": 1}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["num_speculative_tokens"] == 1
    assert r.json()["bounds"]["num_speculative_tokens"] == {"min": 0, "max": 3}
    assert spec_server.metric("governor_knob", name="num_speculative_tokens") == 1
    r = httpx.put(f"{spec_server.url}/admin/knobs", json={"num_speculative_tokens": 4}, headers=auth, timeout=10)
    assert r.status_code == 422 and "[0, 3]" in r.json()["error"]["message"]
