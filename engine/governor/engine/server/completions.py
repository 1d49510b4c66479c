"""POST /v1/completions: one or several prompts, n (or best_of) choices each, streamed or not."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from governor.engine.outputs import TokenEvent
from governor.engine.server import choices as ch
from governor.engine.server.errors import APIError
from governor.engine.server.prompts import PromptEncoder, PromptTooLong
from governor.engine.server.protocol import CompletionRequest
from governor.engine.server.state import ServerState, require_unicode


async def completions(state: ServerState, req: CompletionRequest, request: Request) -> Any:
    engine, prompts = state.admit(req.model)
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs would need the prompt's logprobs, which this server does not "
                            "compute; ask for one or the other", param="echo")
    prompt_ids: list[list[int]] = []
    prompt_texts: list[str | None] = []
    for p in req.prompts():
        if isinstance(p, str):
            require_unicode(p, "prompt")
            try:
                prompt_ids.append(await prompts.encode(p))
            except PromptTooLong as e:
                raise APIError(400, str(e), param="prompt") from e
            prompt_texts.append(p)
        else:
            prompt_ids.append(list(p))
            prompt_texts.append(None)
    n = req.n or 1
    per_prompt = req.best_of or n
    # best_of ranks choices by cumulative logprob: each needs its sampled tokens' logprobs.
    logprobs = req.logprobs if per_prompt == n else max(req.logprobs or 0, 0)
    try:
        params = req.sampling_params(req.max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    await ch.compile_constraint(engine, prompts, params)
    plan = ch.plan(prompt_ids, params, per_prompt, "cmpl")
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = ch.submit(engine, plan, req.timeout, state.cache_salt(request, req.cache_salt))
    echoes = [await _echo_text(prompts, ids, text) if req.echo else "" for ids, text in zip(prompt_ids, prompt_texts,
                                                                                             strict=True)]
    base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    if not req.stream:
        await ch.collect(plan, streams)
        kept = ch.best(plan, n) if per_prompt > n else plan
        names = await ch.logprob_texts(prompts, [ev for c in kept for ev in c.events], req.logprobs)
        body = dict(base, choices=[_choice(req, c, echoes[c.prompt_index], names) for c in kept],
                    usage=ch.usage(plan))
        return body
    return StreamingResponse(_stream(req, plan, streams, echoes, prompts, base), media_type="text/event-stream")


async def _echo_text(prompts: PromptEncoder, ids: list[int], text: str | None) -> str:
    if text is not None:
        return text
    return await prompts.run(prompts.tokenizer.decode, ids)


def _logprobs_block(events: list[TokenEvent], n: int | None, names: dict[int, str], offset: int
                    ) -> dict[str, list[Any]] | None:
    """OpenAI's completions logprobs: tokens, their logprobs, the top n of each, and each token's offset in the
    choice's text."""
    if n is None:
        return None
    block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        if ev.token_id is None or ev.logprobs is None:
            continue
        token = names[ev.token_id]
        block["tokens"].append(token)
        block["token_logprobs"].append(ev.logprobs[ev.token_id])
        block["top_logprobs"].append({names[t]: v for t, v in ch.top_entries(ev, n)})
        block["text_offset"].append(offset)
        offset += len(token)
    return block


def _choice(req: CompletionRequest, c: ch.Choice, echo: str, names: dict[int, str]) -> dict[str, Any]:
    assert c.output is not None
    out = c.output.outputs[0]
    choice = {"index": c.index, "text": echo + out.text,
              "logprobs": _logprobs_block(c.events, req.logprobs, names, len(echo)),
              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
    if req.return_token_ids:  # vLLM puts both on the choice of a completion
        choice |= {"prompt_token_ids": c.prompt_ids, "token_ids": list(out.token_ids)}
    return choice


async def _stream(req: CompletionRequest, plan: list[ch.Choice], streams: list[Any], echoes: list[str],
                  prompts: PromptEncoder, base: dict[str, Any]) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    offsets = [len(echoes[c.prompt_index]) for c in plan]
    started = [False] * len(plan)
    generated = [0] * len(plan)
    events = ch.TokenEvents(plan, streams)
    async for i, item in events:
        c = plan[i]
        generated[i] += item.token_id is not None
        echo_due = not started[i] and bool(echoes[c.prompt_index])  # the echoed prompt goes out with the first event
        if not ch.sends_chunk(item, req.logprobs is not None, req.return_token_ids) and not echo_due:
            continue
        names = await ch.logprob_texts(prompts, [item], req.logprobs) if req.logprobs is not None else {}
        text = item.text_delta if started[i] else echoes[c.prompt_index] + item.text_delta
        choice = {"index": c.index, "text": text, "logprobs": _logprobs_block([item], req.logprobs, names, offsets[i]),
                  "finish_reason": item.finish_reason, "stop_reason": item.stop_reason}
        if req.return_token_ids:  # as vLLM: the prompt's ids on a choice's first chunk only
            if not started[i]:
                choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = ch.new_token_ids(item)
        offsets[i] += len(text)
        started[i] = True
        chunk = dict(base, choices=[choice])
        if continuous:
            chunk["usage"] = ch.running_usage(len(c.prompt_ids), generated[i])  # this choice's, as vLLM
        yield f"data: {json.dumps(chunk)}\n\n"
    for line in events.closing(base, include_usage):
        yield line
