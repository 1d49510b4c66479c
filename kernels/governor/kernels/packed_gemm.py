"""Matrix products of several rows over AWQ's and GPTQ's packed integer weights: out = x @ W.T (+ bias), x [M, K],
W dequantized from the packed tensors inside the kernel (layouts: kernels/packed_gemv.py, models/quantization.py).

Decode batches (and speculative verification steps) of a few rows stream the weight like a one-row GEMV:
`packed_gemm` reads each packed word once per step and multiplies the codes, minus their zero points, exact in the
activation dtype, by all the step's rows at once on the tensor cores (`_packed_gemm_split_kernel`, K split over the
programs as `packed_gemv`'s split GEMV splits it). It takes codes in GPTQ's layout (AWQ's are repacked into it at
load) whose groups are consecutive inputs in order, for steps of up to PACKED_GEMM_MAX_ROWS rows, on a tile that
depends on the step's rows (the launch policy's `packed_gemm_tiles`): on an H200 a llama3-8b GPTQ int4 step of 16
rows took 6.1 ms this way against 13.2 through the dense weight below, one of 32 rows 11.7 against 13.5
(docs/performance/quantized-weights.md).

Other steps of several rows (prefill chunks, larger batches, act-order groups) multiply a dense weight with cuBLAS:
`packed_dequantize` writes the weight in the activation dtype in one pass over the packed tensors, [K, N], whose
transpose `torch.nn.functional.linear` takes as it is. The dense weight it writes equals the reference path's bit
for bit, in the layout the reference path multiplies (the transpose of a contiguous [K, N]); what it replaces is the
reference's dequantization, a chain of unpacking, gathering and casting PyTorch ops over the whole weight.

Numerics: `packed_gemm` multiplies exact codes minus zero points and applies each group's scales to the sums in
fp32, as the one-row GEMVs do, where a group spans a K step or more (groups of 128 inputs and more for 4-bit codes,
64 for 8-bit); smaller groups multiply the weight dequantized in fp32 and rounded to the activation dtype, as the
reference path's dense weight is. Products accumulate in fp32 (`tl.dot`; fp32 inputs at IEEE precision, not TF32;
under the interpreter 16-bit inputs are widened to fp32 first, which changes no product) and the sum is rounded
once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import INTERPRET, round_to, triton_usable
from governor.kernels.launch_policy import LaunchPolicy, policy_for
from governor.kernels.packed_gemv import _split_counters, _split_k_finish, packed_codes, packed_zeros

PACKED_GEMM_MAX_ROWS = 32  # the most rows of a step `packed_gemm` takes (see above)


def packed_gemm_usable(x: torch.Tensor, qweight: torch.Tensor, group_size: int, bits: int, in_order: bool) -> bool:
    """Whether `packed_gemm` takes this product: 2 to PACKED_GEMM_MAX_ROWS contiguous rows of x on a Triton device, a
    contiguous int32 qweight in GPTQ's layout whose groups of `group_size` consecutive inputs are in order (`in_order`:
    g_idx is i // group_size) and fit its K step (`packed_gemm_split_shape`)."""
    return (x.dim() == 2 and 1 < x.shape[0] <= PACKED_GEMM_MAX_ROWS and x.is_contiguous() and triton_usable(x)
            and qweight.dim() == 2 and qweight.dtype == torch.int32 and qweight.is_contiguous() and in_order
            and bits in (4, 8) and packed_gemm_split_shape(x.shape[1], group_size, bits, 0) is not None)


@triton.jit
def dense_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, k_mask, n_mask, K: tl.constexpr, GROUP: tl.constexpr,
               BITS: tl.constexpr, GPTQ: tl.constexpr, ZERO_OFFSET: tl.constexpr, dtype: tl.constexpr):
    # The dense weight's [BLOCK_K, BLOCK_N] tile (input features ks, output features cols) in `dtype`: (code - zero)
    # * scale in fp32, each input feature's group from g_idx for GPTQ, i // GROUP for AWQ, rounded once by hand as
    # the reference path's dense weight is (see round_to).
    if GPTQ:
        groups = tl.load(g_ptr + ks, mask=k_mask, other=0).to(tl.int64)[:, None]
    else:
        groups = (ks // GROUP).to(tl.int64)[:, None]
    mask = k_mask[:, None] & n_mask[None, :]
    z = packed_zeros(qz_ptr, groups, cols[None, :], n, mask, BITS, GPTQ, ZERO_OFFSET)
    s = tl.load(s_ptr + groups * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = (packed_codes(qw_ptr, ks, cols, n, K, BITS, GPTQ) - z).to(tl.float32) * s
    return round_to(w, dtype).to(dtype)


@triton.jit
def _packed_gemm_split_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, ws_ptr, cnt_ptr, out_ptr, m, n, K: tl.constexpr,
                              GROUP: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                              HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, MAGIC: tl.constexpr,
                              MAGIC_BITS: tl.constexpr):
    # Program (i, j): every row of x (m <= BLOCK_M) by output features i * BLOCK_N.., over input features
    # j * CHUNK.. in K steps of BLOCK_K; GPTQ's layout, groups of GROUP consecutive inputs. A step's words
    # [BLOCK_K / PER, BLOCK_N] are loaded once; code c of word r stands for input feature PER * r + c, so the step is
    # PER dots, each of x's columns PER * r + c (a strided [BLOCK_M, BLOCK_K / PER] tile) by codes c. Where a group
    # spans the step (GROUP >= BLOCK_K), the dots take the codes minus their zero points, small integers exact in x's
    # dtype, and the group's scales apply to the step's sums: s * sum(x * (q - z)), in fp32, as the one-row split
    # GEMV computes. Where MAGIC is nonzero (a power of two whose unit in the last place is 1: 128 in bf16 for 4-bit
    # codes, 1,024 in fp16, with the bit pattern MAGIC_BITS), MAGIC + code is MAGIC_BITS OR the code, a bit pattern
    # rather than a conversion, and (MAGIC + code) - (MAGIC + zero) one packed subtraction. Smaller groups (several a
    # step, whole words each) take the weight dequantized in fp32 and rounded to x's dtype, as `dense_tile`. The
    # split-K epilogue is the one-row GEMV's (packed_gemv._split_k_finish), over the flattened [BLOCK_M, BLOCK_N]
    # tile.
    dtype = out_ptr.dtype.element_ty
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < m
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < n
    rr = tl.arange(0, BLOCK_K // PER)
    k_first = tl.program_id(1) * CHUNK
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, CHUNK, BLOCK_K):
        k0 = k_first + k_step
        words = tl.load(qw_ptr + (k0 // PER + rr).to(tl.int64)[:, None] * n + cols[None, :], mask=n_mask[None, :],
                        other=0)
        if GROUP >= BLOCK_K:
            group = k0 // GROUP
            z = packed_zeros(qz_ptr, group, cols, n, n_mask, BITS, True, ZERO_OFFSET)
            s = tl.load(s_ptr + group * n + cols, mask=n_mask, other=0.0).to(tl.float32)
            z_magic = (z + MAGIC).to(dtype)[None, :]
        else:  # each packed row's group: [BLOCK_K / PER, BLOCK_N] zero points and scales
            groups = ((k0 + PER * rr) // GROUP).to(tl.int64)[:, None]
            z2 = packed_zeros(qz_ptr, groups, cols[None, :], n, n_mask[None, :], BITS, True, ZERO_OFFSET)
            s2 = tl.load(s_ptr + groups * n + cols[None, :], mask=n_mask[None, :], other=0.0).to(tl.float32)
        step = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(PER):
            q = (words >> (c * BITS)) & MASK
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + (k0 + PER * rr + c)[None, :],
                        mask=row_mask[:, None], other=0.0)
            if GROUP < BLOCK_K:
                w = round_to((q - z2).to(tl.float32) * s2, dtype).to(dtype)
            elif IEEE:
                w = (q - z[None, :]).to(tl.float32)
            elif MAGIC:
                w = (q | MAGIC_BITS).to(tl.int16).to(dtype, bitcast=True) - z_magic
            else:
                w = (q - z[None, :]).to(dtype)
            if IEEE:  # fp32 inputs, or 16-bit ones widened (exactly) for the interpreter, whose dot takes no bf16
                step += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                step += tl.dot(x, w)
        if GROUP >= BLOCK_K:
            acc += step * s[None, :]
        else:
            acc += step
    offs = tl.reshape(rows.to(tl.int64)[:, None] * n + cols[None, :], [BLOCK_M * BLOCK_N])
    bias_offs = tl.reshape(tl.broadcast_to(cols[None, :], [BLOCK_M, BLOCK_N]), [BLOCK_M * BLOCK_N])
    mask = tl.reshape(row_mask[:, None] & n_mask[None, :], [BLOCK_M * BLOCK_N])
    _split_k_finish(tl.reshape(acc, [BLOCK_M * BLOCK_N]), ws_ptr, cnt_ptr, out_ptr, b_ptr, offs, mask, m * n, SPLITS,
                    SPLITS_P2, HAS_BIAS, bias_offs)


def packed_gemm_split_shape(k: int, group_size: int, bits: int, max_chunk: int) -> tuple[int, int] | None:
    """(K step, chunk) of `_packed_gemm_split_kernel` over K inputs in groups of `group_size` consecutive features, or
    None where it does not apply: the step is 16 packed rows (128 inputs of 4 bits, 64 of 8: a dot's K), which must
    divide K and either divide the groups or be divided by them into whole packed rows; the chunk is the step doubled
    while it stays within `max_chunk` and divides K."""
    per = 32 // bits
    step = 16 * per
    if group_size <= 0 or k % group_size or k % step:
        return None
    if group_size % step and (step % group_size or group_size % per):
        return None
    chunk = step
    while chunk * 2 <= max_chunk and k % (chunk * 2) == 0:
        chunk *= 2
    return step, chunk


def packed_gemm_tile(policy: LaunchPolicy, rows: int) -> tuple[int, int, int]:
    """The policy's `packed_gemm_tiles` entry for a step of `rows` rows: the first whose most rows it reaches (the
    last beyond them all)."""
    return next((tile for most, tile in policy.packed_gemm_tiles if rows <= most), policy.packed_gemm_tiles[-1][1])


def packed_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                group_size: int, bias: torch.Tensor | None = None, *, zeros_minus_one: bool = True,
                policy: LaunchPolicy | None = None) -> torch.Tensor:
    """x [M, K] times a packed weight in GPTQ's layout (4 or 8 bits; AWQ's repacked into it at load) in groups of
    `group_size` consecutive inputs in order, plus bias; [M, N] in x's dtype (see above). qzeros hold each zero point
    less one (`zeros_minus_one`, GPTQ's checkpoint format v1) or the zero points (AWQ's). The launch takes the policy's
    `packed_gemm_tiles` entry for its rows (`policy`, None: the device's). The caller has checked the tensors' shapes
    (`QuantizedLinear`); this checks what the launch relies on."""
    k = qweight.shape[0] * (32 // bits) if qweight.dim() == 2 else 0
    if not packed_gemm_usable(x, qweight, group_size, bits, True):
        raise ValueError(f"packed_gemm: needs 2 to {PACKED_GEMM_MAX_ROWS} contiguous rows of x on a Triton device, a "
                         "contiguous int32 qweight of 4- or 8-bit codes packed along the inputs, and groups whose size "
                         f"a K step of 16 packed rows divides or is divided by; got x {tuple(x.shape)} {x.dtype}, "
                         f"qweight {tuple(qweight.shape)} {qweight.dtype}, {bits} bits, group_size {group_size}")
    n = qweight.shape[1]
    if x.shape[1] != k or not (qzeros.is_contiguous() and scales.is_contiguous()) or scales.shape[1] != n:
        raise ValueError(f"packed_gemm: x has {x.shape[1]} columns for a weight of {k} inputs and {n} outputs "
                         f"(scales {tuple(scales.shape)}); zeros and scales must be contiguous")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    policy = policy or policy_for(x.device)
    block_n, max_chunk, warps = packed_gemm_tile(policy, m)
    split = packed_gemm_split_shape(k, group_size, bits, max_chunk)
    assert split is not None  # packed_gemm_usable
    step, chunk = split
    splits, blocks = k // chunk, triton.cdiv(n, block_n)
    ws = torch.empty(splits if splits > 1 else 0, m * n, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32 or INTERPRET
    # MAGIC + code as a bit pattern (see the kernel): 128 in bf16 for 4-bit codes, 1,024 in fp16 for any; not under
    # the interpreter, which converts instead.
    magic, magic_bits = ((0, 0) if ieee else (128, 0x4300) if x.dtype == torch.bfloat16 and bits == 4 else
                         (1024, 0x6400) if x.dtype == torch.float16 else (0, 0))
    _packed_gemm_split_kernel[(blocks, splits)](
        x, qweight, qzeros, scales, bias if bias is not None else out, ws, _split_counters(x.device, blocks), out, m, n,
        K=k, GROUP=group_size, BITS=bits, ZERO_OFFSET=int(zeros_minus_one), BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=step, CHUNK=chunk, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        HAS_BIAS=bias is not None, IEEE=ieee, MAGIC=magic, MAGIC_BITS=magic_bits, num_warps=warps,
    )  # fmt: skip
    return out


_DQ_BLOCK_K, _DQ_BLOCK_N = 32, 128


def packed_dequantize_usable(qweight: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether `packed_dequantize` runs here: Triton on `like`'s device, a contiguous int32 qweight."""
    return triton_usable(like) and qweight.dim() == 2 and qweight.dtype == torch.int32 and qweight.is_contiguous()


@triton.jit
def _packed_dequantize_kernel(qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, n, K: tl.constexpr, GROUP: tl.constexpr,
                              BITS: tl.constexpr, GPTQ: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program: BLOCK_K input features by BLOCK_N output features of the dense weight [K, n], in out's dtype:
    # (code - zero) * scale in fp32, rounded once, as `packed_gemm` computes its tiles.
    dtype = out_ptr.dtype.element_ty
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = ks < K, cols < n
    w = dense_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, k_mask, n_mask, K, GROUP, BITS, GPTQ, ZERO_OFFSET, dtype)
    tl.store(out_ptr + ks.to(tl.int64)[:, None] * n + cols[None, :], w, mask=k_mask[:, None] & n_mask[None, :])


def packed_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                      bits: int, group_size: int, dtype: torch.dtype, *, zeros_minus_one: bool) -> torch.Tensor:
    """The AWQ (`g_idx` None) or GPTQ packed weight dense, [K, N] in `dtype` (the transpose of the [N, K] weight,
    contiguous): (code - zero) * scale computed in fp32 and rounded once, as `QuantizedLinear.dequantize(dtype)`
    computes it. Layouts and `zeros_minus_one` as `packed_gemm`'s."""
    if not packed_dequantize_usable(qweight, scales):
        raise ValueError(f"packed_dequantize: needs Triton on the scales' device and a contiguous int32 qweight; got "
                         f"qweight {tuple(qweight.shape)} {qweight.dtype}")
    gptq = g_idx is not None
    k = qweight.shape[0] * (32 // bits if gptq else 1)
    n = qweight.shape[1] * (1 if gptq else 8)
    if not (qzeros.is_contiguous() and scales.is_contiguous()) or scales.shape[1] != n:
        raise ValueError(f"packed_dequantize: scales {tuple(scales.shape)} for a weight of {n} outputs; zeros and "
                         "scales must be contiguous")
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, _DQ_BLOCK_K), triton.cdiv(n, _DQ_BLOCK_N))
    _packed_dequantize_kernel[grid](
        qweight, qzeros, scales, g_idx if gptq else qweight, out, n, K=k, GROUP=max(group_size, 1), BITS=bits,
        GPTQ=gptq, ZERO_OFFSET=int(zeros_minus_one), BLOCK_K=_DQ_BLOCK_K, BLOCK_N=_DQ_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out
