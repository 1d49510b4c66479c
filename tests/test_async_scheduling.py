"""Async scheduling: the step after a greedy step is launched before that step's tokens reach the host, its
tokens fed on the device. What the engine produces must not change: every token, event and finish reason
equal to one-step-at-a-time scheduling, through stops the host cannot foresee, aborts, deadlines, arrivals,
knob changes, preemption and the prefix cache; and the blocks must all come back."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
import torch

from governor.engine import SamplingParams
from governor.engine.config import EngineConfig, Knobs
from governor.engine.kv.kv_manager import KVManager
from governor.engine.llm_engine import LLMEngine
from governor.engine.outputs import StepResult
from governor.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from governor.engine.sequence import Sequence, SequenceStatus
from tests.test_engine_parity import greedy, mixed_prompts


def make_engine(path: str, async_scheduling: bool, **kwargs: Any) -> LLMEngine:
    config = EngineConfig(**{"model": path, "dtype": "float32", "max_model_len": 128,
                             "async_scheduling": async_scheduling, **kwargs})
    return LLMEngine(config)


def count_fed_steps(engine: LLMEngine) -> list[int]:
    """Wrap the runner so each fed step (launched before the previous step's tokens were read) counts."""
    fed = [0]
    inner = engine.runner.execute

    def execute(out: SchedulerOutput, all_logits: bool = False, feed: torch.Tensor | None = None,
                argmax: bool = False, drafts: torch.Tensor | None = None) -> torch.Tensor:
        if feed is not None:
            fed[0] += 1
        return inner(out, all_logits, feed, argmax, drafts)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return fed


Trace = dict[str, list[tuple[int | None, str, str | None]]]


def drive(engine: LLMEngine, script: dict[int, list[tuple[str, Any]]], max_calls: int = 400) -> Trace:
    """Call step() until nothing is left, applying `script[call]` (adds, aborts, knob changes) before that
    call; the events of each request, in order."""
    trace: Trace = defaultdict(list)
    call = 0
    while call < max_calls and (engine.has_unfinished_requests() or call <= max(script, default=0)):
        for action, arg in script.get(call, []):
            if action == "add":
                rid, prompt, params = arg
                engine.add_request(rid, prompt, params, stream_text=True)
            elif action == "abort":
                out = engine.abort(arg)
                if out is not None:
                    trace[arg].append((None, "", "abort"))
            elif action == "knobs":
                engine.update_knobs(**arg)
        result: StepResult = engine.step()
        for ev in result.events:
            trace[ev.request_id].append((ev.token_id, ev.text_delta, ev.finish_reason))
        call += 1
    assert not engine.has_unfinished_requests(), "the engine did not drain within the call budget"
    return dict(trace)


def stop_tokens_from(trace: Trace, picks: dict[str, int]) -> dict[str, int]:
    """For each request id, the token it generated at index picks[rid]: a stop that really happens."""
    return {rid: trace[rid][i][0] for rid, i in picks.items()}  # type: ignore[misc]


def workload(stops: dict[str, int] | None = None) -> dict[int, list[tuple[str, Any]]]:
    """Requests arriving over the first calls with different lengths, some ended by stop tokens (which
    the host cannot foresee), one aborted and one narrowed by a knob change while steps are in flight."""
    prompts = mixed_prompts(10, seed=5, hi=30)
    script: dict[int, list[tuple[str, Any]]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        max_tokens = [7, 20, 33, 12, 5, 26, 18, 9, 40, 15][i]
        stop_ids = [stops[f"r{i}"]] if stops and f"r{i}" in stops else []
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_ids)
        script[[0, 0, 0, 2, 2, 5, 9, 9, 14, 21][i]].append(("add", (f"r{i}", prompt, params)))
    script[11].append(("abort", "r2"))
    script[16].append(("knobs", {"max_num_seqs": 3}))
    script[24].append(("knobs", {"max_num_seqs": 8}))
    return dict(script)


ENGINE_SETUPS = {
    "default": {},
    "prefix-cache": {"enable_prefix_caching": True, "block_size": 4},
    # 14 blocks of 8 tokens for up to 8 sequences of up to 30 + 40 tokens: continuations run short of
    # blocks and the step-at-a-time scheduler preempts.
    "tight-blocks": {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 72},
    "chunked": {"max_num_batched_tokens": 9},
}


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_async_scheduling_gives_every_event_of_step_at_a_time_scheduling(hf_checkpoint, setup: str) -> None:
    check_same_events(str(hf_checkpoint("qwen3")), {"max_num_seqs": 8, **ENGINE_SETUPS[setup]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("setup", ["default", "prefix-cache", "tight-blocks"])
def test_gpu_async_scheduling_with_cuda_graphs_gives_every_event(hf_checkpoint, setup: str) -> None:
    """On the GPU the fed token ids are gathered on the device before a CUDA graph's replay, and the host
    reads tokens from pinned buffers behind events: the same events as one step at a time."""
    kwargs: dict[str, Any] = {"max_num_seqs": 8, "device": "cuda", **ENGINE_SETUPS[setup]}
    if "num_kv_blocks" not in kwargs:
        kwargs["kv_cache_memory_bytes"] = 2**28
    engine = check_same_events(str(hf_checkpoint("qwen3")), kwargs)
    assert engine.runner.graphs is not None


def check_same_events(path: str, kwargs: dict[str, Any]) -> LLMEngine:
    """Run the workload one step at a time and with async scheduling; assert equal events; the async engine."""
    sync = make_engine(path, False, **kwargs)
    plain = drive(sync, workload())
    # Stops at tokens the requests really produce, mid-way, so steps launched ahead carry rows that end.
    stops = stop_tokens_from(plain, {"r1": 6, "r5": 3, "r8": 10, "r9": 0})
    expected = drive(sync, workload(stops))
    for rid, i in {"r1": 6, "r5": 3, "r8": 10}.items():
        # the stop token may come earlier than the picked index, but it does end the request there or before
        assert expected[rid][-1][2] == "stop" and len(expected[rid]) <= i + 1

    engine = make_engine(path, True, **kwargs)
    fed = count_fed_steps(engine)
    got = drive(engine, workload(stops))
    assert got == expected
    assert fed[0] > 10, "hardly any step was launched ahead: the test would not see async scheduling"
    engine.kv.check_invariants(engine.scheduler.running)
    assert engine.kv.pool.num_used == 0 and not engine.scheduler.running and not engine._requests
    return engine


def test_a_step_in_flight_for_a_request_that_ended_is_dropped_and_its_blocks_come_back(hf_checkpoint) -> None:
    engine = make_engine(str(hf_checkpoint("qwen3")), True, block_size=4)
    prompt = mixed_prompts(1, seed=9)[0]
    engine.add_request("a", prompt, greedy(30))
    engine.add_request("b", prompt[:5], greedy(30))
    events: list[tuple[str, int | None]] = []
    for _ in range(3):
        events += [(ev.request_id, ev.token_id) for ev in engine.step().events]
    assert engine._in_flight is not None  # the step after the last one read is running
    assert engine.abort("a") is not None
    assert engine.kv.pool.num_used == len(engine._requests["b"].seq.block_table)
    while engine.has_unfinished_requests():
        events += [(ev.request_id, ev.token_id) for ev in engine.step().events]
    assert sum(rid == "a" for rid, _ in events) == 3  # nothing from the row launched before the abort
    assert sum(rid == "b" for rid, _ in events) == 30
    engine.kv.check_invariants(engine.scheduler.running)
    assert engine.kv.pool.num_used == 0


def test_sampled_or_logprob_requests_run_one_step_at_a_time_and_match(hf_checkpoint) -> None:
    path = str(hf_checkpoint("llama"))
    prompts = mixed_prompts(4, seed=3)
    params = [SamplingParams(temperature=0.9, max_tokens=14, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, logprobs=1, ignore_eos=True), greedy(14), greedy(9)]
    outs = []
    for async_scheduling in (False, True):
        engine = make_engine(path, async_scheduling)
        fed = count_fed_steps(engine)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"s{i}", prompt, p)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step().finished:
                finished[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        outs.append(finished)
        assert fed[0] == 0  # a live request needs the sampler: every step is read before the next
    assert outs[0] == outs[1]


def test_async_scheduling_is_off_with_the_setting(hf_checkpoint) -> None:
    engine = make_engine(str(hf_checkpoint("qwen3")), False)
    fed = count_fed_steps(engine)
    engine.add_request("x", [5, 6, 7], greedy(10))
    while engine.has_unfinished_requests():
        engine.step()
        assert engine._in_flight is None
    assert fed[0] == 0


# --- Scheduler.schedule_continuation ---------------------------------------------------------------


def running_scheduler(lengths: list[int], block_size: int = 4, num_blocks: int = 64,
                      **knobs: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose sequences have each just had a step launched that samples their next token:
    every known token computed."""
    k = Knobs(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_speculative_tokens": 0, **knobs})
    sched = Scheduler(KVManager(num_blocks, block_size), k)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"q{i}", i, list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=50), 50)
        sched.add(seq)
        seqs.append(seq)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == lengths
    sched.update_from_output(out)
    return sched, seqs


def rows_of(seqs: list[Sequence]) -> dict[int, int]:
    return {id(seq): i for i, seq in enumerate(seqs)}


def test_continuation_feeds_every_running_sequence_in_running_order_and_allocates_at_block_ends() -> None:
    sched, seqs = running_scheduler([3, 4, 8, 5])  # positions 3, 4, 8, 5: the 4- and 8-token ones need a block
    pool = sched.kv.pool
    free = pool.num_free
    rows = {id(seqs[0]): 2, id(seqs[1]): 0, id(seqs[2]): 3, id(seqs[3]): 1}
    out = sched.schedule_continuation(rows, set())
    assert out is not None
    assert [s.seq for s in out.scheduled] == seqs
    assert [s.fed_from for s in out.scheduled] == [2, 0, 3, 1]
    assert all(s.num_new_tokens == 1 and s.samples and s.num_logits == 1 for s in out.scheduled)
    assert pool.num_free == free - 2
    assert [len(s.block_table) for s in seqs] == [1, 2, 3, 2]


def test_continuation_leaves_out_the_sequences_the_step_in_flight_ends() -> None:
    sched, seqs = running_scheduler([3, 6, 2])
    out = sched.schedule_continuation(rows_of(seqs), {id(seqs[1])})
    assert out is not None and [s.seq for s in out.scheduled] == [seqs[0], seqs[2]]
    assert sched.schedule_continuation(rows_of(seqs), {id(s) for s in seqs}) is None


@pytest.mark.parametrize("case", ["not-in-step", "speculating", "admissible", "budget", "blocks"])
def test_continuation_declines_whenever_the_scheduler_could_do_otherwise(case: str) -> None:
    sched, seqs = running_scheduler([3, 4, 8])
    rows = rows_of(seqs)
    if case == "not-in-step":
        del rows[id(seqs[1])]
    elif case == "speculating":
        sched.knobs.num_speculative_tokens = 2
    elif case == "admissible":
        sched.add(Sequence("w", 9, [1, 2], SamplingParams(temperature=0.0, max_tokens=5), 5))
    elif case == "budget":
        sched.knobs.max_num_batched_tokens = 2
    else:  # two sequences at a block end, one free block
        sched.kv.pool.allocate(sched.kv.pool.num_free - 1)
    tables = [list(s.block_table) for s in seqs]
    free = sched.kv.pool.num_free
    assert sched.schedule_continuation(rows, set()) is None
    assert [s.block_table for s in seqs] == tables and sched.kv.pool.num_free == free  # nothing allocated


def test_a_continuation_while_speculating_needs_the_engine_to_skip_its_drafts() -> None:
    sched, seqs = running_scheduler([3, 4], num_speculative_tokens=2)
    assert sched.schedule_continuation(rows_of(seqs), set()) is None
    out = sched.schedule_continuation(rows_of(seqs), set(), without_drafts=True)
    assert out is not None and all(s.num_spec == 0 and s.num_new_tokens == 1 for s in out.scheduled)


def test_a_waiting_sequence_does_not_stop_a_continuation_when_it_could_not_be_admitted() -> None:
    sched, seqs = running_scheduler([3, 4], max_num_seqs=2)
    sched.add(Sequence("w", 9, [1, 2], SamplingParams(temperature=0.0, max_tokens=5), 5))
    out = sched.schedule_continuation(rows_of(seqs), set())
    assert out is not None and len(out.scheduled) == 2
    # ... but one ending in the step in flight makes room for it: schedule() would admit it.
    assert sched.schedule_continuation(rows_of(seqs), {id(seqs[0])}) is None


def test_fed_step_computes_what_a_step_with_the_tokens_on_the_host_computes(hf_checkpoint) -> None:
    """The runner's device-side feed: a fed step's logits equal a plain decode of the same tokens."""
    rng = random.Random(4)
    nxt = [rng.randrange(2, 1000) for _ in range(3)]  # each sequence's next token
    logits: dict[bool, torch.Tensor] = {}
    for fed in (False, True):
        engine = make_engine(str(hf_checkpoint("llama")), False)
        sched = engine.scheduler
        seqs = []
        for i, prompt in enumerate(mixed_prompts(3, seed=11, lo=3, hi=12)):
            seq = Sequence(f"f{i}", i, prompt, greedy(5), 5)
            sched.add(seq)
            seqs.append(seq)
        out = sched.schedule()
        engine.runner.execute(out)
        sched.update_from_output(out)
        if fed:
            previous = torch.tensor([0, *reversed(nxt)])  # row 1 + j holds sequence (2 - j)'s token
            step = sched.schedule_continuation({id(s): 3 - i for i, s in enumerate(seqs)}, set())
            assert step is not None
            logits[fed] = engine.runner.execute(step, feed=previous)
        else:
            for seq, tok in zip(seqs, nxt, strict=True):
                seq.output_token_ids.append(tok)
            step = sched.schedule()
            assert all(s.num_new_tokens == 1 for s in step.scheduled)
            logits[fed] = engine.runner.execute(step)
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0)


def test_execute_refuses_a_feed_that_does_not_match_the_step(hf_checkpoint) -> None:
    engine = make_engine(str(hf_checkpoint("llama")), False)
    seq = Sequence("x", 0, [3, 4, 5], greedy(5), 5)
    engine.scheduler.add(seq)
    out = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="fed decodes"):
        engine.runner.execute(out, feed=torch.tensor([1]))
    fed = SchedulerOutput([ScheduledSeq(seq, 1, fed_from=0)])
    with pytest.raises(ValueError, match="fed decodes"):
        engine.runner.execute(fed)
    assert seq.status is SequenceStatus.RUNNING
