"""Who runs this step: decodes first, then prefill chunks into the remaining token budget."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from governor.engine.config import Knobs
from governor.engine.kv.kv_manager import KVManager
from governor.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence's share of a step. A decode may carry speculative draft tokens after its last token:
    `num_spec` slots are reserved by the scheduler, `draft_tokens` filled by the proposer. Drafts still on
    the device (`spec.draft_model.DeviceDrafts`) have `draft_src` set, their offset in the step's flattened
    drafts, which the runner copies the token ids from; `draft_tokens` then holds placeholders of the right
    count until the proposer's `resolve` writes the values.

    A fed decode (`fed_from` set, `Scheduler.schedule_continuation`) is scheduled while the step before
    is still running: its one token is the one that step samples for the sequence, not yet known on the
    host, which the runner copies on the device from row `fed_from` of that step's sampled tokens."""

    seq: Sequence
    num_new_tokens: int
    num_spec: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    fed_from: int | None = None
    draft_src: int | None = None

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

    The scheduler is the only writer of a sequence's `num_computed_tokens`: at admission (a cached or shared
    prefix), at preemption (back to 0), and after a step ran (`update_from_output`, `accept_drafts`). Its blocks
    come and go through the KV manager (`kv`).
    """

    def __init__(self, kv: KVManager, knobs: Knobs, max_model_len: int | None = None,
                 align_prefill_chunks: bool = True) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.knobs = knobs
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

    def _spec_slots(self, seq: Sequence) -> int:
        """Draft slots for a decode: K, but never past max_tokens or max_model_len once all are accepted."""
        k = self.knobs.num_speculative_tokens
        if k == 0 or not seq.is_decoding:
            return 0
        k = min(k, seq.max_tokens - len(seq.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        return max(0, k)

    def _aligned(self, seq: Sequence, n: int) -> int:
        """Shorten a prefill chunk that does not finish the known tokens so it ends on a block boundary:
        every chunk then starts block-aligned, as a prefix-cache hit does, so warm and cold runs compute
        each position with the same shapes."""
        if n >= seq.num_uncomputed_tokens or not self.align_prefill_chunks:
            return n
        end = seq.num_computed_tokens + n
        aligned = end - end % self.block_size
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else n

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

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        # Victims are taken newest first, so appendleft keeps the waiting queue oldest-first.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        budget, kv = self.knobs.max_num_batched_tokens, self.kv
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
            fit = kv.fits(seq, n)
            while fit < n:
                victims = [s for s in self.running if id(s) not in taken and s is not seq]
                if not victims:
                    break
                self._preempt(victims[-1])
                fit = kv.fits(seq, n)
            if fit == 0:
                self._preempt(seq)
                continue
            spec = max(0, fit - uncomputed)
            if fit < uncomputed:  # a prefill chunk that stops short of the known tokens (spec is 0)
                fit = self._aligned(seq, fit)
            kv.allocate(seq, fit)
            scheduled.append(ScheduledSeq(seq, fit, num_spec=spec))
            taken.add(id(seq))
            budget -= fit

        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.knobs.max_num_seqs:
            seq = self.waiting[0]
            shared = self._shared_prompt(seq)
            if shared is None:
                break  # its sibling is still computing the prompt they share: admit it after that
            hits = shared or kv.cached_prefix(seq)
            start = len(hits) * self.block_size
            fit = max(0, min(seq.num_tokens - start, budget, kv.room_beyond(hits)))
            if fit == 0:
                break  # admission never preempts: wait for blocks to free up
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            kv.admit(seq, hits)
            seq.num_computed_tokens = start
            if shared:
                self.prompt_tokens_shared += start
            elif kv.enable_prefix_caching and seq.cache_seed is not None:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hit_tokens += start
            fit = self._aligned(seq, fit)
            kv.allocate(seq, fit)
            scheduled.append(ScheduledSeq(seq, fit))
            taken.add(id(seq))
            budget -= fit

        return SchedulerOutput(scheduled, admitted)

    def schedule_continuation(self, rows: dict[int, int], ending: set[int], without_drafts: bool = False
                              ) -> SchedulerOutput | None:
        """The next step, scheduled while the step in flight has yet to deliver its tokens: what `schedule`
        will make of it once they are in, when that is certain up to stops the host cannot foresee.

        rows: id(seq) -> its row among the in-flight step's sampled tokens, for every sequence that step
        samples (each of them has computed all its known tokens). ending: ids of the sequences that the
        in-flight step ends for sure (their token reaches max_tokens). Every other running sequence then
        decodes its coming token, fed from its row (`ScheduledSeq.fed_from`), in running order, as
        `schedule` orders decodes. A sequence the step ends by a stop token or string is in it too: its
        row is computed and dropped.

        None, allocating nothing, when `schedule` could do otherwise: a running sequence that is not in
        `rows` (a prefill chunk, one left out of the step), draft slots to reserve (unless `without_drafts`:
        the engine skips speculation for this step), a waiting sequence it could admit, a token budget too
        small for every decode, or too few free blocks (it would preempt)."""
        knobs = self.knobs
        if knobs.num_speculative_tokens > 0 and not without_drafts:
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
        bs, kv = self.block_size, self.kv
        full = [seq for seq in seqs if seq.num_computed_tokens == len(seq.block_table) * bs]
        if len(full) > kv.num_free:
            return None
        for seq in full:
            kv.allocate(seq, 1)
        return SchedulerOutput([ScheduledSeq(seq, 1, fed_from=rows[id(seq)]) for seq in seqs])

    def update_from_output(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """After `out` ran: its known tokens' KV is written, so count them computed and settle their blocks (a
        sequence with drafts is settled by `accept_drafts` once they are verified). Returns the scheduled
        sequences that sample a token, in order."""
        sampling = []
        settle = self.kv.settle
        for s in out.scheduled:
            if s.samples:  # read before the count moves
                sampling.append(s)
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft_tokens)
            if not s.draft_tokens:
                settle(s.seq)
        return sampling

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the KV of the accepted drafts is kept, the slots of the rejected ones released."""
        seq.num_computed_tokens += num_accepted
        self.kv.settle(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished (running or still waiting) and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
