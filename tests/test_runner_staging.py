"""ModelRunner.stage: the batched decode rows and the incremental block-table writes fill the host buffers
exactly as a straightforward per-row staging does, over long random runs of a real scheduler (decodes,
chunked prefills, speculative drafts with rejections, preemption, prefix-cache hits, finishing sequences
that shift the rows, block tables that grow, shrink and are rebuilt)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import governor.engine.runner as runner_module
from governor.engine.config import Knobs
from governor.engine.kv.kv_manager import KVManager
from governor.engine.runner import ModelRunner, StepShape
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from governor.engine.sequence import Sequence

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_SEQS = 8
MAX_TOKENS = 32
MAX_SPEC = 3


def reference_stage(r: ModelRunner, out: SchedulerOutput) -> StepShape:
    """Per-row staging written the plain way: every row's tokens, positions, slots and whole block table."""
    h = r.host
    ids, pos, slots, bt, lens, qsl, lidx = h.input_ids, h.positions, h.slots, h.block_tables, h.seq_lens, h.qsl, \
        h.logits_idx
    bs = r.block_size
    t = n_sample = num_decodes = max_q = width = 0
    qsl[0] = 0
    for i, s in enumerate(out.scheduled):
        seq, n = s.seq, s.num_new_tokens
        start = seq.num_computed_tokens
        p = np.arange(start, start + n)
        table = np.asarray(seq.block_table, dtype=np.int64)
        known = n - len(s.draft_tokens)
        ids[t:t + known] = (seq.prompt_token_ids + seq.output_token_ids)[start:start + known]
        ids[t + known:t + n] = s.draft_tokens
        pos[t:t + n] = p
        slots[t:t + n] = table[p // bs] * bs + p % bs
        bt[i, :len(table)] = table
        width = max(width, len(table))
        lens[i] = start + n
        t += n
        qsl[i + 1] = t
        max_q = max(max_q, n)
        if n == 1 and num_decodes == i:
            num_decodes += 1
        m = s.num_logits
        lidx[n_sample:n_sample + m] = np.arange(t - m, t)
        n_sample += m
    return StepShape(t, len(out.scheduled), num_decodes, max_q, n_sample, width)


def make_runner() -> ModelRunner:
    # Staging never touches the model or the KV cache.
    model: Any = None
    return ModelRunner(model, [], BLOCK_SIZE, MAX_TOKENS, MAX_SEQS, MAX_MODEL_LEN, torch.device("cpu"),
                       max_spec_tokens=MAX_SPEC)


def host_buffers(r: ModelRunner) -> dict[str, np.ndarray]:
    return {name: getattr(r.host, name) for name in
            ("input_ids", "positions", "slots", "block_tables", "seq_lens", "qsl", "logits_idx")}


def advance(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    """What a step does to the sequences, as LLMEngine.step does it, with random tokens and acceptances."""
    for s in sched.update_from_output(out):
        seq = s.seq
        accepted = rng.randint(0, len(s.draft_tokens))
        if s.draft_tokens:  # releases the slots of rejected drafts: the next step may get other blocks
            sched.accept_drafts(seq, accepted)
        seq.output_token_ids.extend([*s.draft_tokens[:accepted], rng.randrange(50)])
        if seq.num_tokens >= MAX_MODEL_LEN - 1 - MAX_SPEC or len(seq.output_token_ids) >= seq.max_tokens:
            sched.finish(seq, "length")
    for seq in list(sched.running):  # finish a few early: the remaining rows shift up
        if rng.random() < 0.03:
            sched.finish(seq, "stop")


@pytest.mark.parametrize("seed", range(6))
def test_stage_fills_the_same_buffers_as_a_per_row_reference_over_random_schedules(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVManager(24, BLOCK_SIZE, enable_prefix_caching=True)  # small: preemptions, blocks reused by others
    knobs = Knobs(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS, num_speculative_tokens=0)
    sched = Scheduler(kv, knobs, max_model_len=MAX_MODEL_LEN)
    fast, ref = make_runner(), make_runner()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]  # shared prompts: cache hits
    seen = {"decode_rows": 0, "prefill_rows": 0, "draft_rows": 0, "preemptions": 0, "grown_tables": 0}
    for step in range(400):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes)[:rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
            seq = Sequence(f"r{step}", step, prompt or [1], SamplingParams(temperature=0.0), rng.randint(1, 20))
            seq.cache_seed = b"seed"
            sched.add(seq)
        knobs.num_speculative_tokens = rng.choice([0, 0, 1, MAX_SPEC])
        knobs.max_num_batched_tokens = rng.choice([MAX_TOKENS, 16, 5])
        tables_before = {id(s): len(s.block_table) for s in sched.running}
        out = sched.schedule()
        for s in out.scheduled:
            s.set_drafts([rng.randrange(50) for _ in range(rng.randint(0, s.num_spec))])
            if len(s.seq.block_table) > tables_before.get(id(s.seq), len(s.seq.block_table)):
                seen["grown_tables"] += 1
        if not out.scheduled:
            continue

        assert fast.stage(out) == reference_stage(ref, out)
        for name, want in host_buffers(ref).items():
            np.testing.assert_array_equal(host_buffers(fast)[name], want, err_msg=f"{name} at step {step}")

        seen["decode_rows"] += sum(s.num_new_tokens == 1 for s in out.scheduled)
        seen["draft_rows"] += sum(bool(s.draft_tokens) for s in out.scheduled)
        seen["prefill_rows"] += sum(s.num_new_tokens > 1 and not s.draft_tokens for s in out.scheduled)
        advance(sched, out, rng)
    seen["preemptions"] = sched.num_preemptions
    assert all(v > 0 for v in seen.values()), seen  # the run exercised every kind of row and event


def test_a_table_trimmed_and_regrown_to_the_same_length_is_rewritten() -> None:
    """The case a length-based shortcut gets wrong: rejected drafts' blocks are released and the next
    step's table reaches the same length with a different last block."""
    runner = make_runner()
    seq = Sequence("a", 0, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0), 10)
    seq.block_table = [7, 3]
    seq.num_computed_tokens = 4
    out = SchedulerOutput([ScheduledSeq(seq, 1)])
    runner.stage(out)
    seq.block_table[1] = 9  # same length, other block: e.g. trimmed, freed and reallocated in place
    runner.stage(out)
    assert runner.host.block_tables[0, :2].tolist() == [7, 9]
    assert runner.host.slots[0] == 9 * BLOCK_SIZE + 0


# --- upload: one staging buffer, one copy; logits rows ------------------------------------------

def random_steps(seed: int, steps: int = 150) -> Iterator[tuple[ModelRunner, SchedulerOutput]]:
    """A runner and each step of a random schedule (decodes, chunked prefills, drafts, preemptions, and
    after the arrivals stop, steps of decodes alone), for the caller to stage; the sequences advance
    after the caller's turn."""
    rng = random.Random(seed)
    knobs = Knobs(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS, num_speculative_tokens=0)
    sched = Scheduler(KVManager(40, BLOCK_SIZE, enable_prefix_caching=True), knobs, max_model_len=MAX_MODEL_LEN)
    runner = make_runner()
    for step in range(steps):
        if step < steps // 2 and rng.random() < 0.3:
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 16))]
            sched.add(Sequence(f"r{step}", step, prompt, SamplingParams(temperature=0.0), rng.randint(1, 20)))
        knobs.num_speculative_tokens = rng.choice([0, 0, MAX_SPEC])
        out = sched.schedule()
        for s in out.scheduled:
            s.set_drafts([rng.randrange(50) for _ in range(rng.randint(0, s.num_spec))])
        if out.scheduled:
            yield runner, out
            advance(sched, out, rng)


