"""`governor serve`: load the engine, start the step thread, serve HTTP with uvicorn, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from governor import contract
from governor.engine.config import EngineConfig
from governor.engine.gc_freeze import freeze_startup_objects
from governor.engine.llm_engine import LLMEngine
from governor.engine.server import DEFAULT_MAX_REQUEST_BODY_BYTES
from governor.engine.server.app import create_app
from governor.engine.server.async_engine import ABORT_AT_SHUTDOWN, AsyncEngine
from governor.engine.server.metrics import EngineMetrics
from governor.engine.server.prompts import PromptEncoder
from governor.engine.server.state import ServerState
from governor.engine.tokenizer import load_tokenizer

API_KEY_ENV = "GOVERNOR_API_KEY"
EXIT_DRAINED, EXIT_LOAD_FAILED, EXIT_REQUESTS_CUT = 0, 1, 3
_FLUSH_S = 2.0  # after the drain deadline, how long cut requests get to send their error event


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    admin_token: str | None = None
    max_queue: int = 1024
    drain_grace_s: float = 30.0
    revision: str | None = None
    namespace: str | None = None
    salt_per_api_key: bool = False
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tool_call_parser: str | None = None  # set only with --enable-auto-tool-choice
    metrics_names: str = "governor"  # --metrics-names: "vllm" exports vLLM's names beside Governor's

log = logging.getLogger("governor.engine.server")


def read_admin_token(token_file: str | None) -> str | None:
    """The admin bearer token from --admin-token-file, else GOVERNOR_ADMIN_TOKEN; None disables the API."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"admin token file {token_file} is empty")
        return token
    return os.environ.get(contract.ADMIN_TOKEN_ENV) or None


def read_api_key(flag: str | None) -> str | None:
    """The key /v1 requires: --api-key, else GOVERNOR_API_KEY; None leaves /v1 open."""
    return flag or os.environ.get(API_KEY_ENV) or None


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: mark not ready and refuse new requests, let in-flight ones finish (up to the
    grace period), end the rest with an error (an error event on a stream, a 503 otherwise), then stop uvicorn.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float,
                 active_requests: Callable[[], int]) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.active_requests = active_requests
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining:
            super().handle_exit(sig, frame)
            return
        log.info("signal %s: draining (%d in flight, grace %.0f s)", sig, self.state.in_flight,
                 self.grace_s)
        self.state.draining = True
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        # Requests in the engine, and HTTP requests still being prepared (tokenizing, compiling a schema).
        def busy() -> int:
            return max(self.state.in_flight, self.active_requests())

        while busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if busy() and self.state.engine is not None:
            self.state.requests_cut = max(busy(), self.state.engine.end_all(ABORT_AT_SHUTDOWN))
            log.warning("grace period over: ending %d requests in flight with an error", self.state.requests_cut)
            flush = loop.time() + _FLUSH_S
            while self.active_requests() and loop.time() < flush:
                await asyncio.sleep(0.02)
        self.should_exit = True


def scope_of(revision: str | None, namespace: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """The revision and namespace labels of the metrics: each flag, else its env var (`GOVERNOR_REVISION`,
    `GOVERNOR_NAMESPACE`, which the operator sets), else "" (a standalone engine)."""
    return (revision or env.get(contract.REVISION_ENV, ""), namespace or env.get(contract.NAMESPACE_ENV, ""))


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Open the port at once (so /health answers during a long load), load the model on a thread,
    then mark ready. Returns the process exit code: 0 once every request finished (after a drain), 1 if the
    model failed to load, 3 if the drain deadline cut requests short."""
    o = options
    name = o.served_model_name or Path(config.model).name
    revision_label, namespace_label = scope_of(o.revision, o.namespace, os.environ)
    metrics = EngineMetrics(name, revision_label, namespace_label, names=o.metrics_names)
    state = ServerState(metrics, name, config.model, o.admin_token, o.salt_per_api_key, o.api_key,
                        o.tool_call_parser)
    app = create_app(state, o.max_request_body_bytes)
    uv_config = uvicorn.Config(app, host=o.host, port=o.port, log_level="info", access_log=False,
                               timeout_graceful_shutdown=5)
    server = _DrainingServer(uv_config, state, o.drain_grace_s, app.state.active_requests)
    host, port, admin_token, max_queue = o.host, o.port, o.admin_token, o.max_queue

    def load() -> None:
        try:
            engine = LLMEngine(config)
            freeze_startup_objects()
            metrics.set_info({"model_digest": engine.model_digest, "tokenizer_digest": engine.tokenizer_digest,
                              "served_model_name": name,
                              "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
                              "quantization": engine.model_config.quantization.method
                              if engine.model_config.quantization is not None else "none"})
            try:  # the grammar compiler's vocabulary tables (~2 s at 128k tokens), now rather than at a first request
                engine.structured_outputs()
            except Exception:  # structured requests will get the error as a 400; nothing else needs it
                log.exception("structured outputs are unavailable with this tokenizer")
            async_engine = AsyncEngine(engine, metrics, max_queue)
            state.prompts = PromptEncoder(load_tokenizer(config.tokenizer or config.model), engine.max_model_len)
            async_engine.start()
            state.engine = async_engine
            state.ready = True
            log.info("serving %s on http://%s:%d (admin API %s)", name, host, port,
                     "enabled" if admin_token else "disabled")
        except Exception as e:  # a load failure is reported on /ready, in the log, and by the exit code
            log.exception("the model failed to load")
            state.load_error = f"{type(e).__name__}: {e}"
            server.should_exit = True

    threading.Thread(target=load, name="governor-load", daemon=True).start()
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.shutdown()
        if state.prompts is not None:
            state.prompts.close()
    if state.load_error:
        return EXIT_LOAD_FAILED
    return EXIT_REQUESTS_CUT if state.requests_cut else EXIT_DRAINED
