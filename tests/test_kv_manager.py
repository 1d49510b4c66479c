"""The KV manager (the block pool's one caller) and the scheduler (the one writer of computed-token counts): their
invariants over random schedules, and who may touch what, read from the engine's source."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from governor.engine.config import Knobs
from governor.engine.kv.kv_manager import KVManager
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import Scheduler
from governor.engine.sequence import Sequence

ENGINE = Path(__file__).resolve().parents[1] / "engine" / "governor" / "engine"


def seq(request_id: str, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(request_id, 0, tokens, SamplingParams(temperature=0.0), max_tokens)


def test_allocate_reserves_whole_blocks_for_the_next_tokens_and_trim_gives_back_the_rest() -> None:
    kv = KVManager(8, 4)
    s = seq("a", list(range(10)))
    kv.allocate(s, 10)
    assert len(s.block_table) == 3 and kv.num_free == 5
    assert kv.reserve(s, 20) and len(s.block_table) == 5  # room for 20 positions
    assert not kv.reserve(s, 40) and len(s.block_table) == 5  # 10 blocks do not fit: nothing taken
    kv.trim(s, 10)
    assert len(s.block_table) == 3 and kv.num_free == 5
    kv.free(s)
    assert s.block_table == [] and kv.num_free == 8
    kv.check_invariants([s])


def test_allocate_refuses_what_does_not_fit_and_takes_nothing() -> None:
    kv = KVManager(2, 4)
    s = seq("a", list(range(12)))
    with pytest.raises(RuntimeError, match="do not fit in the 2 free KV blocks"):
        kv.allocate(s, 12)
    assert s.block_table == [] and kv.num_free == 2


def test_a_cached_prefix_is_found_after_its_sequence_ends_and_leaves_one_token_to_compute() -> None:
    kv = KVManager(8, 4, enable_prefix_caching=True)
    first = seq("a", list(range(8)))
    first.cache_seed = b"seed"
    kv.allocate(first, 8)
    first.num_computed_tokens = 8  # as the scheduler counts a step that ran
    kv.cache_computed(first)
    kv.free(first)
    again = seq("b", list(range(8)))
    again.cache_seed = b"seed"
    hits = kv.cached_prefix(again)
    assert len(hits) == 1  # both blocks are cached; the last is recomputed for its logits
    assert kv.room_beyond(hits) == (kv.num_free - 1) * 4  # taking the cached block revives it
    kv.admit(again, hits)
    assert again.block_table == hits and again.num_cached_blocks == 1 and kv.pool.ref_counts[hits[0]] == 1


def test_check_invariants_catches_a_table_longer_than_the_computed_tokens() -> None:
    kv = KVManager(4, 4)
    s = seq("a", list(range(6)))
    kv.allocate(s, 6)  # 2 blocks, none of the 6 tokens computed yet
    with pytest.raises(AssertionError, match="holds 2 blocks for 0 computed tokens"):
        kv.check_invariants([s])


def test_check_invariants_catches_a_block_held_but_not_counted() -> None:
    kv = KVManager(4, 4)
    a, b = seq("a", [1, 2, 3]), seq("b", [1, 2, 3])
    kv.allocate(a, 3)
    a.num_computed_tokens = 3
    b.block_table = list(a.block_table)  # shared without taking a reference
    b.num_computed_tokens = 3
    with pytest.raises(AssertionError, match="ref count 1, held 2 times"):
        kv.check_invariants([a, b])


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_and_kv_manager_keep_their_invariants_over_random_schedules(seed: int) -> None:
    """Admission (with prefix hits), chunked prefill, decodes with draft slots, preemption and finishing, on a pool
    small enough to run out; after every step's output is handled, every running sequence holds exactly the blocks
    of its computed tokens and the pool's counts agree."""
    rng = random.Random(seed)
    knobs = Knobs(max_num_seqs=6, max_num_batched_tokens=24, num_speculative_tokens=0)
    kv = KVManager(12, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, knobs, max_model_len=64)
    shared = [rng.randrange(50) for _ in range(12)]
    for step in range(300):
        if rng.random() < 0.3:
            s = seq(f"r{step}", shared[:rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 10))],
                    rng.randint(4, 30))
            s.cache_seed = b"seed"
            sched.add(s)
        knobs.num_speculative_tokens = rng.choice([0, 2])
        out = sched.schedule()
        for s in out.scheduled:
            s.set_drafts([rng.randrange(50) for _ in range(rng.randint(0, s.num_spec))])
        for s in sched.update_from_output(out):
            accepted = rng.randint(0, len(s.draft_tokens))
            if s.draft_tokens:
                sched.accept_drafts(s.seq, accepted)
            s.seq.output_token_ids.extend([*s.draft_tokens[:accepted], rng.randrange(50)])
            if len(s.seq.output_token_ids) >= s.seq.max_tokens or s.seq.num_tokens >= 60:
                sched.finish(s.seq, "length")
        kv.check_invariants(sched.running)
    assert sched.num_preemptions > 0 and kv.num_cached > 0  # the run reached both


def _writes_to(tree: ast.AST, attribute: str) -> list[int]:
    """Lines that assign or augment-assign `<anything>.<attribute>`."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        lines += [t.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == attribute]
    return lines


def _engine_modules() -> dict[str, ast.AST]:
    return {str(p.relative_to(ENGINE)): ast.parse(p.read_text()) for p in sorted(ENGINE.rglob("*.py"))}


def test_only_the_scheduler_writes_computed_token_counts() -> None:
    """The target's sequences are counted by the scheduler alone; the draft model counts its own copies of them."""
    writers = {name for name, tree in _engine_modules().items() if _writes_to(tree, "num_computed_tokens")}
    assert writers == {"scheduler.py", "spec/draft_model.py"}


def test_only_the_kv_manager_uses_the_block_pool() -> None:
    users = set()
    for name, tree in _engine_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "governor.engine.kv.block_pool":
                users.add(name)
    assert users == {"kv/kv_manager.py"}
