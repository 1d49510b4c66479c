"""FastAPI app: OpenAI-compatible endpoints, health and readiness, metrics, and the admin knob API."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from governor import contract
from governor.engine.server import DEFAULT_MAX_REQUEST_BODY_BYTES
from governor.engine.server.auth import APIKeyGuard, bearer_token, token_matches
from governor.engine.server.chat import chat_completions
from governor.engine.server.completions import completions
from governor.engine.server.connection import BodyTooLarge, RequestGuard
from governor.engine.server.errors import APIError, error_response
from governor.engine.server.http_metrics import HttpMetricsMiddleware
from governor.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from governor.engine.server.state import ServerState, fingerprint, model_card

log = logging.getLogger("governor.engine.server")

_ERROR_KINDS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
                422: "bad_knob", 429: "queue_full", 500: "internal", 503: "unavailable"}


def create_app(state: ServerState, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="Governor engine", version="0.1.0")
    app.state.governor = state
    metrics = state.metrics
    guard: dict[str, RequestGuard] = {}

    def guarded(asgi: Any, **_: Any) -> RequestGuard:
        guard["guard"] = RequestGuard(asgi, max_request_body_bytes, lambda: metrics.error("too_large"))
        return guard["guard"]

    app.add_middleware(guarded)  # type: ignore[arg-type]
    if state.api_key is not None:  # before the body is read or validated
        app.add_middleware(APIKeyGuard, api_key=state.api_key, on_refused=lambda: metrics.error("unauthorized"))
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)  # outermost: the guards' 413s and 401s are counted too
    app.state.active_requests = lambda: guard["guard"].active if guard else 0

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.error(_ERROR_KINDS.get(e.status, "other"))
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error("bad_request")
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            param = None
            message = f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        else:
            message = f"{param + ': ' if param else ''}{err.get('msg', 'invalid request')}"
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        if not isinstance(e, BodyTooLarge):  # counted where it is detected
            # The router's own 404 and 405: a path or method the server does not have.
            metrics.error({404: "unknown_route"}.get(e.status_code) or _ERROR_KINDS.get(e.status_code, "other"))
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                              else "server_error", code="request_too_large" if isinstance(e, BodyTooLarge) else None)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        metrics.error("internal")
        log.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    # --- health -------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.ready and not state.draining:
            return JSONResponse({"status": "ready"})
        status = "draining" if state.draining else "failed" if state.load_error else "starting"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- OpenAI API ---------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine, _ = state.loaded()
        return {"object": "list", "data": [model_card(state, engine.engine.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        engine, _ = state.loaded()
        if model_id != state.served_model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {state.served_model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return model_card(state, engine.engine.max_model_len)

    @app.post("/v1/completions")
    async def post_completions(req: CompletionRequest, request: Request) -> Any:
        return await completions(state, req, request)

    @app.post("/v1/chat/completions")
    async def post_chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await chat_completions(state, req, request)

    # --- admin --------------------------------------------------------------------------------

    def _check_admin(request: Request) -> str:
        """The caller's admin token (401 unless it is the right one)."""
        if state.admin_token is None:
            raise APIError(404, "the admin API is disabled: start the server with GOVERNOR_ADMIN_TOKEN or "
                                "--admin-token-file", "not_found_error")
        given = bearer_token(request.headers.get("authorization", ""))
        if not token_matches(given, state.admin_token):
            raise APIError(401, "missing or wrong bearer token for the admin API", "authentication_error")
        return given

    def _knobs_state() -> dict[str, Any]:
        eng = state.loaded()[0].engine
        bounds = {k: contract.KnobBound(min=lo, max=hi) for k, (lo, hi) in eng.knob_caps().items()}
        return contract.KnobsState(**eng.knobs.model_dump(), bounds=bounds).model_dump()

    @app.get(contract.ADMIN_KNOBS_PATH)
    async def get_knobs(request: Request) -> dict[str, Any]:
        _check_admin(request)
        return _knobs_state()

    @app.put(contract.ADMIN_KNOBS_PATH)
    async def put_knobs(request: Request) -> dict[str, Any]:
        token = _check_admin(request)
        try:
            update = contract.KnobsUpdate.model_validate_json(await request.body())
        except ValidationError as e:
            err = e.errors()[0]
            if err["type"] == "json_invalid":
                raise APIError(400, f"malformed JSON body: {err['msg']}") from e
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(422, f"{param + ': ' if param else ''}{err['msg']}", param=param) from e
        try:
            before, after = await state.loaded()[0].update_knobs(update.changes())
        except ValueError as e:
            raise APIError(422, str(e), param=str(e).split("=")[0]) from e
        changed = {k: {"from": getattr(before, k), "to": getattr(after, k)} for k in update.changes()}
        log.info(json.dumps({"event": "knobs_changed", "who": f"admin-token:{fingerprint(token)}",
                             "changes": changed}, sort_keys=True))
        return _knobs_state()

    return app
