"""The engine requests behind one HTTP request — one per choice: `n` (or `best_of`) per prompt — and their events,
merged into one stream or collected into finished choices.

Choices of one prompt share its KV blocks: the first is the prompt's owner, the rest are admitted once its prompt
is computed and start from its full blocks (`Scheduler`, `Sequence.prompt_source`). Each choice with a seed gets
`seed + its index`, so choices differ and each is reproducible."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from governor.engine.outputs import RequestOutput, TokenEvent
from governor.engine.sampling_params import SamplingParams
from governor.engine.server.async_engine import ABORT_AT_SHUTDOWN, AsyncEngine, QueueFullError, RequestFailed
from governor.engine.server.errors import APIError
from governor.engine.server.prompts import PromptEncoder

Item = TokenEvent | RequestOutput | RequestFailed
log = logging.getLogger("governor.engine.server")


@dataclass
class Choice:
    """One engine request: the `index`-th choice of the HTTP request, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    shares_prompt_of: str | None = None  # the request id of the choice whose prompt KV this one reuses
    events: list[TokenEvent] = field(default_factory=list)
    output: RequestOutput | None = None


def plan(prompts: list[list[int]], params: SamplingParams, per_prompt: int, prefix: str) -> list[Choice]:
    """`per_prompt` choices for each prompt, indexed prompt-major (OpenAI's order for a batch of prompts)."""
    base = uuid.uuid4().hex
    choices = []
    for p, ids in enumerate(prompts):
        owner = None
        for j in range(per_prompt):
            i = p * per_prompt + j
            own = params if per_prompt == 1 and len(prompts) == 1 else dataclasses.replace(
                params, seed=None if params.seed is None else params.seed + j)
            rid = f"{prefix}-{base}" if len(prompts) * per_prompt == 1 else f"{prefix}-{base}-{i}"
            choices.append(Choice(i, p, ids, own, rid, owner))
            owner = owner or rid
    return choices


async def compile_constraint(engine: AsyncEngine, prompts: PromptEncoder, params: SamplingParams) -> None:
    """Compile the request's output constraint on the prompt pool (a 400 if it is invalid), so the step thread
    finds it compiled: a schema takes up to ~0.1 s to compile, a stall every stream would feel."""
    if params.structured_outputs is None:
        return
    try:
        await prompts.run(engine.engine.structured_outputs().compile, params.structured_outputs)
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from e


def submit(engine: AsyncEngine, choices: list[Choice], timeout: float | None, salt: str | None
           ) -> list[AsyncGenerator[Item, None]]:
    """Validate and admit every choice (a 400 or a 429 before any starts), then start them."""
    try:
        engine.admit(len(choices))
        seen: set[int] = set()
        for c in choices:  # a prompt's choices differ only in their seeds: one check each prompt
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                engine.engine.validate_request({"prompt_token_ids": c.prompt_ids}, c.params)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    except QueueFullError as e:
        raise APIError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from e
    return [engine.generate(c.request_id, c.prompt_ids, c.params, timeout, salt, admitted=True,
                            share_prompt_of=c.shares_prompt_of) for c in choices]


