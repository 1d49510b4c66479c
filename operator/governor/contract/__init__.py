"""What the engine, the operator and the tuner agree on: knob names, metric names, admin API shapes.

Imports nothing heavy (pydantic only): the operator image has no torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# --- live knobs -------------------------------------------------------------------------------

ADMIN_KNOBS_PATH = "/admin/knobs"
ADMIN_TOKEN_ENV = "GOVERNOR_ADMIN_TOKEN"


class KnobsUpdate(BaseModel):
    """Body of PUT /admin/knobs: any subset of the knobs. Strict: `true` or `"4"` is not a knob value.

    Its fields are where the knobs are named: `KNOB_NAMES` is read from them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences running in one step.")
    max_num_batched_tokens: int | None = Field(default=None, ge=1,
                                               description="Token budget of one step (prefill chunk size).")
    num_speculative_tokens: int | None = Field(default=None, ge=0, description="Speculation depth K (0 = off).")

    def changes(self) -> dict[str, int]:
        return self.model_dump(exclude_none=True)


KNOB_NAMES: tuple[str, ...] = tuple(KnobsUpdate.model_fields)
"""The live knobs, in the order they are listed everywhere (flags, status, records)."""


class KnobBound(BaseModel):
    min: int
    max: int


class KnobsState(BaseModel):
    """Body of GET /admin/knobs and of a successful PUT: effective values and the hard caps. Its knob fields are
    `KNOB_NAMES`, in that order (a test holds them together)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_speculative_tokens: int
    bounds: dict[str, KnobBound]


# --- metrics ------------------------------------------------------------------------------------
# Names as exposed on /metrics (counters carry the `_total` suffix there). docs/metrics.md documents them.

METRIC_PREFIX = "governor_"
TTFT_SECONDS = "governor_time_to_first_token_seconds"
ITL_SECONDS = "governor_inter_token_latency_seconds"
E2E_SECONDS = "governor_e2e_request_latency_seconds"
QUEUE_SECONDS = "governor_request_queue_time_seconds"
REQUESTS_RUNNING = "governor_requests_running"
REQUESTS_WAITING = "governor_requests_waiting"
KV_BLOCKS_USED = "governor_kv_blocks_used"
KV_BLOCKS_TOTAL = "governor_kv_blocks_total"
PROMPT_TOKENS = "governor_prompt_tokens_total"
GENERATION_TOKENS = "governor_generation_tokens_total"
PREEMPTIONS = "governor_preemptions_total"
REQUESTS_FINISHED = "governor_requests_finished_total"  # label finish_reason
REQUEST_ERRORS = "governor_request_errors_total"  # label kind
PREFIX_CACHE_QUERIES = "governor_prefix_cache_queries_total"
PREFIX_CACHE_HIT_TOKENS = "governor_prefix_cache_hit_tokens_total"
SPEC_PROPOSED_TOKENS = "governor_spec_proposed_tokens_total"
SPEC_ACCEPTED_TOKENS = "governor_spec_accepted_tokens_total"
SPEC_VERIFICATION_STEPS = "governor_spec_verification_steps_total"  # mean accepted length = accepted / steps
SPEC_ACCEPTED_BY_POSITION = "governor_spec_accepted_by_position_total"  # label position (1 = first draft)
KNOB = "governor_knob"  # label name: the effective value of each live knob
ENGINE_INFO = "governor_engine_info"
KV_CACHE_USAGE = "governor_kv_cache_usage_ratio"  # blocks used / blocks in the pool, 0 to 1
REQUEST_PROMPT_TOKENS = "governor_request_prompt_tokens"  # histogram, one observation per finished request
REQUEST_GENERATION_TOKENS = "governor_request_generation_tokens"  # histogram, one per finished request
PREFILL_SECONDS = "governor_request_prefill_time_seconds"  # first scheduled -> first token
DECODE_SECONDS = "governor_request_decode_time_seconds"  # first token -> finish
TPOT_SECONDS = "governor_request_time_per_output_token_seconds"  # decode time / (generated tokens - 1)
ITERATION_TOKENS = "governor_iteration_tokens"  # histogram: tokens computed by one engine step
HTTP_REQUESTS = "governor_http_requests_total"  # labels route (template), method, status

# Every series carries these, so the operator and tuner can scope queries to one service (its served model
# name and its namespace) and one revision. `namespace` is the label prometheus-operator's PodMonitor puts on
# every target (the pod's namespace): on a clash Prometheus keeps the target's, of the same value, so the
# series carries namespace="<pod namespace>" with or without that relabelling. Empty for a standalone engine
# (Prometheus stores no empty label).
SCOPE_LABELS = ("model_name", "revision", "namespace")
REVISION_ENV = "GOVERNOR_REVISION"
NAMESPACE_ENV = "GOVERNOR_NAMESPACE"  # the operator sets it from the pod's metadata.namespace (downward API)

# Latency histogram buckets (seconds): fine enough for p95 between 5 ms and 60 s.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.5, 10.0, 12.5, 15.0,
    20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 90.0, 120.0,
)
