"""Parallel sampling (n > 1): the choices of one prompt share its full KV blocks, and each is exactly the request
it would be alone (fp32 CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from governor.engine import LLM, SamplingParams

PROMPT = list(range(10, 110))  # 100 tokens: 6 full blocks of 16 and 4 tokens more


@pytest.fixture(scope="module")
def model(hf_checkpoint) -> Path:
    return hf_checkpoint("llama")


def test_n_choices_take_the_prompts_full_blocks_from_the_first(model: Path) -> None:
    llm = LLM(str(model), dtype="float32", block_size=16)
    out = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert llm.stats()["prompt_tokens_shared"] == 3 * 96
    assert llm.stats()["kv_blocks_used"] == 0
    alone = [llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=9 + i, max_tokens=8, ignore_eos=True))[0]
             for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_shared_blocks_are_held_once_while_the_choices_run(model: Path) -> None:
    llm = LLM(str(model), dtype="float32", block_size=16)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"c{i}", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           share_prompt_of="c0" if i else None)
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.kv.pool.num_used)
        engine.kv.check_invariants(engine.scheduler.running)
    # 6 shared full blocks + each choice's own last block (its prompt's tail and first outputs): 6 + 4, not 4 * 7.
    assert max(used) == 10


def test_a_choice_whose_sibling_ended_computes_its_own_prompt(model: Path) -> None:
    llm = LLM(str(model), dtype="float32", block_size=16)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPT, greedy)
    engine.add_request("b", PROMPT, greedy, share_prompt_of="a")
    engine.abort("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step().finished
    assert outs[0].outputs[0].token_ids == llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    assert engine.stats()["prompt_tokens_shared"] == 0
