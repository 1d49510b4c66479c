"""Prometheus metrics of one engine process (names from governor.contract, documented in docs/metrics.md).

Two families. Governor's own (`governor_*`) are always exported: the operator, the tuner and the rollout
analysis read them. With `--metrics-names vllm` the subset of vLLM's V1 engine metrics that Governor can fill
truthfully is exported as well (`vllm:*`, with vLLM's names, types, label names and buckets), so dashboards,
autoscaler triggers and the Gateway API Inference Extension's endpoint picker written for vLLM read a Governor
engine unchanged. It is opt-in because every vLLM series is a second observation on the step thread and adds
some three quarters to what each scrape renders and each Prometheus stores.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from governor import contract as c
from governor.engine.outputs import RequestOutput

METRICS_NAMES = ("governor", "vllm")  # `--metrics-names`: Governor's family only, or vLLM's beside it
_FINISH_REASONS = ("stop", "length", "abort", "timeout")

# Prefill, decode and per-token times: 1, 2.5, 5 per decade from 1 ms to 1000 s. Coarser than the latency
# buckets (contract.LATENCY_BUCKETS, which rollout and tuning quantiles need): these explain TTFT, ITL and e2e,
# and 19 buckets instead of 44 keep each scrape cheap; decodes longer than 120 s still get buckets.
PHASE_BUCKETS = tuple(m * 10.0**e for e in range(-3, 4) for m in (1, 2.5, 5) if m * 10.0**e <= 1000)
# Tokens per request: 1, 2, 5, 10, 20, 50, ... (vLLM's ladder), up to a million so any max_model_len fits.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
# Tokens computed by one engine step: powers of two, as batch sizes and CUDA graph sizes go.
STEP_TOKEN_BUCKETS = tuple(2**i for i in range(17))

# vLLM's buckets, so `le` series that dashboards select on exist here too.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                              10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM has no timeout: a request Governor ends at its deadline is one the server gave up on, vLLM's "abort".
_VLLM_FINISH_REASON = {"stop": "stop", "length": "length", "abort": "abort", "timeout": "abort"}


class EngineMetrics:
    """Every series carries the scope labels (`contract.SCOPE_LABELS`: model_name, revision, namespace) so the
    operator can scope queries by service and revision. Counters that mirror engine counters are advanced by
    delta after each step. All observation happens on the step thread, except `http_request` (the event loop)."""

    def __init__(self, model_name: str, revision: str, namespace: str = "", names: str = "governor") -> None:
        if names not in METRICS_NAMES:
            raise ValueError(f"metrics names must be one of {', '.join(METRICS_NAMES)}, got {names!r}")
        disable_created_metrics()  # *_created series only add cardinality for our scrapers
        self.registry = CollectorRegistry()
        self.labels = dict(zip(c.SCOPE_LABELS, (model_name, revision, namespace), strict=True))
        labelnames = list(self.labels)
        r = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float] = c.LATENCY_BUCKETS) -> Any:
            return Histogram(name, doc, labelnames, buckets=buckets, registry=r).labels(**self.labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name.removesuffix("_total"), doc, [*labelnames, *extra], registry=r)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*labelnames, *extra], registry=r)

        self.ttft = hist(c.TTFT_SECONDS, "Time from arrival to the first generated token.")
        self.itl = hist(c.ITL_SECONDS, "Time between consecutive generated tokens of a request.")
        self.e2e = hist(c.E2E_SECONDS, "Time from arrival to the end of a request.")
        self.queue = hist(c.QUEUE_SECONDS, "Time from arrival to first being scheduled.")
        self.prefill = hist(c.PREFILL_SECONDS, "Time from first being scheduled to the first token.", PHASE_BUCKETS)
        self.decode = hist(c.DECODE_SECONDS, "Time from the first token to the end of a request.", PHASE_BUCKETS)
        self.tpot = hist(c.TPOT_SECONDS, "Decode time per token after the first, one per request.", PHASE_BUCKETS)
        self.prompt_len = hist(c.REQUEST_PROMPT_TOKENS, "Prompt tokens of each finished request.", TOKEN_BUCKETS)
        self.generation_len = hist(c.REQUEST_GENERATION_TOKENS, "Tokens generated for each finished request.",
                                   TOKEN_BUCKETS)
        self.iteration_tokens = hist(c.ITERATION_TOKENS, "Tokens computed by one engine step.", STEP_TOKEN_BUCKETS)
        self.running = gauge(c.REQUESTS_RUNNING, "Requests being computed.").labels(**self.labels)
        self.waiting = gauge(c.REQUESTS_WAITING, "Requests waiting to be scheduled.").labels(**self.labels)
        self.kv_used = gauge(c.KV_BLOCKS_USED, "KV cache blocks in use.").labels(**self.labels)
        self.kv_total = gauge(c.KV_BLOCKS_TOTAL, "KV cache blocks in the pool.").labels(**self.labels)
        self.kv_usage = gauge(c.KV_CACHE_USAGE, "Fraction of KV cache blocks in use, 0 to 1.").labels(**self.labels)
        self.prompt_tokens = counter(c.PROMPT_TOKENS, "Prompt tokens admitted.").labels(**self.labels)
        self.generation_tokens = counter(c.GENERATION_TOKENS, "Tokens generated.").labels(**self.labels)
        self.preemptions = counter(c.PREEMPTIONS, "Sequences preempted for lack of KV blocks.").labels(**self.labels)
        self.finished = counter(c.REQUESTS_FINISHED, "Requests finished, by finish reason.", ("finish_reason",))
        self.errors = counter(c.REQUEST_ERRORS, "Requests refused or failed, by kind.", ("kind",))
        self.http_requests = counter(c.HTTP_REQUESTS, "HTTP requests answered, by route template, method and "
                                                      "status code.", ("route", "method", "status"))
        self.prefix_queries = counter(c.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(c.PREFIX_CACHE_HIT_TOKENS, "Prompt tokens found in the prefix cache.")
        self.spec_proposed = counter(c.SPEC_PROPOSED_TOKENS, "Speculative tokens proposed.")
        self.spec_accepted = counter(c.SPEC_ACCEPTED_TOKENS, "Speculative tokens accepted.")
        self.spec_steps = counter(c.SPEC_VERIFICATION_STEPS, "Verification steps of speculative decodes.")
        self.spec_by_position = counter(c.SPEC_ACCEPTED_BY_POSITION,
                                        "Draft tokens accepted at each draft position (1 = first).", ("position",))
        self.knob = gauge(c.KNOB, "Effective value of each live engine knob.", ("name",))
        self._info_labels = ("model_digest", "tokenizer_digest", "served_model_name", "kv_cache_dtype", "quantization")
        self.info = Gauge(c.ENGINE_INFO, "Engine identity (value is always 1; present once the model is loaded).",
                          [*labelnames, *self._info_labels], registry=r)
        for reason in _FINISH_REASONS:  # expose zeros so rate() works from the first scrape
            self.finished.labels(**self.labels, finish_reason=reason)
        r.register(_Scoped((PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR), self.labels))

        self.vllm = VllmMetrics(r, self.labels) if names == "vllm" else None
        def followers(governor: Any, vllm_name: str) -> list[Any]:
            return [governor] if self.vllm is None else [governor, getattr(self.vllm, vllm_name)]

        # Engine counters mirrored by delta: stats() key -> the counters that follow it.
        self._mirrored: list[tuple[str, list[Any]]] = [
            ("prompt_tokens", followers(self.prompt_tokens, "prompt_tokens")),
            ("generation_tokens", followers(self.generation_tokens, "generation_tokens")),
            ("preemptions", followers(self.preemptions, "preemptions")),
            ("prefix_cache_queries", followers(self.prefix_queries.labels(**self.labels), "prefix_queries")),
            ("prefix_cache_hit_tokens", followers(self.prefix_hits.labels(**self.labels), "prefix_hits")),
            ("spec_proposed_tokens", followers(self.spec_proposed.labels(**self.labels), "spec_draft_tokens")),
            ("spec_accepted_tokens", followers(self.spec_accepted.labels(**self.labels), "spec_accepted")),
            ("spec_verification_steps", followers(self.spec_steps.labels(**self.labels), "spec_drafts")),
        ]
        self._last: dict[str, int] = {}
        # Server-clock time of each live request's first token (for prefill, decode and time per output token),
        # until it finishes; `forget_ended` drops those of requests that ended otherwise (aborts).
        self._first_token_at: dict[str, float] = {}

    def set_info(self, info: dict[str, str]) -> None:
        """Publish the loaded engine's identity: model and tokenizer digests, served name, KV dtype, weight
        quantization."""
        self.info.labels(**self.labels, **{k: info[k] for k in self._info_labels}).set(1)

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Update gauges and advance mirrored counters from the engine's stats() (after a step or an abort)."""
        used, total = stats["kv_blocks_used"], stats["kv_blocks_total"]
        usage = used / total if total else 0.0
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_used.set(used)
        self.kv_total.set(total)
        self.kv_usage.set(usage)
        if self.vllm is not None:
            self.vllm.observe_state(stats, usage)
        last = self._last
        for key, metrics in self._mirrored:
            value = stats[key]
            delta = value - last.get(key, 0)
            if delta > 0:
                for metric in metrics:
                    metric.inc(delta)
            last[key] = value
        for pos, count in enumerate(stats.get("spec_acceptance_by_position", []), start=1):
            delta = count - last.get(f"spec_pos_{pos}", 0)
            if delta > 0:
                self.spec_by_position.labels(**self.labels, position=str(pos)).inc(delta)
                if self.vllm is not None:  # vLLM counts draft positions from 0
                    self.vllm.spec_accepted_per_pos.labels(**self.vllm.labels, position=str(pos - 1)).inc(delta)
            last[f"spec_pos_{pos}"] = count
        # Baselines for `observe_step`: what ran before (a warm-up, say) is no step of this server's.
        last["steps"] = stats["steps"]
        if "tokens_computed" in stats:
            last["tokens_computed"] = stats["tokens_computed"]

    def observe_step(self, stats: dict[str, Any]) -> None:
        """After an engine step: `observe_stats`, and the tokens the step computed (when the engine reports them
        as `tokens_computed`: every token its forward passes ran, prefill chunks, decodes and drafts)."""
        steps, computed = stats["steps"], stats.get("tokens_computed")
        if computed is not None and steps > self._last.get("steps", 0):
            n = computed - self._last.get("tokens_computed", 0)
            self.iteration_tokens.observe(n)
            if self.vllm is not None:
                self.vllm.iteration_tokens.observe(n)
        self.observe_stats(stats)

    def observe_first_token(self, request_id: str, ttft_s: float, at: float) -> None:
        """A request's first token reached the server at `at` (time.monotonic()), `ttft_s` after it arrived."""
        self.ttft.observe(ttft_s)
        if self.vllm is not None:
            self.vllm.ttft.observe(ttft_s)
        self._first_token_at[request_id] = at

    def observe_inter_tokens(self, itls_s: Sequence[float]) -> None:
        """Tokens after the first reached the server, each the given seconds after its request's previous one
        (a step's worth at once: one call per step, not per token)."""
        observe = self.itl.observe
        for itl_s in itls_s:
            observe(itl_s)
        if self.vllm is not None:
            observe = self.vllm.itl.observe
            for itl_s in itls_s:
                observe(itl_s)

    def observe_finished(self, out: RequestOutput, at: float, last_token_at: float | None) -> None:
        """A request ended on its own (stop, length, timeout), seen by the server at `at`; `last_token_at` is when
        its last token was (None: it got none). Times are time.monotonic(), the clock of the engine's own."""
        self.finish(out.outputs[0].finish_reason or "abort")
        m = out.metrics
        num_prompt, num_generated = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        scheduled_at = m["arrival"] + m["queue_s"] if "queue_s" in m else None
        first_token_at = self._first_token_at.pop(out.request_id, None)
        self.e2e.observe(m["e2e_s"])
        if scheduled_at is not None:
            self.queue.observe(m["queue_s"])
        self.prompt_len.observe(num_prompt)
        self.generation_len.observe(num_generated)
        if first_token_at is not None:
            if scheduled_at is not None:
                self.prefill.observe(first_token_at - scheduled_at)
            decode_s = at - first_token_at
            self.decode.observe(decode_s)
            if num_generated > 1:
                self.tpot.observe(decode_s / (num_generated - 1))
        v = self.vllm
        if v is None:
            return
        v.e2e.observe(m["e2e_s"])
        v.prompt_len.observe(num_prompt)
        v.generation_len.observe(num_generated)
        if scheduled_at is not None:
            v.queue.observe(m["queue_s"])
        if first_token_at is None or last_token_at is None:
            return  # vLLM's phase times need a first token; without one they would be made up
        if scheduled_at is not None:
            v.prefill.observe(first_token_at - scheduled_at)
            v.inference.observe(last_token_at - scheduled_at)
        decode_s = last_token_at - first_token_at  # vLLM's decode phase ends at the last token, not the finish
        v.decode.observe(decode_s)
        v.tpot.observe(decode_s / (num_generated - 1) if num_generated > 1 else 0.0)  # vLLM observes 0 for one

    def forget_ended(self, live: Collection[str]) -> None:
        """Drop first-token times of requests no longer `live` (aborted, so never `observe_finished`). Called after
        every step; rebuilds only once 64 such entries have piled up, so it costs O(1) per step."""
        if len(self._first_token_at) > len(live) + 64:
            self._first_token_at = {rid: t for rid, t in self._first_token_at.items() if rid in live}

    def set_knobs(self, knobs: dict[str, int]) -> None:
        for name, value in knobs.items():
            self.knob.labels(**self.labels, name=name).set(value)

    def finish(self, reason: str) -> None:
        """Count a request that ended, by finish reason (stop, length, abort, timeout)."""
        self.finished.labels(**self.labels, finish_reason=reason).inc()
        if self.vllm is not None:
            self.vllm.success[_VLLM_FINISH_REASON.get(reason, "abort")].inc()

    def error(self, kind: str) -> None:
        self.errors.labels(**self.labels, kind=kind).inc()

    def http_request(self, route: str, method: str, status: int) -> None:
        """Count an answered HTTP request (`http_metrics.HttpMetricsMiddleware` calls it)."""
        self.http_requests.labels(**self.labels, route=route, method=method, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmMetrics:
    """vLLM's names for what Governor measures. Every series carries vLLM's labels, `model_name` (the served
    model name, as vLLM's) and `engine` ("0": one engine per process), and Governor's `revision` and `namespace`.
    Left out, because Governor has no truthful value for them: LoRA (`vllm:lora_requests_info`), sleep mode,
    request parameter histograms, prompt tokens by source, external and multi-modal caches, `error` and
    `repetition` finish reasons."""

    def __init__(self, registry: CollectorRegistry, scope: dict[str, str]) -> None:
        self.labels = {**scope, "engine": "0"}
        labelnames = list(self.labels)
        r = registry

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, labelnames, buckets=buckets, registry=r).labels(**self.labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labelnames, registry=r).labels(**self.labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labelnames, registry=r).labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use; 1 is full.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions of running requests.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests taken in.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                          [*labelnames, "finished_reason"], registry=r)
        self.success = {reason: success.labels(**self.labels, finished_reason=reason)
                        for reason in ("stop", "length", "abort")}
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                               TOKEN_BUCKETS)
        self.generation_len = hist("vllm:request_generation_tokens", "Tokens generated for each finished request.",
                                   TOKEN_BUCKETS)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens computed by one engine step.",
                                     VLLM_ITERATION_BUCKETS)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to the first token.", VLLM_TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                        VLLM_TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Mean time per token after the first, one observation per finished request.",
                         VLLM_TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                        VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting to be first scheduled.",
                          VLLM_REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "Time from first scheduled to the last token.",
                              VLLM_REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled to the first token.",
                            VLLM_REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                           VLLM_REQUEST_LATENCY_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative verification steps.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0 = first).",
                                             [*labelnames, "position"], registry=r)
        # The endpoint picker's prefix-cache scorer reads these two labels (the rest of vLLM's cache config has
        # no Governor counterpart). Published with the first stats, when the pool is known.
        self._cache_info = Gauge("vllm:cache_config_info", "KV cache configuration (the value is always 1).",
                                 [*labelnames, "block_size", "num_gpu_blocks"], registry=r)
        self._cache_info_set = False

    def observe_state(self, stats: dict[str, Any], kv_usage: float) -> None:
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_usage.set(kv_usage)
        if not self._cache_info_set:
            self._cache_info.labels(**self.labels, block_size=str(stats["kv_block_size"]),
                                    num_gpu_blocks=str(stats["kv_blocks_total"])).set(1)
            self._cache_info_set = True


class _Scoped(Collector):
    """prometheus_client's process, platform and garbage-collector collectors, read on each scrape, with the
    scope labels added to their samples (so every series of the engine carries them)."""

    def __init__(self, collectors: Iterable[Collector], labels: dict[str, str]) -> None:
        self.collectors = tuple(collectors)
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        for collector in self.collectors:
            for family in collector.collect():
                scoped = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    scoped.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
                yield scoped
