"""Request intake: the forms a prompt may take, and the checks a request must meet before it is queued."""

from __future__ import annotations

from typing import Any

from governor.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


def prompt_token_ids(prompt: Prompt, tokenizer: Any) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as a string, token ids, or {"prompt"/"prompt_token_ids": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, list | tuple):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def validate_request(prompt: Prompt, params: SamplingParams, tokenizer: Any, vocab_size: int,
                     max_model_len: int) -> tuple[str | None, list[int], int]:
    """(prompt text, prompt token ids, max_tokens) of a request; ValueError with the reason if invalid."""
    params.validate()
    outside = sorted(t for t in params.logit_bias or {} if t >= vocab_size)
    if outside:
        raise ValueError(f"logit_bias token ids must be in the model's vocabulary [0, {vocab_size}); "
                         f"{', '.join(map(str, outside[:5]))} {'is' if len(outside) == 1 else 'are'} not")
    text, ids = prompt_token_ids(prompt, tokenizer)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
    if max_tokens < 1:
        raise ValueError(f"the prompt ({len(ids)} tokens) leaves no room to generate within "
                         f"max_model_len={max_model_len}")
    if len(ids) + max_tokens > max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                         f"exceeds max_model_len={max_model_len}")
    return text, ids, max_tokens
