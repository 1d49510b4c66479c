"""The fused all-reduce + residual add + RMSNorm (kernels/reduce_norm.py), its flags, packets and slots, on CPU.

Under Triton's interpreter a kernel is Python over raw addresses, so the ranks can be processes of this host, each
launching its own rank's kernel over shared CPU memory that stands for the peer-mapped buffers and signal pads (each
process maps it at addresses of its own, as peers map each other's GPU memory): the whole protocol runs (pushes into
the peers' buffers, flags raised and taken back, the two slots), and a mistake in it gives a wrong sum or a rank that
never returns. The real peer-to-peer run is the GPU test in tests/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import dataclasses
import io
import queue
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from governor.kernels.elementwise import INTERPRET
from governor.kernels.launch_policy import LaunchPolicy
from governor.kernels.reduce_norm import PeerMemory, all_reduce_add_rms_norm, all_reduce_add_rms_norm_ref
from tests.conftest import seeded_randn

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the ranks are CPU processes under the interpreter")

EPS = 1e-6
_TIMEOUT_S = 120.0


def _shared(world: int, buffer_bytes: int, signal_words: int, packet_bytes: int = 0) -> list[torch.Tensor]:
    """Every rank's buffer (rows, then packets), then every rank's signal pad, in shared memory."""
    return ([torch.zeros(buffer_bytes + packet_bytes, dtype=torch.uint8).share_memory_() for _ in range(world)]
            + [torch.zeros(signal_words, dtype=torch.int32).share_memory_() for _ in range(world)])


def _peer_memory(rank: int, world: int, memory: list[torch.Tensor], programs: int = 64,
                 packet_bytes: int = 0) -> PeerMemory:
    """Rank `rank`'s view: the addresses at which this process maps every rank's buffer and pad."""
    buffers, pads = memory[:world], memory[world:]
    return PeerMemory(rank, world, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                      torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64),
                      buffers[0].numel() - packet_bytes, pads[0].numel(),
                      torch.zeros(pads[0].numel() // world, dtype=torch.int32), programs, packet_bytes)


def _rank_main(rank: int, world: int, memory: list[torch.Tensor], calls: list[dict[str, Any]], out: Any,
               programs: int, packet_bytes: int, packet_rows: int) -> None:
    """Run `calls` ({x: every rank's part, residual, weight}) in order as `rank`, calls of up to `packet_rows` rows
    in packets; put (rank, results, counters)."""
    peers = _peer_memory(rank, world, memory, programs, packet_bytes)
    policy = dataclasses.replace(LaunchPolicy(), reduce_norm_packet_max_rows=packet_rows)
    try:
        results = [all_reduce_add_rms_norm(c["x"][rank], c["residual"], c["weight"], EPS, peers, policy=policy)
                   for c in calls]
        saved = io.BytesIO()  # bytes, not tensors: a tensor in a queue needs its sender alive when it is read
        torch.save((results, peers.calls), saved)
        out.put((rank, saved.getvalue(), None))
    except Exception as e:  # the parent raises it
        out.put((rank, None, e))


def _start(world: int, memory: list[torch.Tensor], calls: list[dict[str, Any]], ranks: range, out: Any,
           programs: int = 64, packet_bytes: int = 0, packet_rows: int = 0) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, memory, calls, out, programs, packet_bytes, packet_rows),
                         daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


def _collect(out: Any, count: int, procs: list[Any]) -> dict[int, Any]:
    got = {}
    try:
        for _ in range(count):
            rank, saved, error = out.get(timeout=_TIMEOUT_S)
            if error is not None:
                raise error
            got[rank] = torch.load(io.BytesIO(saved))
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(count)) - set(got))} never got past the flags")
    finally:
        for p in procs:
            p.kill()
    return got


@pytest.mark.parametrize(("world", "dtype", "programs", "packet_rows"),
                         [(2, torch.bfloat16, 64, 0), (2, torch.float32, 3, 0), (3, torch.bfloat16, 1, 0),
                          (3, torch.float32, 64, 0), (3, torch.float32, 1, 4), (2, torch.bfloat16, 3, 2)],
                         ids=["2-bf16", "2-fp32-3-programs", "3-bf16-1-program", "3-fp32", "3-fp32-packets-1-program",
                              "2-bf16-mixed-3-programs"])
def test_every_rank_gets_the_reference_sum_add_and_norm_call_after_call(world: int, dtype: torch.dtype,
                                                                        programs: int, packet_rows: int) -> None:
    """Calls of different row counts, with and without a residual, one after another as a step issues them: each
    rank's outputs equal the reference's, bitwise for the sum, and every rank's are the same bits. With fewer
    programs than rows (3 or 1: a batch larger than the GPU's SMs) each program takes every `programs`-th row.
    Calls of up to `packet_rows` rows go in packets: all of them (4), or those of 1 and 2 rows between calls of 3
    and 4 rows with flags (2), on the same rows and their counts."""
    n = 48
    rows_per_call = [1, 3, 3, 1, 4, 2, 4]
    packet_bytes = 2 * world * 2 * 4 * n * dtype.itemsize
    memory = _shared(world, buffer_bytes=2 * world * 4 * n * dtype.itemsize, signal_words=world * 4,
                     packet_bytes=packet_bytes)
    view = _peer_memory(0, world, memory, packet_bytes=packet_bytes)
    assert view.max_rows(n, dtype) == 4 and view.packet_rows(n, dtype) == 4
    weight = seeded_randn(n, dtype=dtype, seed=7)
    calls = [{"x": [seeded_randn(t, n, dtype=dtype, seed=100 * c + r, scale=2.0) for r in range(world)],
              "residual": None if c % 3 == 0 else seeded_randn(t, n, dtype=dtype, seed=999 + c), "weight": weight}
             for c, t in enumerate(rows_per_call)]
    out = mp.get_context("spawn").Queue()
    got = _collect(out, world, _start(world, memory, calls, range(world), out, programs, packet_bytes, packet_rows))
    for c, call in enumerate(calls):
        want_out, want_h = all_reduce_add_rms_norm_ref(call["x"], call["residual"], weight, EPS)
        for rank in range(world):
            result, h = got[rank][0][c]
            assert torch.equal(h, want_h), (c, rank)
            assert torch.equal(result, got[0][0][c][0]), (c, rank)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(result.float(), want_out.float(), atol=tol, rtol=tol)
    assert all(not pad.any() for pad in memory[world:])  # every flag raised was taken back
    per_row = [sum(1 for t in rows_per_call if t > row) for row in range(4)]
    for rank in range(world):
        assert got[rank][1].tolist() == per_row  # each row alternates its slots with its own count
    # A rank a call ahead must not write where a peer may still read, which a run on CPU cannot provoke on purpose:
    # so the layout is checked. Row 0 took part in every call: its last call's parts are in slot 0, the one
    # before's in slot 1, each at its sender's place in every other rank's buffer; in packets, tagged with the row's
    # call number + 1 (7 and 6) over the payload's 4 bytes.
    for rank in range(world):
        rows = memory[rank][:-packet_bytes].view(dtype).view(2, 4, world, n)
        packets = memory[rank][-packet_bytes:].view(torch.int64).view(2, 4, world, n * dtype.itemsize // 4)
        for p in range(world):
            for slot, c in ((0, 6), (1, 5)):
                if p == rank:
                    continue
                if rows_per_call[c] <= packet_rows:
                    assert torch.equal(packets[slot, 0, p] >> 32, torch.full_like(packets[slot, 0, p], c + 1))
                    payload = (packets[slot, 0, p] & 0xFFFFFFFF).to(torch.int32)
                    assert torch.equal(payload.view(dtype), calls[c]["x"][p][0])
                else:
                    assert torch.equal(rows[slot, 0, p], calls[c]["x"][p][0])


def test_too_many_rows_or_a_bad_shape_is_refused() -> None:
    peers = _peer_memory(0, 2, _shared(2, buffer_bytes=2 * 2 * 4 * 32 * 2, signal_words=64))
    weight = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 4 rows"):
        all_reduce_add_rms_norm(torch.zeros(5, 32, dtype=torch.bfloat16), None, weight, EPS, peers)
    with pytest.raises(ValueError, match="contiguous rows"):
        all_reduce_add_rms_norm(torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16),
                                weight, EPS, peers)


def test_a_lone_rank_waits_at_the_flags_or_packets_until_its_peer_comes() -> None:
    """The barrier is real under both protocols: rank 0 alone does not finish, and does once rank 1 makes the same
    call. The two protocols' pairs run side by side, on memories of their own, so they share the wait."""
    packet_bytes = 2 * 2 * 2 * 32 * 4
    calls = [{"x": [torch.full((1, 32), float(r + 1)) for r in range(2)], "residual": None,
              "weight": torch.ones(32)}]
    runs = []
    for packet_rows in (0, 1):  # flags, packets
        memory = _shared(2, buffer_bytes=2 * 2 * 1 * 32 * 4, signal_words=2, packet_bytes=packet_bytes)
        out = mp.get_context("spawn").Queue()
        procs = _start(2, memory, calls, range(1), out, packet_bytes=packet_bytes, packet_rows=packet_rows)
        runs.append((packet_rows, memory, out, procs))
    for _, _, out, _ in runs:
        with pytest.raises(queue.Empty):
            out.get(timeout=15.0 if out is runs[0][2] else 0.5)  # far longer than a call takes once both are in
    for packet_rows, memory, out, procs in runs:
        got = _collect(out, 2, procs + _start(2, memory, calls, range(1, 2), out, packet_bytes=packet_bytes,
                                              packet_rows=packet_rows))
        for rank in range(2):
            assert torch.equal(got[rank][0][0][1], torch.full((1, 32), 3.0)), packet_rows
