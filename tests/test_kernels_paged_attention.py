"""Paged attention: the Triton kernels against the torch reference, the reference against dense attention.

Without CUDA the kernels run under Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before anything imports the kernels (Triton reads it when `@triton.jit` decorates a kernel).
"""

import dataclasses
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from governor.kernels import paged_attention as pa
from governor.kernels.elementwise import INTERPRET, has_pdl
from governor.kernels.launch_policy import LaunchPolicy, policy_for, policy_for_arch
from governor.kernels.paged_attention import checks as pa_checks
from governor.kernels.paged_attention import decode as pa_decode
from governor.kernels.paged_attention import gluon_decode as pa_gluon
from governor.kernels.paged_attention import prefill as pa_prefill
from governor.kernels.paged_attention import splits as pa_splits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POLICY = policy_for(DEVICE)  # what the entry points launch with when given no policy
# The policy H100s and H200s run: the decisions tests take for 132 SMs off CUDA, and what sm_90a is compiled with.
SM90 = policy_for_arch("sm_90")
# (atol, rtol): fp32 is exact math; half types round P to 8 (bf16) or 11 (fp16) mantissa bits.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
FP8 = pa.FP8_KV_DTYPE
E4M3_HALF_STEP = 2.0**-4  # round to nearest with 3 mantissa bits: relative error <= 2^-4
E4M3_HALF_SUBNORMAL_STEP = 2.0**-10  # below 2^-6 the step is a fixed 2^-9 (times the scale)

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET),
    reason="no CUDA and TRITON_INTERPRET is not 1 (it was set to something else before import)",
)


# ----------------------------------------------------------------------------------------------
# Fixtures built by hand: a paged cache whose blocks are shuffled
# ----------------------------------------------------------------------------------------------


class PagedCase:
    """Random contexts stored in a paged cache at shuffled blocks."""

    def __init__(
        self,
        seq_lens: list[int],
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        spare_table_entries: int = 2,
    ) -> None:
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.seq_lens_list = seq_lens
        self.dtype = dtype
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no sequence owns
        width = max(blocks_per_seq, default=0) + spare_table_entries
        ids = torch.randperm(num_blocks, generator=self.gen, device=DEVICE)
        # Unused table entries point at real blocks of other sequences: reading them would show.
        table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=self.gen, device=DEVICE)
        self.block_ids: list[torch.Tensor] = []
        for i, (start, count) in enumerate(zip(_prefix_sums(blocks_per_seq)[:-1], blocks_per_seq, strict=True)):
            self.block_ids.append(ids[start : start + count])
            table[i, :count] = self.block_ids[-1]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=self.gen, device=DEVICE).to(dtype)
        self.v_cache = torch.randn(shape, generator=self.gen, device=DEVICE).to(dtype)
        self.block_tables = table.to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    def dense_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's K and V, contiguous: [seq_len, num_kv_heads, head_dim]."""
        heads, head_dim = self.k_cache.shape[2:]
        keys = [
            self.k_cache[b].reshape(-1, heads, head_dim)[:n]
            for b, n in zip(self.block_ids, self.seq_lens_list, strict=True)
        ]
        values = [
            self.v_cache[b].reshape(-1, heads, head_dim)[:n]
            for b, n in zip(self.block_ids, self.seq_lens_list, strict=True)
        ]
        return keys, values

    def queries(self, q_lens: list[int], num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random q [sum(q_lens), Hq, D] and its query_start_loc."""
        head_dim = self.k_cache.shape[3]
        q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=self.gen, device=DEVICE).to(self.dtype)
        return q, torch.tensor(_prefix_sums(q_lens), dtype=torch.int32, device=DEVICE)


def _prefix_sums(xs: list[int]) -> list[int]:
    """[0, x0, x0 + x1, ...]: len(xs) + 1 entries, like query_start_loc."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


@dataclass
class Fp8KV:
    """An fp8 copy of a float32 PagedCase's caches with per-head scales (absmax / 448)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def head_magnitudes(low: float, high: float, num_heads: int, device: torch.device = DEVICE) -> torch.Tensor:
    """Geometric steps from low to high, one per head: heads whose ranges differ by orders of magnitude."""
    return torch.logspace(math.log10(low), math.log10(high), num_heads, device=device)


def quantize_fp8(
    case: PagedCase, k_range: tuple[float, float] = (0.5, 2.0), v_range: tuple[float, float] = (0.1, 10.0)
) -> Fp8KV:
    """Spread the case's per-head K/V magnitudes over the ranges (in place: `case` stays the unquantized
    twin), then store every slot into a fresh fp8 cache through write_kv_ref."""
    assert case.dtype == torch.float32
    num_blocks, block_size, heads, head_dim = case.k_cache.shape
    case.k_cache *= head_magnitudes(*k_range, heads)[:, None]
    case.v_cache *= head_magnitudes(*v_range, heads)[:, None]
    kv = Fp8KV(
        torch.empty(case.k_cache.shape, dtype=FP8, device=DEVICE),
        torch.empty(case.v_cache.shape, dtype=FP8, device=DEVICE),
        case.k_cache.abs().amax(dim=(0, 1, 3)) / pa.FP8_MAX,
        case.v_cache.abs().amax(dim=(0, 1, 3)) / pa.FP8_MAX,
    )
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    pa.write_kv_ref(
        case.k_cache.view(-1, heads, head_dim), case.v_cache.view(-1, heads, head_dim),
        kv.k_cache, kv.v_cache, slots, **kv.scales,
    )  # fmt: skip
    return kv


def dequantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a reader of the fp8 cache sees: fp8.float() * scale[head]."""
    return cache.float() * scale[:, None]


def dense_causal_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int], scale: float
) -> torch.Tensor:
    """Textbook attention, one sequence and one query head at a time, from contiguous K/V."""
    num_q_heads = q.shape[1]
    num_kv_heads = keys[0].shape[1] if keys else 1
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        seq_len = k.shape[0]
        for j in range(q_len):
            position = seq_len - q_len + j
            for h in range(num_q_heads):
                kv = h // (num_q_heads // num_kv_heads)
                scores = (k[: position + 1, kv].float() @ q[row + j, h].float()) * scale
                out[row + j, h] = torch.softmax(scores, dim=0) @ v[: position + 1, kv].float()
        row += q_len
    return out


# ----------------------------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------------------------


