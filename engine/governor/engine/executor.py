"""Start-up and the forward pass: the tensor-parallel ranks, rank 0's worker (weights, KV cache, runner), the CUDA
graphs and the kernel warm-up; then one scheduled step at a time on every rank."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

import torch

from governor.engine.config import EngineConfig
from governor.engine.kv.cache import bytes_per_block
from governor.engine.kv.kv_manager import KVManager
from governor.engine.models.model_config import ModelConfig, load_model_config
from governor.engine.scheduler import SchedulerOutput
from governor.engine.tp.group import SINGLE, TPGroup
from governor.engine.tp.processes import WorkerProcesses
from governor.engine.tp.rank0 import gpu_has_work, start_workers, stop_workers, watch_for_stuck_steps
from governor.engine.tp.sharding import shard_config
from governor.engine.warm_up import warm_up_kernels
from governor.engine.worker import Worker, WorkerSpec

log = logging.getLogger("governor.engine")

EXIT_VISIBLE_S = 5.0  # how long a failed step waits to see whether a worker exited (and is named) before re-raising

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_worker_spec(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                        calibration_vocab: int) -> WorkerSpec:
    """What every rank builds from `config`: the device type, the weights' dtype, the attention backend and the
    draft cache's block size resolved; a tensor-parallel size that does not divide the heads, or more ranks than
    GPUs, fail here, before any process starts."""
    device_type = _resolve_device(config.device)
    dtype = _DTYPES[model_config.torch_dtype if config.dtype == "auto" else config.dtype]
    tp_size = config.tensor_parallel_size
    shard_config(model_config, tp_size)
    if device_type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs (one per rank); torch sees "
                         f"{torch.cuda.device_count()}")
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "torch"
    spec = config.speculative_config
    draft_bytes = 0
    if spec is not None and spec.model:  # the draft model keeps a cache of as many blocks
        draft_bytes = bytes_per_block(load_model_config(spec.model), config.block_size, dtype)
    return WorkerSpec(config, model_config, dtype, device_type, max_model_len, backend, calibration_vocab,
                      draft_bytes,
                      cuda_graphs=device_type == "cuda" and backend == "triton" and not config.enforce_eager,
                      float32_matmul_precision=torch.get_float32_matmul_precision())


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return device


class ModelExecutor:
    """One model on one device, or split over `tensor_parallel_size` devices (one process per rank: this one is
    rank 0 and runs everything but the other shards' forward). Built ready to run: workers joined, rank 0's
    worker loaded, decode graphs captured. `close()` stops the workers."""

    def __init__(self, spec: WorkerSpec) -> None:
        config = spec.config
        self.tp: TPGroup = SINGLE
        self._workers: WorkerProcesses | None = None
        self._finalizer: weakref.finalize[..., ModelExecutor] | None = None
        self._before_leaving: list[Callable[[], None]] = []  # run by `stop_workers` before NCCL is torn down
        if config.tensor_parallel_size > 1:
            self._start_workers(spec, config.tensor_parallel_size)
        try:
            w = Worker(spec, self.tp)  # rank 0's; what the engine steps with is kept below
            self.device = w.device
            self.model, self.kv_caches, self.runner = w.model, w.kv_caches, w.runner
            self.block_size, self.kv_dtype, self.num_blocks = w.block_size, w.kv_dtype, w.num_blocks
            log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB%s); max concurrent max_model_len "
                     "sequences: %.1f", self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                     w.kv_cache_bytes() / 2**20, " per rank" if self.tp.size > 1 else "",
                     self.num_blocks * self.block_size / spec.max_model_len)
            self.use_cuda_graphs = spec.cuda_graphs
            self.cuda_graph_capture_s = w.cuda_graph_capture_s
            if self.use_cuda_graphs:
                graphs = self.runner.graphs
                assert graphs is not None
                if self.tp.size > 1:
                    self._before_leaving.append(graphs.release)
                log.info("CUDA graphs: %d captured in %.1f s (decode batch sizes up to %d%s%s)", graphs.num_captures,
                         self.cuda_graph_capture_s, config.seqs_cap,
                         f", verification at {1 + config.spec_cap} tokens per sequence" if config.spec_cap else "",
                         f"; on each of {self.tp.size} ranks" if self.tp.size > 1 else "")
        except BaseException:
            self.close()
            raise

    def _start_workers(self, spec: WorkerSpec, size: int) -> None:
        """Spawn ranks 1..size-1 and join their rendezvous as rank 0."""
        self.tp, workers = start_workers(spec, size)
        self._workers = workers
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        stopped = threading.Event()
        self._finalizer = weakref.finalize(self, stop_workers, self.tp, workers, stopped, self._before_leaving)
        if spec.device_type == "cuda":
            watch_for_stuck_steps(workers, stopped, gpu_has_work(torch.device("cuda", 0)))
        log.info("tensor parallel: %d ranks (%s), worker pids %s", size, torch.distributed.get_backend(),
                 workers.pids)

    def warm_up(self, kv: KVManager, seqs_cap: int, tokens_cap: int, max_model_len: int) -> None:
        """Compile the Triton kernels of prefill and mixed steps now rather than on the first requests
        (`warm_up.warm_up_kernels`), with blocks lent by `kv`. The engine runs it on CUDA with the Triton backend."""
        warm_up_kernels(self.execute, kv, seqs_cap, tokens_cap, max_model_len, self.device)

    def execute(self, out: SchedulerOutput, all_logits: bool = False, feed: torch.Tensor | None = None,
                argmax: bool = False, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The runner's step, after checking that every rank is there to run it. A step that fails because a worker
        has exited closes the engine and raises an error naming that worker."""
        workers = self._workers
        if workers is None:
            return self.runner.execute(out, all_logits, feed, argmax, drafts)
        if self.closed:
            raise RuntimeError("the engine is closed: its tensor-parallel workers have stopped")
        try:
            workers.check_alive()
            return self.runner.execute(out, all_logits, feed, argmax, drafts)
        except Exception as e:
            if not workers.wait_for_an_exit(EXIT_VISIBLE_S):  # a peer's socket can close before its exit shows
                raise
            dead = workers.describe_exits()
            self.close()
            raise RuntimeError(f"{dead}; the engine cannot step without it and is closed: restart it") from e

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process groups; idempotent, and a no-op with one rank.
        Also runs when the executor is garbage-collected or the interpreter exits."""
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive
