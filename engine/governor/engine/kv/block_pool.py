"""Fixed pool of KV blocks: reference counts, an LRU free queue, and the prefix index of cached blocks."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Hands out KV block ids and remembers which full blocks hold which content.

    Invariants:
    - a block is in the free queue iff its ref count is 0 (`num_free + num_used == num_blocks`);
    - `index[h] == b` iff `block_hash[b] == h`: a cached block is found by its content hash while it is
      in use *and* after it is freed, until it is evicted (reallocated), least recently freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._index: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached ones among them stay reusable until evicted)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each), evicting the least recently freed cached content."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self._index[h]
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 joins the free queue's tail.
        Callers free a sequence's blocks last-first, so its prefix blocks are evicted last."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed while not in use")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest prefix of `hashes` (a hash chain, so a miss ends the prefix)."""
        hits = []
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by `lookup` (reviving free ones)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """Record that a full, in-use block holds the content with hash h (first writer wins)."""
        if h in self._index or self.block_hash[block] is not None:
            return
        self._index[h] = block
        self.block_hash[block] = h

    def check_invariants(self) -> None:
        """Assert the pool's invariants (used by tests and debug runs)."""
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in self._free), f"block {b}: ref count {rc}, in free queue: {b in self._free}"
        for h, b in self._index.items():
            assert self.block_hash[b] == h, f"index entry for block {b} disagrees with its hash"
        assert sum(h is not None for h in self.block_hash) == len(self._index), "a hashed block is not indexed"
