"""Tensors in, logits out: flattens a scheduled step into preallocated buffers and runs the model."""

from __future__ import annotations

import functools
import math
from dataclasses import astuple, dataclass

import numpy as np
import torch

from governor.engine.attention import AttentionMetadata
from governor.engine.cuda_graphs import CudaGraphs, GraphKey, capture_sizes
from governor.engine.models.llama import CausalLM
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.tp.group import TPGroup

# Control messages from rank 0 to tensor-parallel workers, int64: a header [command, *StepShape, *_StepExtras]
# then, for a step, what a worker cannot derive (`_lead`): the decode rows' tokens and positions (their slots,
# context lengths and query starts follow from those and the block tables), every other row in full, the
# logits rows, and the block-table entries that changed since the last step. The first broadcast has a fixed
# size and carries the header and as much payload as fits, so a decode step costs one broadcast; a second one
# carries the rest of a larger step.
_SHUTDOWN, _STEP = 0, 1
_HEADER_LEN = 11  # command, the 6 StepShape fields, the 4 _StepExtras fields
_FIRST_MESSAGE_LEN = 1024

_ALIGN = 256  # byte alignment of each field in the staging buffers (as the CUDA allocator aligns tensors)
# A step's upload copies the used part of each field; neighbouring parts are copied together, unused gap
# included, when the gap is at most this many bytes: a separate copy costs the host about as long as
# ~256 KiB takes over PCIe (a few microseconds). So a decode step is one copy.
_MERGE_GAP_BYTES = 256 * 1024
# A step's block tables go up as whole rows (max_blocks_per_seq entries each) unless the columns past the step's
# widest table would add at least this many bytes: then only its [seqs, width] part is packed on the host, copied
# (a second copy) and scattered into the rows on the device. The same trade-off as _MERGE_GAP_BYTES: a copy costs the
# host about what that many bytes cost over PCIe. qwen3-0.6b's default 40,960-token context made the whole rows 2.6
# MB a step at batch 256, ~50 us of copy on the compute stream by PCIe arithmetic; the effect on offline throughput
# is within the spread of runs (docs/design/step-pipeline.md).
_PACK_TABLES_MIN_SAVED_BYTES = _MERGE_GAP_BYTES


@dataclass
class StepShape:
    """The sizes of a staged step: with the staged host buffers, all a forward needs."""

    num_tokens: int
    num_seqs: int
    num_decodes: int  # leading sequences with one query token
    max_query_len: int
    num_logits: int
    table_width: int  # block-table columns any sequence of the step uses


@dataclass
class _StepExtras:
    """The rest of a step's header: how its logits are computed (or only their argmax), the length of the fed
    tokens (0: not fed) and of the block-table changes."""

    all_logits: int
    argmax: int
    feed_len: int
    deltas_len: int


