"""OpenAI API request shapes (pydantic), with vLLM's extensions.

Every field of OpenAI's completions and chat completions requests is known here: the ones Governor implements, and
the ones that change nothing for a self-hosted model (`metadata`, `store: false`, `service_tier`, ...), accepted when
their value is a no-op and refused with a 400 naming them otherwise. A field neither API has is refused with a 400
naming it (a typo must not pass silently)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from governor.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from governor.engine.server.tool_calls import TextPart, Tool, ToolCall, ToolChoice

MAX_N = 128  # choices per request (n and best_of): each is a sequence of its own in the engine


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="vLLM's extension: usage on every chunk.")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _no_op(value: Any, allowed: tuple[Any, ...], name: str, what: str) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{name}={json.dumps(value)} is not supported: {what}")


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. vLLM's extras (top_k, min_p, repetition_penalty,
    min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, cache_salt,
    return_token_ids, structured_outputs and the guided_* fields) are top-level fields, plus `timeout` (seconds)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Upper bounds are the int64 range the sampler and torch.Generator take: beyond it the step thread fails.
    top_k: int | None = Field(default=None, ge=-1, le=2**63 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="Token id (as a string) → bias in "
                                                "[-100, 100], added to its logit.")
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256,
                                   description="Prefix-cache isolation: requests share cached KV only with "
                                               "requests of the same salt.")
    timeout: float | None = Field(default=None, gt=0.0, description="End the request after this many seconds "
                                                                    "with finish_reason 'timeout'.")
    return_token_ids: bool = Field(default=False, description="vLLM's extension: the choice carries `token_ids` "
                                   "(generated ids) and the prompt's ids come as `prompt_token_ids`; streamed, "
                                   "every new token gets a chunk with its ids, even when its text is empty.")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # No-ops for a self-hosted model: accepted, and changing nothing.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _vllm_rules(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        _no_op(self.store, (False,), "store", "this server does not store completions")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint asked for through any of the fields that can carry one (at most one of them)."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            asked.append(("response_format", StructuredOutputsParams(json_object=True) if fmt.type == "json_object"
                          else StructuredOutputsParams(json=fmt.json_schema.schema_ if fmt.json_schema else {})))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            asked.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object))))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutputsParams(**{kind: value})))
        if len(asked) > 1:
            raise ValueError(f"give at most one output constraint; got {', '.join(n for n, _ in asked)}")
        return asked[0][1] if asked else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's parameters for one choice. ValueError names what is wrong."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}") from e
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured if structured is not None else self.structured())


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of token ids, or a list of either (one set of choices per prompt).")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({n})")
        if self.best_of is not None and self.best_of > n and self.stream:
            raise ValueError("best_of greater than n cannot be streamed: the best choices are known only at the end")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list")
        _no_op(self.suffix or None, (), "suffix", "insertion (a suffix after the completion) is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: one string or token-id list, or several (a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    """A message of the conversation. `developer` is OpenAI's newer name for `system` and is rendered as one."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # OpenAI's responses carry it; replayed histories send it back

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted when they ask for nothing this server would have to do differently.
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    moderation: Any = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant's")
        _no_op(self.modalities, (["text"],), "modalities", "this server produces text only")
        for name in ("audio", "prediction", "web_search_options", "functions", "function_call", "moderation",
                     "reasoning_effort", "verbosity"):
            _no_op(getattr(self, name), (), name, "not available on this server (use tools for function calling)")
        return self
