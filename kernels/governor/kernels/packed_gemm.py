"""Matrix products of several rows over AWQ's and GPTQ's packed integer weights: out = x @ W.T (+ bias), x [M, K],
W dequantized from the packed tensors inside the kernel (layouts: kernels/packed_gemv.py, models/quantization.py).

Without it a step of several rows rebuilds the whole weight in the activation dtype and multiplies that (the
reference path: per weight, half a byte read, two written and two read again); here each program reads the packed
codes of its [BLOCK_K, BLOCK_N] tile, unpacks them with their zero points and scales in registers (`packed_codes`,
`packed_zeros`, shared with the one-row GEMVs) and feeds the tile to `tl.dot`, so the weight's bytes are read once per
BLOCK_M rows. Decode batches are weight-streaming like a GEMV; that is where it pays by construction:
`QuantizedLinear` takes it for steps of up to PACKED_GEMM_MAX_ROWS rows.

Larger steps (prefill chunks) are compute-bound, and there the dense product is cuBLAS's: `packed_dequantize`
writes the weight in the activation dtype in one pass over the packed tensors (the same per-tile arithmetic as
`packed_gemm`, stored instead of multiplied), [K, N], whose transpose `torch.nn.functional.linear` takes as it is.
The dense weight it writes equals the reference path's bit for bit, in the layout the reference path multiplies
(the transpose of a contiguous [K, N]); what it replaces is the reference's dequantization, a chain of unpacking,
gathering and casting PyTorch ops over the whole weight.

Numerics are the reference path's: the dequantized weight, computed in fp32, is rounded to the activation dtype (as
`QuantizedLinear.dequantize(x.dtype)` rounds it), products accumulate in fp32 (`tl.dot`; fp32 inputs at IEEE
precision, not TF32; under the interpreter 16-bit inputs are widened to fp32 first, which changes no product) and
the sum is rounded once, so results differ from the reference by the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import INTERPRET, round_to, triton_usable
from governor.kernels.packed_gemv import packed_codes, packed_zeros

PACKED_GEMM_MAX_ROWS = 64  # the rows a step may have for `QuantizedLinear` to take `packed_gemm` (see above)
_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 64, 32  # a first tile, not yet measured on a GPU


def packed_gemm_usable(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `packed_gemm` takes this product: 2 to PACKED_GEMM_MAX_ROWS contiguous rows of x, Triton available,
    a contiguous int32 qweight."""
    return (x.dim() == 2 and 1 < x.shape[0] <= PACKED_GEMM_MAX_ROWS and x.is_contiguous() and triton_usable(x)
            and qweight.dim() == 2 and qweight.dtype == torch.int32 and qweight.is_contiguous())


@triton.jit
def program_tile(m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # (rows, cols, row mask, col mask) of this program's [BLOCK_M, BLOCK_N] output tile, programs over (M, N).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < m, cols < n


@triton.jit
def rows_tile(x_ptr, rows, ks, K: tl.constexpr, row_mask, k_mask):
    # x's [BLOCK_M, BLOCK_K] tile of a contiguous [M, K] x, as stored (zero outside the masks).
    return tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                   other=0.0)


@triton.jit
def store_rows(out_ptr, acc, b_ptr, rows, cols, n, row_mask, n_mask, HAS_BIAS: tl.constexpr):
    # acc (fp32) plus the bias, rounded once to the output's dtype into rows x cols of a contiguous [M, n] out.
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :], round_to(acc, dtype).to(dtype),
             mask=row_mask[:, None] & n_mask[None, :])


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
def _packed_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, out_ptr, m, n, K: tl.constexpr,
                        GROUP: tl.constexpr, BITS: tl.constexpr, GPTQ: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        IEEE: tl.constexpr):
    # Program: BLOCK_M rows by BLOCK_N output features; per K step, the weight tile dequantized in registers (each
    # input feature's group from g_idx for GPTQ, i // GROUP for AWQ) and rounded to x's dtype, then one dot.
    dtype = out_ptr.dtype.element_ty
    rows, cols, row_mask, n_mask = program_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = rows_tile(x_ptr, rows, ks, K, row_mask, k_mask)
        w = dense_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, k_mask, n_mask, K, GROUP, BITS, GPTQ, ZERO_OFFSET,
                       dtype)
        if IEEE:  # fp32 inputs, or 16-bit ones widened (exactly) for the interpreter, whose dot takes no bf16
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    store_rows(out_ptr, acc, b_ptr, rows, cols, n, row_mask, n_mask, HAS_BIAS)


def packed_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None = None, *,
                zeros_minus_one: bool = True) -> torch.Tensor:
    """x [M, K] times the AWQ (`g_idx` None: groups of `group_size` consecutive inputs, 4 bits) or GPTQ (4 or 8
    bits, each input's group from g_idx) packed weight, plus bias; [M, N] in x's dtype. GPTQ's qzeros hold each zero
    point less one (`zeros_minus_one`, checkpoint format v1) or the zero points (AWQ's, repacked at load). The caller
    has checked the tensors' shapes (`QuantizedLinear`); this checks what the launch relies on."""
    if not packed_gemm_usable(x, qweight):
        raise ValueError(f"packed_gemm: needs 2 to {PACKED_GEMM_MAX_ROWS} contiguous rows of x on a Triton device and "
                         f"a contiguous int32 qweight; got x {tuple(x.shape)} {x.dtype}, qweight "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    gptq = g_idx is not None
    k = qweight.shape[0] * (32 // bits if gptq else 1)
    n = qweight.shape[1] * (1 if gptq else 8)
    if x.shape[1] != k or not (qzeros.is_contiguous() and scales.is_contiguous()) or scales.shape[1] != n:
        raise ValueError(f"packed_gemm: x has {x.shape[1]} columns for a weight of {k} inputs and {n} outputs "
                         f"(scales {tuple(scales.shape)}); zeros and scales must be contiguous")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _packed_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx if gptq else qweight, bias if bias is not None else out, out, x.shape[0], n,
        K=k, GROUP=max(group_size, 1), BITS=bits, GPTQ=gptq, ZERO_OFFSET=int(zeros_minus_one), BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or INTERPRET, num_warps=4,
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
