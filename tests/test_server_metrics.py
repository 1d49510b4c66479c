"""`governor serve --metrics-names vllm` end to end: the request histograms, KV usage, HTTP and process metrics,
and vLLM's names beside Governor's, read from a real server process on 127.0.0.1.

One server (the tiny Qwen3 of conftest) serves the whole module; each test takes deltas of what it sends, so
the order of tests does not matter. Every wait is bounded.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from governor import contract
from governor.cli import main as governor_main
from governor.engine.server.async_engine import burst_gaps
from governor.engine.server.http_metrics import UNMATCHED, HttpMetricsMiddleware
from governor.engine.server.metrics import EngineMetrics
from governor.engine.tokenizer import load_tokenizer
from tests.test_server import Sample, Server, metric_value, start_server, wait_until

MODEL = "tiny-qwen3"
REVISION = "r2"
NAMESPACE = "team-b"
NUM_KV_BLOCKS = 256
DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SCOPE = {"model_name": MODEL, "revision": REVISION, "namespace": NAMESPACE}


@pytest.fixture(scope="module")
def server(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--revision", REVISION,
                      "--metrics-names", "vllm", "--max-model-len", "512", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                      "--max-num-batched-tokens", "128", log_dir=tmp_path_factory.mktemp("logs"),
                      env={contract.NAMESPACE_ENV: NAMESPACE}) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(hf_checkpoint: Callable[[str], Path]) -> Any:
    return load_tokenizer(hf_checkpoint("qwen3"))


def complete(server: Server, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of exactly `max_tokens` tokens (ignore_eos), checked to have succeeded."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def idle(server: Server) -> list[Sample]:
    """A scrape taken once no request runs or waits (every step's metrics are then in)."""
    def settled() -> list[Sample] | None:
        samples = server.metrics()
        busy = metric_value(samples, contract.REQUESTS_RUNNING) + metric_value(samples, contract.REQUESTS_WAITING)
        return None if busy else samples
    return wait_until(settled, "the engine to be idle", timeout=10)


def deltas(before: list[Sample], after: list[Sample], names: list[str]) -> dict[str, float]:
    return {n: metric_value(after, n) - metric_value(before, n) for n in names}


# --- Governor's request histograms -----------------------------------------------------------------


def test_each_finished_request_is_observed_once_in_every_request_histogram(server: Server, tokenizer: Any) -> None:
    prompts, n_tokens = ["a small red boat", "the long road home", "seven quiet lamps"], 5
    histograms = [contract.REQUEST_PROMPT_TOKENS, contract.REQUEST_GENERATION_TOKENS, contract.PREFILL_SECONDS,
                  contract.DECODE_SECONDS, contract.TPOT_SECONDS]
    names = [f"{h}_{part}" for h in histograms for part in ("count", "sum")]
    before = idle(server)
    for p in prompts:
        complete(server, p, n_tokens)
    d = deltas(before, idle(server), names)
    assert {n: d[f"{n}_count"] for n in histograms} == dict.fromkeys(histograms, len(prompts))
    assert d[f"{contract.REQUEST_PROMPT_TOKENS}_sum"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert d[f"{contract.REQUEST_GENERATION_TOKENS}_sum"] == len(prompts) * n_tokens
    assert d[f"{contract.PREFILL_SECONDS}_sum"] > 0
    # Each request's time per output token is its decode time over the 4 tokens after the first.
    assert d[f"{contract.TPOT_SECONDS}_sum"] == pytest.approx(d[f"{contract.DECODE_SECONDS}_sum"] / (n_tokens - 1))


def test_prompt_and_generation_lengths_land_in_their_buckets(server: Server) -> None:
    prompt = list(range(1000, 1030))  # 30 token ids: between the 20 and 50 buckets
    bucket = f"{contract.REQUEST_PROMPT_TOKENS}_bucket"
    gen_bucket = f"{contract.REQUEST_GENERATION_TOKENS}_bucket"
    before = idle(server)
    complete(server, prompt, 3)
    after = idle(server)

    def delta(name: str, le: str) -> float:
        return metric_value(after, name, le=le) - metric_value(before, name, le=le)

    assert (delta(bucket, "20.0"), delta(bucket, "50.0")) == (0, 1)
    assert (delta(gen_bucket, "2.0"), delta(gen_bucket, "5.0")) == (0, 1)


def test_an_engine_step_is_observed_with_the_tokens_it_computed(server: Server) -> None:
    # Token ids no other request sends: no prefix-cache hit, so all 40 prompt tokens are computed (one chunk,
    # under the 128-token budget), then one decode token per step for the 4 tokens after the first.
    prompt, n_tokens = list(range(1500, 1540)), 5
    name = contract.ITERATION_TOKENS
    before = idle(server)
    complete(server, prompt, n_tokens)
    d = deltas(before, idle(server), [f"{name}_sum", f"{name}_count"])
    assert d[f"{name}_sum"] == len(prompt) + n_tokens - 1
    assert 1 <= d[f"{name}_count"] <= n_tokens


def test_kv_cache_usage_is_the_fraction_of_blocks_held_while_a_request_runs(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "a story about the sea", "max_tokens": 400,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        wait_until(lambda: next(lines).startswith("data: "), "the first streamed token")
        samples = server.metrics()
        usage = metric_value(samples, contract.KV_CACHE_USAGE)
        assert 0 < usage <= 1
        # Within a block: the step thread may set the two gauges on either side of this scrape.
        assert usage == pytest.approx(metric_value(samples, contract.KV_BLOCKS_USED) / NUM_KV_BLOCKS,
                                      abs=1 / NUM_KV_BLOCKS)
    # Leaving the stream aborts the request: its blocks go back to the pool.
    wait_until(lambda: server.metric(contract.KV_CACHE_USAGE) == 0, "the KV cache usage to return to 0")


# --- HTTP requests ---------------------------------------------------------------------------------


def test_http_requests_are_counted_by_route_template_method_and_status(server: Server) -> None:
    name = contract.HTTP_REQUESTS
    cases = {  # (route, method, status) -> how to produce one
        (UNMATCHED, "GET", "404"): lambda: httpx.get(f"{server.url}/no/such/path", timeout=10),
        ("/v1/completions", "GET", "405"): lambda: httpx.get(f"{server.url}/v1/completions", timeout=10),
        ("/v1/completions", "POST", "400"): lambda: httpx.post(f"{server.url}/v1/completions", timeout=10,
                                                               json={"model": MODEL, "prompt": "hi", "max_tokens": -1}),
        ("/v1/models", "GET", "200"): lambda: httpx.get(f"{server.url}/v1/models", timeout=10),
        (UNMATCHED, "other", "404"): lambda: httpx.request("BREW", f"{server.url}/coffee", timeout=10),
    }
    before = server.metrics()
    for (_, _, status), send in cases.items():
        assert send().status_code == int(status)
    after = server.metrics()
    counted = {key: metric_value(after, name, route=key[0], method=key[1], status=key[2])
               - metric_value(before, name, route=key[0], method=key[1], status=key[2]) for key in cases}
    assert counted == dict.fromkeys(cases, 1)


def test_unknown_paths_add_no_route_label_values(server: Server) -> None:
    for i in range(5):
        assert httpx.get(f"{server.url}/scan/{i}/wp-login.php", timeout=10).status_code == 404
    # The app's route templates, from its OpenAPI schema, and the schema and docs routes themselves.
    templates = {*httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"], "/openapi.json", "/docs",
                 "/docs/oauth2-redirect", "/redoc"}
    server.get("/metrics")  # counted once answered, so the next scrape shows it
    routes = {labels["route"] for name, labels, _ in server.metrics() if name == contract.HTTP_REQUESTS}
    assert {UNMATCHED, "/ready", "/metrics", "/openapi.json"} <= routes <= templates | {UNMATCHED}


def test_an_exception_before_the_response_is_counted_as_a_500() -> None:
    metrics = EngineMetrics("m", "r1")
    app = FastAPI()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("no answer")

    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    assert TestClient(app, raise_server_exceptions=False).get("/boom").status_code == 500
    labels = {"model_name": "m", "revision": "r1", "namespace": "", "route": "/boom", "method": "GET", "status": "500"}
    assert metrics.registry.get_sample_value(contract.HTTP_REQUESTS, labels) == 1


# --- process metrics -------------------------------------------------------------------------------


def test_process_metrics_describe_the_engine_process(server: Server) -> None:
    samples = server.metrics()
    assert metric_value(samples, "process_resident_memory_bytes", **SCOPE) > 50 * 2**20  # torch alone is more
    assert metric_value(samples, "process_cpu_seconds_total", **SCOPE) > 0
    assert metric_value(samples, "process_open_fds", **SCOPE) > 0
    assert metric_value(samples, "python_info", **SCOPE) == 1
    assert {lab["generation"] for n, lab, _ in samples if n == "python_gc_collections_total"} == {"0", "1", "2"}


# --- vLLM's names ----------------------------------------------------------------------------------

# Governor series -> the vLLM series that exports the same measurement (histograms: both _count and _sum).
ALIASES = {
    contract.REQUESTS_RUNNING: "vllm:num_requests_running",
    contract.REQUESTS_WAITING: "vllm:num_requests_waiting",
    contract.KV_CACHE_USAGE: "vllm:kv_cache_usage_perc",
    contract.PROMPT_TOKENS: "vllm:prompt_tokens_total",
    contract.GENERATION_TOKENS: "vllm:generation_tokens_total",
    contract.PREEMPTIONS: "vllm:num_preemptions_total",
    contract.PREFIX_CACHE_QUERIES: "vllm:prefix_cache_queries_total",
    contract.PREFIX_CACHE_HIT_TOKENS: "vllm:prefix_cache_hits_total",
    contract.SPEC_PROPOSED_TOKENS: "vllm:spec_decode_num_draft_tokens_total",
    contract.SPEC_ACCEPTED_TOKENS: "vllm:spec_decode_num_accepted_tokens_total",
    contract.SPEC_VERIFICATION_STEPS: "vllm:spec_decode_num_drafts_total",
    **{f"{g}_{part}": f"{v}_{part}" for g, v in (
        (contract.TTFT_SECONDS, "vllm:time_to_first_token_seconds"),
        (contract.ITL_SECONDS, "vllm:inter_token_latency_seconds"),
        (contract.E2E_SECONDS, "vllm:e2e_request_latency_seconds"),
        (contract.QUEUE_SECONDS, "vllm:request_queue_time_seconds"),
        (contract.PREFILL_SECONDS, "vllm:request_prefill_time_seconds"),
        # Equal here: every request of this module that finishes on its own does so with its last token (no
        # timeouts) and generates more than one token.
        (contract.DECODE_SECONDS, "vllm:request_decode_time_seconds"),
        (contract.TPOT_SECONDS, "vllm:request_time_per_output_token_seconds"),
        (contract.REQUEST_PROMPT_TOKENS, "vllm:request_prompt_tokens"),
        (contract.REQUEST_GENERATION_TOKENS, "vllm:request_generation_tokens"),
        (contract.ITERATION_TOKENS, "vllm:iteration_tokens_total"),
    ) for part in ("count", "sum")},
}


def test_vllm_series_equal_the_governor_series_they_alias(server: Server) -> None:
    complete(server, "the garden gate", 4)
    samples = idle(server)
    governor = {g: metric_value(samples, g) for g in ALIASES}
    vllm = {g: metric_value(samples, v) for g, v in ALIASES.items()}
    assert vllm == governor
    assert governor[f"{contract.TTFT_SECONDS}_count"] > 0  # not equal because both are empty


def test_vllm_request_success_counts_finish_reasons_as_vllm_names_them(server: Server) -> None:
    complete(server, "two old keys", 3)
    samples = idle(server)
    finished = {r: metric_value(samples, contract.REQUESTS_FINISHED, finish_reason=r)
                for r in ("stop", "length", "abort", "timeout")}
    success = {lab["finished_reason"]: v for n, lab, v in samples if n == "vllm:request_success_total"}
    assert success == {"stop": finished["stop"], "length": finished["length"],
                       "abort": finished["abort"] + finished["timeout"]}
    assert success["length"] > 0


def test_vllm_series_carry_vllm_labels_and_the_scope(server: Server) -> None:
    samples = [s for s in server.metrics() if s[0].startswith("vllm:")]
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n, _, _ in samples}
    # What dashboards, KEDA triggers and the endpoint picker read.
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds", "vllm:request_success_total", "vllm:iteration_tokens_total",
            "vllm:request_prefill_time_seconds", "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds", "vllm:cache_config_info"} <= names
    assert "vllm:lora_requests_info" not in names  # Governor serves no adapters: no value to give
    for name, labels, _ in samples:
        assert labels.items() >= {**SCOPE, "engine": "0"}.items(), name
    [(_, info, value)] = [s for s in samples if s[0] == "vllm:cache_config_info"]
    assert (info["block_size"], info["num_gpu_blocks"], value) == ("16", str(NUM_KV_BLOCKS), 1)


def test_vllm_histograms_use_vllm_buckets(server: Server) -> None:
    samples = server.metrics()

    def bounds(name: str) -> list[str]:
        return [lab["le"] for n, lab, _ in samples if n == f"{name}_bucket"]

    assert bounds("vllm:time_to_first_token_seconds")[:3] == ["0.001", "0.005", "0.01"]
    assert bounds("vllm:time_to_first_token_seconds")[-2:] == ["2560.0", "+Inf"]
    assert bounds("vllm:iteration_tokens_total") == [
        f"{b}.0" for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)] + ["+Inf"]
    assert bounds("vllm:e2e_request_latency_seconds")[-2:] == ["7680.0", "+Inf"]


