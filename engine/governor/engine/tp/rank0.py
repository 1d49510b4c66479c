"""Rank 0's side of a tensor-parallel engine's lifetime: spawning the workers and joining their group at start,
sending them the shutdown and waiting for them at the end."""

from __future__ import annotations

import logging

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


def stop_workers(tp: TPGroup, workers: WorkerProcesses) -> None:
    """Send the shutdown (when every worker can still take it), leave the groups as the workers do, and
    wait for them to exit."""
    if workers.all_alive():
        try:
            broadcast_shutdown(tp)
        except Exception as e:  # a worker went away meanwhile (it failed as rank 0 did): the join ends the rest
            log.warning("could not send the shutdown to every tensor-parallel worker: %s", str(e).splitlines()[0])
    # Before the join: tearing NCCL down may wait for every rank to do it too.
    destroy_tp_group(tp)
    workers.join()
