"""The step loop: admit requests, schedule, run the model, sample, stop, free blocks."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from governor.engine.config import EngineConfig, Knobs
from governor.engine.detokenizer import IncrementalDetokenizer
from governor.engine.kv.block_hash import identity_seed
from governor.engine.kv.block_pool import BlockPool
from governor.engine.kv.cache import bytes_per_block
from governor.engine.models.checkpoint import model_digest, tokenizer_digest
from governor.engine.models.model_config import load_model_config
from governor.engine.outputs import CompletionOutput, RequestOutput, StepResult, TokenEvent
from governor.engine.runner import broadcast_shutdown
from governor.engine.sampler import argmax_only, greedy_tokens, sample, token_logprobs
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from governor.engine.sequence import Sequence, SequenceStatus
from governor.engine.spec.draft_model import DraftModelProposer
from governor.engine.spec.proposer import NgramProposer, Proposer
from governor.engine.spec.verifier import accept_greedy, accept_sampled, target_distributions
from governor.engine.tokenizer import decoder, load_tokenizer
from governor.engine.tp.group import (
    SINGLE,
    TPGroup,
    check_no_open_group,
    destroy_tp_group,
    free_port,
    init_tp_group,
    rank_device,
)
from governor.engine.tp.processes import WorkerProcesses
from governor.engine.tp.sharding import shard_config
from governor.engine.worker import Worker, WorkerSpec

log = logging.getLogger("governor.engine")

Prompt = str | list[int] | dict[str, Any]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    arrival: float  # time.monotonic() at add_request
    # From the sampling parameters, once, for the per-token stop checks:
    stop_ids: frozenset[int]  # token ids that end it: its stop_token_ids, and EOS unless ignore_eos
    stop_strings: list[str]
    max_output: int  # output tokens at which it ends with "length": max_tokens, or what max_model_len leaves
    argmax_only: bool  # greedy without logprobs (sampler.argmax_only)
    detok: IncrementalDetokenizer | None = None
    emitted: int = 0  # characters of detok.text already handed out as deltas
    final_text: str | None = None


class _Sampled(NamedTuple):
    """A step's new tokens, flat in sampling order: each sequence's accepted drafts, then its sampled token."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None] | None  # one per token; None when no request asked for any
    counts: list[int] | None  # tokens per sequence; None when each got one (the step has no drafts)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are still on their way to the host (async scheduling)."""

    sampling: list[ScheduledSeq]  # the sequences it samples for, in row order
    tokens: torch.Tensor  # [rows] int64 on the device: each row's argmax
    host: torch.Tensor  # the host copy of `tokens` (pinned on CUDA): read once `ready` has passed
    ready: torch.cuda.Event | None  # None on CPU, where the copy is done when issued


