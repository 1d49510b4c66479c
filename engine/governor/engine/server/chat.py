"""POST /v1/chat/completions: the chat template applied off the event loop, n choices, streamed or not."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from governor.engine.outputs import TokenEvent
from governor.engine.sampling_params import StructuredOutputsParams
from governor.engine.server import choices as ch
from governor.engine.server.errors import APIError
from governor.engine.server.prompts import PromptEncoder, PromptTooLong
from governor.engine.server.protocol import ChatCompletionRequest
from governor.engine.server.state import ServerState, require_unicode
from governor.engine.server.tool_calls import (
    ToolChoice,
    finish_reason,
    messages_for_template,
    resolve_tool_choice,
    tools_for_template,
)
from governor.engine.server.tool_choice import tool_call_stream, tool_choice_schema
from governor.engine.server.tool_parsers import ToolCallStream


async def render_prompt(prompts: PromptEncoder, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                        template_kwargs: dict[str, Any]) -> list[int]:
    """Token ids of the rendered conversation: a 400 for a template error or a prompt that cannot fit."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            require_unicode(m["content"], f"messages.{i}.content")
    kwargs = dict(req.chat_template_kwargs or {}, add_generation_prompt=req.add_generation_prompt,
                  continue_final_message=req.continue_final_message, **template_kwargs)
    try:
        rendered = await prompts.render_chat(messages, **kwargs)
    except Exception as e:  # jinja errors from the model's own template are the caller's input problem
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
    try:
        return await prompts.encode(rendered, add_special_tokens=False)
    except PromptTooLong as e:
        raise APIError(400, str(e), param="messages") from e


async def chat_completions(state: ServerState, req: ChatCompletionRequest, request: Request) -> Any:
    engine, prompts = state.admit(req.model)
    try:
        tool_choice = resolve_tool_choice(req.tools, req.tool_choice)
        schema = tool_choice_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
        tool_call_stream(req.tools, req.tool_choice, state.tool_call_parser, req.parallel_tool_calls)  # checks it
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from e
    try:
        constraint = req.structured()
        if schema is not None and constraint is not None:
            raise ValueError("tool_choice 'required' or a named function constrains the output already: it cannot "
                             "be combined with response_format or structured outputs")
    except ValueError as e:
        raise APIError(400, str(e)) from e
    messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages_for_template(req.messages)]
    ids = await render_prompt(prompts, req, messages, {"tools": tools_for_template(req.tools)} if req.tools else {})
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, top_n,
                                     StructuredOutputsParams(json=schema) if schema is not None else None)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    calls = _ToolCalls(req, state.tool_call_parser, tool_choice)
    max_model_len = engine.engine.max_model_len
    if params.max_tokens is None and len(ids) >= max_model_len:
        raise APIError(400, f"the rendered chat prompt ({len(ids)} tokens) leaves no room to generate within "
                            f"max_model_len={max_model_len}", param="messages")
    await ch.compile_constraint(engine, prompts, params)
    plan = ch.plan([ids], params, req.n or 1, "chatcmpl")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = ch.submit(engine, plan, req.timeout, state.cache_salt(request, req.cache_salt))
    base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model}
    if not req.stream:
        await ch.collect(plan, streams)
        names = await ch.logprob_texts(prompts, [ev for c in plan for ev in c.events], top_n)
        body: dict[str, Any] = dict(base, choices=[_choice(req, c, names, top_n, calls) for c in plan],
                                    usage=ch.usage(plan))
        if req.return_token_ids:  # vLLM puts the prompt's ids on a chat response, the output's on its choice
            body["prompt_token_ids"] = ids
        return body
    base["object"] = "chat.completion.chunk"
    return StreamingResponse(_stream(req, plan, streams, prompts, base, top_n, ids, calls),
                             media_type="text/event-stream")


