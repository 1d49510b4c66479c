"""ASGI middleware for the life of one HTTP request: a cap on the body's size, and cancelling the request's work
the moment its client goes away.

Both wrap `receive`. The body cap answers 413 before a body over the limit is read whole (at once when
Content-Length says so, else as soon as the bytes received pass the limit). Cancellation watches the connection once
the body is in: when the client disconnects before the response is complete, the handler's task is cancelled, which
aborts its engine requests (`AsyncEngine.generate` aborts on exit) and frees their KV blocks at the next step
boundary — for a request still queued, still waiting for its first token, streaming or not."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from governor.engine.server.errors import error_body
from governor.engine.server.http_metrics import CLIENT_GONE

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the bytes received pass the limit (a body without Content-Length). An HTTP
    exception, so the app's handler answers it (FastAPI turns other exceptions met while reading a body into 400s)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(f"more than {limit}", limit))


class RequestGuard:
    """Caps request bodies at `max_body_bytes` (413) and cancels a request's handler when its client disconnects.
    `active` counts the HTTP requests in progress (a drain waits for it to reach 0)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, on_too_large: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_too_large = on_too_large
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._too_large(send, length)
            return
        self.active += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.active -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_in = asyncio.Event()  # the whole body has been received: from now on only a disconnect can arrive
        gone = asyncio.Event()  # the client disconnected
        response = {"started": False, "done": False}
        received = 0

        async def guarded_receive() -> Message:
            nonlocal received
            if body_in.is_set():
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if self.on_too_large is not None:
                        self.on_too_large()
                    raise BodyTooLarge(self.max_body_bytes)
                if not message.get("more_body", False):
                    body_in.set()
            elif message["type"] == "http.disconnect":
                gone.set()
                body_in.set()
            return message

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["done"] = True
            await send(message)

        handler = asyncio.ensure_future(self.app(scope, guarded_receive, tracked_send))

        async def watch() -> None:
            await body_in.wait()
            while not gone.is_set():
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
            if not response["done"]:
                scope.setdefault("state", {})[CLIENT_GONE] = True
                handler.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled from outside (shutdown), not by a disconnect
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _too_large(self, send: Send, size: int) -> None:
        if self.on_too_large is not None:
            self.on_too_large()
        body = json.dumps(error_body(too_large_message(str(size), self.max_body_bytes), "invalid_request_error",
                                     None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def too_large_message(size: str, limit: int) -> str:
    return (f"the request body ({size} bytes) is larger than this server's limit of {limit} bytes "
            "(--max-request-body-bytes)")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