class LLMEngine:
    """One model on one device, or split over `tensor_parallel_size` devices (one process per rank: this
    one is rank 0 and runs everything but the other shards' forward): requests in, finished outputs out,
    one `step()` at a time. `close()` stops the tensor-parallel workers."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device_type = _resolve_device(config.device)
        self.model_config = load_model_config(config.model)
        mc = self.model_config
        dtype_name = mc.torch_dtype if config.dtype == "auto" else config.dtype
        self.dtype = _DTYPES[dtype_name]
        limit = mc.max_position_embeddings if mc.sliding_window is None else min(mc.max_position_embeddings,
                                                                                   mc.sliding_window)
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds what the model supports ({limit}: "
                             "max_position_embeddings" + (", sliding window" if mc.sliding_window else "") + ")")
        tp_size = config.tensor_parallel_size
        shard_config(mc, tp_size)  # a size that does not divide the heads fails here, before any process starts
        if device_type == "cuda" and tp_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs (one per rank); torch sees "
                             f"{torch.cuda.device_count()}")
        tok_dir = config.tokenizer or config.model
        self.tokenizer = load_tokenizer(tok_dir)
        self._decode = decoder(self.tokenizer)  # tokenizer.decode(ids, skip_special_tokens=...), fast where it can
        self.model_digest = model_digest(config.model, config.seed if config.load_format == "dummy" else None)
        self.tokenizer_digest = tokenizer_digest(tok_dir)
        log.info("model %s (%s%s): model digest %s, tokenizer digest %s", config.model, mc.architecture,
                 ", random weights" if config.load_format == "dummy" else "", self.model_digest,
                 self.tokenizer_digest)

        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device_type == "cuda" else "torch"
        spec = config.speculative_config
        draft_bytes = 0
        if spec is not None and spec.model:  # the draft model keeps a cache of as many blocks
            draft_bytes = bytes_per_block(load_model_config(spec.model), config.block_size, self.dtype)
        worker_spec = WorkerSpec(config, mc, self.dtype, device_type, self.max_model_len, backend,
                                 min(mc.vocab_size, len(self.tokenizer)), draft_bytes)
        self.tp: TPGroup = SINGLE
        self._workers: WorkerProcesses | None = None
        self._finalizer: weakref.finalize[[TPGroup, WorkerProcesses], LLMEngine] | None = None
        if tp_size > 1:
            self._start_workers(worker_spec, tp_size)
        try:
            self.worker = Worker(worker_spec, self.tp)
            self._init_rank0(backend)
            if self.use_cuda_graphs:
                self._capture_cuda_graphs()
            if self.device.type == "cuda" and backend == "triton":
                self._warm_up_kernels()
        except BaseException:
            self.close()
            raise

    def _start_workers(self, spec: WorkerSpec, size: int) -> None:
        """Spawn ranks 1..size-1 and join their rendezvous as rank 0."""
        check_no_open_group()  # before any process starts
        port = free_port()
        workers = WorkerProcesses(spec, size, port)
        try:
            self.tp = init_tp_group(0, size, port, rank_device(spec.device_type, 0, size))
        except BaseException:
            workers.join(timeout_s=0)
            raise
        self._workers = workers
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop_workers, self.tp, workers)
        log.info("tensor parallel: %d ranks (%s), worker pids %s", size, torch.distributed.get_backend(),
                 workers.pids)

    def _init_rank0(self, backend: str) -> None:
        config, w = self.config, self.worker
        self.device = w.device
        self.model, self.kv_caches, self.runner = w.model, w.kv_caches, w.runner
        self.block_size, self.kv_dtype, self.num_blocks = w.block_size, w.kv_dtype, w.num_blocks
        self.attention_backend = backend
        self.cuda_graph_capture_s = 0.0
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB%s); max concurrent max_model_len "
                 "sequences: %.1f", self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                 w.kv_cache_bytes() / 2**20, " per rank" if self.tp.size > 1 else "",
                 self.num_blocks * self.block_size / self.max_model_len)
        self.knobs: Knobs = config.initial_knobs()
        self.block_pool = BlockPool(self.num_blocks)
        self.scheduler = Scheduler(self.block_pool, self.block_size, self.knobs, config.enable_prefix_caching,
                                   self.max_model_len, config.align_prefill_chunks)
        self.proposer = self._make_proposer(backend)
        self.spec_counters = {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_verification_steps": 0}
        self.spec_accepted_by_position = [0] * config.spec_cap
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        # Invariant: how many requests in _requests are not argmax_only. While none is, a step without
        # drafts samples with one argmax and no per-row work (`_sample`).
        self._num_not_argmax = 0
        # time.monotonic() after which a request ends with "timeout", for the live requests given one.
        self._deadlines: dict[str, float] = {}
        self._arrivals = itertools.count()
        # Async scheduling: the launched step whose tokens the next step() reads, and two host buffers (with
        # their events) for the tokens of the step being read and the one launched meanwhile, in turn.
        self._async = config.async_scheduling and self.tp.size == 1
        self._in_flight: _InFlight | None = None
        pin = self.device.type == "cuda"
        self._readback = [(torch.empty(config.seqs_cap, dtype=torch.int64, pin_memory=pin),
                           torch.cuda.Event() if pin else None) for _ in range(2)]
        self._readback_turn = 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "requests_finished": 0}

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on a CUDA device, one rank, the Triton attention backend (the
        torch reference syncs with the host), unless `enforce_eager`."""
        return (self.device.type == "cuda" and self.tp.size == 1 and not self.config.enforce_eager
                and self.attention_backend == "triton")

    def _capture_cuda_graphs(self) -> None:
        t0 = time.perf_counter()
        self.runner.capture_cuda_graphs(self.config.seqs_cap)
        torch.cuda.synchronize(self.device)
        graphs = self.runner.graphs
        assert graphs is not None
        self.cuda_graph_capture_s = time.perf_counter() - t0
        log.info("CUDA graphs: %d captured in %.1f s (decode batch sizes up to %d%s)", graphs.num_captures,
                 self.cuda_graph_capture_s, self.config.seqs_cap,
                 f", verification at {1 + self.config.spec_cap} tokens per sequence" if self.config.spec_cap else "")

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels of prefill and mixed steps now rather than on the first requests.

        Triton compiles a kernel once per specialization: besides its constexprs, each integer argument
        is told apart as 1, a multiple of 16, or neither. Decode steps are compiled by the graph capture;
        these throwaway steps give the eager ones -- prefill chunks alone and after decodes, one and
        several sequences -- token and sequence counts of each kind. Then steps at the token budget
        (`_budget_steps`), so that the one-time costs of a full-size step are paid here too. Their blocks
        come from the pool and go back to it unhashed (what they write there is never read); no counter
        moves. A step that does not fit the hard caps, max_model_len or the free blocks is left out."""
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        # (decodes, prefill chunk lengths): decodes are 6-token sequences with their last token to compute.
        steps = [(0, (32,)), (0, (33,)), (0, (17, 16)), (1, (16,)), (3, (29,)), (16, (17,)), (16, (16,))]
        steps += self._ladder_steps() + self._budget_steps()
        for num_decodes, prefills in steps:
            scheduled = []
            for _ in range(num_decodes):
                seq = Sequence("warm-up", -1, [1] * 5, params, 1, output_token_ids=[1])
                seq.num_computed_tokens = 5
                scheduled.append(ScheduledSeq(seq, 1))
            scheduled += [ScheduledSeq(Sequence("warm-up", -1, [1] * n, params, 1), n) for n in prefills]
            blocks = sum(-(-s.seq.num_tokens // self.block_size) for s in scheduled)
            longest = max(s.seq.num_tokens for s in scheduled)
            if (len(scheduled) > self.config.seqs_cap or num_decodes + sum(prefills) > self.config.tokens_cap
                    or longest > self.max_model_len or blocks > self.block_pool.num_free):
                continue
            try:
                for s in scheduled:
                    self.scheduler.allocate(s.seq, s.num_new_tokens)
                self._execute(SchedulerOutput(scheduled))
            finally:
                for s in scheduled:
                    self.block_pool.free(s.seq.block_table[::-1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("kernels of prefill and mixed steps compiled in %.1f s", time.perf_counter() - t0)

    def _ladder_steps(self) -> list[tuple[int, tuple[int, ...]]]:
        """Warm-up prefill steps of 64 * 2^k and 96 * 2^k tokens below the token budget (one chunk each, at most
        max_model_len), so the GEMMs of the step sizes between the small steps and the budget run once here.
        cuBLAS picks its kernels by problem size, and CUDA loads a kernel's module on its first launch (lazy
        loading, torch's default). On an H200 (qwen3-0.6b shape, 256 x 100 -> 1,024 tokens, fp8 KV), the first
        run's first mixed step (243 decodes beside 13 prompt chunks, 1,511 tokens) took 75.4 ms against 18.2 in a
        second run, and 43.6 against 26.8 with CUDA_MODULE_LOADING=EAGER; the first run was 57.3K tok/s against
        58.8K under eager loading (docs/benchmarks.md, issue 9, ninth pass)."""
        cap = self.config.tokens_cap
        sizes = sorted({min(b << k, self.max_model_len) for b in (64, 96) for k in range(20) if (b << k) < cap})
        return [(0, (n,)) for n in sizes]

    def _budget_steps(self) -> list[tuple[int, tuple[int, ...]]]:
        """Warm-up steps of the hard token budget (decodes, prefill chunk lengths): one sequence's chunk,
        up to 64 sequences' prompts, and a decode batch beside one chunk, each chunk at most max_model_len
        (the step then stays under the budget). The first full-size steps of a process cost more than later
        ones: on an H200 (qwen3-0.6b shape, 256 prompts of 100 tokens, fp8 KV, after the small steps above)
        the first 8,192-token prefill step took 346 ms against 36 ms in a second run, the next three 6-52 ms
        more each (docs/benchmarks.md, issue 9, eighth pass). What the time goes to was not broken down
        (candidates: GEMM kernels for that many rows loaded on first use, the activations' first
        allocation); these steps reach the sizes where it is paid. The budget is the hard cap, which the
        tuner may raise the knob to: a cap whose activations do not fit beside the KV cache fails here, at
        start, rather than when the knob first reaches it."""
        cap, seqs = self.config.tokens_cap, self.config.seqs_cap

        def fit(n: int) -> int:
            return min(n, self.max_model_len)

        steps: list[tuple[int, tuple[int, ...]]] = [(0, (fit(cap),))]
        many = min(seqs, 64, cap)
        if many > 1:
            size, extra = divmod(cap, many)
            steps.append((0, (fit(size + extra),) + (fit(size),) * (many - 1)))
        decodes = min(seqs - 1, cap // 2)
        if decodes > 0:
            steps.append((decodes, (fit(cap - decodes),)))
        return steps

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process groups; idempotent, and a no-op with one
        rank. The engine cannot step afterwards. Also runs when the engine is garbage-collected or the
        interpreter exits."""
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def _execute(self, out: SchedulerOutput, all_logits: bool = False, feed: torch.Tensor | None = None,
                 fp32_logits: bool = True) -> torch.Tensor:
        """The runner's step, after checking that every rank is there to run it."""
        if self._workers is not None:
            if self.closed:
                raise RuntimeError("the engine is closed: its tensor-parallel workers have stopped")
            self._workers.check_alive()
        return self.runner.execute(out, all_logits, feed, fp32_logits)

    def _make_proposer(self, backend: str) -> Proposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        assert spec.model is not None
        # The draft's pool has a block for every target block plus room for each sequence's lookahead.
        # Under tensor parallelism the draft runs whole on rank 0 (it is small; workers never see it).
        extra = self.config.seqs_cap * (-(-spec.num_speculative_tokens // self.block_size) + 1)
        return DraftModelProposer(spec.model, self.model_config, self.dtype, self.device, self.num_blocks + extra,
                                  self.block_size, self.max_model_len, self.config.seqs_cap,
                                  self.config.tokens_cap, backend)

    # --- requests -----------------------------------------------------------------------------

    def cache_seed(self, cache_salt: str | None) -> bytes:
        """Seed of a request's block-hash chain: what produced the KV, plus the tenant's salt."""
        return identity_seed(self.model_digest, self.tokenizer_digest, "", str(self.kv_dtype), cache_salt)

    def prompt_token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as a string, token ids, or {"prompt"/"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int], int]:
        """(prompt text, prompt token ids, max_tokens) of a request; ValueError with the reason if invalid."""
        params.validate()
        text, ids = self.prompt_token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise ValueError(f"the prompt ({len(ids)} tokens) leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                             f"exceeds max_model_len={self.max_model_len}")
        return text, ids, max_tokens

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *, stream_text: bool = False,
                    timeout_s: float | None = None, cache_salt: str | None = None) -> None:
        """Validate and queue a request; raises ValueError with the reason if it cannot be served.

        stream_text: keep an incremental detokenizer so each TokenEvent carries its text delta.
        timeout_s: end the request with finish_reason "timeout" once this much time has passed.
        cache_salt: prefix-cache isolation; a dict prompt's "cache_salt" takes precedence.
        """
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, max_tokens = self.validate_request(prompt, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(request_id, next(self._arrivals), ids, params, max_tokens, generator=generator)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])
        if self.config.enable_prefix_caching:
            seq.cache_seed = self.cache_seed(cache_salt)
        now = time.monotonic()
        detok = None
        stop_strings = params.stop_strings
        if stream_text or stop_strings:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = _Request(seq, text, now, stop_ids, stop_strings, min(max_tokens, self.max_model_len - len(ids)),
                       argmax_only(params), detok)
        self._requests[request_id] = req
        self._num_not_argmax += not req.argmax_only
        if timeout_s:
            self._deadlines[request_id] = now + timeout_s
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request now (client gone, deadline passed), freeing its blocks. None if unknown."""
        req = self._requests.get(request_id)
        return None if req is None else self._end(req, reason)

    def update_knobs(self, **changes: int) -> Knobs:
        """Apply knob changes (at a step boundary: callers invoke it between steps). Values are checked
        against the hard caps fixed at start; ValueError names the bound."""
        caps = self.knob_caps()
        for name, value in changes.items():
            if name not in caps:
                raise ValueError(f"unknown knob {name!r}; knobs: {', '.join(caps)}")
            lo, hi = caps[name]
            if not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r} is outside [{lo}, {hi}] (the hard cap fixed at start)")
        for name, value in changes.items():
            setattr(self.knobs, name, value)
        return self.knobs

    def knob_caps(self) -> dict[str, tuple[int, int]]:
        """Inclusive bounds of each live knob, fixed at start."""
        return {
            "max_num_seqs": (1, self.config.seqs_cap),
            "max_num_batched_tokens": (1, self.config.tokens_cap),
            "num_speculative_tokens": (0, self.config.spec_cap),
        }

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one scheduled step: token events for every request that advanced, outputs of finished ones.

        With async scheduling, a step whose every request is greedy without logprobs and without drafts
        (`_argmax_step`) is launched and its tokens are read after the next step is launched, when that
        one is already certain (`Scheduler.schedule_continuation`): its tokens are fed on the device,
        and the host reads and handles this step's tokens while the device runs it. That step is then
        the one in flight between calls, and the next call launches the one after it before reading it.
        Each call still returns the tokens of one step, as soon as they are on the host."""
        result = StepResult([], [])
        self._expire_deadlines(result)
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            # Its tokens are this call's, whether or not the next step can be launched first: when it
            # cannot, the next call schedules it (handing these tokens out does not wait for another step).
            self._in_flight = self._launch_continuation(prev)
            self._complete(prev, result)
            return result
        out = self.scheduler.schedule()
        if not out.scheduled:
            return result
        now = time.monotonic()
        for seq in out.admitted:  # only a sequence taken from the queue can be scheduled for the first time
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = now
        draft_probs = self._propose(out.scheduled)
        # A step whose every token is an argmax takes it over the model-dtype logits (same tokens).
        argmax_step = self._argmax_step(out)
        logits = self._execute(out, fp32_logits=not argmax_step)
        self.counters["steps"] += 1
        sampling: list[ScheduledSeq] = []
        settle = self.scheduler.settle_blocks
        for s in out.scheduled:  # KV of known tokens is now written; drafts are settled after verification
            if s.samples:
                sampling.append(s)
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft_tokens)
            if not s.draft_tokens:
                settle(s.seq)
        if self._async and argmax_step and sampling:  # its tokens can stay on the device a while
            launched = self._launched(sampling, logits)
            self._in_flight = self._launch_continuation(launched)
            self._complete(launched, result)
            return result
        sampled = self._sample(sampling, logits, draft_probs)
        tokens, lps, requests, events = sampled.tokens, sampled.logprobs, self._requests, result.events
        num_events = len(events)
        if sampled.counts is None:  # one token per sequence: the usual step, without a loop per sequence
            for s, token, lp in zip(sampling, tokens, lps or [None] * len(tokens), strict=True):
                self._append_token(requests[s.seq.request_id], token, lp, result)
        else:
            at = 0
            for s, n in zip(sampling, sampled.counts, strict=True):
                if s.draft_tokens:
                    self._settle_drafts(s, num_accepted=n - 1)
                req = requests[s.seq.request_id]
                for j in range(at, at + n):
                    if self._append_token(req, tokens[j], lps[j] if lps is not None else None, result):
                        break  # the tokens after a stop are dropped
                at += n
        self.counters["generation_tokens"] += len(events) - num_events  # one event per appended token
        return result

    # --- async scheduling -----------------------------------------------------------------------

    def _argmax_step(self, out: SchedulerOutput) -> bool:
        """Whether every token a scheduled step samples is the argmax of its logits row: every live request
        is greedy without logprobs, and no sequence carries drafts (verification reads whole rows; without
        drafts the logits rows are the sampling sequences', one each)."""
        return self._num_not_argmax == 0 and (self.proposer is None
                                              or not any(s.draft_tokens for s in out.scheduled))

    def _launched(self, sampling: list[ScheduledSeq], logits: torch.Tensor) -> _InFlight:
        """Take the argmax of each row on the device and start copying the tokens to the host."""
        tokens = logits.argmax(dim=1)
        buffer, ready = self._readback[self._readback_turn]
        self._readback_turn ^= 1
        host = buffer[:len(sampling)]
        host.copy_(tokens, non_blocking=True)
        if ready is not None:
            ready.record()
        return _InFlight(sampling, tokens, host, ready)

    def _launch_continuation(self, prev: _InFlight) -> _InFlight | None:
        """Launch the step after `prev` before its tokens are on the host, when the scheduler can say
        now what that step is; None (nothing launched) otherwise. A sequence whose token from `prev`
        reaches its max_output is left out: `prev` ends it."""
        rows: dict[int, int] = {}
        ending: set[int] = set()
        requests = self._requests
        for i, s in enumerate(prev.sampling):
            seq = s.seq
            rows[id(seq)] = i
            req = requests.get(seq.request_id)
            if req is not None and len(seq.output_token_ids) + 1 >= req.max_output:
                ending.add(id(seq))
        out = self.scheduler.schedule_continuation(rows, ending)
        if out is None:
            return None
        logits = self._execute(out, feed=prev.tokens, fp32_logits=False)  # its tokens are argmaxes
        self.counters["steps"] += 1
        settle = self.scheduler.settle_blocks
        for s in out.scheduled:  # one past the known tokens until prev's token joins them (`_complete`)
            s.seq.num_computed_tokens += 1
            settle(s.seq)
        return self._launched(out.scheduled, logits)

    def _complete(self, flight: _InFlight, result: StepResult) -> None:
        """Wait for a launched step's tokens and append them, as a step appends its sampled tokens. A row
        whose sequence has ended meanwhile (a stop in the step before, an abort, a deadline) is dropped."""
        if flight.ready is not None:
            flight.ready.synchronize()
        tokens = flight.host.tolist()
        requests, events = self._requests, result.events
        num_events = len(events)
        cache = self.config.enable_prefix_caching
        for s, token in zip(flight.sampling, tokens, strict=True):
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if not self._append_token(requests[seq.request_id], token, None, result) and cache:
                # A step in flight computes this token's KV: register its block once full, as the settle
                # after that step would have, had it run after the token was known.
                self.scheduler.cache_computed_blocks(seq)
        self.counters["generation_tokens"] += len(events) - num_events

    def _append_token(self, req: _Request, token: int, lp: dict[int, float] | None, result: StepResult) -> bool:
        """Append a new token to its request, check the stop conditions and emit the token's event;
        True when the request finished."""
        seq = req.seq
        seq.output_token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        if req.detok is not None:
            req.detok.add(token)
        reason = self._check_stop(req, token)
        if reason is None:
            result.events.append(TokenEvent(seq.request_id, token, self._text_delta(req), lp, None, None))
            return False
        self._finish(req, reason, result)
        result.events.append(TokenEvent(seq.request_id, token, self._text_delta(req), lp, seq.finish_reason,
                                        seq.stop_reason))
        return True

    def _finish(self, req: _Request, reason: str, result: StepResult) -> None:
        result.finished.append(self._end(req, reason))

    def _end(self, req: _Request, reason: str) -> RequestOutput:
        """End a live request: free its blocks and proposer state, count it, forget it; its final output."""
        self.scheduler.finish(req.seq, reason)
        if self.proposer is not None:
            self.proposer.release(req.seq)
        self.counters["requests_finished"] += 1
        self._forget(req.seq.request_id)
        return self._output(req)

    def _forget(self, request_id: str) -> _Request | None:
        """Drop a request from the live ones (and from `_num_not_argmax` and `_deadlines`); None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is not None and not req.argmax_only:
            self._num_not_argmax -= 1
        self._deadlines.pop(request_id, None)
        return req

    def _propose(self, scheduled: list[ScheduledSeq]) -> dict[int, torch.Tensor]:
        """Fill each speculative decode's draft slots; returns draft distributions by id(seq) (draft model,
        sampled requests only)."""
        probs: dict[int, torch.Tensor] = {}
        spec = [s for s in scheduled if s.num_spec > 0]
        if not spec or self.proposer is None:
            for s in spec:
                s.set_drafts([])
            return probs
        for s, (drafts, q) in zip(spec, self.proposer.propose(spec), strict=True):
            s.set_drafts(drafts)
            if q is not None:
                probs[id(s.seq)] = q[:len(drafts)]
        return probs

    def _sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                draft_probs: dict[int, torch.Tensor]) -> _Sampled:
        """Tokens (and logprobs) of the sampling sequences: one sampled token each, or accepted drafts + one.
        Sequence i's logits rows are its last known token's and its drafts', in order."""
        if len(sampling) == logits.shape[0]:  # no drafts: row i is sequence i's
            if self._num_not_argmax == 0:
                # Every request is greedy without logprobs (argmax_only): one argmax, nothing per row.
                return _Sampled(greedy_tokens(logits), None, None)
            seqs = [s.seq for s in sampling]
            sampled = sample(logits, [q.params for q in seqs], [q.generator for q in seqs], self.generator)
            return _Sampled(sampled.token_ids, sampled.logprobs, None)
        rows = list(itertools.accumulate((1 + len(s.draft_tokens) for s in sampling), initial=0))
        plain = [i for i, s in enumerate(sampling) if not s.draft_tokens]
        out: list[tuple[list[int], list[dict[int, float] | None]]] = [([], []) for _ in sampling]
        if plain:
            seqs = [sampling[i].seq for i in plain]
            sampled = sample(logits[[rows[i] for i in plain]], [q.params for q in seqs], [q.generator for q in seqs],
                             self.generator)
            for i, tok, lp in zip(plain, sampled.token_ids, sampled.logprobs, strict=True):
                out[i] = ([tok], [lp])
        for i, s in enumerate(sampling):
            if not s.draft_tokens:
                continue
            seq, block = s.seq, logits[rows[i]:rows[i + 1]]
            if seq.params.greedy:
                tokens = accept_greedy(block.argmax(dim=1).tolist(), s.draft_tokens)
            else:
                p = target_distributions(block, [seq.params] * block.shape[0])
                tokens = accept_sampled(p, s.draft_tokens, draft_probs.get(id(seq)), seq.generator)
            lps = token_logprobs(block[:len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
            out[i] = (tokens, lps)
        return _Sampled([t for tokens, _ in out for t in tokens], [lp for _, lps in out for lp in lps],
                        [len(tokens) for tokens, _ in out])

    def _settle_drafts(self, s: ScheduledSeq, num_accepted: int) -> None:
        """Keep the KV of accepted drafts, release the slots of rejected ones, and count."""
        k = len(s.draft_tokens)
        s.seq.num_computed_tokens += num_accepted
        self.scheduler.settle_blocks(s.seq)
        if self.proposer is not None:
            self.proposer.accepted(s.seq, k, num_accepted)
        self.spec_counters["spec_proposed_tokens"] += k
        self.spec_counters["spec_accepted_tokens"] += num_accepted
        self.spec_counters["spec_verification_steps"] += 1
        for j in range(num_accepted):
            self.spec_accepted_by_position[j] += 1

    def _expire_deadlines(self, result: StepResult) -> None:
        if not self._deadlines:
            return
        now = time.monotonic()
        for rid in [r for r, deadline in self._deadlines.items() if now >= deadline]:
            out = self.abort(rid, "timeout")
            if out is not None:
                result.finished.append(out)
                result.events.append(TokenEvent(rid, None, "", None, "timeout", None))

    def _check_stop(self, req: _Request, token: int) -> str | None:
        seq = req.seq
        if req.stop_strings and req.detok is not None:
            text = req.detok.text
            hits = [(i, s) for s in req.stop_strings if (i := text.find(s)) >= 0]
            if hits:
                cut, stop = min(hits)
                seq.stop_reason = stop
                req.final_text = text[:cut]
                return "stop"
        if token in req.stop_ids:
            if token in seq.params.stop_token_ids:  # EOS ends it too, but with no stop_reason
                seq.stop_reason = token
            return "stop"
        if len(seq.output_token_ids) >= req.max_output:
            return "length"
        return None

    def _text_delta(self, req: _Request) -> str:
        """New text to hand out; while a stop string could still be forming, its possible start is held back."""
        if req.detok is None:
            return ""
        text = req.final_text if req.final_text is not None else req.detok.text
        end = len(text)
        if not req.seq.is_finished and req.stop_strings:
            end -= max(len(s) for s in req.stop_strings) - 1
        if end <= req.emitted:
            return ""
        delta = text[req.emitted:end]
        req.emitted = end
        return delta

    def detokenize(self, seq: Sequence) -> str:
        return self._decode(seq.output_token_ids, seq.params.skip_special_tokens)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        if req.final_text is not None:
            text = req.final_text
        elif req.detok is not None:
            text = req.detok.text
        else:
            text = self.detokenize(seq)
        cumulative = None
        if seq.logprobs:
            cumulative = sum(lp[t] for lp, t in zip(seq.logprobs, seq.output_token_ids, strict=False))
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
                                      list(seq.logprobs) if seq.params.logprobs is not None else None, cumulative)
        now = time.monotonic()
        metrics = {"arrival": req.arrival, "finished": now, "e2e_s": now - req.arrival,
                   "preemptions": float(seq.num_preemptions)}
        if seq.first_scheduled_at is not None:
            metrics["queue_s"] = seq.first_scheduled_at - req.arrival
        return RequestOutput(seq.request_id, req.prompt, list(seq.prompt_token_ids), [completion], True, metrics)

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """fp32 logits at every position of `token_ids` [T, vocab], computed through the paged cache in
        prefill chunks of `chunk_size` tokens (default: one chunk). For scoring and accuracy checks; call
        it between steps. Uses (and returns) free blocks; raises if too few are free."""
        seq = Sequence("prompt-logits", -1, list(token_ids), SamplingParams(temperature=0.0, max_tokens=1), 1)
        chunk = chunk_size or len(token_ids)
        rows = []
        try:
            while seq.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - seq.num_computed_tokens)
                self.scheduler.allocate(seq, n)
                rows.append(self._execute(SchedulerOutput([ScheduledSeq(seq, n)]), all_logits=True))
                seq.num_computed_tokens += n
        finally:
            self.block_pool.free(seq.block_table[::-1])
        return torch.cat(rows)

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        steps = self.spec_counters["spec_verification_steps"]
        return {
            **self.spec_counters,
            "spec_acceptance_by_position": list(self.spec_accepted_by_position),
            "spec_mean_accepted_length": self.spec_counters["spec_accepted_tokens"] / steps if steps else 0.0,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.block_pool.num_used,
            "kv_block_size": self.block_size,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "kv_blocks_cached": self.block_pool.num_cached,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            **self.counters,
        }