async def merged(streams: list[AsyncGenerator[Item, None]]) -> AsyncIterator[tuple[int, Item]]:
    """(choice position, item) from every stream as they come. Leaving early closes them all, which aborts
    their requests."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[Item, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as e:  # its request cannot go on: end its choice, so the merge does not wait for it
            log.exception("a choice's stream failed")
            queue.put_nowait((i, RequestFailed(f"internal error: {type(e).__name__}")))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, item = await queue.get()
            yield i, item
            if not isinstance(item, TokenEvent):
                open_streams -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TokenEvents:
    """The token events of a request's choices, as they come (`async for i, event in events`): each choice's
    final output is kept on it and the first failure in `failed`; `closing` gives a stream's last lines."""

    def __init__(self, plan: list[Choice], streams: list[AsyncGenerator[Item, None]]) -> None:
        self.plan, self.streams = plan, streams
        self.failed: RequestFailed | None = None

    async def __aiter__(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        async for i, item in merged(self.streams):
            if isinstance(item, TokenEvent):
                yield i, item
            elif isinstance(item, RequestFailed):
                self.failed = self.failed or item
            else:
                self.plan[i].output = item

    def closing(self, base: dict[str, Any], include_usage: bool) -> list[str]:
        """An error event if a choice failed (in-band: the response has started), else the usage chunk when asked
        for; then [DONE]."""
        if self.failed is not None:
            lines = [f"data: {json.dumps(error_event(self.failed))}\n\n"]
        elif include_usage:
            lines = [f"data: {json.dumps(dict(base, choices=[], usage=usage(self.plan)))}\n\n"]
        else:
            lines = []
        return [*lines, "data: [DONE]\n\n"]


async def logprob_texts(prompts: PromptEncoder, events: list[TokenEvent], n: int | None) -> dict[int, str]:
    """The text of every token the events' logprobs blocks name (decoded on the prompt pool); {} without logprobs."""
    if n is None:
        return {}
    ids = sorted(set(logprob_ids(events, n)))
    return dict(zip(ids, await prompts.run(prompts.token_texts, ids), strict=True))


def failure_error(failure: RequestFailed) -> APIError:
    status = 503 if failure is ABORT_AT_SHUTDOWN else 500 if failure.type == "server_error" else 400
    return APIError(status, failure.message, failure.type, code=failure.code)


async def collect(choices: list[Choice], streams: list[AsyncGenerator[Item, None]]) -> None:
    """Run every choice to its end, keeping its events and output (an APIError if any failed)."""
    async for i, item in merged(streams):
        c = choices[i]
        if isinstance(item, TokenEvent):
            c.events.append(item)
        elif isinstance(item, RequestFailed):
            raise failure_error(item)
        else:
            c.output = item


def best(choices: list[Choice], n: int) -> list[Choice]:
    """For best_of: each prompt's n choices of highest cumulative logprob, renumbered in order."""
    kept: list[Choice] = []
    for p in sorted({c.prompt_index for c in choices}):
        group = [c for c in choices if c.prompt_index == p]
        group.sort(key=_score, reverse=True)
        kept.extend(group[:n])
    for i, c in enumerate(kept):
        c.index = i
    return kept


def _score(c: Choice) -> float:
    """A choice's cumulative logprob; one without tokens (a timeout before its first) ranks last."""
    lp = c.output.outputs[0].cumulative_logprob if c.output and c.output.outputs else None
    return float("-inf") if lp is None else lp


def usage(choices: list[Choice]) -> dict[str, int]:
    """Token counts of finished choices; a prompt counts once however many choices it had."""
    prompt = sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values())
    completion = sum(len(c.output.outputs[0].token_ids) for c in choices if c.output and c.output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def running_usage(prompt_tokens: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def top_entries(ev: TokenEvent, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of an event's logprobs, most likely first."""
    assert ev.logprobs is not None
    return sorted(ev.logprobs.items(), key=lambda kv: -kv[1])[:n]


def logprob_ids(events: list[TokenEvent], n: int) -> list[int]:
    """Every token id a logprobs block of these events names (to decode them all in one go)."""
    ids: list[int] = []
    for ev in events:
        if ev.token_id is not None and ev.logprobs is not None:
            ids.append(ev.token_id)
            ids.extend(t for t, _ in top_entries(ev, n))
    return ids


def new_token_ids(ev: TokenEvent) -> list[int]:
    """The ids an event adds to the output (none when the request ended without a token, e.g. a timeout)."""
    return [] if ev.token_id is None else [ev.token_id]


def sends_chunk(ev: TokenEvent, logprobs: bool, token_ids: bool) -> bool:
    """Whether a streamed token event gets a chunk: it has text, ends the request, or carries what the
    client asked for (logprobs, or the token's id: its text may be empty, e.g. partial UTF-8)."""
    return bool(ev.text_delta) or ev.finish_reason is not None or logprobs or (token_ids and ev.token_id is not None)


def error_event(failure: RequestFailed) -> dict[str, Any]:
    return {"error": {"message": failure.message, "type": failure.type, "param": None, "code": failure.code}}
