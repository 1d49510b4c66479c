"""One streaming request to an OpenAI-compatible server and what it took: TTFT, ITLs, E2E, tokens.

A request never raises: HTTP errors (non-2xx, 429 included), broken streams, exceptions and the
per-request deadline all end as a failed `RequestRecord` whose `error_kind` names what happened.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from governor.loadgen.workload import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_TEXT_LIMIT = 300


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; `*_s` offsets are from the benchmark start.

    Invariant: `error_kind is None` iff the request succeeded (2xx and a stream that ended in [DONE]).
    """

    index: int
    prompt_words: int
    max_tokens: int
    scheduled_s: float  # when the arrival process released it
    start_s: float | None = None  # when it was sent (later than scheduled_s if it waited for a concurrency slot)
    ttft: float | None = None  # send → first chunk carrying text or token ids
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks carrying text or token ids
    e2e: float | None = None  # send → [DONE]
    prompt_tokens: int | None = None  # the server's count from `usage`; None when the server sent no usage
    # `usage.completion_tokens`, else `token_ids_received`, else the number of chunks carrying text
    output_tokens: int = 0
    token_ids_received: int | None = None  # ids over the chunks' `token_ids`; None when no chunk had the field
    usage_reported: bool = False
    status: int | None = None
    # "http_<status>", "timeout", "incomplete_stream", "stream_error", or the exception's class name
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def fail(self, kind: str, text: str) -> None:
        self.error_kind, self.error = kind, text[:_ERROR_TEXT_LIMIT]


def endpoint_url(base_url: str, endpoint: str) -> str:
    """The request URL for `endpoint` ("completions" or "chat"); a base URL ending in /v1 is accepted too."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[endpoint]


def request_body(spec: RequestSpec, model: str, endpoint: str, ignore_eos: bool,
                 return_token_ids: bool = False) -> dict[str, Any]:
    """The JSON body: greedy, streaming, with the usage chunk requested so the server counts the tokens."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:  # a vLLM extension; left out when off so strict OpenAI servers accept the body
        body["ignore_eos"] = True
    if return_token_ids:  # a vLLM extension too: a chunk per token, even one whose text is empty
        body["return_token_ids"] = True
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries ('' for role-only, finish-only and usage chunks)."""
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text += piece or ""
    return text


def chunk_token_ids(chunk: dict[str, Any]) -> list[int] | None:
    """The generated token ids a streamed chunk carries (vLLM's `return_token_ids`); None without the field."""
    ids: list[int] | None = None
    for choice in chunk.get("choices") or ():
        if isinstance(choice.get("token_ids"), list):
            ids = (ids or []) + choice["token_ids"]
    return ids


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                       record: RequestRecord, t0: float, timeout: float) -> RequestRecord:
    """Send one streaming request and fill `record` (also returned). Never raises, except on cancellation.
    `timeout` bounds the whole request, not only each read, so a trickling stream cannot run on."""
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, record, start), timeout)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no [DONE] within {timeout} s")
    except Exception as e:  # a load generator reports failures; it never stops on one
        record.fail(type(e).__name__, str(e) or repr(e))
    return record


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                  record: RequestRecord, start: float) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as response:
        record.status = response.status_code
        if not response.is_success:
            record.fail(f"http_{response.status_code}", (await response.aread()).decode(errors="replace"))
            return
        last: float | None = None
        chunks = 0
        done = False
        async for line in response.aiter_lines():
            if done or not line.startswith("data:"):
                continue  # blank separators, SSE comments, and the stream's tail after [DONE]
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                # End time is [DONE]; the loop still reads to the end of the body so the connection goes
                # back to the pool instead of being closed (a fresh connection per request would skew TTFT).
                record.e2e, done = now - start, True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                record.fail("stream_error", json.dumps(chunk["error"]))
                return
            ids = chunk_token_ids(chunk)
            if ids is not None:
                record.token_ids_received = (record.token_ids_received or 0) + len(ids)
            if chunk_text(chunk) or ids:
                chunks += 1
                if last is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
            usage = chunk.get("usage")
            if usage:
                record.usage_reported = True
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = int(usage.get("completion_tokens") or 0)
        if not done:
            record.fail("incomplete_stream", f"the stream ended without [DONE] after {chunks} output chunks")
        elif not record.usage_reported:
            record.output_tokens = chunks if record.token_ids_received is None else record.token_ids_received
