"""Counting every HTTP request the server answers, by route template, method and status code (ASGI middleware).

Labels stay bounded whatever clients send: the route is the template of the app's route that matched
(`/v1/completions`), or `unmatched` for any other path; the method is one of the standard ones, or `other`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from governor.engine.server.metrics import EngineMetrics

CLIENT_GONE = "governor.client_gone"  # set in the request's scope state by `connection.RequestGuard`
CLIENT_CLOSED_REQUEST = 499  # the status counted for a request whose client left before it was answered (as nginx)
UNMATCHED = "unmatched"  # the route label of a path no route serves (a 404); templates start with "/"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def route_template(routes: Iterable[BaseRoute], scope: Scope) -> str:
    """The path template of the route that serves `scope`, as the router picks it: the first full match, else
    the first route whose path matched but not its method (the router answers 405); else UNMATCHED."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", UNMATCHED))
        if match is Match.PARTIAL and partial is None:
            partial = route
    return UNMATCHED if partial is None else str(getattr(partial, "path", UNMATCHED))


class HttpMetricsMiddleware:
    """Counts each HTTP request once its response has been sent, in `EngineMetrics.http_requests`: the status
    the client got (404 and 405 included), 499 when the client left before an answer, or 500 when the app raised
    before answering. Add it to the app with
    `app.add_middleware(HttpMetricsMiddleware, metrics=state.metrics)`."""

    def __init__(self, app: ASGIApp, metrics: EngineMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Matched before the app runs: the router adds its own keys to the scope on the way down.
        route = route_template(getattr(scope.get("app"), "routes", ()), scope)
        method = scope["method"] if scope["method"] in METHODS else "other"
        status: int | None = None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        except asyncio.CancelledError:
            if status is not None:  # cancelled mid-response: the client did get this status
                self.metrics.http_request(route, method, status)
            raise  # cancelled before answering (shutdown): there is no response to count
        except Exception:
            # Raised before answering: the server's error middleware, outside this one, answers 500.
            self.metrics.http_request(route, method, 500 if status is None else status)
            raise
        if status is None and scope.get("state", {}).get(CLIENT_GONE):
            status = CLIENT_CLOSED_REQUEST  # the client left before the answer: nothing was sent
        self.metrics.http_request(route, method, 500 if status is None else status)
