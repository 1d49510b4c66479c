"""Bearer tokens: `--api-key` on every /v1 request (checked before the body is read, as vLLM does: a client without
the key learns nothing about its request), and the comparison the admin API uses too."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from governor.engine.server.connection import ASGIApp, Receive, Scope, Send
from governor.engine.server.errors import error_body


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value; "" for anything else."""
    return authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""


def token_matches(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


class APIKeyGuard:
    """401 for a /v1 request without `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1"):
            await self.app(scope, receive, send)
            return
        auth = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), "")
        if token_matches(bearer_token(auth), self.api_key):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        body = json.dumps(error_body("missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                                     "authentication_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
