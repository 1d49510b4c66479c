"""The engine step's fast paths give what the general paths give: one argmax for a batch of plain greedy
requests (the sampler's greedy tokens, ties included), the precomputed stop checks, and the count of
requests that need more than an argmax kept exact as requests come and go."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import governor.engine.runner as runner_module
from governor.engine import LLM, SamplingParams
from governor.engine.config import Knobs
from governor.engine.kv.kv_manager import KVManager
from governor.engine.llm_engine import LLMEngine
from governor.engine.sampler import argmax_only, greedy_tokens, sample
from governor.engine.scheduler import Scheduler
from governor.engine.sequence import Sequence
from tests.test_engine_parity import greedy, mixed_prompts


def live_not_argmax(engine: LLMEngine) -> int:
    return sum(not argmax_only(r.seq.params) for r in engine._requests.values())


@pytest.mark.parametrize("seed", range(4))
def test_greedy_tokens_are_the_first_maximum_and_what_a_mixed_batch_gives_its_greedy_rows(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (64, 50), generator=g).float()  # few values: most rows have tied maxima
    fast = greedy_tokens(logits)
    assert fast == [row.tolist().index(max(row.tolist())) for row in logits]
    # A batch with one sampled row takes the general path (softmax, noise, torch.where); its greedy rows must
    # still get the fast path's tokens.
    params = [SamplingParams(temperature=0.0)] * 63 + [SamplingParams(temperature=1.0, seed=seed)]
    assert sample(logits, params, [None] * 64).token_ids[:63] == fast[:63]


def test_plain_greedy_batch_gets_the_tokens_of_the_general_sampler(llm: LLM, sample_calls: dict[str, int]) -> None:
    """logprobs=0 keeps every request greedy but sends the step through `sample` (and the logprobs)."""
    calls = sample_calls
    prompts = mixed_prompts(6, seed=21)
    fast = llm.generate(prompts, greedy(12))
    assert calls["sample"] == 0
    general = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    assert calls["sample"] > 0
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in general]
    assert all(len(o.outputs[0].logprobs or []) == 12 for o in general)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_argmax_steps_take_model_dtype_logits_and_the_tokens_of_fp32_ones(hf_checkpoint,
                                                                         async_scheduling: bool) -> None:
    """A bf16 model: a step whose tokens are all argmaxes gets only its token ids from the runner (the argmax of
    the model-dtype logits, never widened to fp32); they are the tokens of the general sampler, which widens the
    logits (logprobs=0 keeps requests greedy but takes that path)."""
    bf16 = LLM(str(hf_checkpoint("llama")), dtype="bfloat16", max_model_len=256, async_scheduling=async_scheduling)
    dtypes: list[torch.dtype] = []
    inner = bf16.engine.runner.execute

    def execute(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = inner(*args, **kwargs)
        dtypes.append(logits.dtype)
        return logits
    bf16.engine.runner.execute = execute  # type: ignore[method-assign]
    prompts = mixed_prompts(5, seed=23)
    fast = bf16.generate(prompts, greedy(12))
    assert dtypes and set(dtypes) == {torch.int64}
    dtypes.clear()
    general = bf16.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0))
    assert dtypes and set(dtypes) == {torch.float32}
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in general]


def test_count_of_requests_needing_the_sampler_follows_adds_finishes_aborts_and_timeouts(llm: LLM) -> None:
    engine = llm.engine
    kinds = [greedy(3), SamplingParams(temperature=0.8, max_tokens=5, seed=1),
             SamplingParams(temperature=0.0, max_tokens=9, logprobs=2), greedy(40)]
    for i, prompt in enumerate(mixed_prompts(12, seed=22)):
        engine.add_request(f"c{i}", prompt, kinds[i % 4], timeout_s=1e-9 if i == 5 else None)
    assert engine._num_not_argmax == live_not_argmax(engine) == 6
    engine.abort("c1")
    engine.abort("c4")
    assert engine._num_not_argmax == live_not_argmax(engine) == 5
    while engine.has_unfinished_requests():
        engine.step()  # c5 times out; the others finish with "length" at different steps
        assert engine._num_not_argmax == live_not_argmax(engine)
        assert set(engine._deadlines) <= set(engine._requests)
    assert engine._num_not_argmax == 0 and not engine._deadlines


def test_a_stop_token_that_is_also_eos_reports_itself_as_the_stop_reason(llm: LLM,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = mixed_prompts(1, seed=23)[0]
    free = llm.generate([prompt], greedy(8))[0].outputs[0].token_ids
    monkeypatch.setattr(llm.engine.inputs, "eos_token_ids", frozenset({free[2]}))
    both = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[free[2]]))[0]
    eos = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_at = free.index(free[2])
    assert both.outputs[0].token_ids == free[:stop_at + 1]
    assert (both.outputs[0].finish_reason, both.outputs[0].stop_reason) == ("stop", free[2])
    assert eos.outputs[0].token_ids == free[:stop_at + 1]
    assert (eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == free and ignored.outputs[0].finish_reason == "length"


def test_a_decode_at_a_block_boundary_takes_a_block_and_preempts_when_none_is_free() -> None:
    """The scheduler's usual-decode shortcut covers only a decode with room in its last block."""
    sched = Scheduler(KVManager(2, 4), Knobs(max_num_seqs=4, max_num_batched_tokens=64, num_speculative_tokens=0))
    pool = sched.kv.pool
    old, new = (Sequence(r, i, [1, 2, 3], SamplingParams(temperature=0.0), 8) for i, r in enumerate("ab"))
    for seq in (old, new):
        sched.add(seq)
    out = sched.schedule()  # both prefill 3 tokens into a block each
    assert [s.num_new_tokens for s in out.scheduled] == [3, 3]
    sched.update_from_output(out)
    for seq in (old, new):
        seq.output_token_ids.append(7)
    out = sched.schedule()  # each decode has room: its 4th slot
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(old, 1), (new, 1)]
    assert pool.num_free == 0
    sched.update_from_output(out)
    for seq in (old, new):
        seq.output_token_ids.append(7)
    out = sched.schedule()  # the 5th token needs a block: none is free, so the newest is preempted
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(old, 1)]
    assert old.block_table and len(old.block_table) == 2 and new.block_table == []
    assert sched.num_preemptions == 1 and list(sched.waiting) == [new]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_tables_packed_to_the_steps_width_give_the_tokens_of_whole_rows(
        hf_checkpoint, monkeypatch: pytest.MonkeyPatch, device: str, async_scheduling: bool) -> None:
    """Packing is forced on every step (threshold 0) against never; on CUDA the decode steps replay CUDA graphs,
    whose block-table rows the packed upload scatters into."""
    prompts = mixed_prompts(6, seed=31)
    tokens = {}
    for packed in (False, True):
        monkeypatch.setattr(runner_module, "_PACK_TABLES_MIN_SAVED_BYTES", 0 if packed else 1 << 40)
        llm = LLM(str(hf_checkpoint("qwen3")), dtype="float32", max_model_len=256, device=device,
                  async_scheduling=async_scheduling)
        runner = llm.engine.runner
        decisions: list[bool] = []
        inner = runner._packs_tables

        def packs(shape: Any, inner: Any = inner, decisions: list[bool] = decisions) -> bool:
            decisions.append(inner(shape))
            return decisions[-1]
        runner._packs_tables = packs  # type: ignore[method-assign]
        tokens[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(20))]
        llm.close()
        assert decisions and set(decisions) == {packed}
    assert tokens[True] == tokens[False]
