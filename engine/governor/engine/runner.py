"""Tensors in, logits out: flattens a scheduled step into preallocated buffers and runs the model."""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass

import numpy as np
import torch

from governor.engine.attention import AttentionMetadata
from governor.engine.cuda_graphs import CudaGraphs, GraphKey, capture_sizes
from governor.engine.models.llama import CausalLM
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.tp.group import TPGroup

# Control messages from rank 0 to tensor-parallel workers, int64: a header [command, *StepShape] then, for
# a step, the staged buffers it uses (`_payload_parts`). The first broadcast has a fixed size and carries
# the header and as much payload as fits, so a typical decode step costs one broadcast; a second one
# carries the rest of a larger step.
_SHUTDOWN, _STEP = 0, 1
_HEADER_LEN = 7
_FIRST_MESSAGE_LEN = 2048


@dataclass
class StepShape:
    """The sizes of a staged step: with the staged host buffers, all a forward needs."""

    num_tokens: int
    num_seqs: int
    num_decodes: int  # leading sequences with one query token
    max_query_len: int
    num_logits: int
    table_width: int  # block-table columns any sequence of the step uses


class ModelRunner:
    """Owns the step buffers, sized once for the hard caps (max tokens, max seqs, max blocks per seq).

    Host-side staging arrays are filled with numpy and copied to the device in one transfer per buffer,
    so the shapes a step sees depend only on the batch, never on Python-side allocation.

    With a tensor-parallel group (`tp`, size > 1) the runner on rank 0 leads: after staging a step it
    broadcasts the staged buffers over the control group, and each worker's runner (`follow`) receives
    them into its own buffers and runs the same forward on its shard. Only rank 0 computes logits.

    After `capture_cuda_graphs`, a step whose sequences each have few query tokens (a decode, or a
    speculative verification) is padded to the next captured batch size and replayed from a CUDA graph;
    every other step runs eagerly. Padding rows write their KV nowhere (slot -1) and attend to nothing
    (context length 0), so they never touch the cache.
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_model_len: int, device: torch.device,
                 max_spec_tokens: int = 0, tp: TPGroup | None = None) -> None:
        self.model = model
        self.tp = tp if tp is not None and tp.size > 1 else None
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
        # Marks the last step's host-to-device copies: pinned buffers are refilled only once it is done.
        self._uploaded: torch.cuda.Event | None = None
        # Invariant: _row_tables[i] == h_block_tables[i, :len(_row_tables[i])]: what `_stage_block_tables`
        # last wrote to row i (the rest of the row is stale and never read: seq_lens bounds it).
        self._row_tables: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.graphs: CudaGraphs | None = None
        self._verify_query_len = 1 + max_spec_tokens  # query tokens per sequence of a verification graph

    def _wait_for_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def stage(self, out: SchedulerOutput) -> StepShape:
        """Fill the host buffers for this step: block tables, then the leading single-token rows
        (decodes, the common case) batched, then every other row (prefill chunks, verifications)."""
        self._wait_for_uploads()
        scheduled = out.scheduled
        num_decodes = 0
        while num_decodes < len(scheduled) and scheduled[num_decodes].num_new_tokens == 1:
            num_decodes += 1
        width = self._stage_block_tables(scheduled)
        ids, pos, slots = self.h_input_ids.numpy(), self.h_positions.numpy(), self.h_slots.numpy()
        lens, qsl, lidx = self.h_seq_lens.numpy(), self.h_qsl.numpy(), self.h_logits_idx.numpy()
        qsl[0] = 0
        n_sample = self._stage_decodes(scheduled[:num_decodes])
        bs = self.block_size
        t = num_decodes
        max_q = 1 if num_decodes else 0
        for i in range(num_decodes, len(scheduled)):
            s = scheduled[i]
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            p = np.arange(start, start + n)
            known = n - len(s.draft_tokens)
            ids[t:t + known] = seq.token_ids(start, start + known)
            ids[t + known:t + n] = s.draft_tokens
            pos[t:t + n] = p
            slots[t:t + n] = np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs
            lens[i] = start + n
            t += n
            qsl[i + 1] = t
            max_q = max(max_q, n)
            m = s.num_logits
            lidx[n_sample:n_sample + m] = np.arange(t - m, t)
            n_sample += m
        return StepShape(t, len(scheduled), num_decodes, max_q, n_sample, width)

    def _stage_block_tables(self, scheduled: list[ScheduledSeq]) -> int:
        """Write each row's block table where it differs from what the row already holds; the widest.

        Rewriting every table each step costs a list-to-array conversion per sequence, yet a decoding
        sequence's table gains one block every `block_size` steps. So each row remembers the table it
        holds (`_row_tables`) and is written only where the table changed: nothing when equal (a C-level
        list compare), the new tail when the table only grew, the whole table otherwise (another sequence
        took the row, or blocks were trimmed and replaced). Comparing contents, not lengths or ids, keeps
        this exact whatever the scheduler or a proposer did to the list in between."""
        bt = self.h_block_tables.numpy()
        rows = self._row_tables
        width = 0
        for i, s in enumerate(scheduled):
            table = s.seq.block_table
            n = len(table)
            width = max(width, n)
            row = rows[i]
            if table == row:
                continue
            k = len(row)
            if n > k and table[:k] == row:
                bt[i, k:n] = table[k:]
                row.extend(table[k:])
            else:
                bt[i, :n] = table
                rows[i] = list(table)
        return width

    def _stage_decodes(self, decodes: list[ScheduledSeq]) -> int:
        """Fill rows 0..len(decodes) - 1, each one query token, with a few array operations instead of
        per-row ones; returns how many of them sample (their logits come first, in row order)."""
        n = len(decodes)
        if n == 0:
            return 0
        bs = self.block_size
        positions, tokens, blocks, sampling = [], [], [], []
        for i, s in enumerate(decodes):
            seq = s.seq
            p = seq.num_computed_tokens
            positions.append(p)
            tokens.append(seq.token_ids(p, p + 1)[0])
            blocks.append(seq.block_table[p // bs])
            if p + 1 == seq.num_tokens:  # ScheduledSeq.samples for a row of one known token
                sampling.append(i)
        pos = self.h_positions.numpy()[:n]
        pos[:] = positions
        self.h_input_ids.numpy()[:n] = tokens
        self.h_slots.numpy()[:n] = np.asarray(blocks, dtype=np.int64) * bs + pos % bs
        self.h_seq_lens.numpy()[:n] = pos + 1
        self.h_qsl.numpy()[1:n + 1] = np.arange(1, n + 1)
        self.h_logits_idx.numpy()[:len(sampling)] = sampling  # a row's only token is token i
        return len(sampling)

    def _upload(self, shape: StepShape) -> AttentionMetadata:
        """Copy the staged buffers to the device; the step's attention metadata."""
        t, b, num_decodes, n_sample = shape.num_tokens, shape.num_seqs, shape.num_decodes, shape.num_logits
        self._copy(self.input_ids, self.h_input_ids, t)
        self._copy(self.positions, self.h_positions, t)
        self._copy(self.slots, self.h_slots, t)
        self._copy(self.block_tables, self.h_block_tables, b)
        self._copy(self.seq_lens, self.h_seq_lens, b)
        self._copy(self.qsl, self.h_qsl, b + 1)
        self._copy(self.logits_idx, self.h_logits_idx, n_sample)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        nd_tokens = int(self.h_qsl[num_decodes])
        torch.sub(self.qsl[num_decodes:b + 1], nd_tokens, out=self.prefill_qsl[:b + 1 - num_decodes])
        return AttentionMetadata(
            slot_mapping=self.slots[:t],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.qsl[:b + 1],
            num_decodes=num_decodes,
            num_decode_tokens=nd_tokens,
            max_query_len=shape.max_query_len,
            prefill_query_start_loc=self.prefill_qsl[:b + 1 - num_decodes],
        )

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
        dst[:n].copy_(src[:n], non_blocking=True)

    def _forward(self, shape: StepShape) -> torch.Tensor:
        meta = self._upload(shape)
        t = shape.num_tokens
        return self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, meta)

    # --- CUDA graphs ------------------------------------------------------------------------------

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture decode graphs for every ladder size up to `max_num_seqs` (the hard cap), and, with
        speculation, verification graphs of 1 + K_cap query tokens per sequence, largest first. Writes no
        KV and needs no scheduler state; call it once, after the KV cache and fp8 scales are final."""
        if self.graphs is not None:
            raise RuntimeError("CUDA graphs are already captured for this runner")
        if self.tp is not None:
            raise RuntimeError("CUDA graphs are not supported with tensor parallelism; run eagerly")
        max_tokens, max_seqs = self.input_ids.shape[0], self.seq_lens.shape[0]
        keys = [GraphKey(b, q) for q in sorted({1, self._verify_query_len}) if max_tokens >= q
                for b in capture_sizes(min(max_num_seqs, max_seqs, max_tokens // q))]
        self.graphs = graphs = CudaGraphs(self.device)
        for key in sorted(keys, key=lambda k: k.num_tokens, reverse=True):
            # An all-padding step: the uploads stay outside the graph (each replay is preceded by them).
            meta = self._upload(self._pad(StepShape(0, 0, 0, 0, 0, 0), key))
            graphs.capture(key, functools.partial(self.model, self.input_ids[:key.num_tokens],
                                                  self.positions[:key.num_tokens], self.kv_caches, meta))

    def _graph_key(self, shape: StepShape) -> GraphKey | None:
        """The captured graph that can run this step once padded, if any."""
        if self.graphs is None or shape.num_seqs == 0:
            return None
        query_len = 1 if shape.max_query_len == 1 else self._verify_query_len
        if shape.max_query_len > query_len:
            return None
        return self.graphs.padded_key(shape.num_seqs, query_len)

    def _pad(self, shape: StepShape, key: GraphKey) -> StepShape:
        """Fill the staged host buffers past the step's real rows up to `key`'s shape; the padded shape.

        Decode graphs (query_len 1) run every row through the decode kernel; verification graphs run
        every sequence through the varlen kernel, with padding sequences of 0 queries and padding
        tokens that belong to no sequence (their outputs are never read)."""
        self._wait_for_uploads()
        t, b = shape.num_tokens, shape.num_seqs
        t_pad, b_pad = key.num_tokens, key.num_seqs
        self.h_input_ids.numpy()[t:t_pad] = 0
        self.h_positions.numpy()[t:t_pad] = 0
        self.h_slots.numpy()[t:t_pad] = -1
        self.h_seq_lens.numpy()[b:b_pad] = 0
        qsl = self.h_qsl.numpy()
        if key.query_len == 1:
            qsl[b + 1:b_pad + 1] = np.arange(b + 1, b_pad + 1)
            return StepShape(t_pad, b_pad, b_pad, 1, shape.num_logits, shape.table_width)
        qsl[b + 1:b_pad + 1] = t
        return StepShape(t_pad, b_pad, 0, key.query_len, shape.num_logits, shape.table_width)

    def _run(self, shape: StepShape) -> torch.Tensor:
        """Hidden states of the step's tokens [T, hidden]: from a graph when one fits, else eagerly."""
        key = self._graph_key(shape)
        if key is None:
            return self._forward(shape)
        assert self.graphs is not None
        self._upload(self._pad(shape, key))
        return self.graphs.replay(key)[:shape.num_tokens]

    def hidden_states(self, out: SchedulerOutput) -> torch.Tensor:
        """Run a step on this rank alone (never broadcast) and return the final hidden states [T, hidden]:
        for work every rank stages identically by itself, such as fp8 calibration."""
        return self._forward(self.stage(out))

    def execute(self, out: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        """Run one step. Returns fp32 logits [rows, V] in schedule order: one row per sampling sequence,
        plus one per draft token of a speculative decode; or every scheduled token when `all_logits`."""
        shape = self.stage(out)
        if self.tp is not None:
            self._lead(shape)
        hidden = self._run(shape)
        if all_logits:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[self.logits_idx[:shape.num_logits]])

    # --- tensor parallelism: rank 0 leads, workers follow ---------------------------------------

    def _payload_parts(self, shape: StepShape) -> list[np.ndarray]:
        """Views of the staged host buffers a step uses, in payload order."""
        t, b, w = shape.num_tokens, shape.num_seqs, shape.table_width
        return [self.h_input_ids.numpy()[:t], self.h_positions.numpy()[:t], self.h_slots.numpy()[:t],
                self.h_seq_lens.numpy()[:b], self.h_qsl.numpy()[:b + 1], self.h_block_tables.numpy()[:b, :w]]

    def _lead(self, shape: StepShape) -> None:
        """Rank 0: broadcast the staged step to the workers."""
        assert self.tp is not None
        message = np.concatenate([np.array([_STEP, *astuple(shape)], dtype=np.int64),
                                  *(p.ravel() for p in self._payload_parts(shape))])
        first = np.zeros(_FIRST_MESSAGE_LEN, dtype=np.int64)
        head = message[:_FIRST_MESSAGE_LEN]
        first[:head.size] = head
        self.tp.broadcast(torch.from_numpy(first))
        if message.size > _FIRST_MESSAGE_LEN:
            self.tp.broadcast(torch.from_numpy(message[_FIRST_MESSAGE_LEN:]))

    def follow(self) -> bool:
        """A worker's half of one step: receive rank 0's staged step and run the forward on this shard.
        Returns False when rank 0 sent the shutdown instead."""
        assert self.tp is not None
        first = torch.empty(_FIRST_MESSAGE_LEN, dtype=torch.int64)
        self.tp.broadcast(first)
        command, *sizes = first[:_HEADER_LEN].tolist()
        if command == _SHUTDOWN:
            return False
        shape = StepShape(*sizes)
        parts = self._payload_parts(shape)
        size = _HEADER_LEN + sum(p.size for p in parts)
        message = first
        if size > _FIRST_MESSAGE_LEN:
            rest = torch.empty(size - _FIRST_MESSAGE_LEN, dtype=torch.int64)
            self.tp.broadcast(rest)
            message = torch.cat([first, rest])
        self._wait_for_uploads()
        for i in range(shape.num_seqs):  # the payload overwrites these rows' block tables
            self._row_tables[i] = []
        flat, at = message.numpy(), _HEADER_LEN
        for p in parts:
            p[...] = flat[at:at + p.size].reshape(p.shape)
            at += p.size
        self._forward(shape)
        return True


def broadcast_shutdown(tp: TPGroup) -> None:
    """Rank 0: tell every worker runner to leave its step loop (`follow` returns False)."""
    tp.broadcast(torch.zeros(_FIRST_MESSAGE_LEN, dtype=torch.int64))  # command 0
