"""The step loop: admit requests, schedule, run the model, sample, stop, free blocks.

Beside it: start-up and the forward pass (`executor`: ranks, weights, graphs, warm-up), request intake
(`intake`), who runs each step and the computed-token counts (`scheduler`), which blocks each sequence holds
(`kv.kv_manager`), speculative decoding (`spec.decoding`), and a live request's stop checks and outputs
(`request_state`)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from governor.engine.config import EngineConfig, Knobs
from governor.engine.executor import ModelExecutor, resolve_worker_spec
from governor.engine.intake import InputProcessor, Prompt
from governor.engine.kv.kv_manager import KVManager
from governor.engine.models.checkpoint import model_digest, tokenizer_digest
from governor.engine.models.model_config import load_model_config, with_quantization
from governor.engine.outputs import RequestOutput, StepResult, TokenEvent
from governor.engine.request_state import RequestState
from governor.engine.sampler import greedy_tokens, sample
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from governor.engine.sequence import Sequence, SequenceStatus
from governor.engine.spec.decoding import SpeculativeDecoding, make_proposer
from governor.engine.spec.draft_model import DraftModelProposer
from governor.engine.tokenizer import decoder, load_tokenizer

if TYPE_CHECKING:  # imported when the first structured request comes: the grammar library loads with it
    from governor.engine.structured import StructuredOutputs

log = logging.getLogger("governor.engine")


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
        self.model_config = mc = with_quantization(load_model_config(config.model), config.quantization)
        limit = mc.max_position_embeddings if mc.sliding_window is None else min(mc.max_position_embeddings,
                                                                                   mc.sliding_window)
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds what the model supports ({limit}: "
                             "max_position_embeddings" + (", sliding window" if mc.sliding_window else "") + ")")
        tok_dir = config.tokenizer or config.model
        self.tokenizer = load_tokenizer(tok_dir)
        self._decode = decoder(self.tokenizer)  # tokenizer.decode(ids, skip_special_tokens=...), fast where it can
        self.model_digest = model_digest(config.model, config.seed if config.load_format == "dummy" else None)
        self.tokenizer_digest = tokenizer_digest(tok_dir)
        log.info("model %s (%s%s): model digest %s, tokenizer digest %s", config.model, mc.architecture,
                 ", random weights" if config.load_format == "dummy" else "", self.model_digest,
                 self.tokenizer_digest)
        worker_spec = resolve_worker_spec(config, mc, self.max_model_len, min(mc.vocab_size, len(self.tokenizer)))
        self.dtype, backend = worker_spec.dtype, worker_spec.attention_backend
        self.executor = ex = ModelExecutor(worker_spec)
        try:
            self.device, self.model, self.runner, self.tp = ex.device, ex.model, ex.runner, ex.tp
            self.kv_caches = ex.kv_caches
            self.block_size, self.kv_dtype, self.num_blocks = ex.block_size, ex.kv_dtype, ex.num_blocks
            self.knobs: Knobs = config.initial_knobs()
            self.kv = KVManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
            self.scheduler = Scheduler(self.kv, self.knobs, self.max_model_len, config.align_prefill_chunks)
            proposer = make_proposer(config, mc, self.dtype, self.device, self.num_blocks, self.block_size,
                                     self.max_model_len, backend)
            self.spec = None if proposer is None else SpeculativeDecoding(proposer, self.scheduler, config.spec_cap,
                                                                          drafts_on_device=self.tp.size == 1)
            if isinstance(proposer, DraftModelProposer) and ex.use_cuda_graphs:
                proposer.capture_cuda_graphs(config.seqs_cap)
            if self.device.type == "cuda" and backend == "triton":
                ex.warm_up(self.kv, config.seqs_cap, config.tokens_cap, self.max_model_len)
        except BaseException:
            ex.close()
            raise
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        identity = (self.model_digest, self.tokenizer_digest, str(self.kv_dtype))
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len, frozenset(mc.eos_token_ids),
                                     identity if config.enable_prefix_caching else None, self.device)
        self._requests: dict[str, RequestState] = {}
        # Invariant: how many requests in _requests are not argmax_only. While none is, a step without
        # drafts samples with one argmax and no per-row work (`_sample`).
        self._num_not_argmax = 0
        # time.monotonic() after which a request ends with "timeout", for the live requests given one.
        self._deadlines: dict[str, float] = {}
        self._arrivals = itertools.count()
        # Async scheduling: the launched step whose tokens the next step() reads, and two host buffers (with
        # their events) for the tokens of the step being read and the one launched meanwhile, in turn.
        self._async = config.async_scheduling
        self._in_flight: _InFlight | None = None
        pin = self.device.type == "cuda"
        self._readback = [(torch.empty(config.seqs_cap, dtype=torch.int64, pin_memory=pin),
                           torch.cuda.Event() if pin else None) for _ in range(2)]
        self._readback_turn = 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "requests_finished": 0,
                         "tokens_computed": 0}

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process groups; idempotent, and a no-op with one
        rank. The engine cannot step afterwards. Also runs when the engine is garbage-collected or the
        interpreter exits."""
        self.executor.close()

    # --- requests -----------------------------------------------------------------------------

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int], int]:
        """(prompt text, prompt token ids, max_tokens) of a request; ValueError with the reason if invalid
        (`InputProcessor.validate`)."""
        return self.inputs.validate(prompt, params)

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler (`InputProcessor.structured_outputs`)."""
        return self.inputs.structured_outputs()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *, stream_text: bool = False,
                    timeout_s: float | None = None, cache_salt: str | None = None,
                    share_prompt_of: str | None = None) -> None:
        """Validate and queue a request; raises ValueError with the reason if it cannot be served.

        stream_text: keep an incremental detokenizer so each TokenEvent carries its text delta.
        timeout_s: end the request with finish_reason "timeout" once this much time has passed.
        cache_salt: prefix-cache isolation; a dict prompt's "cache_salt" takes precedence.
        share_prompt_of: a live request with the same prompt (a parallel sample's sibling): this one starts from
        its full prompt KV blocks once it has computed them, instead of computing its own.
        """
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sibling = self._requests.get(share_prompt_of) if share_prompt_of is not None else None
        req = self.inputs.request(request_id, next(self._arrivals), prompt, params, stream_text=stream_text,
                                  cache_salt=cache_salt, prompt_source=sibling.seq if sibling is not None else None)
        self._requests[request_id] = req
        self._num_not_argmax += not req.argmax_only
        if timeout_s:
            self._deadlines[request_id] = req.arrival + timeout_s
        self.scheduler.add(req.seq)
        self.counters["prompt_tokens"] += req.seq.num_prompt_tokens

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
        if self.spec is not None and changes.get("num_speculative_tokens", self.knobs.num_speculative_tokens) \
                != self.knobs.num_speculative_tokens:
            self.spec.reset_backoff()  # a new depth: prompt lookup tries it at once
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
        if out.admitted and self.spec is not None:
            self.spec.reset_backoff()  # new sequences: prompt lookup gets its chance at once
        draft_probs = self.spec.propose(out.scheduled) if self.spec is not None else {}
        # A step whose every token is an argmax gets only those (`CausalLM.compute_argmax`: taken over the
        # model-dtype logits, the same tokens, which never leave the device).
        argmax_step = self._argmax_step(out)
        logits = self.executor.execute(out, argmax=argmax_step,  # the token ids themselves in an argmax step
                                       drafts=self.spec.device_drafts if self.spec is not None else None)
        if self.spec is not None:
            self.spec.resolve()  # the drafts' values, now that their verification is queued
        self.counters["steps"] += 1
        self.counters["tokens_computed"] += sum(s.num_new_tokens for s in out.scheduled)
        sampling = self.scheduler.update_from_output(out)  # drafts are settled after verification
        if argmax_step:
            if self._async and sampling:  # its tokens can stay on the device a while
                launched = self._launched(sampling, logits)
                self._in_flight = self._launch_continuation(launched)
                self._complete(launched, result)
                return result
            sampled = _Sampled(logits.tolist(), None, None)
        else:
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
                    assert self.spec is not None
                    self.spec.settle(s, num_accepted=n - 1)
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
        return self._num_not_argmax == 0 and (self.spec is None or not any(s.draft_tokens for s in out.scheduled))

    def _launched(self, sampling: list[ScheduledSeq], tokens: torch.Tensor) -> _InFlight:
        """Start copying a launched step's argmax tokens (on the device) to the host."""
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
        # With speculation a continuation has no drafts: only when the proposer is backing off (`spec.skip_step`).
        skip = self.spec is not None and self.knobs.num_speculative_tokens > 0 and self.spec.may_skip()
        out = self.scheduler.schedule_continuation(rows, ending, without_drafts=skip)
        if out is None:
            return None
        if skip:
            assert self.spec is not None
            self.spec.skip_step()
        tokens = self.executor.execute(out, feed=prev.tokens, argmax=True)  # its tokens are argmaxes
        self.counters["steps"] += 1
        self.counters["tokens_computed"] += len(out.scheduled)
        # Each is counted one past its known tokens until prev's token joins them (`_complete`).
        return self._launched(self.scheduler.update_from_output(out), tokens)

    def _complete(self, flight: _InFlight, result: StepResult) -> None:
        """Wait for a launched step's tokens and append them, as a step appends its sampled tokens. A row
        whose sequence has ended meanwhile (a stop in the step before, an abort, a deadline) is dropped."""
        if flight.ready is not None:
            flight.ready.synchronize()
        tokens = flight.host.tolist()
        requests, events = self._requests, result.events
        num_events = len(events)
        cache = self.kv.enable_prefix_caching
        for s, token in zip(flight.sampling, tokens, strict=True):
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if not self._append_token(requests[seq.request_id], token, None, result) and cache:
                # A step in flight computes this token's KV: register its block once full, as the settle
                # after that step would have, had it run after the token was known.
                self.kv.cache_computed(seq)
        self.counters["generation_tokens"] += len(events) - num_events

    def _append_token(self, req: RequestState, token: int, lp: dict[int, float] | None, result: StepResult) -> bool:
        """Append a new token to its request, check the stop conditions and emit the token's event;
        True when the request finished."""
        seq = req.seq
        reason = req.append(token, lp)
        if reason is None:
            result.events.append(TokenEvent(seq.request_id, token, req.text_delta(), lp, None, None))
            return False
        self._finish(req, reason, result)
        result.events.append(TokenEvent(seq.request_id, token, req.text_delta(), lp, seq.finish_reason,
                                        seq.stop_reason))
        return True

    def _finish(self, req: RequestState, reason: str, result: StepResult) -> None:
        result.finished.append(self._end(req, reason))

    def _end(self, req: RequestState, reason: str) -> RequestOutput:
        """End a live request: free its blocks and proposer state, count it, forget it; its final output."""
        self.scheduler.finish(req.seq, reason)
        if self.spec is not None:
            self.spec.release(req.seq)
        self.counters["requests_finished"] += 1
        self._forget(req.seq.request_id)
        return req.output(self.detokenize)

    def _forget(self, request_id: str) -> RequestState | None:
        """Drop a request from the live ones (and from `_num_not_argmax` and `_deadlines`); None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is not None and not req.argmax_only:
            self._num_not_argmax -= 1
        self._deadlines.pop(request_id, None)
        return req

    def _sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                draft_probs: dict[int, torch.Tensor]) -> _Sampled:
        """Tokens (and logprobs) of the sampling sequences: one sampled token each, or accepted drafts + one.
        Sequence i's logits rows are its last known token's and its drafts', in order."""
        if len(sampling) == logits.shape[0]:  # no drafts: row i is sequence i's
            if self._num_not_argmax == 0:
                # Every request is greedy without logprobs (argmax_only): one argmax, nothing per row.
                return _Sampled(greedy_tokens(logits), None, None)
            seqs = [s.seq for s in sampling]
            sampled = sample(logits, [q.params for q in seqs], [q.generator for q in seqs], self.generator,
                             [q.logits_processor for q in seqs])
            return _Sampled(sampled.token_ids, sampled.logprobs, None)
        assert self.spec is not None
        out = self.spec.verify(sampling, logits, draft_probs, self.generator)
        return _Sampled([t for tokens, _ in out for t in tokens], [lp for _, lps in out for lp in lps],
                        [len(tokens) for tokens, _ in out])

    def _expire_deadlines(self, result: StepResult) -> None:
        if not self._deadlines:
            return
        now = time.monotonic()
        for rid in [r for r, deadline in self._deadlines.items() if now >= deadline]:
            out = self.abort(rid, "timeout")
            if out is not None:
                result.finished.append(out)
                result.events.append(TokenEvent(rid, None, "", None, "timeout", None))

    def detokenize(self, seq: Sequence) -> str:
        return self._decode(seq.output_token_ids, seq.params.skip_special_tokens)

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
                self.kv.allocate(seq, n)
                out = SchedulerOutput([ScheduledSeq(seq, n)])
                rows.append(self.executor.execute(out, all_logits=True))
                self.scheduler.update_from_output(out)
        finally:
            self.kv.free(seq)
        return torch.cat(rows)

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **(self.spec.stats() if self.spec is not None else SpeculativeDecoding.idle_stats()),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.kv.num_used,
            "kv_block_size": self.block_size,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "prompt_tokens_shared": self.scheduler.prompt_tokens_shared,
            "kv_blocks_cached": self.kv.num_cached,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            **self.counters,
        }

