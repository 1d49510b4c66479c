"""vLLM as the peer runners start it: importable with a clear error, FlashInfer's sampler off when FlashInfer is
absent (the bundle leaves it out; vLLM then samples with its PyTorch sampler), and CUDA graphs captured only at the
batch sizes a workload reaches."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

from benchmarks.peers.peer import import_peer

VLLM_HINT = ("vLLM 0.26.0 is not importable: unpack the bundle (`python3 -m benchmarks.peers.bundle install "
             "--peers-dir .peers`) and put .peers/site on PYTHONPATH, or `pip install vllm==0.26.0`")


def import_vllm() -> ModuleType:
    """The vllm module, after setting VLLM_USE_FLASHINFER_SAMPLER=0 when flashinfer is not importable."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return import_peer("vllm", VLLM_HINT)


def capture_sizes(max_batch: int) -> list[int]:
    """CUDA-graph batch sizes up to `max_batch`: the powers of two below it, and itself. vLLM's default list (every
    multiple of 8 up to twice max_num_seqs, about 50 graphs) costs start-up time that a fixed-batch benchmark never
    uses: a decode batch pads up to the next size, at most twice its own."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]
