"""What the HTTP handlers share: the engine (once loaded), the prompt encoder, metrics and the server's settings."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from governor.engine.server.async_engine import AsyncEngine
from governor.engine.server.errors import APIError
from governor.engine.server.metrics import EngineMetrics
from governor.engine.server.prompts import PromptEncoder


@dataclass
class ServerState:
    """`engine` and `prompts` are None while the model loads: the port is open from the start so liveness
    (/health) holds during a long load while /ready answers 503."""

    metrics: EngineMetrics
    served_model_name: str
    model_path: str
    admin_token: str | None
    salt_per_api_key: bool = False  # prefix-cache isolation per client API key (bearer token)
    api_key: str | None = None  # required as a bearer token on /v1 when set
    tool_call_parser: str | None = None  # parses tool calls out of chat output (tool_choice "auto")
    engine: AsyncEngine | None = None
    prompts: PromptEncoder | None = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    requests_cut: int = 0  # requests ended by the drain deadline

    @property
    def in_flight(self) -> int:
        return self.engine.num_in_flight if self.engine is not None else 0

    def loaded(self) -> tuple[AsyncEngine, PromptEncoder]:
        """The engine and prompt encoder, or a 503 while the model is still loading (or failed to)."""
        if self.engine is None or self.prompts is None:
            raise APIError(503, f"the model failed to load: {self.load_error}" if self.load_error
                           else "the server is starting: the model is still loading", "service_unavailable",
                           headers={"Retry-After": "1"})
        return self.engine, self.prompts

    def admit(self, model: str) -> tuple[AsyncEngine, PromptEncoder]:
        """The engine for a new OpenAI request for `model`: 503 while draining or loading, 404 for another model."""
        if self.draining:
            raise APIError(503, "the server is draining and accepts no new requests", "service_unavailable",
                           headers={"Retry-After": "1"})
        loaded = self.loaded()
        if model != self.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.served_model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return loaded

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The request's cache_salt, prefixed with a digest of its API key when salts are per key."""
        auth = request.headers.get("authorization", "")
        if not self.salt_per_api_key or not auth.startswith("Bearer "):
            return salt
        key = hashlib.sha256(auth.removeprefix("Bearer ").strip().encode()).hexdigest()
        return f"key:{key}:{salt or ''}"


def fingerprint(token: str) -> str:
    """A short, stable name for a secret in logs: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def require_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can carry lone surrogates; the tokenizer cannot take them
        raise APIError(400, f"{param} is not valid Unicode text: {e.reason} at character {e.start}",
                       param=param) from e


def model_card(state: ServerState, max_model_len: int) -> dict[str, Any]:
    return {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "governor",
            "root": state.model_path, "parent": None, "max_model_len": max_model_len}
