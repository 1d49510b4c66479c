"""`governor serve`: load the engine, start the step thread, serve HTTP with uvicorn, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import uvicorn

from governor import contract
from governor.engine.config import EngineConfig
from governor.engine.gc_freeze import freeze_startup_objects
from governor.engine.llm_engine import LLMEngine
from governor.engine.server.app import ServerState, create_app
from governor.engine.server.async_engine import AsyncEngine
from governor.engine.server.metrics import EngineMetrics
from governor.engine.tokenizer import load_tokenizer

log = logging.getLogger("governor.engine.server")


def read_admin_token(token_file: str | None) -> str | None:
    """The admin bearer token from --admin-token-file, else GOVERNOR_ADMIN_TOKEN; None disables the API."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"admin token file {token_file} is empty")
        return token
    return os.environ.get(contract.ADMIN_TOKEN_ENV) or None


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: mark not ready and refuse new requests, let in-flight ones finish (up to the
    grace period), then stop uvicorn. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
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
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            log.warning("grace period over with %d requests in flight", self.state.in_flight)
        self.should_exit = True


def scope_of(revision: str | None, namespace: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """The revision and namespace labels of the metrics: each flag, else its env var (`GOVERNOR_REVISION`,
    `GOVERNOR_NAMESPACE`, which the operator sets), else "" (a standalone engine)."""
    return (revision or env.get(contract.REVISION_ENV, ""), namespace or env.get(contract.NAMESPACE_ENV, ""))


def serve(config: EngineConfig, host: str, port: int, served_model_name: str | None, admin_token: str | None,
          max_queue: int, drain_grace_s: float, revision: str | None = None, salt_per_api_key: bool = False,
          namespace: str | None = None) -> int:
    """Open the port at once (so /health answers during a long load), load the model on a thread,
    then mark ready. Returns the process exit code: 0 after a drain, 1 if the model failed to load."""
    name = served_model_name or Path(config.model).name
    revision_label, namespace_label = scope_of(revision, namespace, os.environ)
    metrics = EngineMetrics(name, revision_label, namespace_label)
    state = ServerState(metrics, name, config.model, admin_token, salt_per_api_key)
    app = create_app(state)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                               timeout_graceful_shutdown=5)
    server = _DrainingServer(uv_config, state, drain_grace_s)

    def load() -> None:
        try:
            engine = LLMEngine(config)
            freeze_startup_objects()
            metrics.set_info({"model_digest": engine.model_digest, "tokenizer_digest": engine.tokenizer_digest,
                              "served_model_name": name,
                              "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch.")})
            async_engine = AsyncEngine(engine, metrics, max_queue)
            state.tokenizer = load_tokenizer(config.tokenizer or config.model)
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
    return 1 if state.load_error else 0