def test_write_kv_ref_stores_each_token_at_its_slot_and_skips_negative_slots() -> None:
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key = torch.randn(3, 2, 16)
    value = torch.randn(3, 2, 16)
    slots = torch.tensor([2 * 8 + 5, -1, 0 * 8 + 7], dtype=torch.int64)

    pa.write_kv_ref(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache[2, 5], key[0]) and torch.equal(v_cache[2, 5], value[0])
    assert torch.equal(k_cache[0, 7], key[2]) and torch.equal(v_cache[0, 7], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # nothing else was written
    assert int((v_cache != 0).any(dim=(2, 3)).sum()) == 2


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_matches_ref(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 16, 2, 32, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(6, 16, 2, 32, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(6 * 16, generator=gen)[:10]
    slots[[3, 7]] = -1
    slots = slots.to(DEVICE)
    key = torch.randn(10, 2, 32, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(10, 2, 32, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    pa.write_kv_ref(key, value, k_ref, v_ref, slots)
    pa.write_kv(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_rejects_int32_slot_mapping() -> None:
    cache = torch.zeros(2, 8, 1, 16)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        pa.write_kv_ref(
            torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), cache, cache.clone(), torch.zeros(1, dtype=torch.int32)
        )


# ----------------------------------------------------------------------------------------------
# The reference against dense attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "block_size"),
    [(2, 2, 8), (4, 2, 16), (8, 2, 16), (4, 1, 32)],
    ids=["mha-bs8", "gqa2-bs16", "gqa4-bs16", "mqa-bs32"],
)
def test_reference_matches_dense_causal_attention(num_q_heads: int, num_kv_heads: int, block_size: int) -> None:
    seq_lens, q_lens = [1, 9, 40, 33], [1, 9, 5, 1]  # decode, whole prompt, chunk over a prefix
    case = PagedCase(seq_lens, num_kv_heads, 16, block_size, torch.float32)
    q, query_start_loc = case.queries(q_lens, num_q_heads)
    scale = 0.25

    got = pa.paged_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, scale
    )

    want = dense_causal_attention(q, *case.dense_kv(), q_lens, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_rejects_more_queries_than_context() -> None:
    case = PagedCase([3], 1, 16, 8, torch.float32)
    q, query_start_loc = case.queries([4], 1)
    with pytest.raises(ValueError, match="4 queries but only 3 tokens"):
        pa.paged_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, 1.0)


# ----------------------------------------------------------------------------------------------
# Decode kernel
# ----------------------------------------------------------------------------------------------


def _decode_against_ref(
    case: PagedCase,
    num_q_heads: int,
    num_splits: int | None,
    out: torch.Tensor | None = None,
    fp8: Fp8KV | None = None,
    q_dtype: torch.dtype | None = None,
    policy: LaunchPolicy | None = None,
) -> None:
    """The decode kernel against the reference on the case's cache, or on its fp8 copy `fp8`, launched under
    `policy` (None: the device's)."""
    num_seqs = len(case.seq_lens_list)
    q, query_start_loc = case.queries([1] * num_seqs, num_q_heads)
    q = q.to(q_dtype or case.dtype)
    k_cache, v_cache, scales = _caches(case, fp8)
    scale = 1 / math.sqrt(q.shape[2])
    want = pa.paged_attention_ref(
        q, k_cache, v_cache, case.block_tables, case.seq_lens, query_start_loc, scale, **scales
    )

    got = pa.paged_decode_attention(
        q, k_cache, v_cache, case.block_tables, case.seq_lens, scale, out, num_splits=num_splits, policy=policy,
        **scales
    )

    assert got.dtype == q.dtype
    _assert_close_for(got, want, q.dtype, fp8)


def _caches(case: PagedCase, fp8: Fp8KV | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """K cache, V cache and the scale kwargs the entry points take: the case's own, or its fp8 copy's."""
    if fp8 is None:
        return case.k_cache, case.v_cache, {}
    return fp8.k_cache, fp8.v_cache, fp8.scales


def _assert_close_for(got: torch.Tensor, want: torch.Tensor, q_dtype: torch.dtype, fp8: Fp8KV | None) -> None:
    """Kernel vs reference at q's dtype tolerance. With fp8, in units of each head's largest |V| (its
    scale * 448), since quantize_fp8 spreads the heads' ranges 100x apart. Measured on CPU in those
    units: fp32 2.5e-7, bf16 3.3e-3, fp16 8e-5."""
    atol, rtol = TOLERANCE[q_dtype]
    got, want = got.float(), want.float()
    if fp8 is not None:
        group = got.shape[1] // fp8.v_scale.shape[0]
        v_max = (fp8.v_scale * pa.FP8_MAX).repeat_interleave(group)[:, None]
        got, want = got / v_max, want / v_max
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize(
    ("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, 2, 2, 16, 16),
        (torch.float32, 4, 2, 32, 8),
        (torch.float32, 8, 2, 16, 32),
        (torch.float32, 4, 1, 64, 16),
        (torch.bfloat16, 8, 2, 32, 16),
        (torch.float16, 4, 1, 16, 16),
    ],
    ids=["mha-f32", "gqa2-f32-bs8", "gqa4-f32-bs32", "mqa-f32-d64", "gqa4-bf16", "mqa-f16"],
)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
def test_decode_kernel_matches_reference(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_splits: int
) -> None:
    # Lengths below, at and past block and tile boundaries, one of them not a block multiple.
    case = PagedCase([1, 16, 37, 130], num_kv_heads, head_dim, block_size, dtype, spare_table_entries=10)
    _decode_against_ref(case, num_q_heads, num_splits)


@needs_triton
def test_decode_split_kv_is_chosen_automatically_for_long_contexts_and_stays_exact() -> None:
    # One kv head, two sequences: few programs and a 2048-token table capacity -> several partitions,
    # most of them past the short sequence's end.
    case = PagedCase([700, 30], 1, 16, 16, torch.float32, spare_table_entries=128 - 44)
    assert case.block_tables.shape[1] * 16 >= 2 * POLICY.split_min_partition
    assert pa_splits._choose_num_splits(SM90, 2, 2048, torch.device("cpu")) > 1
    _decode_against_ref(case, 2, None)


def test_fold_counters_grow_into_new_zeroed_ones_and_keep_the_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa_decode, "_FOLD_COUNTERS", {})
    monkeypatch.setattr(pa_decode, "_RETIRED_FOLD_COUNTERS", [])
    cpu = torch.device("cpu")
    first = pa_decode._fold_counters(cpu, 10)
    assert first.numel() == 4096 and pa_decode._fold_counters(cpu, 4096) is first
    first[3] = 7  # as if a graph captured with these counters held state
    grown = pa_decode._fold_counters(cpu, 5000)
    assert grown.numel() == 5000 and not grown.any()
    assert len(pa_decode._RETIRED_FOLD_COUNTERS) == 1 and pa_decode._RETIRED_FOLD_COUNTERS[0] is first
    assert pa_decode._fold_counters(cpu, 10) is grown


# How split launches merge: (decode_fold_max_splits, decode_reduce_pdl). PDL needs a GPU (off under the interpreter).
MERGES = {"fold": (64, False), "reduce": (0, False), "reduce-pdl": (0, True)}


@needs_triton
@pytest.mark.parametrize("merge", list(MERGES))
@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_split_decode_partials_merge_alike_every_way(monkeypatch: pytest.MonkeyPatch, merge: str, fp8: bool) -> None:
    # Three splits of contexts below and past a partition, an empty sequence among them; twice, since the fold's
    # arrival counters must be back at zero for the next call.
    fold_max, pdl = MERGES[merge]
    policy = dataclasses.replace(POLICY, decode_fold_max_splits=fold_max, decode_reduce_pdl=pdl)
    decode, reduce = LaunchSpy(pa_decode._decode_kernel), LaunchSpy(pa_decode._decode_reduce_kernel)
    monkeypatch.setattr(pa_decode, "_decode_kernel", decode)
    monkeypatch.setattr(pa_decode, "_decode_reduce_kernel", reduce)
    case = PagedCase([1, 16, 0, 37, 130], 2, 16, 16, torch.float32, spare_table_entries=10)
    kv = quantize_fp8(case) if fp8 else None
    for _ in range(2):
        _decode_against_ref(case, 4, 3, fp8=kv, q_dtype=torch.bfloat16 if fp8 else None, policy=policy)
    assert [k["FOLD"] for k in decode.launches] == [merge == "fold"] * 2
    assert len(reduce.launches) == (0 if merge == "fold" else 2)
    pdl_on = pdl and has_pdl(DEVICE)
    assert all(k["PDL"] is pdl_on and k.get("launch_pdl", False) is pdl_on for k in reduce.launches)
    if merge == "fold":
        assert not pa_decode._FOLD_COUNTERS[case.seq_lens.device].any()


@needs_triton
@pytest.mark.parametrize(("num_splits", "longest", "folds"), [(8, 500, True), (9, 570, False)])
def test_split_launches_fold_their_merge_up_to_8_splits(monkeypatch: pytest.MonkeyPatch, num_splits: int,
                                                        longest: int, folds: bool) -> None:
    # The settings as they ship: 8 splits merge inside the decode kernel, 9 in the reduce kernel.
    decode, reduce = LaunchSpy(pa_decode._decode_kernel), LaunchSpy(pa_decode._decode_reduce_kernel)
    monkeypatch.setattr(pa_decode, "_decode_kernel", decode)
    monkeypatch.setattr(pa_decode, "_decode_reduce_kernel", reduce)
    # Tables of 32 / 36 blocks (512 / 576 keys): 8 / 9 partitions of 64 keys, every one of them run.
    case = PagedCase([longest, 30], 1, 16, 16, torch.float32, spare_table_entries=0)
    assert pa.decode_num_splits(2, case.block_tables.shape[1] * 16, DEVICE, num_splits) == num_splits
    _decode_against_ref(case, 2, num_splits)
    (launch,) = decode.launches
    assert launch["SPLIT"] and launch["FOLD"] is folds
    assert len(reduce.launches) == (not folds)
    # The attention target's shapes on 132 SMs: batch 32 x 8 kv heads at 4K and batch 8 at 4K fold (2 and 8 splits),
    # batch 1 at 32K (64 splits) does not.
    cpu = torch.device("cpu")
    assert [pa.decode_num_splits(b * 8, c, cpu, fp8=True, policy=SM90)
            for b, c in ((32, 4096), (8, 4096), (1, 32768))] == [2, 8, 64]


# ----------------------------------------------------------------------------------------------
# The Gluon fp8 decode kernel (sm_90+): which calls take it, and what it compiles to (no GPU needed)
# ----------------------------------------------------------------------------------------------


def test_gluon_decode_takes_fp8_caches_with_half_q_head_dims_64_128_and_groups_up_to_16_on_sm90(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa_gluon, "INTERPRET", False)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    cuda, bf16, fp16 = torch.device("cuda"), torch.bfloat16, torch.float16

    def takes(device: torch.device = cuda, q: torch.dtype = bf16, kv: torch.dtype = FP8, head_dim: int = 128,
              group: int = 4, policy: LaunchPolicy = SM90) -> bool:
        return pa_gluon._gluon_decode(policy, device, q, kv, head_dim, group, caches_aligned=True)

    assert takes() and takes(q=fp16) and takes(head_dim=64) and takes(group=1) and takes(group=16)
    assert not takes(q=torch.float32)  # fp32 q keeps the Triton kernel's tf32/fp32 products
    assert not takes(kv=bf16) and not takes(head_dim=256) and not takes(head_dim=32) and not takes(group=32)
    assert not takes(device=torch.device("cpu"))
    assert not pa_gluon._gluon_decode(SM90, cuda, bf16, FP8, 128, 4, caches_aligned=False)
    for other in ((8, 9), (10, 0), (12, 0)):
        capability["value"] = other
        assert not takes()  # measured and tested on sm_90 only
    capability["value"] = (9, 0)
    assert not takes(policy=dataclasses.replace(SM90, gluon_decode=False))
    monkeypatch.setattr(pa_gluon, "INTERPRET", True)
    assert not takes()  # Gluon has no interpreter: CPU runs take the Triton kernel


def test_gluon_decode_needs_16_byte_aligned_cache_rows() -> None:
    # Its copies move 16 bytes: a head stride of 136 (a padded view) or a cache starting 1 byte in must go to the
    # Triton kernel (a 1-byte cp.async does not compile).
    cache = torch.zeros(4, 16, 8, 128, dtype=FP8)
    assert pa_gluon._gluon_caches_aligned(cache, cache.clone())
    padded = torch.zeros(4, 16, 8, 136, dtype=FP8)[..., :128]
    assert not pa_gluon._gluon_caches_aligned(cache, padded)
    shifted = torch.zeros(4 * 16 * 8 * 128 + 1, dtype=FP8)[1:].view(4, 16, 8, 128)
    assert not pa_gluon._gluon_caches_aligned(shifted, cache)


def test_gluon_decode_launches_that_fit_one_wave_of_4_programs_per_sm_take_64_keys_a_step_larger_ones_16() -> None:
    cpu = torch.device("cpu")  # 132 SMs off CUDA: 528 programs a wave

    def tile(programs: int) -> int:
        return pa_gluon._gluon_decode_tile(SM90, programs, cpu)

    assert tile(1) == tile(528) == 64
    assert tile(529) == tile(2048) == 16
    # Every split launch fits (its split count is chosen so); the throughput workload's batch 256 does not.
    for batch, context in ((32, 4096), (32, 32768), (8, 4096), (1, 32768), (16, 8192)):
        splits = pa.decode_num_splits(batch * 8, context, cpu, fp8=True, policy=SM90)
        assert splits > 1 and tile(batch * 8 * splits) == 64
    assert pa.decode_num_splits(256 * 8, 1024, cpu, fp8=True, policy=SM90) == 1 and tile(256 * 8) == 16


@pytest.mark.parametrize(("tile", "head_dim", "group", "merge"), [
    (SM90.gluon_tile_n_narrow, 128, 4, "fold"), (SM90.gluon_tile_n_wide, 128, 8, "pdl"),
    (SM90.gluon_tile_n_narrow, 64, 1, "reduce"), (SM90.gluon_tile_n_wide, 128, 2, "unsplit")])
def test_gluon_decode_compiles_for_sm90_to_16_byte_k_v_reads_without_spills(tile: int, head_dim: int, group: int,
                                                                            merge: str) -> None:
    # Compiled by scripts/decode-sass.py with Triton's ptxas for sm_90a (no GPU; in a process without the
    # interpreter, under which Gluon cannot compile): the loop's K/V bytes arrive by cp.async and come back from
    # shared memory 16 bytes at a time -- none of the Triton kernel's byte loads (LDS.U8) -- and nothing spills.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "kernels"), str(root / "engine")])
    run = subprocess.run([sys.executable, str(root / "scripts" / "decode-sass.py"), "--gluon", "--tile", str(tile),
                          "--head-dim", str(head_dim), "--group", str(group), "--top", "1000",
                          *(["--no-split"] if merge == "unsplit" else ["--merge", merge])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    header = re.search(r"(\d+) registers, spills (\d+)/(\d+) bytes", run.stdout)
    assert header is not None, run.stdout
    # The 16-key program runs at ptxas's choice, 128 registers and a few spilled bytes: faster than 139 without
    # spills (LaunchPolicy.gluon_maxnreg_wide); the 64-key one spills nothing.
    uncapped_wide = tile == SM90.gluon_tile_n_wide and SM90.gluon_maxnreg_wide is None
    spill_limit = 64 if uncapped_wide else 0
    assert int(header.group(1)) <= 255 and int(header.group(2)) <= spill_limit and int(header.group(3)) <= spill_limit
    ops = {m.group(2): int(m.group(1)) for m in re.finditer(r"^\s+(\d+)\s+(\S+)$", run.stdout, re.MULTILINE)}

    def lane_bytes(prefix: str) -> int:  # bytes one lane moves through the loop's instructions named so
        widths = {"128": 16, "64": 8}
        return sum(n * widths[op.rsplit(".", 1)[1]] for op, n in ops.items() if op.startswith(prefix))

    # One warp moves each step's K and V tiles once each way. Per key a lane holds head_dim / 4 bytes of K and
    # head_dim / 8 of V: 16-byte copies at 128, 16 and 8 at 64.
    assert not any(op.startswith(("LDS.U8", "LDS.S8", "LDS.U16", "LDS.S16", "LDGSTS.E.32")) for op in ops)
    tile_bytes = 2 * tile * head_dim
    assert lane_bytes("LDGSTS.E") * 32 == tile_bytes
    assert lane_bytes("LDS.") * 32 == tile_bytes
    # Two 16 x TILE_N x head_dim products (S = q K^T, P V) in m16n8k16 steps.
    assert ops["HMMA.16816.F32"] == 2 * 16 * tile * head_dim // (16 * 8 * 16)


def test_int64_offsets_are_used_exactly_when_an_offset_can_reach_2_to_the_31() -> None:
    def cache(num_blocks: int, dtype: torch.dtype = FP8) -> torch.Tensor:
        return torch.empty(num_blocks, 16, 8, 128, dtype=dtype, device="meta")  # 16,384 elements a block

    assert not pa_checks._needs_int64_offsets(cache(2**17))  # last offset 2^31 - 1
    assert pa_checks._needs_int64_offsets(cache(2**17 + 1))
    assert pa_checks._needs_int64_offsets(cache(16), cache(2**18, torch.bfloat16))  # either cache decides
    assert not pa_checks._needs_int64_offsets(cache(0))


class LaunchSpy:
    """Stands in for a Triton kernel (`kernel[grid](...)`), records each launch's keyword arguments, then launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_triton
@pytest.mark.parametrize("big", [False, True], ids=["int32", "int64"])
def test_decode_and_prefill_launch_the_offset_width_the_caches_need(monkeypatch: pytest.MonkeyPatch,
                                                                    big: bool) -> None:
    decode, prefill = LaunchSpy(pa_decode._decode_kernel), LaunchSpy(pa_prefill._prefill_kernel)
    monkeypatch.setattr(pa_decode, "_decode_kernel", decode)
    monkeypatch.setattr(pa_prefill, "_prefill_kernel", prefill)
    if big:  # as if a cache had 2^31 elements (one that size cannot be allocated here)
        for launcher in (pa_decode, pa_prefill):
            monkeypatch.setattr(launcher, "_needs_int64_offsets", lambda *caches: True)
    case = PagedCase([5, 40], 2, 16, 8, torch.float32)
    _decode_against_ref(case, 4, 1)
    _prefill_against_ref(case, [5, 7], 4)
    assert [k["OFFSETS_64"] for k in decode.launches + prefill.launches] == [big, big]


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_the_int64_offset_path_gives_the_same_outputs(monkeypatch: pytest.MonkeyPatch, fp8: bool) -> None:
    # Caches big enough for int64 cannot be allocated here: force the path on small ones; decode and prefill. (The
    # casts themselves need a real 2^31-element cache: test_gpu_fp8_decode_past_2_to_the_31_elements.)
    case = PagedCase([1, 16, 37, 130], 2, 32, 16, torch.float32, spare_table_entries=10)
    quantized = quantize_fp8(case) if fp8 else None
    for launcher in (pa_decode, pa_prefill):
        monkeypatch.setattr(launcher, "_needs_int64_offsets", lambda *caches: True)
    q_dtype = torch.bfloat16 if fp8 else None
    _decode_against_ref(case, 8, 3, fp8=quantized, q_dtype=q_dtype)
    _prefill_against_ref(case, [1, 16, 20, 3], 8, fp8=quantized, q_dtype=q_dtype)


def test_decode_register_cap_applies_to_narrow_fp8_launches_on_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    options = pa_decode._decode_launch_options
    monkeypatch.setattr(pa_decode, "INTERPRET", False)
    assert options(SM90, fp8=True, wide=False)["maxnreg"] == SM90.decode_maxnreg_fp8
    assert "maxnreg" not in options(SM90, fp8=True, wide=True)  # wide: the compiler's count (a cap of 168 spilled)
    assert "maxnreg" not in options(SM90, fp8=False, wide=False)
    monkeypatch.setattr(pa_decode, "INTERPRET", True)  # the interpreter takes no register cap
    assert "maxnreg" not in options(SM90, fp8=True, wide=False)


def test_fp8_decode_launches_take_warps_and_tiles_by_width_and_16_bit_ones_one_setting() -> None:
    d, p = pa_decode, SM90
    narrow, wide = (d._decode_launch_options(p, fp8=True, wide=w) for w in (False, True))
    assert (narrow["num_warps"], d._decode_tile(p, True, False)) == (p.decode_num_warps_fp8, p.decode_tile_n_fp8)
    assert (wide["num_warps"], d._decode_tile(p, True, True)) == (p.decode_wide_num_warps_fp8, p.decode_wide_tile_n_fp8)
    assert narrow["num_stages"] == wide["num_stages"] == p.decode_num_stages_fp8
    for w in (False, True):
        assert d._decode_launch_options(p, fp8=False, wide=w) == {"num_warps": p.decode_num_warps_16}  # 3 stages
        assert d._decode_tile(p, False, w) == p.tile_n


def test_only_unsplit_fp8_launches_that_fill_their_waves_are_wide() -> None:
    cpu = torch.device("cpu")  # 132 SMs off CUDA: waves of 8 x 132 = 1,056 one-warp programs

    def wide(programs: int) -> bool:
        return pa_decode._wide_decode(SM90, True, False, programs, cpu)

    # The H200 measurements (8 kv heads): 1 warp faster at batch 256 (2,048 programs) and 128 (1,024), slower at 192,
    # 160, 64 and 48 (1,536, 1,280, 512, 384).
    assert wide(2048) and wide(1024)
    assert not any(wide(p) for p in (1536, 1280, 512, 384, 1, 0))
    assert wide(3 * 1056) and not wide(2 * 1056 + 1)  # fill 100% / 67%
    assert not pa_decode._wide_decode(SM90, True, True, 2048, cpu)  # split launches never
    assert not pa_decode._wide_decode(SM90, False, False, 2048, cpu)  # 16-bit caches never
    # The throughput workload's decode batch (256 x 8 kv heads) is unsplit and wide; batch 48 at 4K unsplit, not wide.
    assert pa.decode_num_splits(256 * 8, 1024, cpu, fp8=True, policy=SM90) == 1 and wide(256 * 8)
    assert pa.decode_num_splits(48 * 8, 4096, cpu, fp8=True, policy=SM90) == 1 and not wide(48 * 8)


@needs_triton
@pytest.mark.parametrize(("num_splits", "wide"), [(1, True), (1, False), (3, False)],
                         ids=["unsplit-wide", "unsplit-narrow", "split"])
def test_fp8_decode_launches_run_the_settings_of_their_width(monkeypatch: pytest.MonkeyPatch, num_splits: int,
                                                             wide: bool) -> None:
    decode = LaunchSpy(pa_decode._decode_kernel)
    monkeypatch.setattr(pa_decode, "_decode_kernel", decode)
    # A fill this small case reaches or not (12 programs here; on a GPU a wide launch has a thousand or more). A split
    # launch is never wide, whatever the fill.
    policy = dataclasses.replace(POLICY, decode_wide_min_wave_fill=0.0 if wide or num_splits > 1 else 2.0)
    # Contexts across both tile sizes' boundaries, GQA 4 over 2 kv heads, bf16 q as the engine runs it.
    case = PagedCase([1, 63, 64, 65, 129, 300], 2, 32, 16, torch.float32, spare_table_entries=4)
    _decode_against_ref(case, 8, num_splits, fp8=quantize_fp8(case), q_dtype=torch.bfloat16, policy=policy)
    (launch,) = decode.launches
    assert launch["SPLIT"] is (num_splits > 1)
    assert launch["TILE_N"] == pa_decode._decode_tile(policy, True, wide)
    options = pa_decode._decode_launch_options(policy, True, wide)
    assert {k: launch.get(k) for k in ("num_warps", "num_stages", "maxnreg")} == {
        k: options.get(k) for k in ("num_warps", "num_stages", "maxnreg")}


def test_fp8_split_counts_fit_one_wave_and_16_bit_ones_fill_the_target() -> None:
    # 132 SMs off CUDA. fp8: 4 programs per SM, rounded down: batch 32 x 8 kv heads -> 2 splits (512 of 528 slots).
    cpu = torch.device("cpu")
    assert pa_splits._choose_num_splits(SM90, 256, 4096, cpu, fp8=True) == 2
    assert pa_splits._choose_num_splits(SM90, 128, 8192, cpu, fp8=True) == 4
    assert pa_splits._choose_num_splits(SM90, 8, 32768, cpu, fp8=True) == 64  # 66 fit, capped
    assert pa_splits._choose_num_splits(SM90, 300, 32768, cpu, fp8=True) == 1  # two would take 1.14 waves
    assert pa_splits._choose_num_splits(SM90, 256, 1024, cpu, fp8=True) == 2
    assert pa_splits._choose_num_splits(SM90, 256, 1023, cpu, fp8=True) == 1  # partitions of >= 512 tokens
    # 16-bit: 3 per SM, rounded up.
    assert pa_splits._choose_num_splits(SM90, 256, 4096, cpu) == 2
    assert pa_splits._choose_num_splits(SM90, 128, 8192, cpu) == 4
    assert pa_splits._choose_num_splits(SM90, 300, 32768, cpu) == 2


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_of_an_empty_sequence_is_zero(num_splits: int) -> None:
    # Padding rows of a CUDA-graph batch have seq_len 0; they must not produce NaN.
    case = PagedCase([0, 20], 1, 16, 8, torch.float32, spare_table_entries=8)
    q, _ = case.queries([1, 1], 2)
    out = pa.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.25, num_splits=num_splits
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


@needs_triton
def test_decode_reads_strided_q_and_writes_into_out() -> None:
    case = PagedCase([5, 50], 2, 16, 16, torch.float32)
    qkv = torch.randn(2, 4 + 2 * 2, 16, device=DEVICE)  # q heads then k and v heads, as a fused projection
    q = qkv[:, :4]
    out = torch.full((2, 4, 16), float("nan"), device=DEVICE)
    query_start_loc = torch.arange(3, dtype=torch.int32, device=DEVICE)
    want = pa.paged_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, 0.25
    )

    got = pa.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.25, out)

    assert got is out
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_decode_rejects_head_dim_that_is_not_a_power_of_two() -> None:
    case = PagedCase([4], 1, 24, 8, torch.float32)
    q, _ = case.queries([1], 1)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        pa.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)


# ----------------------------------------------------------------------------------------------
# Prefill kernel
# ----------------------------------------------------------------------------------------------


def _prefill_against_ref(
    case: PagedCase, q_lens: list[int], num_q_heads: int, fp8: Fp8KV | None = None, q_dtype: torch.dtype | None = None
) -> None:
    """The prefill kernel against the reference on the case's cache, or on its fp8 copy `fp8`."""
    q, query_start_loc = case.queries(q_lens, num_q_heads)
    q = q.to(q_dtype or case.dtype)
    k_cache, v_cache, scales = _caches(case, fp8)
    scale = 1 / math.sqrt(q.shape[2])
    want = pa.paged_attention_ref(
        q, k_cache, v_cache, case.block_tables, case.seq_lens, query_start_loc, scale, **scales
    )

    got = pa.paged_prefill_attention(
        q, k_cache, v_cache, case.block_tables, case.seq_lens, query_start_loc, max(q_lens), scale, **scales
    )

    assert got.dtype == q.dtype
    _assert_close_for(got, want, q.dtype, fp8)


@needs_triton
@pytest.mark.parametrize(
    ("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, 2, 2, 16, 16),
        (torch.float32, 4, 2, 32, 8),
        (torch.float32, 8, 2, 16, 32),
        (torch.float32, 3, 1, 16, 16),
        (torch.bfloat16, 8, 2, 32, 16),
        (torch.float16, 4, 1, 64, 16),
    ],
    ids=["mha-f32", "gqa2-f32-bs8", "gqa4-f32-bs32", "mqa3-f32", "gqa4-bf16", "mqa-f16-d64"],
)
def test_prefill_kernel_matches_reference(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    # A whole prompt, a chunk over a cached prefix, a decode token, and a chunk whose prefix and
    # length are not block multiples; query tiles end mid-sequence.
    seq_lens, q_lens = [21, 100, 37, 83], [21, 40, 1, 19]
    case = PagedCase(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    _prefill_against_ref(case, q_lens, num_q_heads)


@needs_triton
def test_prefill_with_one_query_per_sequence_equals_decode() -> None:
    case = PagedCase([9, 64, 65], 2, 32, 16, torch.float32)
    q, query_start_loc = case.queries([1, 1, 1], 4)
    args = (case.k_cache, case.v_cache, case.block_tables, case.seq_lens)

    prefill = pa.paged_prefill_attention(q, *args, query_start_loc, 1, 0.2)
    decode = pa.paged_decode_attention(q, *args, 0.2, num_splits=1)

    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


@needs_triton
def test_prefill_skips_sequences_without_queries() -> None:
    # A sequence with no queries this step (q_len 0) leaves its neighbours' rows correct.
    case = PagedCase([12, 30, 7], 1, 16, 8, torch.float32)
    _prefill_against_ref(case, [12, 0, 3], 2)


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) KV cache with static per-head scales
# ----------------------------------------------------------------------------------------------


def test_fp8_write_then_read_is_within_half_an_e4m3_step_of_the_value() -> None:
    # Heads four orders of magnitude apart, each scaled to its own absmax: every head keeps e4m3's
    # relative precision, down to the subnormals near zero.
    gen = torch.Generator().manual_seed(0)
    heads, head_dim = 3, 16
    magnitudes = head_magnitudes(1e-3, 10.0, heads, torch.device("cpu"))
    key = torch.randn(512, heads, head_dim, generator=gen) * magnitudes[:, None]
    scale = key.abs().amax(dim=(0, 2)) / pa.FP8_MAX
    k_cache = torch.empty(32, 16, heads, head_dim, dtype=FP8)
    v_cache = torch.empty_like(k_cache)

    pa.write_kv_ref(key, key, k_cache, v_cache, torch.arange(512), k_scale=scale, v_scale=scale)

    read = dequantize(k_cache.view(-1, heads, head_dim), scale)
    err = (read - key).abs()
    assert (err <= E4M3_HALF_STEP * key.abs() + E4M3_HALF_SUBNORMAL_STEP * scale[:, None]).all()
    # The bound is the real precision, not slack: some values come within 10% of it.
    normal = key.abs() >= 2.0**-6 * scale[:, None]
    assert float((err[normal] / key.abs()[normal]).max()) > 0.9 * E4M3_HALF_STEP


def test_fp8_write_saturates_at_448_times_the_scale_instead_of_overflowing_to_nan() -> None:
    scale = torch.tensor([0.5, 2.0])
    key = torch.tensor([[[1e4, -1e4, 448.0, -500.0]] * 2])  # [1 token, 2 heads, 4]
    k_cache = torch.empty(1, 4, 2, 4, dtype=FP8)
    v_cache = torch.empty_like(k_cache)

    pa.write_kv_ref(key, key, k_cache, v_cache, torch.tensor([2]), k_scale=scale, v_scale=scale)

    assert dequantize(k_cache[0, 2], scale).tolist() == [
        [224.0, -224.0, 224.0, -224.0],  # scale 0.5: +-448 * 0.5
        [896.0, -896.0, 448.0, -512.0],  # scale 2: +-448 * 2 saturated; 448 and -500 representable after / 2
    ]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_write_kv_kernel_stores_the_same_bytes_as_ref(dtype: torch.dtype) -> None:
    # Every e4m3 value, every midpoint between neighbours (ties: round half to even decides, and the
    # mantissa carries into the next binade), each midpoint one fp32 step either side, values past
    # 448 (saturation), subnormals and -0.0. Power-of-two scales keep x / scale exact; with 0.3 it
    # lands within a rounding of the ties, where only IEEE division (div_rn, as torch) agrees.
    gen = torch.Generator().manual_seed(2)
    heads, head_dim = 3, 32
    scale = torch.tensor([1.0, 0.0625, 0.3])
    grid = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448 (0x7F is NaN)
    mids = (grid[1:] + grid[:-1]) / 2
    inf = torch.tensor(math.inf)
    values = torch.cat([grid, mids, mids.nextafter(inf), mids.nextafter(-inf), torch.tensor([449.0, 464.0, 1e4])])
    values = torch.cat([values, -values, torch.full((1,), -0.0)])
    pad = -len(values) % (heads * head_dim)
    rows = torch.cat([values, torch.randn(pad, generator=gen)]).view(-1, heads, head_dim)
    key = (rows * scale[:, None]).to(dtype)
    value = -key.flip(0)
    num_tokens = key.shape[0]
    slots = torch.randperm(num_tokens + 16, generator=gen)[:num_tokens]
    slots[[1, 7]] = -1
    cache_shape = (-(-(num_tokens + 16) // 16), 16, heads, head_dim)
    k_ref = torch.zeros(cache_shape, dtype=FP8)
    v_ref = torch.zeros(cache_shape, dtype=FP8)
    k_got, v_got = k_ref.clone().to(DEVICE), v_ref.clone().to(DEVICE)

    pa.write_kv_ref(key, value, k_ref, v_ref, slots, k_scale=scale, v_scale=scale)
    pa.write_kv(
        key.to(DEVICE), value.to(DEVICE), k_got, v_got, slots.to(DEVICE),
        k_scale=scale.to(DEVICE), v_scale=scale.to(DEVICE),
    )  # fmt: skip

    assert torch.equal(k_got.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.cpu().view(torch.uint8), v_ref.view(torch.uint8))


def test_fp8_reference_attention_stays_within_a_sixteenth_of_each_heads_value_range() -> None:
    # The fp8 cache against the same K/V unquantized. Each output is a softmax-weighted mean of V
    # rows, so V's rounding alone moves it by <= 2^-4 of the head's largest |V|; K's rounding
    # perturbs the weights. Measured over 6 seeds: max |error| / max|V_head| = 0.016 .. 0.037 for
    # fp8 (a bf16 cache: 0.001 .. 0.002); asserted: <= 2^-4.
    seq_lens = [1, 40, 300, 1000]
    case = PagedCase(seq_lens, 2, 64, 16, torch.float32, seed=4)
    fp8 = quantize_fp8(case)
    q, query_start_loc = case.queries([1] * len(seq_lens), 8)
    args = (case.block_tables, case.seq_lens, query_start_loc, 1 / 8)

    exact = pa.paged_attention_ref(q, case.k_cache, case.v_cache, *args)
    got = pa.paged_attention_ref(q, fp8.k_cache, fp8.v_cache, *args, **fp8.scales)

    v_max = case.v_cache.abs().amax(dim=(0, 1, 3)).repeat_interleave(4)  # per q head
    err = ((got - exact).abs() / v_max[:, None]).max()
    assert 0 < float(err) <= E4M3_HALF_STEP


@needs_triton
@pytest.mark.parametrize(
    ("q_dtype", "num_q_heads", "num_kv_heads", "head_dim"),
    [(torch.float32, 8, 2, 32), (torch.bfloat16, 8, 2, 32), (torch.float16, 3, 3, 16)],
    ids=["f32-gqa4", "bf16-gqa4", "f16-mha"],
)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-kv"])
def test_fp8_decode_kernel_matches_the_fp8_reference(
    q_dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, num_splits: int
) -> None:
    # Same quantized bytes on both sides, so the kernel is held to q's dtype tolerance (fp32: 1e-5).
    case = PagedCase([1, 16, 37, 130], num_kv_heads, head_dim, 16, torch.float32, spare_table_entries=10)
    _decode_against_ref(case, num_q_heads, num_splits, fp8=quantize_fp8(case), q_dtype=q_dtype)


@needs_triton
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_prefill_kernel_matches_the_fp8_reference(q_dtype: torch.dtype) -> None:
    seq_lens, q_lens = [21, 100, 37, 83], [21, 40, 1, 19]
    case = PagedCase(seq_lens, 2, 32, 8, torch.float32)
    _prefill_against_ref(case, q_lens, 4, fp8=quantize_fp8(case), q_dtype=q_dtype)


def _fp8_call(entry: str, scales: dict[str, torch.Tensor], cache_dtype: torch.dtype = FP8) -> None:
    """Call one public entry point on a tiny cache of `cache_dtype` with bf16 q/K/V."""
    k_cache = torch.zeros(2, 8, 2, 16, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.zeros(1, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    calls = {
        "write_kv_ref": lambda: pa.write_kv_ref(kv, kv, k_cache, v_cache, slots, **scales),
        "write_kv": lambda: pa.write_kv(kv, kv, k_cache, v_cache, slots, **scales),
        "paged_attention_ref": lambda: pa.paged_attention_ref(q, k_cache, v_cache, tables, lens, starts, 1.0, **scales),
        "paged_decode_attention": lambda: pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, **scales),
        "paged_prefill_attention": lambda: pa.paged_prefill_attention(
            q, k_cache, v_cache, tables, lens, starts, 1, 1.0, **scales
        ),
    }
    calls[entry]()


ENTRY_POINTS = ["write_kv_ref", "write_kv", "paged_attention_ref", "paged_decode_attention", "paged_prefill_attention"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_fp8_cache_without_scales_is_rejected(entry: str) -> None:
    with pytest.raises(ValueError, match=r"fp8 .* KV cache needs k_scale and v_scale .*v_scale is None"):
        _fp8_call(entry, {"k_scale": torch.ones(2, device=DEVICE)})


@pytest.mark.parametrize("entry", ["write_kv", "paged_decode_attention"])
def test_scales_for_a_bf16_cache_are_rejected_not_ignored(entry: str) -> None:
    scales = {"k_scale": torch.ones(2, device=DEVICE), "v_scale": torch.ones(2, device=DEVICE)}
    with pytest.raises(ValueError, match="apply only to an fp8"):
        _fp8_call(entry, scales, cache_dtype=torch.bfloat16)


def test_fp8_scales_must_be_float32_per_kv_head() -> None:
    scales = {"k_scale": torch.ones(2, device=DEVICE), "v_scale": torch.ones(4, device=DEVICE)}
    with pytest.raises(ValueError, match=r"v_scale must be float32 \[num_kv_heads\] = \[2\]"):
        _fp8_call("paged_attention_ref", scales)


def test_other_fp8_cache_dtypes_are_rejected() -> None:
    with pytest.raises(ValueError, match="only fp8 KV cache dtype supported"):
        _fp8_call("write_kv_ref", {}, cache_dtype=torch.float8_e5m2)


# ----------------------------------------------------------------------------------------------
# GPU: real shapes (on a machine with a CUDA GPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 4, 128), (64, 8, 64), (32, 8, 128)])
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_real_shapes(
    num_q_heads: int, num_kv_heads: int, head_dim: int, context: int, num_splits: int | None
) -> None:
    # Batch 32 at the given context, a few shorter sequences mixed in.
    seq_lens = [context] * 28 + [context - 1, context // 3 + 5, 17, 1]
    case = PagedCase(seq_lens, num_kv_heads, head_dim, 16, torch.bfloat16)
    _decode_against_ref(case, num_q_heads, num_splits)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 4, 128), (64, 8, 64)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunked_prefill_real_shapes(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # Chunks of 512-2048 over prefixes up to 32K, plus a whole 2048-token prompt and a decode token.
    q_lens = [2048, 2048, 512, 1000, 1536, 1]
    prefixes = [0, 30720, 4096, 16000, 31000, 20000]
    case = PagedCase([p + n for p, n in zip(prefixes, q_lens, strict=True)], num_kv_heads, head_dim, 16, torch.bfloat16)
    _prefill_against_ref(case, q_lens, num_q_heads)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(32, 4), (64, 8)], ids=["gqa8-32q", "gqa8-64q"])
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_decode_real_shapes(num_q_heads: int, num_kv_heads: int, context: int, num_splits: int | None) -> None:
    # bf16 q over an fp8 cache, head_dim 128, GQA 8:1, batch 32 with a few shorter sequences.
    seq_lens = [context] * 28 + [context - 1, context // 3 + 5, 17, 1]
    case = PagedCase(seq_lens, num_kv_heads, 128, 16, torch.float32)
    _decode_against_ref(case, num_q_heads, num_splits, fp8=quantize_fp8(case), q_dtype=torch.bfloat16)


@pytest.mark.parametrize("merge", list(MERGES))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_split_decode_merges_under_a_cuda_graph(monkeypatch: pytest.MonkeyPatch, merge: str, fp8: bool) -> None:
    # Batch 32 at 4K (2 splits for both dtypes), captured once and replayed on new queries and lengths: the PDL launch
    # must capture as a graph edge, the fold's counters must reset on every replay.
    fold_max, pdl = MERGES[merge]
    policy = dataclasses.replace(POLICY, decode_fold_max_splits=fold_max, decode_reduce_pdl=pdl)
    seq_lens = [4096] * 28 + [4095, 1370, 17, 1]
    case = PagedCase(seq_lens, 8, 128, 16, torch.float32 if fp8 else torch.bfloat16)
    kv = quantize_fp8(case) if fp8 else None
    k_cache, v_cache, scales = _caches(case, kv)
    q, qsl = case.queries([1] * 32, 32)
    q = q.to(torch.bfloat16)
    scale = 128**-0.5
    out = torch.empty_like(q)

    def call() -> None:
        pa.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, scale, out,
                                  max_seq_len=4096, policy=policy, **scales)

    assert pa.decode_num_splits(32 * 8, 4096, DEVICE, fp8=fp8) == 2
    reduce = LaunchSpy(pa_decode._decode_reduce_kernel)
    monkeypatch.setattr(pa_decode, "_decode_reduce_kernel", reduce)
    call()  # compile outside the capture
    assert len(reduce.launches) == (merge != "fold")  # 2 splits: folded, or the reduce as this test forces it
    assert all(k["PDL"] is pdl and k.get("launch_pdl", False) is pdl for k in reduce.launches)  # an H100/H200
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    for lens in (seq_lens, seq_lens[::-1]):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE))
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.zero_()
        graph.replay()
        want = pa.paged_attention_ref(q, k_cache, v_cache, case.block_tables, case.seq_lens, qsl, scale, **scales)
        _assert_close_for(out, want, torch.bfloat16, kv)
    if merge == "fold":
        assert not pa_decode._FOLD_COUNTERS[q.device].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_decode_past_2_to_the_31_elements() -> None:
    # fp8 caches of 2^17 + 64 blocks x 16 x 8 x 128 (2.15 GB each): the sequences' blocks sit at the end, where
    # element offsets pass 2^31, so a missing int64 cast would read the wrong memory. The reference reads only the
    # blocks the tables name.
    blocks, bs, heads, dim = 2**17 + 64, 16, 8, 128
    k_cache = torch.zeros(blocks, bs, heads, dim, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    assert pa_checks._needs_int64_offsets(k_cache, v_cache)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    seq_lens = [1000, 517]
    tables = torch.arange(blocks - 128, blocks, device=DEVICE, dtype=torch.int32).view(2, 64)
    used = tables.flatten().long()
    k_cache[used] = torch.randn(len(used), bs, heads, dim, generator=gen, device=DEVICE).to(FP8)
    v_cache[used] = torch.randn(len(used), bs, heads, dim, generator=gen, device=DEVICE).to(FP8)
    q = torch.randn(2, 32, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(heads, device=DEVICE)
    got = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, k_scale=ones, v_scale=ones)
    want = pa.paged_attention_ref(q, k_cache, v_cache, tables, lens, torch.arange(3, dtype=torch.int32,
                                  device=DEVICE), dim**-0.5, k_scale=ones, v_scale=ones)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_chunked_prefill_real_shapes() -> None:
    q_lens = [2048, 2048, 512, 1000, 1536, 1]
    prefixes = [0, 30720, 4096, 16000, 31000, 20000]
    case = PagedCase([p + n for p, n in zip(prefixes, q_lens, strict=True)], 4, 128, 16, torch.float32)
    _prefill_against_ref(case, q_lens, 32, fp8=quantize_fp8(case), q_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_write_kv_real_shapes_stores_the_same_bytes_as_ref() -> None:
    # A 4096-token prefill chunk of 8 kv heads x 128 in bf16, scattered into a 16-token-block cache;
    # the hardware cast (round to nearest even, saturating) against torch's.
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    heads, head_dim, num_tokens = 8, 128, 4096
    key = (torch.randn(num_tokens, heads, head_dim, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    value = (torch.randn(num_tokens, heads, head_dim, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    # Scales at the 99th percentile so some values saturate.
    k_scale = key.float().abs().transpose(0, 1).reshape(heads, -1).quantile(0.99, dim=1) / pa.FP8_MAX
    v_scale = head_magnitudes(0.001, 0.1, heads)
    slots = torch.randperm(num_tokens * 2, generator=gen, device=DEVICE)[:num_tokens]
    k_ref = torch.zeros(num_tokens * 2 // 16, 16, heads, head_dim, dtype=FP8, device=DEVICE)
    v_ref = torch.zeros_like(k_ref)
    k_got, v_got = k_ref.clone(), v_ref.clone()

    pa.write_kv_ref(key, value, k_ref, v_ref, slots, k_scale=k_scale, v_scale=v_scale)
    pa.write_kv(key, value, k_got, v_got, slots, k_scale=k_scale, v_scale=v_scale)

    assert torch.equal(k_got.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="the Gluon decode kernel runs on sm_90 only")


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim", "block_size", "q_dtype"), [
    (32, 8, 128, 16, torch.bfloat16), (8, 8, 128, 16, torch.float16), (16, 8, 64, 32, torch.bfloat16),
    (64, 8, 128, 16, torch.bfloat16), (32, 2, 128, 16, torch.float16), (40, 8, 128, 16, torch.bfloat16)],
    ids=["gqa4-bf16", "mha-f16", "gqa2-d64-bs32", "gqa8", "gqa16-f16", "gqa5"])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 12], ids=["unsplit", "split3-fold", "split8-fold", "split12-reduce"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_gluon_fp8_decode_matches_the_fp8_reference(monkeypatch: pytest.MonkeyPatch, num_q_heads: int,
                                                        num_kv_heads: int, head_dim: int, block_size: int,
                                                        q_dtype: torch.dtype, num_splits: int) -> None:
    # Lengths around the 16- and 64-key steps, the 64-key partition unit and the block size, an empty sequence, one
    # token, and long ones; per-head scales 100x apart. Twice, so the fold's counters must have reset.
    gluon, triton_kernel = LaunchSpy(pa_gluon._gluon_decode_kernel), LaunchSpy(pa_decode._decode_kernel)
    monkeypatch.setattr(pa_gluon, "_gluon_decode_kernel", gluon)
    monkeypatch.setattr(pa_decode, "_decode_kernel", triton_kernel)
    case = PagedCase([0, 1, 31, 32, 33, 64, 65, 100, 1000, 2500, 4097], num_kv_heads, head_dim, block_size,
                     torch.float32, spare_table_entries=7)
    kv = quantize_fp8(case)
    for _ in range(2):
        _decode_against_ref(case, num_q_heads, num_splits, fp8=kv, q_dtype=q_dtype)
    assert len(gluon.launches) == 2 and not triton_kernel.launches
    assert all(k["FOLD"] is (1 < num_splits <= POLICY.decode_fold_max_splits) for k in gluon.launches)
    # 11 x kv heads x splits programs: both tiles among the cases (e.g. 704 at 8 kv heads and 8 splits: 16 keys).
    run = pa.decode_num_splits(11 * num_kv_heads, case.block_tables.shape[1] * block_size, DEVICE, num_splits, fp8=True)
    assert all(k["TILE_N"] == pa_gluon._gluon_decode_tile(POLICY, 11 * num_kv_heads * run, DEVICE)
               for k in gluon.launches)
    if 1 < num_splits <= POLICY.decode_fold_max_splits:
        assert not pa_decode._FOLD_COUNTERS[case.seq_lens.device].any()


@pytest.mark.parametrize(("batch", "context", "tile"), [(32, 4096, SM90.gluon_tile_n_narrow),
                                                     (72, 700, SM90.gluon_tile_n_wide)],
                         ids=["b32-4k-split", "b72-unsplit-wide"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_gluon_and_triton_fp8_decode_agree(monkeypatch: pytest.MonkeyPatch, batch: int, context: int,
                                               tile: int) -> None:
    # The attention target's shape (batch 32 x 32:8 heads at 4K, 2 splits, 64 keys a step) and an unsplit launch of
    # 576 programs (16 keys a step, as the throughput workload's batch 256), against the reference and against the
    # Triton kernel on the same fp8 bytes. The kernels round differently (fp16 P in both, other summation orders),
    # so within bf16's tolerance, not bit-equal.
    gluon = LaunchSpy(pa_gluon._gluon_decode_kernel)
    monkeypatch.setattr(pa_gluon, "_gluon_decode_kernel", gluon)
    case = PagedCase([context] * (batch - 4) + [context - 1, context // 3 + 5, 17, 1], 8, 128, 16, torch.float32)
    kv = quantize_fp8(case)
    q, qsl = case.queries([1] * batch, 32)
    q = q.to(torch.bfloat16)
    outs = []
    for use_gluon in (True, False):
        outs.append(pa.paged_decode_attention(q, kv.k_cache, kv.v_cache, case.block_tables, case.seq_lens,
                                              128**-0.5, max_seq_len=context, **kv.scales,
                                              policy=dataclasses.replace(POLICY, gluon_decode=use_gluon)))
    (launch,) = gluon.launches
    assert launch["TILE_N"] == tile and launch["SPLIT"] is (tile == SM90.gluon_tile_n_narrow)
    want = pa.paged_attention_ref(q, kv.k_cache, kv.v_cache, case.block_tables, case.seq_lens, qsl, 128**-0.5,
                                  **kv.scales)
    _assert_close_for(outs[0], want, torch.bfloat16, kv)
    _assert_close_for(outs[0], outs[1], torch.bfloat16, kv)
