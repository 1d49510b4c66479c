"""Results returned to callers, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TokenEvent:
    """One request's progress in one step: the token it got (None when it ended without one, e.g. on a
    timeout), the text that token completed (when the request streams text), and how it finished."""

    request_id: str
    token_id: int | None
    text_delta: str
    logprobs: dict[int, float] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class StepResult:
    events: list[TokenEvent]
    finished: list[RequestOutput]
