"""The worker processes of ranks 1..N-1: started and stopped by rank 0 (the engine process).

Each worker is a daemon process of the spawn context that joins the rendezvous, builds its Worker
(worker.py) and follows rank 0's steps until rank 0 sends the shutdown. A worker never outlives rank
0: it leaves when the control group's connection to rank 0 breaks, and a watchdog thread ends it if
its parent process is gone; SIGINT is ignored (a terminal's Ctrl-C reaches rank 0, which stops it). SIGUSR1 makes
a worker print every thread's Python stack to its stderr (`kill -USR1 PID`: where a rank waits), from a C signal
handler that runs even while the worker is blocked in a call that holds the interpreter lock.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from governor.engine.tp.group import TPGroup, destroy_tp_group, init_tp_group, rank_device
from governor.engine.worker import Worker, WorkerSpec

log = logging.getLogger("governor.engine")

JOIN_TIMEOUT_S = 30.0


class WorkerProcesses:
    """Ranks 1..size-1, spawned at once; they block in the rendezvous until rank 0 joins it."""

    def __init__(self, spec: WorkerSpec, size: int, port: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        for rank in range(1, size):
            p = ctx.Process(target=_worker_main, args=(spec, rank, size, port, os.getpid()),
                            name=f"governor-tp-rank{rank}", daemon=True)
            p.start()
            self.procs.append(p)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def check_alive(self) -> None:
        """RuntimeError naming a worker that has exited (rank 0 must not wait on it in a collective)."""
        if not self.all_alive():
            raise RuntimeError(f"{self.describe_exits()}; the engine cannot step without it: restart the engine")

    def describe_exits(self) -> str:
        """The workers that have exited, with their exit codes."""
        return "; ".join(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                         for rank, p in enumerate(self.procs, start=1) if not p.is_alive())

    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def wait_for_an_exit(self, timeout_s: float) -> bool:
        """Whether a worker has exited, waiting up to `timeout_s` for one to."""
        deadline = time.monotonic() + timeout_s
        while self.all_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Wait for every worker to exit; terminate (then kill) any that do not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                log.warning("tensor-parallel worker %s did not exit; terminating it", p.name)
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)  # rank 0 died without a shutdown: nothing left to serve


def _worker_main(spec: WorkerSpec, rank: int, size: int, port: int, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="governor-tp-watchdog",
                     daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    if spec.device_type == "cpu":  # the ranks share the host's cores: spinning thread pools would collide
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    tp: TPGroup | None = None
    worker: Worker | None = None
    try:
        tp = init_tp_group(rank, size, port, rank_device(spec.device_type, rank, size))
        worker = Worker(spec, tp)
        worker.serve()
    except Exception:
        log.exception("tensor-parallel worker rank %d failed", rank)
        raise SystemExit(1) from None
    finally:
        if worker is not None and worker.runner.graphs is not None:
            worker.runner.graphs.release()  # before NCCL's teardown, which waits while they exist (rank 0 too)
        if tp is not None:
            destroy_tp_group(tp)
    log.info("tensor-parallel worker rank %d: shut down", rank)

