"""Paged attention: the Triton kernels against the torch reference, the reference against dense attention.

Without CUDA the kernels run under Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before anything imports the kernels (Triton reads it when `@triton.jit` decorates a kernel).
"""

import math

import pytest
import torch

from governor.kernels import paged_attention as pa

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol): fp32 is exact math; half types round P to 8 (bf16) or 11 (fp16) mantissa bits.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or pa._INTERPRET),
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
    case: PagedCase, num_q_heads: int, num_splits: int | None, out: torch.Tensor | None = None
) -> None:
    num_seqs = len(case.seq_lens_list)
    q, query_start_loc = case.queries([1] * num_seqs, num_q_heads)
    scale = 1 / math.sqrt(q.shape[2])
    want = pa.paged_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, scale
    )

    got = pa.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, out, num_splits=num_splits
    )

    assert got.dtype == q.dtype
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


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
    assert case.block_tables.shape[1] * 16 >= 2 * pa._SPLIT_MIN_PARTITION
    assert pa._choose_num_splits(2, 2048, torch.device("cpu")) > 1
    _decode_against_ref(case, 2, None)


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


def _prefill_against_ref(case: PagedCase, q_lens: list[int], num_q_heads: int) -> None:
    q, query_start_loc = case.queries(q_lens, num_q_heads)
    scale = 1 / math.sqrt(q.shape[2])
    want = pa.paged_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, scale
    )

    got = pa.paged_prefill_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, query_start_loc, max(q_lens), scale
    )

    assert got.dtype == q.dtype
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


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
# GPU: real shapes (run through the device tool)
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
