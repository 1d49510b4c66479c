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
from governor.engine.models.model_config import ModelConfig, load_model_config, with_quantization
from governor.engine.runner import ModelRunner
from governor.engine.sampler import LogitFilter
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.sequence import Sequence
from governor.kernels.argmax import argmax_rows


@dataclass
class _DraftState:
    view: Sequence  # the draft's copy of the sequence: same prompt list, outputs + pending drafts
    known: int  # tokens of the real sequence the draft has seen (its KV holds them)


@dataclass
class DeviceDrafts:
    """A step's drafts before the host has read them: the draft's rounds are queued on the device, and the
    verification can be queued behind them, taking its draft token ids from `tokens` (`ModelRunner.execute`'s
    drafts), so the host does not wait for the draft before launching it. `resolve` reads the drafts once (the
    host's one wait for them, which then also covers the verification's forward) and settles the proposer's state.

    tokens: [proposing sequences, rounds] int64 on the device; `offsets[i]` is scheduled entry i's offset in
    `tokens.view(-1)` (None: no drafts), `counts[i]` its number of drafts, `q[i]` its draft distributions [k, V]
    for a sampled request (None otherwise)."""

    tokens: torch.Tensor
    offsets: list[int | None]
    counts: list[int]
    q: list[torch.Tensor | None]
    _settle: list[tuple[int, int, _DraftState, Sequence]]  # (scheduled index, row, state, real sequence)

    def resolve(self) -> list[list[int]]:
        """The drafts of each scheduled entry, on the host, with the proposer's state settled on them: call it once."""
        host = self.tokens.tolist()  # the one wait for the device
        out: list[list[int]] = [[] for _ in self.counts]
        for i, r, st, seq in self._settle:
            out[i] = host[r][:self.counts[i]]
            st.view.output_token_ids.extend(out[i])
            st.known = seq.num_tokens  # the KV now covers the known tokens and all drafts but the last
        return out