@pytest.mark.parametrize("packed", [False, True], ids=["whole-rows", "packed-tables"])
@pytest.mark.parametrize("merge_gap", [0, 1 << 30])  # a copy per used field; one copy of the whole span
def test_one_buffer_upload_gives_each_device_field_what_per_field_copies_give(
        merge_gap: int, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "_MERGE_GAP_BYTES", merge_gap)
    monkeypatch.setattr(runner_module, "_PACK_TABLES_MIN_SAVED_BYTES", 0 if packed else 1 << 40)
    addresses = None
    for runner, out in random_steps(seed=1):
        shape = runner.stage(out)
        runner._upload(shape)
        t, b, nd, n, w = shape.num_tokens, shape.num_seqs, shape.num_decodes, shape.num_logits, shape.table_width
        h = runner.host
        expected = {"input_ids": h.input_ids[:t], "positions": h.positions[:t], "slots": h.slots[:t],
                    "seq_lens": h.seq_lens[:b], "qsl": h.qsl[:b + 1],
                    "logits_idx": h.logits_idx[:n], "prefill_qsl": h.qsl[nd:b + 1] - h.qsl[nd]}
        for name, want in expected.items():  # what `dst[:k].copy_(src[:k])` per field would leave
            np.testing.assert_array_equal(getattr(runner, name)[:len(want)].numpy(), want, err_msg=name)
        # Packed, each row's first `width` entries (all any sequence of the step reads); else whole rows.
        tables = runner.block_tables[:b, :w] if packed else runner.block_tables[:b]
        np.testing.assert_array_equal(tables.numpy(), h.block_tables[:b, :tables.shape[1]])
        assert runner._packs_tables(shape) == packed
        ranges = runner._upload_ranges(shape)
        assert (len(ranges) == 1) == bool(merge_gap)
        assert (ranges[-1][1] > runner.field_offsets["block_tables"]) == (not packed)
        # Every field is a fixed view of the one device buffer (the addresses CUDA graphs capture).
        now = {name: getattr(runner, name).data_ptr() for name in [*expected, "block_tables"]}
        assert addresses is None or now == addresses
        addresses = now
        base = runner.buffer.data_ptr()
        assert all(base <= p < base + runner.buffer.numel() for p in now.values())


