"""One-row products over AWQ's and GPTQ's packed integer weights: out = x @ W.T (+ bias), x [1, K], W dequantized
in registers from the packed codes, zero points and scales (never a dequantized copy).

`gptq_gemv` reads codes packed along the input features (GPTQ's layout, which models/quantization.py repacks AWQ's
into at load), `awq_gemv` AWQ's own layout. Groups of consecutive inputs take `_packed_split_kernel` (K split over the
programs, partial sums added in one order); act order and groups no K step divides take `_packed_gemv_kernel`, which
gathers each code's zero point and scale. `packed_codes` and `packed_zeros` unpack a tile for these kernels and for
the batched ones of packed_gemm.py. Measurements behind the shapes: docs/design/gemv.md#quantized-weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import pdl_launch, round_to, triton_usable
from governor.kernels.gemv import one_row_output, x_tile
from governor.kernels.launch_policy import LaunchPolicy, policy_for

# --- AWQ int4 weights -----------------------------------------------------------------------------------------------
# AWQ's GEMM layout (models/quantization.py): qweight [K, N/8] int32, 8 four-bit codes per int32 along the output
# features, nibble j holding column AWQ_ORDER[j] = (0, 2, 4, 6, 1, 3, 5, 7)[j] of its eight; qzeros [G, N/8] packed
# the same way; scales [G, N] float16; G = K / group_size. W[o, i] = (q[i, o] - z[i // group_size, o]) *
# s[i // group_size, o], exact in fp32; `awq_gemv` and `gptq_gemv` sum x times it in fp32 and round once (never
# rounding W itself, as `fp8_gemv`).
#
# Where every K step lies in one group (groups of consecutive features: AWQ always, GPTQ without act order), a step's
# zero points and scales are one per output feature: the step sums q * x per feature, then applies them once,
# s * (sum(q * x) - z * sum(x)), so a code costs its unpacking and a multiply-add. Act order (GPTQ's g_idx scattering
# the features over the groups) gathers each code's zero point and scale (the slow general case).


def awq_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `awq_gemv` computes, in PyTorch: x times the weight unpacked and dequantized in fp32, plus bias, rounded
    once to x's dtype."""
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=qweight.device)  # column c's nibble (AWQ_ORDER inverted)
    shifts = 4 * order.repeat(qweight.shape[1])

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return (packed.repeat_interleave(8, dim=1) >> shifts) & 0xF

    groups = torch.arange(qweight.shape[0], device=qweight.device) // group_size
    w = (unpack(qweight) - unpack(qzeros)[groups]).float() * scales.float()[groups]  # [K, N]
    return F.linear(x.float(), w.t(), None if bias is None else bias.float()).to(x.dtype)


def packed_gemv_usable(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `awq_gemv` or `gptq_gemv` takes this product: one contiguous row of x, Triton available, a contiguous
    int32 qweight."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and triton_usable(x) and qweight.dim() == 2
            and qweight.dtype == torch.int32 and qweight.is_contiguous())


