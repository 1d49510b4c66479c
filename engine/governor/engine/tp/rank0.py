"""Rank 0's side of a tensor-parallel engine's lifetime: spawning the workers and joining their group at start,
sending them the shutdown and waiting for them at the end."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from governor.engine.runner import broadcast_shutdown
from governor.engine.tp.group import (
    TPGroup,
    check_no_open_group,
    destroy_tp_group,
    free_port,
    init_tp_group,
    rank_device,
)
from governor.engine.tp.processes import WorkerProcesses
from governor.engine.worker import WorkerSpec

log = logging.getLogger("governor.engine")


def start_workers(spec: WorkerSpec, size: int) -> tuple[TPGroup, WorkerProcesses]:
    """Spawn ranks 1..size-1 and join their rendezvous as rank 0: the group and the workers."""
    check_no_open_group()  # before any process starts
    port = free_port()
    workers = WorkerProcesses(spec, size, port)
    try:
        tp = init_tp_group(0, size, port, rank_device(spec.device_type, 0, size))
    except BaseException:
        workers.join(timeout_s=0)
        raise
    return tp, workers


def stop_workers(tp: TPGroup, workers: WorkerProcesses, stopped: threading.Event | None = None,
                 before_leaving: list[Callable[[], None]] | None = None) -> None:
    """Send the shutdown (when every worker can still take it), run `before_leaving` (rank 0 frees its CUDA graphs
    there, `CudaGraphs.release`), leave the groups as the workers do, and wait for them to exit; then set
    `stopped`."""
    if workers.all_alive():
        try:
            broadcast_shutdown(tp)
        except Exception as e:  # a worker went away meanwhile (it failed as rank 0 did): the join ends the rest
            log.warning("could not send the shutdown to every tensor-parallel worker: %s", str(e).splitlines()[0])
    for release in before_leaving or []:
        try:
            release()
        except Exception as e:  # a GPU in a bad state: leave the groups all the same
            log.warning("before leaving the tensor-parallel groups: %s", str(e).splitlines()[0])
    # Before the join: tearing NCCL down may wait for every rank to do it too.
    destroy_tp_group(tp)
    workers.join()
    if stopped is not None:
        stopped.set()


def gpu_has_work(device: torch.device) -> Callable[[], bool]:
    """Whether `device`'s default stream (where the engine's steps run) still has work queued."""
    stream = torch.cuda.default_stream(device)
    return lambda: not stream.query()


STUCK_STEP_GRACE_S = 10.0
STUCK_STEP_EXIT_CODE = 70


def watch_for_stuck_steps(workers: WorkerProcesses, stopped: threading.Event, gpu_busy: Callable[[], bool],
                          poll_s: float = 0.5, grace_s: float = STUCK_STEP_GRACE_S,
                          end_process: Callable[[int], object] = os._exit) -> threading.Thread:
    """A daemon thread that ends rank 0's process when a worker has exited in the middle of a GPU step.

    Rank 0's GPU then waits forever in that step's collective (a peer-to-peer barrier has no timeout; NCCL's is
    minutes), and so does any host thread that waits for the step's results: no exception can reach the engine.
    A worker's exit while rank 0's GPU is idle needs nothing from here: the next step raises (`ModelExecutor.execute`).
    So once a worker is gone, until the workers are stopped (`stopped`: a close can hang on that step too), the
    thread watches rank 0's GPU (`gpu_busy`: whether it has work queued); if it still has work queued `grace_s`
    later, it logs which worker exited and ends the process (`end_process`) with STUCK_STEP_EXIT_CODE. (A normal
    close stops the workers with rank 0's GPU idle.)"""

    def watch() -> None:
        dead_since: float | None = None
        while not stopped.wait(poll_s):
            if workers.all_alive():
                continue
            now = time.monotonic()
            if dead_since is None:
                dead_since = now
            if not gpu_busy():
                dead_since = now  # idle: the next step raises instead
            elif now - dead_since >= grace_s:
                log.critical("%s while a step was running on the GPUs: rank 0 cannot finish that step without it. "
                             "Ending the engine's process (exit code %d)", workers.describe_exits(),
                             STUCK_STEP_EXIT_CODE)
                logging.shutdown()
                end_process(STUCK_STEP_EXIT_CODE)
                return

    thread = threading.Thread(target=watch, name="governor-tp-step-watchdog", daemon=True)
    thread.start()
    return thread
