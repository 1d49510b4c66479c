"""The pieces of tensor parallelism that need no second process: which all-reduce path a message takes, when the
peer-to-peer path is refused and why, the benchmark's size list, and the watchdog that ends rank 0's process when a
step is stuck on a dead worker (driven here by a fake GPU and fake workers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from governor.engine.bench.all_reduce import parse_sizes
from governor.engine.models.llama import vocab_parallel_argmax
from governor.engine.tp.all_reduce import AllReducePolicy, p2p_unavailable_reason
from governor.engine.tp.rank0 import STUCK_STEP_EXIT_CODE, watch_for_stuck_steps

KiB, MiB = 1024, 1024 * 1024


@pytest.mark.parametrize(("nbytes", "path"), [(8 * KiB, "one_shot"), (512 * KiB, "one_shot"),
                                              (512 * KiB + 2, "two_shot"), (8 * MiB, "two_shot"),
                                              (8 * MiB + 2, "nccl"), (64 * MiB, "nccl")])
def test_a_message_takes_the_path_its_size_calls_for(nbytes: int, path: str) -> None:
    for world in (2, 4):
        assert AllReducePolicy.for_size(world).path(nbytes) == path


def test_a_forced_policy_turns_paths_off() -> None:
    assert AllReducePolicy(0, 8 * MiB).path(1) == "two_shot"
    assert AllReducePolicy(0, 0).path(1) == "nccl"
    assert AllReducePolicy.for_size(4).buffer_bytes == 8 * MiB
    assert AllReducePolicy.for_size(3).path(64 * KiB) == "one_shot"  # sizes not measured get smaller bounds


def test_the_peer_to_peer_path_is_refused_off_cuda_and_for_float16() -> None:
    assert p2p_unavailable_reason(torch.device("cpu"), 2) == "device cpu is not CUDA"
    reason = p2p_unavailable_reason(torch.device("cuda", 0), 2, torch.float16)
    assert reason is not None and "bfloat16 and float32" in reason


def test_sizes_parse_with_kib_and_mib_suffixes() -> None:
    assert parse_sizes("8K, 1M,4096") == [8 * KiB, MiB, 4096]
    with pytest.raises(ValueError, match="positive byte counts"):
        parse_sizes("0")


class FakeWorkers:
    def __init__(self) -> None:
        self.alive = True

    def all_alive(self) -> bool:
        return self.alive

    def describe_exits(self) -> str:
        return "tensor-parallel worker rank 1 (pid 4242) exited with code -9"


def _watch(workers: FakeWorkers, busy: threading.Event, grace_s: float
           ) -> tuple[threading.Event, list[int], threading.Thread]:
    stopped, exits = threading.Event(), list[int]()
    thread = watch_for_stuck_steps(workers, stopped, busy.is_set, poll_s=0.01, grace_s=grace_s,  # type: ignore[arg-type]
                                   end_process=exits.append)
    return stopped, exits, thread


def test_the_watchdog_ends_the_process_when_the_gpu_stays_busy_after_a_worker_died(
        caplog: pytest.LogCaptureFixture) -> None:
    workers, busy = FakeWorkers(), threading.Event()
    busy.set()
    stopped, exits, thread = _watch(workers, busy, grace_s=0.2)
    time.sleep(0.3)
    assert exits == []  # every worker alive: a busy GPU is a step running
    workers.alive = False
    thread.join(timeout=5)
    assert exits == [STUCK_STEP_EXIT_CODE]
    assert "rank 1 (pid 4242) exited with code -9 while a step was running" in caplog.text
    stopped.set()


def test_the_watchdog_leaves_an_idle_gpu_and_a_normal_close_alone() -> None:
    workers, busy = FakeWorkers(), threading.Event()
    stopped, exits, thread = _watch(workers, busy, grace_s=0.1)
    workers.alive = False  # the GPU is idle: the next step raises instead
    time.sleep(0.4)
    assert exits == [] and thread.is_alive()
    stopped.set()  # the workers were stopped: the watch ends
    thread.join(timeout=5)
    assert not thread.is_alive() and exits == []


@pytest.mark.parametrize("seed", range(3))
def test_the_vocabulary_parallel_argmax_is_the_whole_rows_first_maximum(seed: int) -> None:
    """Two pretend ranks of a 7-token vocabulary (ids 0..3 and 4..6): every logit negative (a zero padding column
    left in would win), few distinct values (ties across ranks are common). Each rank's call gets both ranks'
    (max, id) from the gather, as the real all-gather gives them, and must give the whole rows' first maximum."""
    g = torch.Generator().manual_seed(seed)
    full = -torch.randint(1, 4, (32, 7), generator=g).to(torch.bfloat16)
    ranks = [(full[:, :4], 0), (full[:, 4:], 4)]

    def sent(part: torch.Tensor, start: int) -> torch.Tensor:  # what a rank puts into the gather
        seen: list[torch.Tensor] = []
        vocab_parallel_argmax(part, start, 2, lambda x: seen.append(x) or x.repeat(1, 2))
        return seen[0]

    gathered = torch.cat([sent(part, start) for part, start in ranks], dim=1)
    for part, start in ranks:
        got = vocab_parallel_argmax(part, start, 2, lambda x: gathered)
        assert got.dtype == torch.int64
        assert torch.equal(got, full.argmax(dim=1))