class _ToolCalls:
    """How a choice's output becomes content and tool calls, per the request's tools and tool_choice."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None, tool_choice: ToolChoice) -> None:
        self.req, self.parser, self.tool_choice = req, parser, tool_choice

    def stream(self) -> ToolCallStream | None:
        """A fresh reader for one choice; None when its output is plain content."""
        return tool_call_stream(self.req.tools, self.req.tool_choice, self.parser, self.req.parallel_tool_calls)

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        return finish_reason(engine_reason, called, self.tool_choice)


def _logprobs_block(events: list[TokenEvent], n: int | None, names: dict[int, str]) -> dict[str, Any] | None:
    if n is None:
        return None
    content = []
    for ev in events:
        if ev.token_id is None or ev.logprobs is None:
            continue
        tok = names[ev.token_id]
        content.append({"token": tok, "logprob": ev.logprobs[ev.token_id], "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": names[t], "logprob": v, "bytes": list(names[t].encode())}
                                         for t, v in ch.top_entries(ev, n)]})
    return {"content": content}


def _choice(req: ChatCompletionRequest, c: ch.Choice, names: dict[int, str], top_n: int | None,
            calls: _ToolCalls) -> dict[str, Any]:
    assert c.output is not None
    out = c.output.outputs[0]
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    finish = out.finish_reason
    reader = calls.stream()
    if reader is not None:
        content, tool_calls = reader.read_whole(out.text)
        message["content"] = content if tool_calls else (content or "")
        if tool_calls:
            message["tool_calls"] = [t.model_dump() for t in tool_calls]
        finish = calls.finish_reason(out.finish_reason, bool(tool_calls))
    choice: dict[str, Any] = {"index": c.index, "message": message,
                              "logprobs": _logprobs_block(c.events, top_n, names),
                              "finish_reason": finish, "stop_reason": out.stop_reason}
    if req.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return choice


async def _stream(req: ChatCompletionRequest, plan: list[ch.Choice], streams: list[Any], prompts: PromptEncoder,
                  base: dict[str, Any], top_n: int | None, prompt_ids: list[int], calls: _ToolCalls
                  ) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    prompt_tokens = len(prompt_ids)
    generated = [0] * len(plan)
    readers = [calls.stream() for _ in plan]

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None,
              extra: dict[str, Any] | None = None, body_extra: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **(extra or {})}
        body = dict(base, choices=[choice], **(body_extra or {}))
        if continuous:  # this choice's usage, as vLLM
            body["usage"] = ch.running_usage(prompt_tokens, generated[index])
        return f"data: {json.dumps(body)}\n\n"

    for c in plan:  # the opening role chunk of every choice (as vLLM: the prompt's ids on it)
        yield chunk(c.index, {"role": "assistant", "content": ""}, None,
                    body_extra={"prompt_token_ids": prompt_ids} if req.return_token_ids else None)
    events = ch.TokenEvents(plan, streams)
    async for i, item in events:
        c = plan[i]
        generated[i] += item.token_id is not None
        reader = readers[i]
        if reader is None:
            deltas = [{"content": item.text_delta}] if item.text_delta else []
            finish = item.finish_reason
        else:
            deltas = reader.feed(item.text_delta or "")
            if item.finish_reason is not None:
                deltas += reader.finish()
            finish = calls.finish_reason(item.finish_reason, reader.called) if item.finish_reason else None
        if not deltas and not ch.sends_chunk(item, top_n is not None, req.return_token_ids):
            continue
        names = await ch.logprob_texts(prompts, [item], top_n) if top_n is not None else {}
        extra = {"token_ids": ch.new_token_ids(item)} if req.return_token_ids else None
        deltas = deltas or [{}]
        for j, delta in enumerate(deltas):  # the event's logprobs and ids on its first chunk, its finish on its last
            first, last = j == 0, j == len(deltas) - 1
            yield chunk(c.index, delta, finish if last else None,
                        _logprobs_block([item], top_n, names) if first else None, extra if first else None)
    for line in events.closing(base, include_usage):
        yield line
