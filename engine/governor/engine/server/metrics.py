"""Prometheus metrics of one engine process (names from governor.contract, documented in docs/metrics.md)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from governor import contract as c

_FINISH_REASONS = ("stop", "length", "abort", "timeout")


class EngineMetrics:
    """Every series carries the scope labels (`contract.SCOPE_LABELS`: model_name, revision, namespace) so the
    operator can scope queries by service and revision. Counters that mirror engine counters are advanced by
    delta after each step."""

    def __init__(self, model_name: str, revision: str, namespace: str = "") -> None:
        disable_created_metrics()  # *_created series only add cardinality for our scrapers
        self.registry = CollectorRegistry()
        self.labels = dict(zip(c.SCOPE_LABELS, (model_name, revision, namespace), strict=True))
        names = list(self.labels)
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=c.LATENCY_BUCKETS, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name.removesuffix("_total"), doc, [*names, *extra], registry=r)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*names, *extra], registry=r)

        self.ttft = hist(c.TTFT_SECONDS, "Time from arrival to the first generated token.").labels(**self.labels)
        self.itl = hist(c.ITL_SECONDS, "Time between consecutive generated tokens of a request.").labels(**self.labels)
        self.e2e = hist(c.E2E_SECONDS, "Time from arrival to the end of a request.").labels(**self.labels)
        self.queue = hist(c.QUEUE_SECONDS, "Time from arrival to first being scheduled.").labels(**self.labels)
        self.running = gauge(c.REQUESTS_RUNNING, "Requests being computed.").labels(**self.labels)
        self.waiting = gauge(c.REQUESTS_WAITING, "Requests waiting to be scheduled.").labels(**self.labels)
        self.kv_used = gauge(c.KV_BLOCKS_USED, "KV cache blocks in use.").labels(**self.labels)
        self.kv_total = gauge(c.KV_BLOCKS_TOTAL, "KV cache blocks in the pool.").labels(**self.labels)
        self.prompt_tokens = counter(c.PROMPT_TOKENS, "Prompt tokens admitted.").labels(**self.labels)
        self.generation_tokens = counter(c.GENERATION_TOKENS, "Tokens generated.").labels(**self.labels)
        self.preemptions = counter(c.PREEMPTIONS, "Sequences preempted for lack of KV blocks.").labels(**self.labels)
        self.finished = counter(c.REQUESTS_FINISHED, "Requests finished, by finish reason.", ("finish_reason",))
        self.errors = counter(c.REQUEST_ERRORS, "Requests refused or failed, by kind.", ("kind",))
        self.prefix_queries = counter(c.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(c.PREFIX_CACHE_HIT_TOKENS, "Prompt tokens found in the prefix cache.")
        self.spec_proposed = counter(c.SPEC_PROPOSED_TOKENS, "Speculative tokens proposed.")
        self.spec_accepted = counter(c.SPEC_ACCEPTED_TOKENS, "Speculative tokens accepted.")
        self.spec_steps = counter(c.SPEC_VERIFICATION_STEPS, "Verification steps of speculative decodes.")
        self.spec_by_position = counter(c.SPEC_ACCEPTED_BY_POSITION,
                                        "Draft tokens accepted at each draft position (1 = first).", ("position",))
        self.knob = gauge(c.KNOB, "Effective value of each live engine knob.", ("name",))
        self._info_labels = ("model_digest", "tokenizer_digest", "served_model_name", "kv_cache_dtype")
        self.info = Gauge(c.ENGINE_INFO, "Engine identity (value is always 1; present once the model is loaded).",
                          [*names, *self._info_labels], registry=r)
        for reason in _FINISH_REASONS:  # expose zeros so rate() works from the first scrape
            self.finished.labels(**self.labels, finish_reason=reason)
        for m in (self.prefix_queries, self.prefix_hits, self.spec_proposed, self.spec_accepted, self.spec_steps):
            m.labels(**self.labels)
        self._last: dict[str, int] = {}

    def set_info(self, info: dict[str, str]) -> None:
        """Publish the loaded engine's identity: model and tokenizer digests, served name, KV dtype."""
        self.info.labels(**self.labels, **{k: info[k] for k in self._info_labels}).set(1)

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Update gauges and advance mirrored counters from the engine's stats() after a step."""
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_used.set(stats["kv_blocks_used"])
        self.kv_total.set(stats["kv_blocks_total"])
        for key, metric in (("prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                            ("preemptions", self.preemptions),
                            ("prefix_cache_queries", self.prefix_queries.labels(**self.labels)),
                            ("prefix_cache_hit_tokens", self.prefix_hits.labels(**self.labels)),
                            ("spec_proposed_tokens", self.spec_proposed.labels(**self.labels)),
                            ("spec_accepted_tokens", self.spec_accepted.labels(**self.labels)),
                            ("spec_verification_steps", self.spec_steps.labels(**self.labels))):
            self._advance(key, metric, stats[key])
        for pos, count in enumerate(stats.get("spec_acceptance_by_position", []), start=1):
            self._advance(f"spec_pos_{pos}", self.spec_by_position.labels(**self.labels, position=str(pos)), count)

    def _advance(self, key: str, metric: Any, value: int) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            metric.inc(delta)
        self._last[key] = value

    def set_knobs(self, knobs: dict[str, int]) -> None:
        for name, value in knobs.items():
            self.knob.labels(**self.labels, name=name).set(value)

    def finish(self, reason: str) -> None:
        self.finished.labels(**self.labels, finish_reason=reason).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(**self.labels, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
