"""Who runs this step: decodes first, then prefill chunks into the remaining token budget."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from governor.engine.config import Knobs
from governor.engine.kv.block_hash import chain_hashes
from governor.engine.kv.block_pool import BlockPool
from governor.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence's share of a step. A decode may carry speculative draft tokens after its last token:
    `num_spec` slots are reserved by the scheduler, `draft_tokens` filled by the proposer.

    A fed decode (`fed_from` set, `Scheduler.schedule_continuation`) is scheduled while the step before
    is still running: its one token is the one that step samples for the sequence, not yet known on the
    host, which the runner copies on the device from row `fed_from` of that step's sampled tokens."""

    seq: Sequence
    num_new_tokens: int
    num_spec: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    fed_from: int | None = None

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        if self.fed_from is not None:
            return True
        known = self.num_new_tokens - len(self.draft_tokens)
        return self.seq.num_computed_tokens + known == self.seq.num_tokens

    def set_drafts(self, drafts: list[int]) -> None:
        """Fill the reserved draft slots with the proposer's tokens (possibly fewer, possibly none)."""
        if len(drafts) > self.num_spec:
            raise ValueError(f"{len(drafts)} draft tokens for {self.num_spec} reserved slots")
        self.num_new_tokens += len(drafts) - self.num_spec
        self.num_spec = len(drafts)
        self.draft_tokens = list(drafts)

    @property
    def num_logits(self) -> int:
        """Positions whose logits this step needs: the last known token and every draft token."""
        return 1 + len(self.draft_tokens) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first, then prefill chunks
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue this step


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption.

    Each step: running sequences that decode go first (protects inter-token latency), then running
    sequences still in prefill, then waiting sequences are admitted while `max_num_seqs` and the
    token budget allow. When KV blocks run out, the newest running sequence not yet scheduled this
    step is preempted: its blocks are freed and it is recomputed later. A request is never dropped.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, knobs: Knobs,
                 enable_prefix_caching: bool = False, max_model_len: int | None = None,
                 align_prefill_chunks: bool = True) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.knobs = knobs
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.align_prefill_chunks = align_prefill_chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix index
        self.prefix_cache_hit_tokens = 0  # of those, tokens found cached (prefill avoided)
        self.prompt_tokens_shared = 0  # prompt tokens parallel samples took from a sibling (prefill avoided)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, seq: Sequence, n: int) -> int:
        """How many of the next n tokens of seq fit in its blocks plus the free blocks."""
        own = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        if own >= n:  # the usual decode: room left in its last block (no need to count free blocks)
            return n
        capacity = (len(seq.block_table) + self.block_pool.num_free) * self.block_size
        return max(0, min(n, capacity - seq.num_computed_tokens))

    def allocate(self, seq: Sequence, n: int) -> None:
        """Extend seq's block table to hold its next n tokens (callers check that they fit first)."""
        needed = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table)
        if needed > 0:
            seq.block_table.extend(self.block_pool.allocate(needed))

    def _spec_slots(self, seq: Sequence) -> int:
        """Draft slots for a decode: K, but never past max_tokens or max_model_len once all are accepted."""
        k = self.knobs.num_speculative_tokens
        if k == 0 or not seq.is_decoding:
            return 0
        k = min(k, seq.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return max(0, k)

    def settle_blocks(self, seq: Sequence) -> None:
        """Once a step's computed count of seq is final (and before seq can finish and free them): release
        slots reserved for drafts that were not used, and cache the newly full blocks."""
        self.trim_blocks(seq)
        if self.enable_prefix_caching:  # checked here too: skips a call per sequence and step without it
            self.cache_computed_blocks(seq)

    def trim_blocks(self, seq: Sequence) -> None:
        """Release blocks past the computed tokens (slots of rejected draft tokens)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.block_pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def _aligned(self, seq: Sequence, n: int) -> int:
        """Shorten a prefill chunk that does not finish the known tokens so it ends on a block boundary:
        every chunk then starts block-aligned, as a prefix-cache hit does, so warm and cold runs compute
        each position with the same shapes."""
        if n >= seq.num_uncomputed_tokens or not self.align_prefill_chunks:
            return n
        end = seq.num_computed_tokens + n
        aligned = end - end % self.block_size
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else n

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of every full block of seq's known tokens (extended as tokens arrive)."""
        assert seq.cache_seed is not None
        have = len(seq.block_hashes)
        full = seq.num_tokens // self.block_size
        if full > have:
            parent = seq.block_hashes[-1] if have else seq.cache_seed
            tokens = seq.token_ids(have * self.block_size, full * self.block_size)
            seq.block_hashes.extend(chain_hashes(parent, tokens, self.block_size))
        return seq.block_hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of seq's tokens; at least one token is left to compute."""
        if not self.enable_prefix_caching or seq.cache_seed is None or seq.num_computed_tokens:
            return []
        hits = self.block_pool.lookup(self._hashes(seq))
        if len(hits) * self.block_size >= seq.num_tokens:
            hits = hits[:-1]  # the last position's logits are needed: recompute its block
        return hits

    def _shared_prompt(self, seq: Sequence) -> list[int] | None:
        """The full prompt blocks seq takes from the sibling it shares its prompt with (`prompt_source`): [] when
        it shares none (no sibling, or the sibling ended), None while the sibling has yet to compute them. At
        least one prompt token is left to compute, for its logits. Prompt blocks are never written again, so
        sharing them needs only a reference each."""
        src = seq.prompt_source
        if src is None:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        if src.status is SequenceStatus.FINISHED or src.num_preemptions or full == 0:
            seq.prompt_source = None
            return []
        if src.status is SequenceStatus.WAITING or src.num_computed_tokens < full * self.block_size:
            return None
        seq.prompt_source = None
        return src.block_table[:full]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's newly completed blocks in the prefix index (after its step ran)."""
        if not self.enable_prefix_caching or seq.cache_seed is None:
            return
        # Accepted draft tokens are computed before they join the sequence's tokens: a block is hashed,
        # and so cached, once its tokens are known (at the next settle).
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full > seq.num_cached_blocks:
            hashes = self._hashes(seq)
            for i in range(seq.num_cached_blocks, full):
                self.block_pool.register(seq.block_table[i], hashes[i])
            seq.num_cached_blocks = full

    def _free_blocks(self, seq: Sequence) -> None:
        # Last block first, so a sequence's prefix is the last of its content to be evicted.
        self.block_pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        # Victims are taken newest first, so appendleft keeps the waiting queue oldest-first.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.knobs.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        taken: set[int] = set()

        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            (decodes if seq.is_decoding else prefills).append(seq)
        bs, speculating = self.block_size, self.knobs.num_speculative_tokens > 0
        for seq in itertools.chain(decodes, prefills):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            uncomputed = seq.num_uncomputed_tokens  # fixed for this sequence while it is being scheduled
            if uncomputed == 1 and not speculating and seq.num_computed_tokens < len(seq.block_table) * bs:
                # The usual decode, what the general path below comes to for it: one token, no draft
                # slots, into the room left in its last block (nothing to allocate, nobody to preempt).
                scheduled.append(ScheduledSeq(seq, 1))
                taken.add(id(seq))
                budget -= 1
                continue
            spec = min(self._spec_slots(seq), max(0, budget - 1))
            n = min(uncomputed + spec, budget)
            fit = self._fits(seq, n)
            while fit < n:
                victims = [s for s in self.running if id(s) not in taken and s is not seq]
                if not victims:
                    break
                self._preempt(victims[-1])
                fit = self._fits(seq, n)
            if fit == 0:
                self._preempt(seq)
                continue
            spec = max(0, fit - uncomputed)
            if fit < uncomputed:  # a prefill chunk that stops short of the known tokens (spec is 0)
                fit = self._aligned(seq, fit)
            self.allocate(seq, fit)
            scheduled.append(ScheduledSeq(seq, fit, num_spec=spec))
            taken.add(id(seq))
            budget -= fit

        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.knobs.max_num_seqs:
            seq = self.waiting[0]
            shared = self._shared_prompt(seq)
            if shared is None:
                break  # its sibling is still computing the prompt they share: admit it after that
            hits = shared or self._cached_prefix(seq)
            revived = sum(1 for b in hits if self.block_pool.ref_counts[b] == 0)
            start = len(hits) * self.block_size
            capacity = (len(hits) + self.block_pool.num_free - revived) * self.block_size - start
            fit = max(0, min(seq.num_tokens - start, budget, capacity))
            if fit == 0:
                break  # admission never preempts: wait for blocks to free up
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            self.block_pool.touch(hits)
            seq.block_table = list(hits)
            seq.num_computed_tokens = start
            seq.num_cached_blocks = len(hits)
            if shared:
                self.prompt_tokens_shared += start
            elif self.enable_prefix_caching and seq.cache_seed is not None:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hit_tokens += start
            fit = self._aligned(seq, fit)
            self.allocate(seq, fit)
            scheduled.append(ScheduledSeq(seq, fit))
            taken.add(id(seq))
            budget -= fit

        return SchedulerOutput(scheduled, admitted)

    def schedule_continuation(self, rows: dict[int, int], ending: set[int]) -> SchedulerOutput | None:
        """The next step, scheduled while the step in flight has yet to deliver its tokens: what `schedule`
        will make of it once they are in, when that is certain up to stops the host cannot foresee.

        rows: id(seq) -> its row among the in-flight step's sampled tokens, for every sequence that step
        samples (each of them has computed all its known tokens). ending: ids of the sequences that the
        in-flight step ends for sure (their token reaches max_tokens). Every other running sequence then
        decodes its coming token, fed from its row (`ScheduledSeq.fed_from`), in running order, as
        `schedule` orders decodes. A sequence the step ends by a stop token or string is in it too: its
        row is computed and dropped.

        None, allocating nothing, when `schedule` could do otherwise: a running sequence that is not in
        `rows` (a prefill chunk, one left out of the step), draft slots to reserve, a waiting sequence it
        could admit, a token budget too small for every decode, or too few free blocks (it would
        preempt)."""
        knobs = self.knobs
        if knobs.num_speculative_tokens > 0:
            return None
        seqs = []
        for seq in self.running:
            if id(seq) not in rows:
                return None
            if id(seq) not in ending:
                seqs.append(seq)
        n = len(seqs)
        if n == 0 or n > knobs.max_num_batched_tokens:
            return None
        if self.waiting and n < knobs.max_num_seqs and n < knobs.max_num_batched_tokens:
            return None
        bs = self.block_size
        full = [seq for seq in seqs if seq.num_computed_tokens == len(seq.block_table) * bs]
        if len(full) > self.block_pool.num_free:
            return None
        for seq, block in zip(full, self.block_pool.allocate(len(full)), strict=True):
            seq.block_table.append(block)
        return SchedulerOutput([ScheduledSeq(seq, 1, fed_from=rows[id(seq)]) for seq in seqs])

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished (running or still waiting) and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._free_blocks(seq)