def freeze_startup_objects() -> None:
    """After one full collection, move every object alive now out of the garbage collector's reach
    (gc.freeze): for a process whose engine lives as long as it does (a server, a benchmark), once the engine
    has started. Otherwise each full collection rescans every object of torch, the model and the engine: a
    pause of 0.18-0.29 s (`scripts/profile-host.py`, throughput workload, H100) that stalls whichever step it
    falls in. Objects frozen are still freed when their last reference goes; only reference cycles
    among them are never collected, which is why a library call (`LLM`) does not do this by itself."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """`freeze_startup_objects` for a timed run inside a longer process (a benchmark called from tests):
    the objects are given back to the collector (gc.unfreeze) when it ends."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()


def _stop_workers(tp: TPGroup, workers: WorkerProcesses) -> None:
    """Send the shutdown (when every worker can still take it), leave the groups as the workers do, and
    wait for them to exit."""
    if workers.all_alive():
        try:
            broadcast_shutdown(tp)
        except Exception as e:  # a worker went away meanwhile (it failed as rank 0 did): the join ends the rest
            log.warning("could not send the shutdown to every tensor-parallel worker: %s", str(e).splitlines()[0])
    # Before the join: tearing NCCL down may wait for every rank to do it too.
    destroy_tp_group(tp)
    workers.join()


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return device
