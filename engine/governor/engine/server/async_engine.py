"""Runs the engine's step loop on its own thread and streams each request's events to asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from governor.engine.config import Knobs
from governor.engine.llm_engine import LLMEngine
from governor.engine.outputs import RequestOutput, StepResult, TokenEvent
from governor.engine.sampling_params import SamplingParams
from governor.engine.server.metrics import EngineMetrics

log = logging.getLogger("governor.engine.server")


class QueueFullError(Exception):
    """More requests are waiting than max_queue allows."""


def burst_gaps(tokens: int, last_token_at: float | None, now: float) -> list[float]:
    """The inter-token latencies of `tokens` tokens of one request that arrive together at `now` (a speculative
    step's accepted drafts come with its verified token), the request's previous token at `last_token_at`: each
    token's share of the wait, (now - last) / tokens, so that the histogram reads time per token whatever the burst;
    a request's first token is its TTFT, not a gap (None: no token yet), and the rest of its burst waited 0."""
    if last_token_at is None:
        return [0.0] * (tokens - 1)
    return [(now - last_token_at) / tokens] * tokens


@dataclass
class RequestFailed:
    """The last item of a request that ended without an output: the engine failed, or the server shut down
    before it finished. Shaped for an OpenAI error body."""

    message: str
    type: str = "server_error"
    code: str | None = None


ENGINE_FAILED = RequestFailed("the engine failed while running this request")
ABORT_AT_SHUTDOWN = RequestFailed("the server shut down before this request finished (drain deadline)",
                                  "server_error", "server_shutdown")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent | RequestOutput | RequestFailed]
    arrival: float
    last_token_at: float | None = None


@dataclass
class _Pending:
    adds: list[tuple[str, list[int], SamplingParams, float | None, str | None, str | None]] = field(
        default_factory=list)
    aborts: list[str] = field(default_factory=list)
    knobs: list[tuple[dict[str, int], concurrent.futures.Future[tuple[Knobs, Knobs]]]] = field(default_factory=list)
    ends: list[tuple[str, RequestFailed]] = field(default_factory=list)  # requests to end with an error


class AsyncEngine:
    """The only thread that touches the LLMEngine is the step thread; everything else hands it work
    through `_pending` under a lock, so knob changes, aborts and admissions all apply at step boundaries."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending = _Pending()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._closing: RequestFailed | None = None  # set by end_all: what requests arriving after it get
        self._thread = threading.Thread(target=self._run, name="governor-engine-step", daemon=True)
        self.metrics.set_knobs(engine.knobs.model_dump())
        self.metrics.observe_stats(engine.stats())

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the step thread, then close the engine (its tensor-parallel workers)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # a step still running: closing now would race it; exit ends the workers
            log.warning("the engine step thread did not stop within 10 s; leaving the engine to process exit")
            return
        self.engine.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self, more: int = 0) -> int:
        """Requests that would wait for a running slot with `more` added now: those not yet handed to the step
        thread and those the scheduler queues, less the slots free under max_num_seqs (where the next step takes
        them). A burst that fits the running slots and the queue is admitted whole."""
        with self._lock:
            pending = len(self._pending.adds)
        scheduler = self.engine.scheduler
        free = max(0, self.engine.knobs.max_num_seqs - len(scheduler.running))
        return max(0, pending + len(scheduler.waiting) + more - free)

    def admit(self, count: int = 1) -> None:
        """QueueFullError unless `count` more requests leave at most max_queue waiting."""
        if self.num_waiting(count) > self.max_queue:
            raise QueueFullError(f"{self.max_queue} requests are already waiting")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       timeout_s: float | None = None, cache_salt: str | None = None, admitted: bool = False,
                       share_prompt_of: str | None = None
                       ) -> AsyncGenerator[TokenEvent | RequestOutput | RequestFailed, None]:
        """Yield the request's token events, then its final RequestOutput (or a RequestFailed). Leaving early (a
        client that disconnected) aborts the request and frees its KV blocks. `admitted`: the caller already
        checked the queue for it (`admit`, for the requests of one HTTP request together). `share_prompt_of`: a
        sibling with the same prompt, added before this one (`LLMEngine.add_request`)."""
        if not admitted:  # else the caller validated it and checked the queue for it (`choices.submit`)
            self.engine.validate_request({"prompt_token_ids": prompt_token_ids}, params)
            self.admit()
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
        if self._closing is not None:  # the drain deadline has passed: it would only be cut
            yield self._closing
            return
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        with self._lock:
            self._streams[request_id] = stream
            self._pending.adds.append((request_id, prompt_token_ids, params, timeout_s, cache_salt, share_prompt_of))
        self._wake.set()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                yield item
                if isinstance(item, RequestOutput | RequestFailed):
                    done = True
                    return
        finally:
            if not done:
                with self._lock:
                    self._pending.aborts.append(request_id)
                self._wake.set()

    def end_all(self, failure: RequestFailed) -> int:
        """End every request in flight with `failure` at the next step boundary (aborting it in the engine);
        returns how many there were."""
        self._closing = failure
        with self._lock:
            rids = list(self._streams)
            self._pending.ends.extend((rid, failure) for rid in rids)
        self._wake.set()
        return len(rids)

    async def update_knobs(self, changes: dict[str, int]) -> tuple[Knobs, Knobs]:
        """Apply at the next step boundary; returns the knobs before and after. ValueError names a violated
        bound (and nothing changes)."""
        fut: concurrent.futures.Future[tuple[Knobs, Knobs]] = concurrent.futures.Future()
        with self._lock:
            self._pending.knobs.append((changes, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    # --- the step thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            try:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                result = self.engine.step()
                self._dispatch(result)
                self.metrics.observe_step(self.engine.stats())
            except Exception:  # a bug must not silently kill the step loop: fail every request loudly
                log.exception("engine step failed; failing all in-flight requests")
                self._fail_all()

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        for changes, fut in pending.knobs:
            try:
                before = self.engine.knobs.model_copy()
                knobs = self.engine.update_knobs(**changes)
                self.metrics.set_knobs(knobs.model_dump())
                fut.set_result((before, knobs.model_copy()))
            except ValueError as e:
                fut.set_exception(e)
        for rid, ids, params, timeout_s, salt, sibling in pending.adds:
            if rid in pending.aborts:
                continue
            try:
                self.engine.add_request(rid, ids, params, stream_text=True, timeout_s=timeout_s, cache_salt=salt,
                                        share_prompt_of=sibling)
            except ValueError as e:  # validated before queueing; only a race with max_model_len could land here
                self._finish_stream(rid, None, RequestFailed(str(e), "invalid_request_error"))
        for rid in pending.aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self.metrics.finish("abort")
            self._streams.pop(rid, None)
        for rid, failure in pending.ends:
            if self.engine.abort(rid) is not None:
                self.metrics.finish("abort")
            self._finish_stream(rid, None, failure)
        if pending.aborts or pending.ends:
            self.metrics.observe_stats(self.engine.stats())

    def _dispatch(self, result: StepResult) -> None:
        now = time.monotonic()
        metrics, streams = self.metrics, self._streams
        bursts = Counter(ev.request_id for ev in result.events if ev.token_id is not None and ev.request_id in streams)
        itls: list[float] = []  # observed together: one metrics call per step, not per token
        for rid, tokens in bursts.items():
            stream = streams[rid]
            if stream.last_token_at is None:
                metrics.observe_first_token(rid, now - stream.arrival, now)
            itls += burst_gaps(tokens, stream.last_token_at, now)
            stream.last_token_at = now
        for ev in result.events:
            target = streams.get(ev.request_id)
            if target is not None:
                target.loop.call_soon_threadsafe(target.queue.put_nowait, ev)
        metrics.observe_inter_tokens(itls)
        for out in result.finished:
            ended = streams.get(out.request_id)
            metrics.observe_finished(out, now, None if ended is None else ended.last_token_at)
            self._finish_stream(out.request_id, out)
        metrics.forget_ended(streams)

    def _finish_stream(self, rid: str, out: RequestOutput | None, failure: RequestFailed | None = None) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        item: RequestOutput | RequestFailed
        if out is not None:
            item = out
        else:
            item = failure or ENGINE_FAILED
            log.error("request %s ended without an output: %s", rid, item.message)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)
            self._finish_stream(rid, None, ENGINE_FAILED)
