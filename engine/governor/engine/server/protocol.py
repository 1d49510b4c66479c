"""OpenAI API request shapes (pydantic). Unknown fields are refused with a 400 naming them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from governor.engine.sampling_params import MAX_LOGPROBS, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions; vLLM's extras (top_k, min_p, ignore_eos,
    stop_token_ids, cache_salt, return_token_ids) are accepted as top-level fields, plus `timeout` (seconds)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Upper bounds are the int64 range the sampler and torch.Generator take: beyond it the step thread fails.
    top_k: int = Field(default=0, ge=-1, le=2**63 - 1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only n=1 is supported.")
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256,
                                   description="Prefix-cache isolation: requests share cached KV only with "
                                               "requests of the same salt.")
    timeout: float | None = Field(default=None, gt=0.0, description="End the request after this many seconds "
                                                                    "with finish_reason 'timeout'.")
    return_token_ids: bool = Field(default=False, description="vLLM's extension: the choice carries `token_ids` "
                                   "(generated ids) and the prompt's ids come as `prompt_token_ids`; streamed, "
                                   "every new token gets a chunk with its ids, even when its text is empty.")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                              logprobs=logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="A string, or a list of token ids.")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
