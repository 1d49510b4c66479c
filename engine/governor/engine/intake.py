"""Request intake: the forms a prompt may take, the checks a request must meet before it is queued, and the
live request built from it (`InputProcessor`: its sequence with cache seed, generator and logits processing, its
stop conditions and detokenizer)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from governor.engine.detokenizer import IncrementalDetokenizer
from governor.engine.kv.block_hash import identity_seed
from governor.engine.logits_processing import LogitsProcessor, needs_processing
from governor.engine.request_state import RequestState
from governor.engine.sampler import argmax_only
from governor.engine.sampling_params import SamplingParams
from governor.engine.sequence import Sequence

if TYPE_CHECKING:  # imported when the first structured request comes: the grammar library loads with it
    from governor.engine.structured import StructuredOutputs

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


class InputProcessor:
    """What a request needs from the served model before it is queued: the tokenizer, the vocabulary and context
    limits, the EOS ids, the identity that seeds its prefix-cache hashes, and the grammar compiler."""

    _structured_outputs: StructuredOutputs | None = None  # `structured_outputs()`, once a structured request came

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 cache_identity: tuple[str, str, str] | None, device: torch.device) -> None:
        """cache_identity: (model digest, tokenizer digest, KV dtype) with prefix caching on, else None."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.cache_identity = cache_identity
        self.device = device

    def cache_seed(self, cache_salt: str | None) -> bytes:
        """Seed of a request's block-hash chain: what produced the KV, plus the tenant's salt."""
        assert self.cache_identity is not None
        model, tokenizer, kv_dtype = self.cache_identity
        return identity_seed(model, tokenizer, "", kv_dtype, cache_salt)

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler, created at the first structured request with the tokenizer and the model's
        vocabulary (the logits' width). A grammar ends on the model's EOS ids that are special tokens (one that is
        also text, such as a byte, would be lost to the output's text); none: the tokenizer's EOS."""
        if self._structured_outputs is None:
            from governor.engine.structured import StructuredOutputs

            special = set(self.tokenizer.all_special_ids)
            stops = sorted(t for t in self.eos_token_ids if t in special)
            self._structured_outputs = StructuredOutputs(self.tokenizer, self.vocab_size,
                                                         stop_token_ids=stops or None)
        return self._structured_outputs

    def validate(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int], int]:
        """(prompt text, prompt token ids, max_tokens) of a request; ValueError with the reason if invalid (an
        output constraint is compiled here: a bad schema, regex or grammar fails before anything is queued)."""
        if params.structured_outputs is not None:
            self.structured_outputs().compile(params.structured_outputs)
        return validate_request(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)

    def request(self, request_id: str, arrival: int, prompt: Prompt, params: SamplingParams, *, stream_text: bool,
                cache_salt: str | None, prompt_source: Sequence | None) -> RequestState:
        """A validated request's live state; ValueError with the reason if it cannot be served.

        stream_text: keep an incremental detokenizer so each TokenEvent carries its text delta. cache_salt:
        prefix-cache isolation; a dict prompt's "cache_salt" takes precedence. prompt_source: a live sequence
        with the same prompt (a parallel sample's sibling) whose prompt KV blocks this one may start from."""
        text, ids, max_tokens = self.validate(prompt, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(request_id, arrival, ids, params, max_tokens, generator=generator)
        if prompt_source is not None and prompt_source.prompt_token_ids == ids:
            seq.prompt_source = prompt_source
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])
        if self.cache_identity is not None:
            seq.cache_seed = self.cache_seed(cache_salt)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        grammar = None
        if params.structured_outputs is not None:  # an invalid schema, regex or grammar is a ValueError here
            grammar = self.structured_outputs().matcher(params.structured_outputs)
        if needs_processing(params):
            seq.logits_processor = LogitsProcessor(params, seq.prompt_token_ids, seq.output_token_ids,
                                                   sorted(stop_ids), grammar)
        # A grammar's end token, a special token, stays out of the text: skipped by the decode, or not added to
        # the detokenizer's text when special tokens are kept (`RequestState.append`).
        detok = None
        if stream_text or params.stop_strings or (grammar is not None and not params.skip_special_tokens):
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return RequestState(seq, text, time.monotonic(), stop_ids, params.stop_strings,
                            min(max_tokens, self.max_model_len - len(ids)), argmax_only(params), detok,
                            min_tokens=params.min_tokens, include_stop_str=params.include_stop_str_in_output,
                            grammar=grammar)