@dataclass
class _HostArrays:
    """numpy views of the staged host buffers (what `stage` fills), kept to skip a .numpy() per use."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    qsl: np.ndarray
    prefill_qsl: np.ndarray
    logits_idx: np.ndarray
    feed_rows: np.ndarray
    draft_dst: np.ndarray
    draft_src: np.ndarray


class ModelRunner:
    """Owns the step buffers, sized once for the hard caps (max tokens, max seqs, max blocks per seq).

    Host-side staging arrays are filled with numpy and copied to the device together (they share one
    buffer: one copy, more only across large unused gaps), so the shapes a step sees depend only on the
    batch, never on Python-side allocation.

    With a tensor-parallel group (`tp`, size > 1) the runner on rank 0 leads: after staging a step it
    broadcasts what a worker needs of them over the control group, and each worker's runner (`follow`) rebuilds
    the same staged buffers and runs the same forward on its shard, graphs included, and the same logits (each
    rank computes its vocabulary rows'; all gather them). A fed step's tokens go from rank 0's device to the
    workers' over the compute group.

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
        self.max_logits = max_num_seqs * (1 + max_spec_tokens)
        # Every staged field lives in one host buffer (pinned on CUDA) mirrored by one device buffer of the
        # same layout: a step uploads what it uses with one copy (`_upload_ranges`), and each field's device
        # tensor is a fixed view of the device buffer, the address captured CUDA graphs read.
        fields = [("seq_lens", torch.int32, (max_num_seqs,)), ("qsl", torch.int32, (max_num_seqs + 1,)),
                  ("prefill_qsl", torch.int32, (max_num_seqs + 1,)), ("logits_idx", torch.int64, (self.max_logits,)),
                  ("feed_rows", torch.int64, (max_num_seqs,)), ("input_ids", torch.int64, (max_num_tokens,)),
                  ("positions", torch.int64, (max_num_tokens,)),
                  ("slots", torch.int64, (max_num_tokens,)),
                  # A step uses whole rows, so the rows it leaves unused are never copied.
                  ("block_tables", torch.int32, (max_num_seqs, self.max_blocks_per_seq)),
                  # A verification's drafts still on the device (`DeviceDrafts`): where each goes among the step's
                  # token ids, and where it is in the flattened drafts. After the tables, so that steps without
                  # them upload the span they always did.
                  ("draft_dst", torch.int64, (max_num_seqs * max_spec_tokens,)),
                  ("draft_src", torch.int64, (max_num_seqs * max_spec_tokens,))]
        self.field_offsets: dict[str, int] = {}
        size = 0
        for name, dtype, shape in fields:
            self.field_offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.h_buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        # A step's block tables packed to its widest table (`_upload`), on the host and on the device; allocated
        # only where whole rows can be large enough for packing to pay.
        n_entries = max_num_seqs * self.max_blocks_per_seq
        self.h_packed_tables: np.ndarray | None = None
        self.packed_tables: torch.Tensor | None = None
        if 4 * n_entries >= _PACK_TABLES_MIN_SAVED_BYTES:
            self.h_packed_tables = torch.zeros(n_entries, dtype=torch.int32, pin_memory=pin).numpy()
            self.packed_tables = torch.zeros(n_entries, dtype=torch.int32, device=device)

        def view(buf: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            start = self.field_offsets[name]
            return buf[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

        # Device tensors by field (what the model and graphs read); `host` holds numpy views of the host side
        # (what `stage` fills).
        dev = {f[0]: view(self.buffer, *f) for f in fields}
        self.input_ids, self.positions, self.slots = dev["input_ids"], dev["positions"], dev["slots"]
        self.block_tables, self.seq_lens, self.qsl = dev["block_tables"], dev["seq_lens"], dev["qsl"]
        self.prefill_qsl, self.logits_idx, self.feed_rows = dev["prefill_qsl"], dev["logits_idx"], dev["feed_rows"]
        self.draft_dst, self.draft_src = dev["draft_dst"], dev["draft_src"]
        self._num_device_drafts = 0  # drafts the staged step takes from the device (`stage`)
        self.host = _HostArrays(**{f[0]: view(self.h_buffer, *f).numpy() for f in fields})
        self._iota = np.arange(max_num_seqs + 1)  # sliced instead of a new arange per step
        # Marks the last step's host-to-device copies: pinned buffers are refilled only once it is done.
        self._uploaded: torch.cuda.Event | None = None
        # Invariant: _row_tables[i] == host.block_tables[i, :len(_row_tables[i])]: what `_stage_block_tables`
        # last wrote to row i (the rest of the row is stale and never read: seq_lens bounds it).
        self._row_tables: list[list[int]] = [[] for _ in range(max_num_seqs)]
        # Rank 0 of several: this step's block-table writes, flattened [row, start, n, *entries] per write, which
        # the workers apply to their copies of the host tables (so those equal rank 0's wherever a step reads).
        self._table_deltas: list[int] = []
        # A worker's copy of a fed step's tokens (rank 0's previous sampled tokens).
        self._feed = (torch.zeros(self.max_logits, dtype=torch.int64, device=device)
                      if self.tp is not None and self.tp.rank > 0 else None)
        self.graphs: CudaGraphs | None = None
        self._verify_query_len = 1 + max_spec_tokens  # query tokens per sequence of a verification graph

    def _wait_for_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def stage(self, out: SchedulerOutput) -> StepShape:
        """Fill the host buffers for this step: block tables, then the leading single-token rows
        (decodes, the common case) batched, then every other row (prefill chunks, verifications).
        A step of fed decodes (`ScheduledSeq.fed_from`) is staged by `_stage_fed`."""
        self._wait_for_uploads()
        self._num_device_drafts = 0
        scheduled = out.scheduled
        if scheduled and scheduled[0].fed_from is not None:
            return self._stage_fed(scheduled)
        num_decodes = 0
        while num_decodes < len(scheduled) and scheduled[num_decodes].num_new_tokens == 1:
            num_decodes += 1
        width = self._stage_block_tables(scheduled)
        h = self.host
        ids, pos, slots, lens, qsl, lidx = h.input_ids, h.positions, h.slots, h.seq_lens, h.qsl, h.logits_idx
        qsl[0] = 0
        n_sample = self._stage_decodes(scheduled[:num_decodes])
        bs = self.block_size
        t = num_decodes
        num_fed = 0
        max_q = 1 if num_decodes else 0
        for i in range(num_decodes, len(scheduled)):
            s = scheduled[i]
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            p = np.arange(start, start + n)
            known = n - len(s.draft_tokens)
            ids[t:t + known] = seq.token_ids(start, start + known)
            if s.draft_src is None:
                ids[t + known:t + n] = s.draft_tokens
            elif n > known:  # the drafts' values are on the device: `_upload` copies them in
                d = n - known
                h.draft_dst[num_fed:num_fed + d] = np.arange(t + known, t + n)
                h.draft_src[num_fed:num_fed + d] = np.arange(s.draft_src, s.draft_src + d)
                num_fed += d
            pos[t:t + n] = p
            slots[t:t + n] = np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs
            lens[i] = start + n
            t += n
            qsl[i + 1] = t
            max_q = max(max_q, n)
            m = s.num_logits
            lidx[n_sample:n_sample + m] = np.arange(t - m, t)
            n_sample += m
        self._num_device_drafts = num_fed
        return StepShape(t, len(scheduled), num_decodes, max_q, n_sample, width)

    def _stage_block_tables(self, scheduled: list[ScheduledSeq]) -> int:
        """Write each row's block table where it differs from what the row already holds; the widest.

        Rewriting every table each step costs a list-to-array conversion per sequence, yet a decoding
        sequence's table gains one block every `block_size` steps. So each row remembers the table it
        holds (`_row_tables`) and is written only where the table changed: nothing when equal (a C-level
        list compare), the new tail when the table only grew, the whole table otherwise (another sequence
        took the row, or blocks were trimmed and replaced). Comparing contents, not lengths or ids, keeps
        this exact whatever the scheduler or a proposer did to the list in between."""
        bt = self.host.block_tables
        rows = self._row_tables
        deltas = self._table_deltas if self.tp is not None else None
        if deltas is not None:
            deltas.clear()
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
                k = 0
                bt[i, :n] = table
                rows[i] = list(table)
            if deltas is not None:
                deltas += (i, k, n - k, *table[k:])
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
        h = self.host
        self._write_decode_rows(positions, blocks)
        h.input_ids[:n] = tokens
        h.logits_idx[:len(sampling)] = sampling  # a row's only token is token i
        return len(sampling)

    def _write_decode_rows(self, positions: list[int] | np.ndarray, blocks: list[int] | np.ndarray) -> None:
        """Rows 0..n-1 as one-token rows at `positions` (`blocks`: the block of each): their positions, KV
        slots, context lengths and query starts."""
        n, bs, h = len(positions), self.block_size, self.host
        pos = h.positions[:n]
        pos[:] = positions
        h.slots[:n] = np.asarray(blocks, dtype=np.int64) * bs + pos % bs
        h.seq_lens[:n] = pos + 1
        h.qsl[1:n + 1] = self._iota[1:n + 1]

    def _stage_fed(self, scheduled: list[ScheduledSeq]) -> StepShape:
        """Stage a step of fed decodes: every row one query token at the sequence's next position (its
        computed count: the token the step before samples for it), every row sampling. The token ids are
        not staged: `feed_rows` says which row of the previous step's sampled tokens each row takes, and
        `_upload` copies them on the device."""
        n = len(scheduled)
        width = self._stage_block_tables(scheduled)
        bs = self.block_size
        positions, blocks, rows = [], [], []
        for s in scheduled:
            seq = s.seq
            p = seq.num_computed_tokens
            positions.append(p)
            blocks.append(seq.block_table[p // bs])
            rows.append(s.fed_from)
        h = self.host
        self._write_decode_rows(positions, blocks)
        h.feed_rows[:n] = rows
        h.qsl[0] = 0
        h.logits_idx[:n] = self._iota[:n]
        return StepShape(n, n, n, 1, n, width)

    def _upload(self, shape: StepShape, feed: torch.Tensor | None = None, drafts: torch.Tensor | None = None
                ) -> None:
        """Copy the step's staged fields to the device: one copy of the host buffer's used span (more only
        across a large unused gap). The prefill rows' rebased query starts are derived here, on the host,
        from the final (padded) query starts. With `feed` (a fed step's previous sampled tokens, on the
        device), the real rows' token ids are then gathered from it on the device; with `drafts` (a
        verification's drafts still on the device, `DeviceDrafts.tokens`), the draft rows' token ids are
        copied from it."""
        h, b, nd = self.host, shape.num_seqs, shape.num_decodes
        np.subtract(h.qsl[nd:b + 1], h.qsl[nd], out=h.prefill_qsl[:b + 1 - nd])
        for start, end in self._upload_ranges(shape, feed is not None):
            self.buffer[start:end].copy_(self.h_buffer[start:end], non_blocking=True)
        if self._packs_tables(shape) and b * shape.table_width:
            assert self.h_packed_tables is not None and self.packed_tables is not None
            # Columns past the widest table are left as they are on the device: no sequence reads them.
            n, w = b * shape.table_width, shape.table_width
            np.copyto(self.h_packed_tables[:n].reshape(b, w), h.block_tables[:b, :w])
            self.packed_tables[:n].copy_(torch.from_numpy(self.h_packed_tables[:n]), non_blocking=True)
            self.block_tables[:b, :w].copy_(self.packed_tables[:n].view(b, w), non_blocking=True)
        if self.device.type == "cuda":
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        if feed is not None:
            n = shape.num_logits  # the real rows: every fed row samples (padding rows do not)
            torch.index_select(feed, 0, self.feed_rows[:n], out=self.input_ids[:n])
        d = self._num_device_drafts
        if d:
            if drafts is None:
                raise ValueError("the step was staged with drafts on the device, and none were given")
            self.input_ids.index_copy_(0, self.draft_dst[:d], drafts.view(-1).index_select(0, self.draft_src[:d]))

    def _packs_tables(self, shape: StepShape) -> bool:
        """Whether the step's block tables go up packed to its widest table (`_PACK_TABLES_MIN_SAVED_BYTES`)."""
        saved = 4 * shape.num_seqs * (self.max_blocks_per_seq - shape.table_width)
        return self.packed_tables is not None and saved >= _PACK_TABLES_MIN_SAVED_BYTES

    def _upload_ranges(self, shape: StepShape, fed: bool = False) -> list[tuple[int, int]]:
        """Byte ranges of the staging buffer a step uses, neighbours merged across gaps of at most
        `_MERGE_GAP_BYTES`; the block tables only when they go up as whole rows (`_packs_tables`). `fed`: the
        step's token ids come from `feed_rows` (`_upload`)."""
        t, b = shape.num_tokens, shape.num_seqs
        whole_rows = not self._packs_tables(shape)
        used = (("seq_lens", 4 * b), ("qsl", 4 * (b + 1)), ("prefill_qsl", 4 * (b + 1 - shape.num_decodes)),
                ("logits_idx", 8 * shape.num_logits), ("feed_rows", 8 * shape.num_logits if fed else 0),
                ("input_ids", 8 * t), ("positions", 8 * t),
                ("slots", 8 * t), ("block_tables", 4 * b * self.max_blocks_per_seq if whole_rows else 0),
                ("draft_dst", 8 * self._num_device_drafts), ("draft_src", 8 * self._num_device_drafts))
        ranges: list[tuple[int, int]] = []
        for name, nbytes in used:
            if not nbytes:
                continue
            start = self.field_offsets[name]
            if ranges and start - ranges[-1][1] <= _MERGE_GAP_BYTES:
                ranges[-1] = (ranges[-1][0], start + nbytes)
            else:
                ranges.append((start, start + nbytes))
        return ranges

    def _metadata(self, shape: StepShape) -> AttentionMetadata:
        """The attention metadata of an uploaded step, over the device buffers."""
        t, b, nd = shape.num_tokens, shape.num_seqs, shape.num_decodes
        return AttentionMetadata(
            slot_mapping=self.slots[:t],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.qsl[:b + 1],
            num_decodes=nd,
            num_decode_tokens=int(self.host.qsl[nd]),
            max_query_len=shape.max_query_len,
            prefill_query_start_loc=self.prefill_qsl[:b + 1 - nd],
        )

    def _forward(self, shape: StepShape, feed: torch.Tensor | None = None, drafts: torch.Tensor | None = None
                 ) -> torch.Tensor:
        self._upload(shape, feed, drafts)
        t = shape.num_tokens
        return self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._metadata(shape))

    # --- CUDA graphs ------------------------------------------------------------------------------

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture decode graphs for every ladder size up to `max_num_seqs` (the hard cap), and, with
        speculation, verification graphs of 1 + K_cap query tokens per sequence, largest first. Writes no
        KV and needs no scheduler state; call it once, after the KV cache and fp8 scales are final."""
        if self.graphs is not None:
            raise RuntimeError("CUDA graphs are already captured for this runner")
        max_tokens, max_seqs = self.input_ids.shape[0], self.seq_lens.shape[0]
        keys = [GraphKey(b, q) for q in sorted({1, self._verify_query_len}) if max_tokens >= q
                for b in capture_sizes(min(max_num_seqs, max_seqs, max_tokens // q))]
        self.graphs = graphs = CudaGraphs(self.device)
        for key in sorted(keys, key=lambda k: k.num_tokens, reverse=True):
            # An all-padding step: the uploads stay outside the graph (each replay is preceded by them).
            self._wait_for_uploads()  # the previous capture's upload reads the buffers _pad rewrites
            shape = self._pad(StepShape(0, 0, 0, 0, 0, 0), key)
            self._num_device_drafts = 0
            self._upload(shape)
            meta = self._metadata(shape)
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
        tokens that belong to no sequence (their outputs are never read). Callers have waited for the
        previous upload (`stage` does)."""
        h = self.host
        t, b = shape.num_tokens, shape.num_seqs
        t_pad, b_pad = key.num_tokens, key.num_seqs
        h.input_ids[t:t_pad] = 0
        h.positions[t:t_pad] = 0
        h.slots[t:t_pad] = -1
        h.seq_lens[b:b_pad] = 0
        qsl = h.qsl
        if key.query_len == 1:
            qsl[b + 1:b_pad + 1] = self._iota[b + 1:b_pad + 1]
            return StepShape(t_pad, b_pad, b_pad, 1, shape.num_logits, shape.table_width)
        qsl[b + 1:b_pad + 1] = t
        return StepShape(t_pad, b_pad, 0, key.query_len, shape.num_logits, shape.table_width)

    def _run(self, shape: StepShape, feed: torch.Tensor | None = None, drafts: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Hidden states of the step's tokens [T, hidden]: from a graph when one fits, else eagerly."""
        key = self._graph_key(shape)
        if key is None:
            return self._forward(shape, feed, drafts)
        assert self.graphs is not None
        self._upload(self._pad(shape, key), feed, drafts)
        return self.graphs.replay(key)[:shape.num_tokens]

    def hidden_states(self, out: SchedulerOutput) -> torch.Tensor:
        """Run a step on this rank alone (never broadcast) and return the final hidden states [T, hidden]:
        for work every rank stages identically by itself, such as fp8 calibration. Under tensor parallelism every
        rank must run the same steps this way, so that the ranks' host block tables stay equal (a worker's follow
        builds on them)."""
        return self._forward(self.stage(out))

    def execute(self, out: SchedulerOutput, all_logits: bool = False, feed: torch.Tensor | None = None,
                argmax: bool = False, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step. Returns fp32 logits [rows, V] in schedule order: one row per sampling sequence,
        plus one per draft token of a speculative decode; or every scheduled token when `all_logits`.
        feed: the previous step's sampled tokens on the device, for a step of fed decodes (their rows'
        `fed_from` index it; under tensor parallelism rank 0 sends them to the workers). argmax=True: only each
        row's argmax token id [rows] int64, for a step whose tokens are only argmaxes (`CausalLM.compute_argmax`).
        drafts: the drafts of a verification still on the device (`DeviceDrafts.tokens`), which the sequences whose
        `ScheduledSeq.draft_src` is set take their draft token ids from (one rank only)."""
        if (feed is not None) != bool(out.scheduled and out.scheduled[0].fed_from is not None):
            raise ValueError("a step of fed decodes needs the previous step's sampled tokens, and only it")
        if drafts is not None and self.tp is not None:
            raise ValueError("drafts on the device need one rank: under tensor parallelism they come as token ids")
        shape = self.stage(out)
        if self.tp is not None:
            self._lead(shape, _StepExtras(int(all_logits), int(argmax), 0 if feed is None else feed.numel(),
                                          len(self._table_deltas)), feed)
        return self._logits(shape, self._run(shape, feed, drafts), all_logits, argmax)

    def _logits(self, shape: StepShape, hidden: torch.Tensor, all_logits: bool, argmax: bool) -> torch.Tensor:
        # Staged logits indices increase, so when every token needs logits (a decode step where every row
        # samples) they are 0..T-1: the rows are the hidden states as they are, no gather.
        if not (all_logits or shape.num_logits == shape.num_tokens):
            hidden = hidden[self.logits_idx[:shape.num_logits]]
        return self.model.compute_argmax(hidden) if argmax else self.model.compute_logits(hidden)

    # --- tensor parallelism: rank 0 leads, workers follow ---------------------------------------

    def _payload_parts(self, shape: StepShape, extras: _StepExtras) -> list[np.ndarray]:
        """Views of the staged host buffers a worker cannot derive, in payload order (the block-table changes
        follow them)."""
        t, b, nd, n, h = shape.num_tokens, shape.num_seqs, shape.num_decodes, shape.num_logits, self.host
        fed = extras.feed_len > 0
        return [h.positions[:nd], h.input_ids[:0 if fed else nd], h.feed_rows[:n if fed else 0], h.logits_idx[:n],
                h.input_ids[nd:t], h.positions[nd:t], h.slots[nd:t], h.seq_lens[nd:b], h.qsl[nd + 1:b + 1]]

    def _lead(self, shape: StepShape, extras: _StepExtras, feed: torch.Tensor | None) -> None:
        """Rank 0: send the staged step to the workers (and a fed step's tokens, on the device)."""
        assert self.tp is not None
        message = np.concatenate([np.array([_STEP, *astuple(shape), *astuple(extras)], dtype=np.int64),
                                  *(p.ravel() for p in self._payload_parts(shape, extras)),
                                  np.asarray(self._table_deltas, dtype=np.int64)])
        first = np.zeros(_FIRST_MESSAGE_LEN, dtype=np.int64)
        head = message[:_FIRST_MESSAGE_LEN]
        first[:head.size] = head
        self.tp.broadcast(torch.from_numpy(first))
        if message.size > _FIRST_MESSAGE_LEN:
            self.tp.broadcast(torch.from_numpy(message[_FIRST_MESSAGE_LEN:]))
        if feed is not None:
            self.tp.broadcast_device(feed)

    def follow(self) -> bool:
        """A worker's half of one step: receive rank 0's staged step, rebuild the staged buffers, and run the
        forward and logits on this shard. Returns False when rank 0 sent the shutdown instead."""
        assert self.tp is not None and self._feed is not None
        first = torch.empty(_FIRST_MESSAGE_LEN, dtype=torch.int64)
        self.tp.broadcast(first)
        command, *sizes = first[:_HEADER_LEN].tolist()
        if command == _SHUTDOWN:
            return False
        shape, extras = StepShape(*sizes[:6]), _StepExtras(*sizes[6:])
        parts = self._payload_parts(shape, extras)
        size = _HEADER_LEN + sum(p.size for p in parts) + extras.deltas_len
        message = first
        if size > _FIRST_MESSAGE_LEN:
            rest = torch.empty(size - _FIRST_MESSAGE_LEN, dtype=torch.int64)
            self.tp.broadcast(rest)
            message = torch.cat([first, rest])
        self._wait_for_uploads()
        flat, at = message.numpy(), _HEADER_LEN
        for p in parts:
            p[...] = flat[at:at + p.size].reshape(p.shape)
            at += p.size
        self._apply_table_deltas(flat[at:at + extras.deltas_len])
        nd, h = shape.num_decodes, self.host
        if nd:
            pos = h.positions[:nd]
            self._write_decode_rows(pos, h.block_tables[self._iota[:nd], pos // self.block_size])
        h.qsl[0] = 0
        feed = None
        if extras.feed_len:
            feed = self._feed[:extras.feed_len]
            self.tp.broadcast_device(feed)
        self._logits(shape, self._run(shape, feed), bool(extras.all_logits), bool(extras.argmax))
        return True

    def _apply_table_deltas(self, deltas: np.ndarray) -> None:
        """Write rank 0's block-table changes ([row, start, n, *entries] each) into this worker's host tables."""
        bt, at = self.host.block_tables, 0
        while at < deltas.size:
            row, start, n = (int(v) for v in deltas[at:at + 3])
            bt[row, start:start + n] = deltas[at + 3:at + 3 + n]
            at += 3 + n


def broadcast_shutdown(tp: TPGroup) -> None:
    """Rank 0: tell every worker runner to leave its step loop (`follow` returns False)."""
    tp.broadcast(torch.zeros(_FIRST_MESSAGE_LEN, dtype=torch.int64))  # command 0
