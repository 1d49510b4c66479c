"""One rank's share of the engine: its weight shard, its KV cache and the runner that steps them.

With tensor_parallel_size 1 the engine's one Worker holds the whole model. With N > 1, rank 0's Worker
lives in the engine process and leads (its runner broadcasts every step it runs); ranks 1..N-1 each
build a Worker in a process of their own (tp/processes.py) and follow. Every rank builds its Worker
through the same sequence of collectives — the all-reduce path, load status, fp8 calibration, the KV
block count, the CUDA graph captures — so they pair up across ranks.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from governor.engine.attention import PagedAttention
from governor.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from governor.engine.kv.cache import allocate_kv_cache, bytes_per_block, max_blocks_for_int32_offsets
from governor.engine.models.checkpoint import LazyTensor, dummy_weights, iter_weights
from governor.engine.models.llama import CausalLM
from governor.engine.models.model_config import ModelConfig
from governor.engine.models.quantization import dummy_linear_tensors
from governor.engine.runner import ModelRunner
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.sequence import Sequence
from governor.engine.tp.group import SINGLE, TPGroup, rank_device
from governor.engine.tp.sharding import shard_config

log = logging.getLogger("governor.engine")


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its Worker, resolved once by rank 0 (it is pickled to the workers)."""

    config: EngineConfig
    model_config: ModelConfig  # the whole model
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda" (rank r of several uses cuda:r)
    max_model_len: int
    attention_backend: str  # "torch" or "triton"
    calibration_vocab: int  # fp8 calibration draws token ids below this
    draft_bytes_per_block: int = 0  # rank 0's draft-model cache grows with the target's block count
    # Decode and verification steps replay CUDA graphs, captured by every rank at start: on CUDA with the Triton
    # attention backend (the torch reference syncs with the host), unless enforce_eager.
    cuda_graphs: bool = False
    # Rank 0's `torch.get_float32_matmul_precision()` ("highest": no TF32), which every rank takes: ranks that rounded
    # float32 matmuls differently would compute different shards of one product.
    float32_matmul_precision: str = "highest"


