"""Runs the engine's step loop on its own thread and streams each request's events to asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
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


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent | RequestOutput]
    arrival: float
    last_token_at: float | None = None


@dataclass
class _Pending:
    adds: list[tuple[str, list[int], SamplingParams, float | None, str | None]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    knobs: list[tuple[dict[str, int], concurrent.futures.Future[Knobs]]] = field(default_factory=list)


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

    def num_waiting(self) -> int:
        with self._lock:
            pending = len(self._pending.adds)
        return pending + len(self.engine.scheduler.waiting)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       timeout_s: float | None = None, cache_salt: str | None = None
                       ) -> AsyncGenerator[TokenEvent | RequestOutput, None]:
        """Yield the request's token events, then its final RequestOutput. Leaving early (a client that
        disconnected) aborts the request and frees its KV blocks."""
        self.engine.validate_request({"prompt_token_ids": prompt_token_ids}, params)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
        if self.num_waiting() >= self.max_queue:
            raise QueueFullError(f"{self.max_queue} requests are already waiting")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        with self._lock:
            self._streams[request_id] = stream
            self._pending.adds.append((request_id, prompt_token_ids, params, timeout_s, cache_salt))
        self._wake.set()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                yield item
                if isinstance(item, RequestOutput):
                    done = True
                    return
        finally:
            if not done:
                with self._lock:
                    self._pending.aborts.append(request_id)
                self._wake.set()

    async def update_knobs(self, changes: dict[str, int]) -> Knobs:
        """Apply at the next step boundary; returns the effective knobs. ValueError names a violated bound."""
        fut: concurrent.futures.Future[Knobs] = concurrent.futures.Future()
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
                self.metrics.observe_stats(self.engine.stats())
            except Exception:  # a bug must not silently kill the step loop: fail every request loudly
                log.exception("engine step failed; failing all in-flight requests")
                self._fail_all()

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        for changes, fut in pending.knobs:
            try:
                knobs = self.engine.update_knobs(**changes)
                self.metrics.set_knobs(knobs.model_dump())
                fut.set_result(knobs.model_copy())
            except ValueError as e:
                fut.set_exception(e)
        for rid, ids, params, timeout_s, salt in pending.adds:
            if rid in pending.aborts:
                continue
            try:
                self.engine.add_request(rid, ids, params, stream_text=True, timeout_s=timeout_s, cache_salt=salt)
            except ValueError as e:  # validated before queueing; only a race with max_model_len could land here
                self._finish_stream(rid, None, error=str(e))
        for rid in pending.aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self.metrics.finish("abort")
            self._streams.pop(rid, None)
        if pending.aborts:
            self.metrics.observe_stats(self.engine.stats())

    def _dispatch(self, result: StepResult) -> None:
        now = time.monotonic()
        for ev in result.events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if ev.token_id is not None:
                if stream.last_token_at is None:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last_token_at)
                stream.last_token_at = now
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ev)
        for out in result.finished:
            self.metrics.finish(out.outputs[0].finish_reason or "abort")
            self.metrics.e2e.observe(out.metrics["e2e_s"])
            if "queue_s" in out.metrics:
                self.metrics.queue.observe(out.metrics["queue_s"])
            self._finish_stream(out.request_id, out)

    def _finish_stream(self, rid: str, out: RequestOutput | None, error: str | None = None) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        if out is None:
            out = RequestOutput(rid, None, [], [], True, {"error": 1.0})
            log.error("request %s failed: %s", rid, error)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_all(self) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)
            self._finish_stream(rid, None, error="engine step failed")
