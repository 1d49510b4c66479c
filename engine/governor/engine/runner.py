"""Tensors in, logits out: flattens a scheduled step into preallocated buffers and runs the model."""

from __future__ import annotations

import numpy as np
import torch

from governor.engine.attention import AttentionMetadata
from governor.engine.models.llama import CausalLM
from governor.engine.scheduler import SchedulerOutput


class ModelRunner:
    """Owns the step buffers, sized once for the hard caps (max tokens, max seqs, max blocks per seq).

    Host-side staging arrays are filled with numpy and copied to the device in one transfer per buffer,
    so the shapes a step sees depend only on the batch, never on Python-side allocation.
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_model_len: int, device: torch.device,
                 max_spec_tokens: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        pin = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        def dev(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.h_input_ids = host(max_num_tokens, dtype=torch.int64)
        self.h_positions = host(max_num_tokens, dtype=torch.int64)
        self.h_slots = host(max_num_tokens, dtype=torch.int64)
        self.h_block_tables = host(max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.h_seq_lens = host(max_num_seqs, dtype=torch.int32)
        self.h_qsl = host(max_num_seqs + 1, dtype=torch.int32)
        self.max_logits = max_num_seqs * (1 + max_spec_tokens)
        self.h_logits_idx = host(self.max_logits, dtype=torch.int64)
        self.input_ids = dev(max_num_tokens, dtype=torch.int64)
        self.positions = dev(max_num_tokens, dtype=torch.int64)
        self.slots = dev(max_num_tokens, dtype=torch.int64)
        self.block_tables = dev(max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = dev(max_num_seqs, dtype=torch.int32)
        self.qsl = dev(max_num_seqs + 1, dtype=torch.int32)
        self.prefill_qsl = dev(max_num_seqs + 1, dtype=torch.int32)
        self.logits_idx = dev(self.max_logits, dtype=torch.int64)

    def prepare(self, out: SchedulerOutput) -> tuple[int, int, AttentionMetadata]:
        """Fill the buffers for this step. Returns (num_tokens, num_logit_rows, metadata)."""
        ids, pos, slots = self.h_input_ids.numpy(), self.h_positions.numpy(), self.h_slots.numpy()
        bt, lens, qsl = self.h_block_tables.numpy(), self.h_seq_lens.numpy(), self.h_qsl.numpy()
        lidx = self.h_logits_idx.numpy()
        bs = self.block_size
        t = 0
        n_sample = 0
        num_decodes = 0
        max_q = 0
        qsl[0] = 0
        for i, s in enumerate(out.scheduled):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            p = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            known = n - len(s.draft_tokens)
            ids[t:t + known] = seq.token_ids(start, start + known)
            ids[t + known:t + n] = s.draft_tokens
            pos[t:t + n] = p
            slots[t:t + n] = table[p // bs] * bs + p % bs
            bt[i, :len(table)] = table
            lens[i] = start + n
            t += n
            qsl[i + 1] = t
            max_q = max(max_q, n)
            if n == 1 and num_decodes == i:
                num_decodes += 1
            m = s.num_logits
            lidx[n_sample:n_sample + m] = np.arange(t - m, t)
            n_sample += m
        b = len(out.scheduled)
        self._copy(self.input_ids, self.h_input_ids, t)
        self._copy(self.positions, self.h_positions, t)
        self._copy(self.slots, self.h_slots, t)
        self._copy(self.block_tables, self.h_block_tables, b)
        self._copy(self.seq_lens, self.h_seq_lens, b)
        self._copy(self.qsl, self.h_qsl, b + 1)
        self._copy(self.logits_idx, self.h_logits_idx, n_sample)
        nd_tokens = int(qsl[num_decodes])
        torch.sub(self.qsl[num_decodes:b + 1], nd_tokens, out=self.prefill_qsl[:b + 1 - num_decodes])
        meta = AttentionMetadata(
            slot_mapping=self.slots[:t],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.qsl[:b + 1],
            num_decodes=num_decodes,
            num_decode_tokens=nd_tokens,
            max_query_len=max_q,
            prefill_query_start_loc=self.prefill_qsl[:b + 1 - num_decodes],
        )
        return t, n_sample, meta

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
        dst[:n].copy_(src[:n], non_blocking=True)

    def execute(self, out: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        """Run one step. Returns fp32 logits [rows, V] in schedule order: one row per sampling sequence,
        plus one per draft token of a speculative decode; or every scheduled token when `all_logits`."""
        t, n_sample, meta = self.prepare(out)
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)
        if all_logits:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[self.logits_idx[:n_sample]])