def test_without_the_flag_no_vllm_name_is_exported() -> None:
    body = EngineMetrics("m", "r1").render().decode()
    assert "vllm:" not in body
    assert contract.KV_CACHE_USAGE in body and "process_resident_memory_bytes" in body


def test_metrics_names_takes_only_governor_or_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        governor_main(["serve", "/models/m", "--metrics-names", "sglang"])
    assert exited.value.code == 2
    assert "--metrics-names" in capsys.readouterr().err
    with pytest.raises(ValueError, match="governor, vllm"):
        EngineMetrics("m", "r1", names="sglang")


# --- every series ----------------------------------------------------------------------------------


def test_every_series_carries_the_scope_labels_and_every_name_is_documented(server: Server) -> None:
    samples = server.metrics()
    for name, labels, _ in samples:
        assert labels.items() >= SCOPE.items(), name
    exported = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n, _, _ in samples}
    docs = DOCS.read_text()
    assert not sorted(n for n in exported if f"`{n}`" not in docs)


# promtool's lint rules that vLLM's own names break (the names are vLLM's, kept so its tooling finds them), and
# the contract's gauge governor_kv_blocks_total, named before this lint was run.
ACCEPTED_LINT = re.compile(r"^(vllm:\w+ metric names should not contain ':'"
                           r"|(vllm:iteration_tokens_total|governor_kv_blocks_total) non-counter metrics should not "
                           r"have \"_total\" suffix)$")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_the_metrics_body_passes_promtool(server: Server) -> None:
    body = httpx.get(f"{server.url}/metrics", timeout=10).content
    checked = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    problems = [line for line in (checked.stdout + checked.stderr).decode().splitlines() if line.strip()]
    assert checked.returncode in (0, 3), problems  # 3: lint problems only, the body parsed
    assert [p for p in problems if not ACCEPTED_LINT.match(p.strip())] == []


def test_tokens_that_arrive_together_share_the_wait_since_the_last_one() -> None:
    """One observation per token after a request's first: a burst of n tokens (a speculative step's accepted drafts
    and its verified token) observes n shares of the wait, not the whole wait once and n - 1 zeros."""
    assert burst_gaps(1, 10.0, 10.5) == [0.5]
    assert burst_gaps(4, 10.0, 11.0) == [0.25] * 4
    assert burst_gaps(1, None, 5.0) == []  # the first token is TTFT
    assert burst_gaps(3, None, 5.0) == [0.0, 0.0]
