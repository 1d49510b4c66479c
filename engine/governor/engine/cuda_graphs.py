"""CUDA graphs of decode-shaped steps: captured once at start for a ladder of padded batch sizes, replayed.

A graph replays the exact kernels of one forward with fixed shapes and fixed buffer addresses, so the
step costs one launch instead of hundreds (a batch-1 decode of an 8B model is otherwise launch bound).
The runner owns the inputs (static device buffers it refills each step) and decides which graph fits a
step; this module owns the ladder of sizes and the captured graphs.

Invariants:
- every graph is captured at start, largest first, into one shared memory pool; nothing is captured
  later (knob changes pick another size of the same ladder), so `num_captures` is fixed after start;
- a graph's output tensor is valid until the next replay of any graph (they share the pool);
- capture writes nothing to the KV cache: its dummy rows have slot -1 and context length 0.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Batch sizes graphs are captured for: vLLM's ladder, dense where batches are small.
_SMALL_SIZES = (1, 2, 4)
_LADDER_STEP = 8


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to and including `max_size` (the hard cap of a step's sequences)."""
    if max_size < 1:
        raise ValueError(f"CUDA graph sizes need a positive cap, got {max_size}")
    sizes = [s for s in _SMALL_SIZES if s < max_size]
    sizes += range(_LADDER_STEP, max_size, _LADDER_STEP)
    return [*sizes, max_size]


@dataclass(frozen=True)
class GraphKey:
    """What fixes a graph's shapes: its padded sequence count and the query tokens of each sequence
    (1 for a decode; 1 + the speculation cap for a verification step)."""

    num_seqs: int
    query_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len


class CudaGraphs:
    """The captured graphs of one runner, by `GraphKey`."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; run eagerly (enforce_eager)")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._sizes: dict[int, list[int]] = {}  # query_len -> sorted captured sequence counts
        self.num_captures = 0
        self.num_replays = 0

    def _register(self, key: GraphKey) -> None:
        if key.num_seqs in self._sizes.get(key.query_len, []):
            raise RuntimeError(f"a CUDA graph for {key} is already captured")
        bisect.insort(self._sizes.setdefault(key.query_len, []), key.num_seqs)
        self.num_captures += 1

    def padded_key(self, num_seqs: int, query_len: int) -> GraphKey | None:
        """The smallest captured graph that holds `num_seqs` sequences of `query_len` tokens; None if none."""
        sizes = self._sizes.get(query_len)
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, num_seqs)
        return GraphKey(sizes[i], query_len) if i < len(sizes) else None

    def capture(self, key: GraphKey, forward: Callable[[], torch.Tensor]) -> None:
        """Run `forward` once eagerly (Triton compiles and the allocator warms up outside the capture),
        then capture it. `forward` must read and write only static buffers and allocate nothing that must
        outlive the step except its returned output."""
        self._register(key)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.graphs[key] = (graph, out)

    def release(self) -> None:
        """Free every captured graph, after the device has finished replaying them. A tensor-parallel rank does it
        before it leaves its process group: PyTorch's NCCL teardown (destroy_process_group) waits for good while a
        graph that captured NCCL collectives still exists."""
        torch.cuda.synchronize(self.device)
        for graph, _out in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self._sizes.clear()

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Replay the graph of `key` on the current stream; its output, valid until the next replay."""
        graph, out = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return out