@triton.jit
def packed_codes(qw_ptr, ks, cols, n, K: tl.constexpr, BITS: tl.constexpr, GPTQ: tl.constexpr):
    # The unsigned codes' [BLOCK_K, BLOCK_N] tile (input features ks, output features cols), int32.
    mask = (ks < K)[:, None] & (cols < n)[None, :]
    if GPTQ:  # packed along the input features, lowest bits first
        per: tl.constexpr = 32 // BITS
        words = tl.load(qw_ptr + (ks // per).to(tl.int64)[:, None] * n + cols[None, :], mask=mask, other=0)
        return (words >> ((ks % per) * BITS)[:, None]) & ((1 << BITS) - 1)
    # AWQ: along the output features, column c in nibble (c % 8) // 2, plus 4 for odd c
    words = tl.load(qw_ptr + ks.to(tl.int64)[:, None] * (n // 8) + (cols // 8)[None, :], mask=mask, other=0)
    return (words >> (((cols % 8) // 2 + (cols % 2) * 4) * 4)[None, :]) & 0xF


@triton.jit
def packed_zeros(qz_ptr, groups, cols, n, mask, BITS: tl.constexpr, GPTQ: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    # The zero points of output features cols in groups `groups` (any shapes that broadcast together), int32.
    # GPTQ: packed along the output features in column order, each stored ZERO_OFFSET less than the zero point (1 in
    # GPTQ's checkpoint format v1; 0 for AWQ's zero points repacked at load, models/quantization.py).
    if GPTQ:
        per: tl.constexpr = 32 // BITS
        words = tl.load(qz_ptr + groups * (n // per) + cols // per, mask=mask, other=0)
        return ((words >> ((cols % per) * BITS)) & ((1 << BITS) - 1)) + ZERO_OFFSET
    words = tl.load(qz_ptr + groups * (n // 8) + cols // 8, mask=mask, other=0)
    return (words >> (((cols % 8) // 2 + (cols % 2) * 4) * 4)) & 0xF


@triton.jit
def _packed_step(x_ptr, q, qz_ptr, s_ptr, g_ptr, k0, ks, cols, n, K: tl.constexpr, GROUP: tl.constexpr,
                 BITS: tl.constexpr, GPTQ: tl.constexpr, GROUPED: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                 dtype: tl.constexpr):
    # The contribution of the K step at k0 (input features ks, codes q from `packed_codes`) to the program's
    # BLOCK_N outputs, in fp32.
    x = x_tile(x_ptr, ks, K, False, dtype)
    q = q.to(tl.float32)
    n_mask = cols < n
    if GROUPED:  # the step lies in one group: its zero points and scales apply to the step's sums
        group = k0 // GROUP
        z = packed_zeros(qz_ptr, group, cols, n, n_mask, BITS, GPTQ, ZERO_OFFSET).to(tl.float32)
        s = tl.load(s_ptr + group * n + cols, mask=n_mask, other=0.0).to(tl.float32)
        return s * (tl.sum(q * x[:, None], axis=0) - z * tl.sum(x, axis=0))
    mask = (ks < K)[:, None] & n_mask[None, :]
    if GPTQ:
        groups = tl.load(g_ptr + ks, mask=ks < K, other=0).to(tl.int64)[:, None]
    else:
        groups = (ks // GROUP).to(tl.int64)[:, None]
    z = packed_zeros(qz_ptr, groups, cols[None, :], n, mask, BITS, GPTQ, ZERO_OFFSET).to(tl.float32)
    s = tl.load(s_ptr + groups * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.sum((q - z) * s * x[:, None], axis=0)


@triton.jit
def _packed_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, out_ptr, n, K: tl.constexpr, GROUP: tl.constexpr,
                        BITS: tl.constexpr, GPTQ: tl.constexpr, GROUPED: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    # One-row GEMV over AWQ's (GPTQ False) or GPTQ's packed integer weights. Program: BLOCK_N output features, a sum
    # per K step (GROUPED: zero points and scales applied to it; see above). The first step's codes are read before
    # waiting for the kernel before (PDL), as `_gemv_kernel` reads its first weight tile.
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    q = packed_codes(qw_ptr, kk, cols, n, K, BITS, GPTQ)
    if PDL:
        gdc_wait()
    out = _packed_step(x_ptr, q, qz_ptr, s_ptr, g_ptr, 0, kk, cols, n, K, GROUP, BITS, GPTQ, GROUPED, ZERO_OFFSET,
                       dtype)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        q = packed_codes(qw_ptr, ks, cols, n, K, BITS, GPTQ)
        out += _packed_step(x_ptr, q, qz_ptr, s_ptr, g_ptr, k0, ks, cols, n, K, GROUP, BITS, GPTQ, GROUPED,
                            ZERO_OFFSET, dtype)
    n_mask = cols < n
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


PACKED_BLOCK_N = 32  # the general kernel: output features a program takes (AWQ: 4 packs of 8)
PACKED_BLOCK_K = 128  # the general kernel: input features a K step takes, at most


def packed_k_step(k: int, group_size: int, in_order: bool) -> tuple[int, bool]:
    """(K step, grouped) of a packed GEMV over K inputs: the largest power of two up to PACKED_BLOCK_K that divides
    the groups (of `group_size` consecutive features when `in_order`), so that every step lies in one group; else
    PACKED_BLOCK_K and the general case."""
    group = k if group_size <= 0 else group_size
    step = PACKED_BLOCK_K
    while step > 16 and group % step:
        step //= 2
    if in_order and group % step == 0 and k % group == 0:
        return step, True
    return PACKED_BLOCK_K, False


# --- The grouped products, split along K ----------------------------------------------------------------------------
# Where every K step lies in one group, `_packed_split_kernel` runs the product instead: each program takes BLOCK_N
# output features over one CHUNK of the input features (split-K), loads each int32 once and unpacks its codes in
# registers. A program over all of K, as `_gemv_kernel` runs, serializes too much per program for int4's few bytes:
# on an H200 llama3-8b's qkv product took 41 us that way in GPTQ's layout and 355 in AWQ's, 15 and 18 split
# (scripts/quantized-gemv-sweep.py, docs/design/gemv.md). Each split
# writes its partial sums to a float32 workspace [SPLITS, N]; the last split of a column block to arrive (a counter
# per block, atomic) adds the partials in one fixed order and writes the output, so results do not depend on which
# split finished first, and resets the counter to zero for the next launch.
#
# GPTQ's layout: a code becomes a float32 without a conversion or a shift. Masked in place, the code at bits
# j * BITS.. of a word (j < PER / 2; the word's upper half is shifted down once for the rest) is, read as a float32,
# the subnormal code * 2^(j * BITS - 149), exactly; the FFMA with x * 2^(85 - j * BITS) (also exact) adds
# code * x * 2^-64, which a step scales back by 2^64 and corrects by the zero point, s * (2^64 * sum(code * x * 2^-64)
# - z * sum(x)). A code costs one AND and one FFMA (the kernel before took a shift, a mask, an OR with the exponent
# of 2^23, a subtraction and an FFMA): the products are bound by instruction issue, not bytes, at these sizes.
# Subnormal operands are exact in FFMA (Triton compiles without flush-to-zero). Range: |x| below 2^43 (x * 2^85
# stays finite); a product code * x below 2^-62 lands among the subnormals and keeps fewer bits (its absolute error
# stays under 2^-86 a term), which activations that small (SiLU of a large negative input) cannot notice. The zero
# point applied to the step's sum carries fp32 rounding of sum(code * x), not of sum((code - z) * x): about 2^-25 of
# the output's scale, as `_packed_gemv_kernel`'s grouped steps do.
# AWQ's own layout: (code | 0x4B000000) is the float 2^23 + code, and subtracting 2^23 + z gives code - z exactly;
# each step adds s * sum((q - z) * x) over its group.


@triton.jit
def _split_k_finish(partial, ws_ptr, cnt_ptr, out_ptr, b_ptr, offs, mask, n, SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, HAS_BIAS: tl.constexpr, bias_offs=None):
    # The split-K epilogue (see above) for one program's BLOCK partial sums at output offsets offs: n is a split's
    # stride in the workspace (the outputs of a launch), bias_offs the bias's offsets (None: offs).
    dtype = out_ptr.dtype.element_ty
    if SPLITS == 1:
        total = partial
    else:
        tl.store(ws_ptr + tl.program_id(1) * n + offs, partial, mask=mask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves (release, below)
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel")
        total = tl.zeros(partial.shape, tl.float32)
        if arrived == SPLITS - 1:  # the last split: every partial is in the workspace
            # Eight splits' partials at a time, fewer for a program of more than 256 outputs (a program of 1,024
            # columns would hold 16 x 1,024 at once).
            EACH: tl.constexpr = 2048 // partial.shape[0] if partial.shape[0] < 2048 else 1
            ROWS: tl.constexpr = min(8, EACH, SPLITS_P2)
            for first in tl.static_range(0, SPLITS_P2, ROWS):
                splits = first + tl.arange(0, ROWS)
                parts = tl.load(ws_ptr + splits[:, None] * n + offs[None, :],
                                mask=(splits < SPLITS)[:, None] & mask[None, :], other=0.0, cache_modifier=".cg")
                total += tl.sum(parts, axis=0)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)
    if HAS_BIAS:
        total += tl.load(b_ptr + (offs if bias_offs is None else bias_offs), mask=mask, other=0.0).to(tl.float32)
    if SPLITS == 1:
        tl.store(out_ptr + offs, round_to(total, dtype).to(dtype), mask=mask)
    else:
        tl.store(out_ptr + offs, round_to(total, dtype).to(dtype), mask=mask & (arrived == SPLITS - 1))


@triton.jit
def _packed_split_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, ws_ptr, cnt_ptr, out_ptr, n, K: tl.constexpr,
                         GROUP: tl.constexpr, BITS: tl.constexpr, GPTQ: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                         ZERO_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    # Program (i, j): output features i * BLOCK_N.., input features j * CHUNK.. in K steps of BLOCK_K, each in one
    # group. AWQ (GPTQ False): a step's words are [BLOCK_K, BLOCK_N / 8], nibble c of a word holding output feature
    # 8p + (c % 4) * 2 + c // 4. GPTQ: [BLOCK_K / PER, BLOCK_N], code i of a word holding input feature PER * r + i.
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    k_first = tl.program_id(1) * CHUNK
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # before any read: the workspace counters are shared with the kernel before
    if GPTQ:
        HALF: tl.constexpr = PER // 2
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < n
        rr = tl.arange(0, BLOCK_K // PER)
        out = tl.zeros([BLOCK_N], tl.float32)
        for k_step in range(0, CHUNK, BLOCK_K):
            k0 = k_first + k_step
            rows = k0 // PER + rr
            words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :], mask=n_mask[None, :], other=0)
            group = k0 // GROUP
            z = packed_zeros(qz_ptr, group, cols, n, n_mask, BITS, True, ZERO_OFFSET).to(tl.float32)
            s = tl.load(s_ptr + group * n + cols, mask=n_mask, other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_K // PER, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_K // PER], tl.float32)
            for h in tl.static_range(2):
                w = words.to(tl.uint32, bitcast=True) >> (16 * h)
                for j in tl.static_range(HALF):
                    q = (w & (MASK << (j * BITS))).to(tl.float32, bitcast=True)  # code * 2^(j * BITS - 149)
                    x = tl.load(x_ptr + rows * PER + (h * HALF + j)).to(tl.float32)
                    x_sum += x
                    acc += q * (x * (2.0 ** (85 - j * BITS)))[:, None]
            out += s * (tl.sum(acc, axis=0) * 18446744073709551616.0 - z * tl.sum(x_sum, axis=0))  # 2^64
    else:
        packs_n = n // 8
        packs = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        c = tl.arange(0, 8)
        cols2 = packs[:, None] * 8 + ((c % 4) * 2 + c // 4)[None, :]  # [BLOCK_N / 8, 8]
        mask2 = (packs < packs_n)[:, None] & (c < 8)[None, :]
        kk = tl.arange(0, BLOCK_K)
        out2 = tl.zeros([BLOCK_N // 8, 8], tl.float32)
        for k_step in range(0, CHUNK, BLOCK_K):
            k0 = k_first + k_step
            words = tl.load(qw_ptr + (k0 + kk).to(tl.int64)[:, None] * packs_n + packs[None, :],
                            mask=(packs < packs_n)[None, :], other=0)
            q = (((words[:, :, None] >> (c * 4)[None, None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            group = k0 // GROUP
            zw = tl.load(qz_ptr + group * packs_n + packs, mask=packs < packs_n, other=0)
            z = ((zw[:, None] >> (c * 4)[None, :]) & 0xF).to(tl.float32) + 8388608.0
            s = tl.load(s_ptr + group * n + cols2, mask=mask2, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + k0 + kk).to(tl.float32)
            out2 += s * tl.sum((q - z[None, :, :]) * x[:, None, None], axis=0)
        out = tl.reshape(out2, [BLOCK_N])
        cols = tl.reshape(cols2, [BLOCK_N])
        n_mask = tl.reshape(mask2, [BLOCK_N])
    _split_k_finish(out, ws_ptr, cnt_ptr, out_ptr, b_ptr, cols, n_mask, n, SPLITS, SPLITS_P2, HAS_BIAS)


_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers, kept: captured CUDA graphs may still point at them


def packed_split_shape(k: int, group_size: int, bits: int, gptq: bool, max_chunk: int, max_rows: int
                       ) -> tuple[int, int] | None:
    """(K step, chunk) of the split kernel over K inputs in groups of `group_size` consecutive features, or None
    where it does not apply: the step is the largest power of two up to `max_rows` words a column (GPTQ, the policy's
    `packed_split_rows`; 64 inputs for AWQ, whose step unpacks [step, 32, 8] codes) that divides the group and holds
    whole words, the chunk the step doubled while it stays within `max_chunk` (the policy's `packed_split_chunk`;
    one step where the step alone is larger) and divides K."""
    if max_rows < 1:
        raise ValueError(f"packed_split_shape: max_rows must be at least 1, got {max_rows}")
    per = 32 // bits
    if group_size <= 0 or k % group_size:
        return None
    step = (1 << (max_rows.bit_length() - 1)) * per if gptq else 64
    while step >= 8 and group_size % step:
        step //= 2
    if step < 8 or step % per:
        return None
    chunk = step
    while chunk * 2 <= max_chunk and k % (chunk * 2) == 0:
        chunk *= 2
    return step, chunk


def _split_counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The split kernel's counters on `device`, zero between launches (each launch's last splits reset theirs).

    One buffer serves every launch on the device, which holds while they run one after another: the engine runs
    every kernel on one stream, and under PDL a split launch waits for the kernel before it to end before it touches
    the counters (every kernel of the decode chain waits so before it writes anything). Split GEMVs on two streams of
    one device at once would share counters and are not supported. A buffer that is outgrown is kept alive, not
    freed: CUDA graphs captured with it still address it."""
    have = _SPLIT_COUNTERS.get(device)
    if have is None or have.numel() < blocks:
        if have is not None:
            _RETIRED_COUNTERS.append(have)
        have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[device] = have
    return have


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, *, policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`awq_gemv_ref` in one Triton kernel for x [1, K] and AWQ's packed int4 tensors; returns [1, N] in x's dtype.
    Groups whose size a power-of-two K step of 8 or more divides take the split kernel (`packed_split_shape`; the
    policy's `packed_split*` fields, None: the device's), others the general one (`packed_k_step`)."""
    if not packed_gemv_usable(x, qweight):
        raise ValueError(f"awq_gemv: needs a contiguous x [1, K] on a Triton device and a contiguous int32 qweight "
                         f"[K, N/8]; got x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)} {qweight.dtype}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = k // group_size if group_size > 0 and k % group_size == 0 else 0
    if x.shape[1] != k or not groups:
        raise ValueError(f"awq_gemv: x has {x.shape[1]} columns and qweight {k} rows, which group_size {group_size} "
                         "must divide; they must be equal")
    if tuple(qzeros.shape) != (groups, n // 8) or tuple(scales.shape) != (groups, n) or not (
            qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"awq_gemv: qzeros must be [{groups}, {n // 8}] and scales [{groups}, {n}], contiguous; got "
                         f"{tuple(qzeros.shape)} and {tuple(scales.shape)}")
    return _packed_launch("awq_gemv", x, qweight, qzeros, scales, None, bias, n, k, group_size, 4, True, policy)


def _packed_launch(name: str, x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, bias: torch.Tensor | None, n: int, k: int, group_size: int, bits: int,
                   in_order: bool, policy: LaunchPolicy | None, zero_offset: int = 1) -> torch.Tensor:
    """A checked AWQ (`g_idx` None) or GPTQ product's launch (`one_row_output` with `policy`, None: the device's):
    `_packed_split_kernel` where the groups are in order and `packed_split_shape` gives a step, else
    `_packed_gemv_kernel` with the fixed PACKED_BLOCK_N by `packed_k_step`."""
    policy = policy or policy_for(x.device)
    pdl, out = one_row_output(name, x, bias, n, policy)
    # GPTQ's layout (AWQ's repacked into it) takes the policy's tile; AWQ's own its own (its [step, 32, 8] unpacking
    # spills registers on the 2 warps of GPTQ's tile).
    gptq = g_idx is not None
    block_n, max_chunk, warps = ((policy.packed_split_block_n, policy.packed_split_chunk, policy.packed_split_warps)
                                 if gptq else policy.packed_split_awq_tile)
    split = packed_split_shape(k, group_size, bits, gptq, max_chunk, policy.packed_split_rows) \
        if in_order and policy.packed_split else None
    if split is not None:
        step, chunk = split
        splits = k // chunk
        blocks = triton.cdiv(n, block_n)
        pdl = pdl and policy.packed_split_pdl
        ws = torch.empty(splits if splits > 1 else 0, n, dtype=torch.float32, device=x.device)
        _packed_split_kernel[(blocks, splits)](
            x, qweight, qzeros, scales, out if bias is None else bias, ws, _split_counters(x.device, blocks), out, n,
            K=k, GROUP=group_size, BITS=bits, GPTQ=gptq, BLOCK_N=block_n, BLOCK_K=step,
            CHUNK=chunk, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), ZERO_OFFSET=zero_offset,
            HAS_BIAS=bias is not None, PDL=pdl, num_warps=warps, **pdl_launch(pdl),
        )  # fmt: skip
        return out
    block_k, grouped = packed_k_step(k, group_size, in_order)
    _packed_gemv_kernel[(triton.cdiv(n, PACKED_BLOCK_N),)](
        x, qweight, qzeros, scales, qweight if g_idx is None else g_idx, out if bias is None else bias, out, n, K=k,
        GROUP=max(group_size, 1), BITS=bits, GPTQ=g_idx is not None, GROUPED=grouped, ZERO_OFFSET=zero_offset,
        BLOCK_N=PACKED_BLOCK_N,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, PDL=pdl, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return out


# --- GPTQ int4 / int8 weights ---------------------------------------------------------------------------------------
# GPTQ (checkpoint format v1): qweight [K / p, N] int32 with p = 32 / bits codes per int32 along the input features,
# lowest bits first; qzeros [G, N / p] packed the same way along the output features, each stored one less than the
# zero point; scales [G, N]; g_idx [K] the group of each input feature (act-order checkpoints scatter them). The weight
# is W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], exact in fp32 (above).


def gptq_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None, *, zeros_minus_one: bool = True
                  ) -> torch.Tensor:
    """What `gptq_gemv` computes, in PyTorch: x times the weight unpacked and dequantized in fp32, plus bias, rounded
    once to x's dtype."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = bits * torch.arange(per, device=qweight.device)
    q = ((qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & mask).reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, per)) & mask).reshape(qzeros.shape[0], -1) + int(zeros_minus_one)
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]  # [K, N]
    return F.linear(x.float(), w.t(), None if bias is None else bias.float()).to(x.dtype)


def gptq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int, bias: torch.Tensor | None = None, *, group_size: int | None = None,
              policy: LaunchPolicy | None = None, zeros_minus_one: bool = True) -> torch.Tensor:
    """`gptq_gemv_ref` in one Triton kernel for x [1, K] and GPTQ's packed 4- or 8-bit tensors (act-order included:
    each input feature's group is read from g_idx); returns [1, N] in x's dtype. `group_size`: the caller knows that
    g_idx is i // group_size (no act order), which takes the split kernel where `packed_split_shape` allows (as
    `awq_gemv`); act order takes the general kernel, which gathers each code's zero point and scale.
    `zeros_minus_one`: qzeros holds each zero point less one (GPTQ's checkpoint format v1), else the zero points
    themselves (AWQ's, repacked at load)."""
    if bits not in (4, 8):
        raise ValueError(f"gptq_gemv: bits must be 4 or 8, got {bits}")
    if not packed_gemv_usable(x, qweight):
        raise ValueError(f"gptq_gemv: needs a contiguous x [1, K] on a Triton device and a contiguous int32 qweight "
                         f"[K/{32 // bits}, N]; got x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    per = 32 // bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    groups = scales.shape[0] if scales.dim() == 2 else 0
    if x.shape[1] != k or n % per:
        raise ValueError(f"gptq_gemv: x has {x.shape[1]} columns and qweight holds {k} input features of {n} outputs; "
                         f"they must be equal, and N a multiple of {per}")
    if (tuple(qzeros.shape) != (groups, n // per) or tuple(scales.shape) != (groups, n) or tuple(g_idx.shape) != (k,)
            or not (qzeros.is_contiguous() and scales.is_contiguous() and g_idx.is_contiguous())):
        raise ValueError(f"gptq_gemv: qzeros must be [G, {n // per}], scales [G, {n}] and g_idx [{k}], contiguous; "
                         f"got {tuple(qzeros.shape)}, {tuple(scales.shape)} and {tuple(g_idx.shape)}")
    if group_size is not None and (group_size <= 0 or k % group_size or k // group_size != groups):
        raise ValueError(f"gptq_gemv: group_size {group_size} must split the {k} input features into the scales' "
                         f"{groups} groups")
    return _packed_launch("gptq_gemv", x, qweight, qzeros, scales, g_idx, bias, n, k, group_size or 0, bits,
                          group_size is not None, policy, int(zeros_minus_one))
