"""FastAPI app: OpenAI-compatible endpoints, health and readiness, metrics, and the admin knob API."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from governor import contract
from governor.engine.outputs import RequestOutput, TokenEvent
from governor.engine.sampling_params import SamplingParams
from governor.engine.server.async_engine import AsyncEngine, QueueFullError
from governor.engine.server.metrics import EngineMetrics
from governor.engine.server.protocol import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class ServerState:
    """What the handlers see. `engine` and `tokenizer` are None while the model loads: the port is open
    from the start so liveness (/health) holds during a long load while /ready answers 503."""

    metrics: EngineMetrics
    served_model_name: str
    model_path: str
    admin_token: str | None
    salt_per_api_key: bool = False  # prefix-cache isolation per client API key (bearer token)
    engine: AsyncEngine | None = None
    tokenizer: Any = None  # the server's own tokenizer instance (the step thread has its own)
    ready: bool = False
    draining: bool = False
    load_error: str | None = None

    @property
    def in_flight(self) -> int:
        return self.engine.num_in_flight if self.engine is not None else 0

    def loaded(self) -> tuple[AsyncEngine, Any]:
        """The engine and tokenizer, or a 503 while the model is still loading (or failed to)."""
        if self.engine is None:
            raise APIError(503, f"the model failed to load: {self.load_error}" if self.load_error
                           else "the server is starting: the model is still loading", "service_unavailable",
                           headers={"Retry-After": "1"})
        return self.engine, self.tokenizer


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Governor engine", version="0.1.0")
    app.state.governor = state
    metrics = state.metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.error({400: "bad_request", 404: "not_found", 429: "queue_full", 503: "unavailable",
                       401: "unauthorized", 422: "bad_knob", 500: "internal"}.get(e.status, "other"))
        return _error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

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
        return _error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                               else "server_error")

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        metrics.error("internal")
        return _error_response(500, f"internal error: {type(e).__name__}", "server_error")

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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine, _ = state.loaded()
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": 0, "owned_by": "governor",
            "root": state.model_path, "max_model_len": engine.engine.max_model_len}]}

    # --- admin --------------------------------------------------------------------------------

    def _check_admin(request: Request) -> None:
        if state.admin_token is None:
            raise APIError(404, "the admin API is disabled: start the server with GOVERNOR_ADMIN_TOKEN or "
                                "--admin-token-file", "not_found_error")
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given, state.admin_token):
            raise APIError(401, "missing or wrong bearer token for the admin API", "authentication_error")

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
        _check_admin(request)
        try:
            update = contract.KnobsUpdate.model_validate(await request.json())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from e
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(422, f"{param + ': ' if param else ''}{err['msg']}", param=param) from e
        try:
            await state.loaded()[0].update_knobs(update.changes())
        except ValueError as e:
            raise APIError(422, str(e), param=str(e).split("=")[0]) from e
        return _knobs_state()

    # --- OpenAI API ---------------------------------------------------------------------------

    def _admit(model: str) -> None:
        if state.draining:
            raise APIError(503, "the server is draining and accepts no new requests", "service_unavailable",
                           headers={"Retry-After": "1"})
        state.loaded()
        if model != state.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def _require_unicode(text: str, param: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry lone surrogates; the tokenizer cannot take them
            raise APIError(400, f"{param} is not valid Unicode text: {e.reason} at character {e.start}",
                           param=param) from e

    def _encode(text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        _require_unicode(text, param)
        return list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _cache_salt(request: Request, salt: str | None) -> str | None:
        """The request's cache_salt, prefixed with a digest of its API key when salts are per key."""
        auth = request.headers.get("authorization", "")
        if not state.salt_per_api_key or not auth.startswith("Bearer "):
            return salt
        key = hashlib.sha256(auth.removeprefix("Bearer ").strip().encode()).hexdigest()
        return f"key:{key}:{salt or ''}"

    async def _events(rid: str, ids: list[int], params: SamplingParams, timeout: float | None,
                      salt: str | None) -> AsyncGenerator[TokenEvent | RequestOutput, None]:
        try:
            gen = state.loaded()[0].generate(rid, ids, params, timeout, salt)
            first = await gen.__anext__()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except QueueFullError as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from e
        return _chain(first, gen)

    def _token_text(tid: int) -> str:
        return str(state.tokenizer.decode([tid]))

    def _usage(prompt_len: int, out: RequestOutput) -> dict[str, int]:
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    async def _collect(events: AsyncGenerator[TokenEvent | RequestOutput, None]
                       ) -> tuple[list[TokenEvent], RequestOutput]:
        """All token events of a non-streamed request, and its final output (500 if the engine failed)."""
        evs: list[TokenEvent] = []
        async for item in events:
            if isinstance(item, TokenEvent):
                evs.append(item)
            elif not item.outputs:
                raise APIError(500, "the engine failed while running this request", "server_error")
            else:
                return evs, item
        raise APIError(500, "the request ended without an output", "server_error")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        _admit(req.model)
        ids = _encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        params = _sampling(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        events = await _events(rid, ids, params, req.timeout, _cache_salt(request, req.cache_salt))

        def logprobs_block(evs: list[TokenEvent], offset: int) -> dict[str, Any] | None:
            if req.logprobs is None:
                return None
            block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for ev in evs:
                if ev.token_id is None or ev.logprobs is None:
                    continue
                block["tokens"].append(_token_text(ev.token_id))
                block["token_logprobs"].append(ev.logprobs[ev.token_id])
                top = sorted(ev.logprobs.items(), key=lambda kv: -kv[1])[:req.logprobs]
                block["top_logprobs"].append({_token_text(t): v for t, v in top})
                block["text_offset"].append(offset)
            return block

        if not req.stream:
            evs, final = await _collect(events)
            c = final.outputs[0]
            choice = {"index": 0, "text": c.text, "logprobs": logprobs_block(evs, 0),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:  # vLLM puts both on the choice of a completion
                choice |= {"prompt_token_ids": ids, "token_ids": list(c.token_ids)}
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [choice], "usage": _usage(len(ids), final)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            offset = 0
            first = True
            try:
                async for item in events:
                    if isinstance(item, TokenEvent):
                        if not _sends_chunk(item, req.logprobs is not None, req.return_token_ids):
                            continue
                        choice = {"index": 0, "text": item.text_delta, "logprobs": logprobs_block([item], offset),
                                  "finish_reason": item.finish_reason, "stop_reason": item.stop_reason}
                        if req.return_token_ids:  # as vLLM: the prompt's ids on the first chunk only
                            if first:
                                choice["prompt_token_ids"] = ids
                            choice["token_ids"] = _new_token_ids(item)
                        chunk = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                 "choices": [choice]}
                        offset += len(item.text_delta)
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                    elif not item.outputs:  # the engine failed: say so in-band, then end the stream
                        err = {"error": {"message": "the engine failed while running this request",
                                         "type": "server_error", "param": None, "code": None}}
                        yield f"data: {json.dumps(err)}\n\n"
                    elif include_usage:
                        usage = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                 "choices": [], "usage": _usage(len(ids), item)}
                        yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        _admit(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                           tokenize=False)
        except Exception as e:  # jinja errors from the model's own template are the caller's input problem
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        ids = _encode(str(rendered), add_special_tokens=False, param="messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling(req, req.max_completion_tokens or req.max_tokens, top_n)
        max_model_len = state.loaded()[0].engine.max_model_len
        if params.max_tokens is None and len(ids) >= max_model_len:
            raise APIError(400, f"the rendered chat prompt ({len(ids)} tokens) leaves no room to generate within "
                                f"max_model_len={max_model_len}", param="messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        events = await _events(rid, ids, params, req.timeout, _cache_salt(request, req.cache_salt))

        def logprobs_block(evs: list[TokenEvent]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            content = []
            for ev in evs:
                if ev.token_id is None or ev.logprobs is None:
                    continue
                top = sorted(ev.logprobs.items(), key=lambda kv: -kv[1])[:req.top_logprobs or 0]
                tok = _token_text(ev.token_id)
                content.append({"token": tok, "logprob": ev.logprobs[ev.token_id], "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": _token_text(t), "logprob": v,
                                                  "bytes": list(_token_text(t).encode())} for t, v in top]})
            return {"content": content}

        if not req.stream:
            evs, final = await _collect(events)
            c = final.outputs[0]
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                      "logprobs": logprobs_block(evs), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            response = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                        "choices": [choice], "usage": _usage(len(ids), final)}
            if req.return_token_ids:  # vLLM puts the prompt's ids on a chat response, the output's on its choice
                choice["token_ids"] = list(c.token_ids)
                response["prompt_token_ids"] = ids
            return response

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish: str | None, ev: TokenEvent | None = None) -> str:
            """A chunk for token event `ev`, or the opening role chunk when `ev` is None."""
            choice = {"index": 0, "delta": delta, "logprobs": None if ev is None else logprobs_block([ev]),
                      "finish_reason": finish}
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [choice]}
            if req.return_token_ids:  # as vLLM: the prompt's ids on the first (role) chunk, new ids on the rest
                if ev is None:
                    body["prompt_token_ids"] = ids
                else:
                    choice["token_ids"] = _new_token_ids(ev)
            return f"data: {json.dumps(body)}\n\n"

        async def sse() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""}, None)
                async for item in events:
                    if isinstance(item, TokenEvent):
                        if not _sends_chunk(item, req.logprobs, req.return_token_ids):
                            continue
                        delta = {"content": item.text_delta} if item.text_delta else {}
                        yield chunk(delta, item.finish_reason, item)
                    elif not item.outputs:  # the engine failed: say so in-band, then end the stream
                        err = {"error": {"message": "the engine failed while running this request",
                                         "type": "server_error", "param": None, "code": None}}
                        yield f"data: {json.dumps(err)}\n\n"
                    elif include_usage:
                        usage = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": req.model, "choices": [], "usage": _usage(len(ids), item)}
                        yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def _sends_chunk(ev: TokenEvent, logprobs: bool, token_ids: bool) -> bool:
    """Whether a streamed token event gets a chunk: it has text, ends the request, or carries what the
    client asked for (logprobs, or the token's id: its text may be empty, e.g. partial UTF-8)."""
    return bool(ev.text_delta) or ev.finish_reason is not None or logprobs or (token_ids and ev.token_id is not None)


def _new_token_ids(ev: TokenEvent) -> list[int]:
    """The ids an event adds to the output (none when the request ended without a token, e.g. a timeout)."""
    return [] if ev.token_id is None else [ev.token_id]


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def _chain(first: TokenEvent | RequestOutput, rest: AsyncGenerator[TokenEvent | RequestOutput, None]
                 ) -> AsyncGenerator[TokenEvent | RequestOutput, None]:
    """Re-attach the first item (awaited early so admission errors surface before the response starts)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
