"""Fixed pool of KV blocks with reference counts and a free list."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids.

    Invariant: a block is in the free queue iff its ref count is 0;
    `num_free + num_used == num_blocks` at all times.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each). Raises if fewer are free: callers check first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 returns to the free queue."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed while not in use")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Assert the pool's invariants (used by tests and debug runs)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc}, in free queue: {b in free}"