def test_packed_tables_leave_the_columns_past_the_widest_table_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    # The device rows keep what an earlier, wider step put there; only [:seqs, :width] is rewritten.
    monkeypatch.setattr(runner_module, "_PACK_TABLES_MIN_SAVED_BYTES", 0)
    runner = make_runner()
    runner.block_tables.fill_(-7)
    runner.host.block_tables[:2, :3] = [[1, 2, 3], [4, 5, 6]]
    runner.host.block_tables[:2, 3:] = 99  # stale host columns: not uploaded when packed
    shape = StepShape(num_tokens=2, num_seqs=2, num_decodes=2, max_query_len=1, num_logits=2, table_width=3)
    runner.host.qsl[:3] = [0, 1, 2]
    runner._upload(shape)
    assert runner.block_tables[:2, :3].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert (runner.block_tables[:2, 3:] == -7).all() and (runner.block_tables[2:] == -7).all()


def test_small_tables_never_pack_and_allocate_no_packing_buffers() -> None:
    # 8 rows of 16 entries: whole rows can never add 256 KiB.
    runner = make_runner()
    assert runner.packed_tables is None and runner.h_packed_tables is None
    assert not runner._packs_tables(StepShape(1, 8, 8, 1, 8, 1))


class RowsModel:
    """A token's hidden state is (position, token id); logits are the hidden states: shows which rows came."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any) -> torch.Tensor:
        return torch.stack([positions.double(), input_ids.double()], dim=1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.clone()


def test_execute_returns_the_rows_of_the_staged_logits_indices_with_or_without_a_gather() -> None:
    kinds = {"every_token": 0, "gathered": 0}
    for runner, out in random_steps(seed=2):
        runner.model = RowsModel()  # type: ignore[assignment]
        logits = runner.execute(out).numpy()
        h, n = runner.host, len(logits)
        rows = h.logits_idx[:n]
        np.testing.assert_array_equal(logits, np.stack([h.positions[rows], h.input_ids[rows]], axis=1))
        assert n == sum(s.num_logits for s in out.scheduled)
        kinds["every_token" if n == sum(s.num_new_tokens for s in out.scheduled) else "gathered"] += 1
    assert all(kinds.values()), kinds