class DraftModelProposer:
    """Proposes up to k tokens per sequence with a draft model; returns the draft distributions too, so
    rejection sampling can use q (greedy requests get argmax drafts and no distribution)."""

    def __init__(self, model_dir: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int, max_num_tokens: int,
                 attention_backend: str, max_spec_tokens: int = 0, quantization: str | None = None) -> None:
        # The draft's weights as the target's would be under `quantization` (fp8 at load, or the checkpoint's own).
        self.config = with_quantization(load_model_config(model_dir), quantization)
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.vocab_size}) differs from the target's "
                             f"({target.vocab_size}); a draft must share the target's tokenizer")
        self.model = CausalLM(self.config, dtype, device, max_model_len,
                              PagedAttention(attention_backend, self.config.head_dim ** -0.5))
        self.model.load_weights(iter_weights(model_dir))
        self.kv = KVManager(num_blocks, block_size)
        self.kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, dtype, device)
        # Graphs of 1 + max_spec_tokens tokens a sequence serve the catch-up forwards once prompts are in: a
        # sequence then catches up on the tokens the last step accepted, at most K + 1.
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, max_num_tokens, max_num_seqs,
                                  max_model_len, device, max_spec_tokens)
        self.states: dict[str, _DraftState] = {}

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture the draft's decode graphs (its rounds after the first) and catch-up graphs of up to K + 1
        tokens a sequence, on the batch-size ladder up to `max_num_seqs`, as the target's runner does."""
        self.runner.capture_cuda_graphs(max_num_seqs)

    def _state(self, seq: Sequence) -> _DraftState:
        st = self.states.get(seq.request_id)
        if st is None:
            view = Sequence(seq.request_id, seq.arrival, seq.prompt_token_ids, seq.params, seq.max_tokens)
            st = self.states[seq.request_id] = _DraftState(view, 0)
        st.view.output_token_ids = list(seq.output_token_ids)
        return st

    def propose(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Drafts (and, for sampled requests, their distributions [k, V]) for each scheduled decode, on the host
        (`launch` and its `resolve`)."""
        launched = self.launch(scheduled)
        if launched is None:
            return [([], None) for _ in scheduled]
        return list(zip(launched.resolve(), launched.q, strict=True))

    def launch(self, scheduled: list[ScheduledSeq]) -> DeviceDrafts | None:
        """Queue the draft's forwards for each scheduled decode and return its drafts on the device (None: no
        sequence proposes this step). Every proposing sequence gets exactly `num_spec` drafts.

        The first forward catches each draft up on the tokens it has not seen, within the runner's token
        budget; a sequence that cannot catch up fully this step advances its draft cache and proposes
        nothing (it proposes from a later step on). The later rounds are fed decodes (`ScheduledSeq.fed_from`):
        each feeds the drafts the round before sampled, on the device, and samples on the device (argmax, or the
        exponential race `torch.multinomial` runs, with the request's generator, without its host-side check), so
        the host waits for the device once, for all the drafts, in `DeviceDrafts.resolve`."""
        budget = self.runner.input_ids.shape[0]
        proposing: list[tuple[int, ScheduledSeq, _DraftState, ScheduledSeq]] = []
        partial: list[tuple[_DraftState, ScheduledSeq]] = []
        for i, s in enumerate(scheduled):
            st = self._state(s.seq)
            # The draft needs KV for every known token plus k - 1 drafts; without room it proposes nothing.
            if s.num_spec == 0 or budget == 0 or not self.kv.reserve(st.view, s.seq.num_tokens + s.num_spec - 1):
                continue
            st.view.num_computed_tokens = st.known
            n = min(st.view.num_tokens - st.known, budget)
            budget -= n
            if st.known + n == st.view.num_tokens:
                proposing.append((i, s, st, ScheduledSeq(st.view, n)))
            else:
                partial.append((st, ScheduledSeq(st.view, n)))
        if not proposing and not partial:
            return None
        # Most drafts first: the rows still drafting in round j are then the first ones of round j - 1.
        proposing.sort(key=lambda e: -e[1].num_spec)
        batch = [e[3] for e in proposing] + [item for _, item in partial]
        logits = self.runner.execute(SchedulerOutput(batch))  # rows: the proposing entries, in order
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        for st, item in partial:
            st.known = item.seq.num_computed_tokens
        if not proposing:
            return None
        sampled = [r for r, e in enumerate(proposing) if not e[1].seq.params.greedy]
        logit_filter = LogitFilter([e[1].seq.params for e in proposing], logits.device, logits.shape[1]) \
            if sampled else None
        live = [sum(1 for e in proposing if e[1].num_spec > j) for j in range(proposing[0][1].num_spec)]
        rounds: list[torch.Tensor] = []  # round j's drafts [live[j]], on the device
        q_rows: dict[int, list[torch.Tensor]] = {r: [] for r in sampled}
        for j, m in enumerate(live):
            if j:
                fed = [ScheduledSeq(e[2].view, 1, fed_from=r) for r, e in enumerate(proposing[:m])]
                logits = self.runner.execute(SchedulerOutput(fed), feed=rounds[-1])
                for item in fed:
                    item.seq.num_computed_tokens += 1
            tokens = argmax_rows(logits[:m])
            if logit_filter is not None:
                probs = logit_filter(logits[:m]).softmax(dim=1)
                for r in (r for r in sampled if r < m):
                    race = torch.empty_like(probs[r]).exponential_(generator=proposing[r][1].seq.generator)
                    tokens[r] = (probs[r] / race).argmax()
                    q_rows[r].append(probs[r])
            rounds.append(tokens)
        drafts = torch.zeros(len(proposing), len(live), dtype=torch.int64, device=logits.device)
        for j, tokens in enumerate(rounds):
            drafts[:live[j], j] = tokens
        offsets: list[int | None] = [None] * len(scheduled)
        counts = [0] * len(scheduled)
        q_out: list[torch.Tensor | None] = [None] * len(scheduled)
        for r, (i, s, _, _) in enumerate(proposing):
            offsets[i], counts[i] = r * len(live), s.num_spec
            q = q_rows.get(r)
            q_out[i] = torch.stack(q) if q else None
        return DeviceDrafts(drafts, offsets, counts, q_out,
                            [(i, r, st, s.seq) for r, (i, s, st, _) in enumerate(proposing)])

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
