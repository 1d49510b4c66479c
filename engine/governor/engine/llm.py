"""Offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from governor.engine.config import EngineConfig
from governor.engine.intake import Prompt
from governor.engine.llm_engine import LLMEngine
from governor.engine.outputs import RequestOutput
from governor.engine.sampling_params import SamplingParams


class LLM:
    """Generate offline with the engine. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op with one rank); also `with LLM(...) as llm:`.
        Garbage collection and interpreter exit close a forgotten engine too."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        All requests are validated before any runs, so a bad one raises ValueError and nothing is queued.
        """
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [str(self._next_id + i) for i in range(len(prompts))]
        self._next_id += len(prompts)
        for prompt, p in zip(prompts, params, strict=True):
            self.engine.validate_request(prompt, p)
        children: dict[str, list[str]] = {}
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            if p.n == 1:
                self.engine.add_request(rid, prompt, p)
                continue
            # Parallel sampling: n requests, the later ones starting from the first one's prompt KV blocks.
            children[rid] = [f"{rid}.{i}" for i in range(p.n)]
            for i, child in enumerate(children[rid]):
                own = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
                self.engine.add_request(child, prompt, own, share_prompt_of=children[rid][0] if i else None)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().finished:
                done[out.request_id] = out
        for rid, kids in children.items():
            outs = [done.pop(k) for k in kids]
            completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
            done[rid] = dataclasses.replace(outs[0], request_id=rid, outputs=completions)
        return [done[rid] for rid in ids]

    def stats(self) -> dict[str, Any]:
        """Engine counters: kv_blocks_total/used, preemptions, prompt/generation tokens, ..."""
        return self.engine.stats()
