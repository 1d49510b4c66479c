"""Draft-model proposer: a smaller model with the target's tokenizer and a paged KV cache of its own.

The draft's cache is kept in step with the target's tokens: before proposing, each sequence's draft
catches up on the tokens it has not seen (its whole prompt the first time, then the tokens accepted
in the last step), then proposes k tokens autoregressively. After verification the draft keeps only
the KV of tokens the target accepted. The draft's copies of the sequences are its own: this proposer alone
moves their computed counts (the target's are the scheduler's), and their blocks come from a KV manager of
its own over the draft's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from governor.engine.attention import PagedAttention
from governor.engine.kv.cache import allocate_kv_cache
from governor.engine.kv.kv_manager import KVManager
from governor.engine.models.checkpoint import iter_weights
from governor.engine.models.llama import CausalLM
from governor.engine.models.model_config import ModelConfig, load_model_config
from governor.engine.runner import ModelRunner
from governor.engine.sampler import filtered_logits
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.sequence import Sequence


@dataclass
class _DraftState:
    view: Sequence  # the draft's copy of the sequence: same prompt list, outputs + pending drafts
    known: int  # tokens of the real sequence the draft has seen (its KV holds them)


class DraftModelProposer:
    """Proposes up to k tokens per sequence with a draft model; returns the draft distributions too, so
    rejection sampling can use q (greedy requests get argmax drafts and no distribution)."""

    def __init__(self, model_dir: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int, max_num_tokens: int,
                 attention_backend: str) -> None:
        self.config = load_model_config(model_dir)
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.vocab_size}) differs from the target's "
                             f"({target.vocab_size}); a draft must share the target's tokenizer")
        self.model = CausalLM(self.config, dtype, device, max_model_len,
                              PagedAttention(attention_backend, self.config.head_dim ** -0.5))
        self.model.load_weights(iter_weights(model_dir))
        self.kv = KVManager(num_blocks, block_size)
        self.kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, max_num_tokens, max_num_seqs,
                                  max_model_len, device)
        self.states: dict[str, _DraftState] = {}

    def _state(self, seq: Sequence) -> _DraftState:
        st = self.states.get(seq.request_id)
        if st is None:
            view = Sequence(seq.request_id, seq.arrival, seq.prompt_token_ids, seq.params, seq.max_tokens)
            st = self.states[seq.request_id] = _DraftState(view, 0)
        st.view.output_token_ids = list(seq.output_token_ids)
        return st

    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Drafts (and, for sampled requests, their distributions [k, V]) for each scheduled decode.

        The first forward catches each draft up on the tokens it has not seen, within the runner's token
        budget; a sequence that cannot catch up fully this step advances its draft cache and proposes
        nothing (it proposes from a later step on)."""
        results: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in scheduled]
        budget = self.runner.input_ids.shape[0]
        catch_up, proposing = [], []
        for i, s in enumerate(scheduled):
            st = self._state(s.seq)
            # The draft needs KV for every known token plus k - 1 drafts; without room it proposes nothing.
            if s.num_spec == 0 or budget == 0 or not self.kv.reserve(st.view, s.seq.num_tokens + s.num_spec - 1):
                continue
            st.view.num_computed_tokens = st.known
            n = min(st.view.num_tokens - st.known, budget)
            budget -= n
            catch_up.append(ScheduledSeq(st.view, n))
            if st.known + n == st.view.num_tokens:
                proposing.append((i, s, st))
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in proposing}
        batch = catch_up
        rounds = max((s.num_spec for _, s, _ in proposing), default=1 if catch_up else 0)
        for j in range(rounds):
            if not batch:
                break
            logits = self.runner.execute(SchedulerOutput(batch))  # rows: the proposing entries, in order
            for item in batch:
                item.seq.num_computed_tokens += item.num_new_tokens
            for view in (b.seq for b in batch if b.seq.num_computed_tokens < b.seq.num_tokens):
                self.states[view.request_id].known = view.num_computed_tokens  # a partial catch-up
            live = proposing
            if not live:
                break  # only partial catch-ups this step
            params = [s.seq.params for _, s, _ in live]
            probs = filtered_logits(logits, params).softmax(dim=1)
            greedy = logits.argmax(dim=1)
            for row, (i, s, st) in enumerate(live):
                if s.seq.params.greedy:
                    token = int(greedy[row])
                else:
                    token = int(torch.multinomial(probs[row], 1, generator=s.seq.generator))
                    q_rows[i].append(probs[row])
                results[i][0].append(token)
                st.view.output_token_ids.append(token)
            proposing = [(i, s, st) for i, s, st in live if s.num_spec > j + 1]
            batch = [ScheduledSeq(st.view, 1) for _, _, st in proposing]  # feed the draft just made
        for i, drafts_q in q_rows.items():
            if drafts_q:
                results[i] = (results[i][0], torch.stack(drafts_q))
        for i, s in enumerate(scheduled):  # the KV now covers the known tokens and all drafts but the last
            if results[i][0]:
                self.states[s.seq.request_id].known = s.seq.num_tokens
        return results

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After verification: keep the draft KV of the accepted drafts only."""
        st = self.states.get(seq.request_id)
        if st is None:
            return
        # st.known counted the pre-step tokens; the draft also wrote drafts 1..num_drafts-1.
        st.known = st.known + min(num_accepted, max(num_drafts - 1, 0))
        self.kv.trim(st.view, st.known)

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop its draft KV."""
        st = self.states.pop(seq.request_id, None)
        if st is not None:
            self.kv.free(st.view)
