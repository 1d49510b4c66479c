"""The kernel warm-up at engine start (CUDA) runs throwaway prefill and mixed steps: it must leave no trace --
every block back in the pool unhashed, no counter moved, the same tokens afterwards. Run here on CPU, where
the engine does not call it by itself."""

from __future__ import annotations

from typing import Any

import pytest

from governor.engine import LLM
from tests.test_engine_parity import greedy, mixed_prompts


@pytest.mark.parametrize("settings", [{}, {"max_num_seqs": 4, "enable_prefix_caching": True},
                                      {"max_num_batched_tokens": 20, "block_size": 4},
                                      {"max_model_len": 20}])  # shorter than some warm-up prefills
def test_warm_up_leaves_no_trace(hf_checkpoint, settings: dict[str, Any]) -> None:
    path = str(hf_checkpoint("qwen3"))
    settings = {"dtype": "float32", "max_model_len": 128, **settings}
    prompts = mixed_prompts(6, seed=17, hi=8)
    expected = [o.outputs[0].token_ids for o in LLM(path, **settings).generate(prompts, greedy(10))]
    llm = LLM(path, **settings)
    engine = llm.engine
    before = engine.stats()
    calls = [0]
    inner = engine.runner.execute

    def execute(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)
    engine.runner.execute = execute  # type: ignore[method-assign]
    engine.executor.warm_up(engine.kv, engine.config.seqs_cap, engine.config.tokens_cap, engine.max_model_len)
    assert calls[0] >= 1  # at least one step fits even the smallest budget here (17 tokens)
    assert engine.stats() == before
    assert engine.kv.pool.num_used == 0 and engine.kv.pool.num_cached == 0
    engine.kv.check_invariants(engine.scheduler.running)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(10))] == expected


def _warm_up_steps(path: str, max_model_len: int, budget: int = 48) -> list[tuple[int, int, int]]:
    """(tokens, sequences, decodes) of each step the warm-up runs, budget 48 tokens and 8 sequences."""
    llm = LLM(path, dtype="float32", max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=8,
              block_size=4)
    engine = llm.engine
    steps: list[tuple[int, int, int]] = []  # (tokens, sequences, decodes)
    inner = engine.executor.execute

    def execute(out: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        decodes = sum(1 for s in out.scheduled if s.seq.num_computed_tokens > 0)
        steps.append((tokens, len(out.scheduled), decodes))
        return inner(out, *args, **kwargs)
    engine.executor.execute = execute  # type: ignore[method-assign]
    engine.executor.warm_up(engine.kv, engine.config.seqs_cap, engine.config.tokens_cap, engine.max_model_len)
    return steps


def test_warm_up_reaches_the_token_budget_with_one_many_and_mixed_sequences(hf_checkpoint) -> None:
    # The first full-size steps of a process cost more than later ones: the warm-up runs steps of the
    # hard token budget -- one sequence's chunk, several prompts, decodes beside a chunk -- where they fit.
    steps = _warm_up_steps(str(hf_checkpoint("qwen3")), 128)
    at_budget = [s for s in steps if s[0] == 48]
    assert (48, 1, 0) in at_budget  # one sequence's chunk
    assert (48, 8, 0) in at_budget  # as many prompts as max_num_seqs allows (<= 64)
    assert (48, 8, 7) in at_budget  # 7 decodes beside one 41-token chunk
    assert max(s[0] for s in steps) == 48 and max(s[1] for s in steps) <= 8


def test_warm_up_chunks_stop_at_max_model_len_below_the_budget(hf_checkpoint) -> None:
    steps = _warm_up_steps(str(hf_checkpoint("qwen3")), 40)
    assert (40, 1, 0) in steps  # one sequence's chunk: max_model_len, not the 48-token budget
    assert (48, 8, 0) in steps  # 8 prompts of 6 tokens still fill the budget
    assert (7 + 40, 8, 7) in steps  # 7 decodes beside a 40-token chunk


def test_warm_up_runs_one_chunk_of_each_ladder_size_below_the_budget(hf_checkpoint) -> None:
    # GEMM kernels are picked by size and loaded on first use: the sizes between the small steps and the budget.
    steps = _warm_up_steps(str(hf_checkpoint("qwen3")), 512, budget=1000)
    singles = {s[0] for s in steps if s[1] == 1 and s[2] == 0}
    assert {64, 96, 128, 192, 256, 384, 512} <= singles  # 768 is cut at max_model_len (512)
    assert not singles & {768, 1024, 1536}
    assert (1000, 8, 0) in steps  # and the budget steps after them


def test_warm_up_ladder_sizes_cut_at_max_model_len_run_once(hf_checkpoint) -> None:
    steps = _warm_up_steps(str(hf_checkpoint("qwen3")), 100, budget=1000)
    singles = [s[0] for s in steps if s[1] == 1 and s[2] == 0]
    assert {64, 96} <= set(singles) and max(singles) == 100
    assert singles.count(100) == 2  # the ladder's sizes from 128 up, all cut to 100, once; the budget's chunk
