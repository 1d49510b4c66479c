"""Which KV blocks each sequence holds: the one caller of the block pool.

The scheduler, the draft model's cache, the warm-up and prompt scoring all give blocks to sequences and take them
back through a `KVManager`; none of them touches a `BlockPool`. The manager never changes how many of a sequence's
tokens are computed: it reads `num_computed_tokens`, which the scheduler's output handling alone writes
(`Scheduler.update_from_output`).
"""

from __future__ import annotations

from collections.abc import Iterable

from governor.engine.kv.block_hash import chain_hashes
from governor.engine.kv.block_pool import BlockPool
from governor.engine.sequence import Sequence


class KVManager:
    """Block tables of sequences over one fixed pool, and the prefix index of their full blocks.

    Invariants (`check_invariants`), between steps, for every sequence given to it:
    - a sequence holds ceil(num_computed_tokens / block_size) blocks, more only while its step is being built
      (the blocks `allocate` added for tokens the step computes) or while drafts are unsettled;
    - its first `num_cached_blocks` blocks are full and were offered to the prefix index (a block whose content
      another block already holds there is not indexed: the first writer wins);
    - each block's reference count is the number of block tables that hold it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # --- giving blocks -------------------------------------------------------------------------

    def fits(self, seq: Sequence, n: int) -> int:
        """How many of the next n tokens of seq fit in its blocks plus the free blocks."""
        own = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        if own >= n:  # the usual decode: room left in its last block (no need to count free blocks)
            return n
        capacity = (len(seq.block_table) + self.pool.num_free) * self.block_size
        return max(0, min(n, capacity - seq.num_computed_tokens))

    def allocate(self, seq: Sequence, n: int) -> None:
        """Extend seq's block table to hold its next n tokens (callers check that they fit first)."""
        if not self.reserve(seq, seq.num_computed_tokens + n):
            raise RuntimeError(f"{n} more tokens of {seq.request_id!r} do not fit in the {self.pool.num_free} "
                               "free KV blocks")

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend seq's block table to hold `num_tokens` positions; False, taking nothing, if too few are free."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def room_beyond(self, hits: list[int]) -> int:
        """Tokens a sequence admitted with the `hits` blocks (a cached or shared prefix) could be given room for
        after them: the free blocks, less the cached ones among `hits` that taking them revives."""
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        return (self.pool.num_free - revived) * self.block_size

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's block table from the `hits` blocks (a cached or shared prefix), taking a reference to each."""
        self.pool.touch(hits)
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)

    # --- taking blocks back --------------------------------------------------------------------

    def trim(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Release the blocks past the first `num_tokens` positions (default: the computed tokens), such as the
        slots of rejected draft tokens."""
        keep = self.blocks_for(seq.num_computed_tokens if num_tokens is None else num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def settle(self, seq: Sequence) -> None:
        """Once a step's computed count of seq is final (and before seq can finish and free them): release slots
        reserved for drafts that were not used, and cache the newly full blocks."""
        self.trim(seq)
        if self.enable_prefix_caching:  # checked here too: skips a call per sequence and step without it
            self.cache_computed(seq)

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks, last block first, so a sequence's prefix is the last of its content to be
        evicted."""
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_cached_blocks = 0

    # --- the prefix index ----------------------------------------------------------------------

    def hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of every full block of seq's known tokens (extended as tokens arrive)."""
        assert seq.cache_seed is not None
        have = len(seq.block_hashes)
        full = seq.num_tokens // self.block_size
        if full > have:
            parent = seq.block_hashes[-1] if have else seq.cache_seed
            tokens = seq.token_ids(have * self.block_size, full * self.block_size)
            seq.block_hashes.extend(chain_hashes(parent, tokens, self.block_size))
        return seq.block_hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of seq's tokens, before any is computed; at least one token is left
        to compute (its logits are needed)."""
        if not self.enable_prefix_caching or seq.cache_seed is None or seq.num_computed_tokens:
            return []
        hits = self.pool.lookup(self.hashes(seq))
        if len(hits) * self.block_size >= seq.num_tokens:
            hits = hits[:-1]  # the last position's logits are needed: recompute its block
        return hits

    def cache_computed(self, seq: Sequence) -> None:
        """Register seq's newly completed blocks in the prefix index (after its step ran)."""
        if not self.enable_prefix_caching or seq.cache_seed is None:
            return
        # Accepted draft tokens are computed before they join the sequence's tokens: a block is hashed,
        # and so cached, once its tokens are known (at the next settle).
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full > seq.num_cached_blocks:
            hashes = self.hashes(seq)
            for i in range(seq.num_cached_blocks, full):
                self.pool.register(seq.block_table[i], hashes[i])
            seq.num_cached_blocks = full

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the pool's invariants and, given `seqs` (every sequence holding blocks, between steps), the
        manager's (used by tests and debug runs)."""
        self.pool.check_invariants()
        if seqs is None:
            return
        held: dict[int, int] = {}
        for seq in seqs:
            assert len(seq.block_table) == self.blocks_for(seq.num_computed_tokens), (
                f"{seq.request_id!r} holds {len(seq.block_table)} blocks for {seq.num_computed_tokens} computed tokens")
            assert seq.num_cached_blocks * self.block_size <= seq.num_computed_tokens
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for b, n in held.items():
            assert self.pool.ref_counts[b] == n, f"block {b}: ref count {self.pool.ref_counts[b]}, held {n} times"
        assert len(held) == self.pool.num_used, f"{self.pool.num_used} blocks in use, {len(held)} held"