class Worker:
    """The model shard, KV cache and runner of one rank. `serve()` is a worker process's step loop."""

    def __init__(self, spec: WorkerSpec, tp: TPGroup = SINGLE) -> None:
        self.spec = spec
        self.tp = tp
        cfg = spec.config
        torch.set_float32_matmul_precision(spec.float32_matmul_precision)
        self.device = rank_device(spec.device_type, tp.rank, tp.size)
        self.local_config = shard_config(spec.model_config, tp.size)
        self.block_size = cfg.block_size
        if tp.size > 1:
            why_not = tp.use_p2p(self.device, spec.dtype, enabled=not cfg.disable_custom_all_reduce)
            if tp.rank == 0 and self.device.type == "cuda":
                log.info("tensor parallel: small all-reduces %s", "over peer-to-peer buffers (one-shot/two-shot), "
                         "large ones over NCCL" if why_not is None else f"over NCCL ({why_not})")
        error: Exception | None = None
        try:
            self.model = CausalLM(self.local_config, spec.dtype, self.device, spec.max_model_len,
                                  PagedAttention(spec.attention_backend, spec.model_config.head_dim ** -0.5), tp)
            self.model.load_weights(self._weights())
        except Exception as e:
            if tp.size == 1:
                raise
            error = e
        _raise_if_any_rank_failed(tp, error, "load its weights")

        self.kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype.startswith("fp8") else spec.dtype
        if self.kv_dtype == torch.float8_e4m3fn:
            self._calibrate_fp8_scales()
        # Every rank must hold the same blocks (the scheduler on rank 0 hands out ids for all of them).
        self.num_blocks = tp.min(self._num_kv_blocks())
        min_blocks = -(-spec.max_model_len // self.block_size)
        if self.num_blocks < min_blocks:
            raise ValueError(f"the KV cache holds {self.num_blocks} blocks of {self.block_size} tokens, fewer than "
                             f"one max_model_len={spec.max_model_len} sequence needs ({min_blocks}); lower "
                             "max_model_len or give the cache more memory (kv_cache_memory_bytes / num_kv_blocks)")
        self.kv_caches = allocate_kv_cache(self.local_config, self.num_blocks, self.block_size, self.kv_dtype,
                                           self.device)
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_size, cfg.tokens_cap, cfg.seqs_cap,
                                  spec.max_model_len, self.device, cfg.spec_cap, tp)
        self.cuda_graph_capture_s = 0.0
        if spec.cuda_graphs:
            t0 = time.perf_counter()
            self.runner.capture_cuda_graphs(cfg.seqs_cap)  # every rank the same ladder, in the same order
            torch.cuda.synchronize(self.device)
            self.cuda_graph_capture_s = time.perf_counter() - t0

    def _weights(self) -> Iterator[tuple[str, LazyTensor]]:
        cfg = self.spec.config
        if cfg.load_format == "dummy":
            quant = self.spec.model_config.quantization
            # A pre-quantized config.json gets random packed tensors in its format; online fp8 quantizes dense ones.
            linear = (None if quant is None or quant.online
                      else functools.partial(dummy_linear_tensors, quant, self.device, cfg.seed))
            return dummy_weights(self.spec.model_config, self.spec.dtype, self.device, cfg.seed, linear)
        return iter_weights(cfg.model)

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache."""
        return self.num_blocks * bytes_per_block(self.local_config, self.block_size, self.kv_dtype)

    def serve(self) -> None:
        """A worker's loop: run each step rank 0 broadcasts, until it sends the shutdown."""
        while self.runner.follow():
            pass

    def _calibrate_fp8_scales(self, num_seqs: int = 4, seq_len: int = 256, margin: float = 2.0) -> None:
        """Static per-layer, per-kv-head fp8 scales from one prefill of seeded random tokens through a
        temporary model-dtype cache: scale = margin * max|x| / 448, so e4m3 (relative precision, max 448)
        covers each head's range with room for inputs hotter than the calibration batch. Every rank
        draws the same tokens and runs the prefill in lockstep; each calibrates the KV heads it holds."""
        seq_len = min(seq_len, self.spec.max_model_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        caches = allocate_kv_cache(self.local_config, num_seqs * blocks_per_seq, self.block_size, self.spec.dtype,
                                   self.device)
        runner = ModelRunner(self.model, caches, self.block_size, num_seqs * seq_len, num_seqs, seq_len,
                             self.device)
        gen = torch.Generator().manual_seed(self.spec.config.seed)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        scheduled = []
        for i in range(num_seqs):
            ids = torch.randint(0, self.spec.calibration_vocab, (seq_len,), generator=gen).tolist()
            seq = Sequence(f"calibrate-{i}", i, ids, params, 1)
            seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            scheduled.append(ScheduledSeq(seq, seq_len))
        attns = [layer.self_attn for layer in self.model.decoder_layers]
        for a in attns:
            a.observe, a.k_amax, a.v_amax = True, None, None
        runner.hidden_states(SchedulerOutput(scheduled))
        for a in attns:
            assert a.k_amax is not None and a.v_amax is not None
            a.k_scale = (a.k_amax * margin / 448.0).clamp(min=1e-8)
            a.v_scale = (a.v_amax * margin / 448.0).clamp(min=1e-8)
            a.observe = False
        log.info("fp8 KV scales calibrated%s: k_scale in [%.3g, %.3g], v_scale in [%.3g, %.3g]",
                 f" (rank {self.tp.rank})" if self.tp.size > 1 else "",
                 min(float(a.k_scale.min()) for a in attns if a.k_scale is not None),
                 max(float(a.k_scale.max()) for a in attns if a.k_scale is not None),
                 min(float(a.v_scale.min()) for a in attns if a.v_scale is not None),
                 max(float(a.v_scale.max()) for a in attns if a.v_scale is not None))

    def _num_kv_blocks(self) -> int:
        """The blocks this rank's memory holds (before the ranks agree on the smallest)."""
        cfg = self.spec.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = bytes_per_block(self.local_config, self.block_size, self.kv_dtype)
        if self.tp.rank == 0:
            per_block += self.spec.draft_bytes_per_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            # What loading freed but PyTorch's allocator still holds (AWQ's repack, weights drawn or quantized at
            # load) counts as used to the driver: hand it back first, so the cache gets it.
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = max(1, budget // per_block)
        cap = max_blocks_for_int32_offsets(self.local_config, self.block_size)
        if blocks > cap:
            # Only a small model on a large GPU gets here (qwen3-0.6b with an fp8 cache on an H200: 2.1M tokens).
            log.info("KV cache: %d blocks fit the memory budget; using %d, so that the model's per-layer K/V tensors "
                     "keep int32 offsets in the attention kernels (num_kv_blocks sets the count explicitly; a draft "
                     "model's cache is sized apart)", blocks, cap)
            blocks = cap
        return blocks


def _raise_if_any_rank_failed(tp: TPGroup, error: Exception | None, what: str) -> None:
    """All ranks learn whether any failed: this rank's own error is re-raised, else the first other one's."""
    if tp.size == 1:
        return
    errors = tp.gather_errors(error)
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise RuntimeError(f"tensor-parallel rank {rank} failed to {what}: {msg}")
