"""W8A8 products of several rows over block-scaled fp8 weights: out = (x codes · x scales) @ (w codes · w scales).T
(+ bias), both sides e4m3 (DeepSeek's and Qwen3-FP8's layout: a float32 scale per (BN_SCALE, BK_SCALE) block of the
weight, and per 1 × BK_SCALE group of a token's features, or per token, on x's side: `fp8_quant.fp8_quantize`).

Per-row weight scales need no kernel of their own (`torch._scaled_mm` takes a scale per row of each side); block
scales change along K, so each program sums a K step's codes in one `tl.dot` (e4m3 inputs, fp32 accumulator: the
tensor cores' fp8 path on sm_90) and scales the partial sum by its row's and column's scales before adding it: every
K step lies in one scale block (the step divides BK_SCALE). The products of codes are exact, the sums fp32, the
result rounded once to the output dtype (on sm_90, Triton may let an e4m3 dot sum part of a K step at the tensor
cores' reduced precision, as cuBLAS's fast-accumulation mode does: its `max_num_imprecise_acc` default, left as is
and not yet measured). Under the interpreter, whose dot takes no fp8, the codes are widened to fp32 first (exactly).
The tile is a first choice, not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import INTERPRET, triton_usable
from governor.kernels.packed_gemm import program_tile, rows_tile, store_rows

_BLOCK_M, _BLOCK_N, _BLOCK_K_MAX = 16, 64, 128


def fp8_block_gemm_ref(codes: torch.Tensor, x_scales: torch.Tensor, x_group: int, w: torch.Tensor,
                       w_scales: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """What `fp8_block_gemm` computes, in PyTorch: both sides dequantized exactly in fp32, multiplied, rounded once."""
    k = codes.shape[1]
    x = codes.float() * x_scales.repeat_interleave(x_group or k, dim=1)[:, :k]
    bn, bk = block
    scale = w_scales.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :k]
    out = x @ (w.float() * scale).t()
    return (out if bias is None else out + bias.float()).to(dtype)


def fp8_block_k_step(bk: int) -> int:
    """The K step of a launch over blocks `bk` inputs wide: the largest power of two up to 128 that divides it, at
    least what `tl.dot` takes on e4m3 (32; 16 under the interpreter); 0 when none does."""
    least = 16 if INTERPRET else 32
    step = _BLOCK_K_MAX
    while step >= least and bk % step:
        step //= 2
    return step if step >= least else 0


def fp8_block_gemm_usable(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int], x_group: int) -> bool:
    """Whether `fp8_block_gemm` takes the product of activations x (before quantization) and w: x 2-D on a Triton
    device, a contiguous e4m3 w, a K step that divides the blocks, and x's groups whole tokens or the blocks' width."""
    return (x.dim() == 2 and triton_usable(x) and w.dim() == 2 and w.dtype == torch.float8_e4m3fn
            and w.is_contiguous() and fp8_block_k_step(block[1]) > 0 and x_group in (0, block[1]))


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, m, n, stride_sw, K: tl.constexpr,
                           X_GROUPS: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                           X_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr):
    # Program: BLOCK_M rows by BLOCK_N output features; per K step, a dot of the codes scaled by the step's scales.
    rows, cols, row_mask, n_mask = program_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = rows_tile(x_ptr, rows, ks, K, row_mask, k_mask)
        b = tl.load(w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: w's rows as columns
        if WIDEN:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        g = k0 // BK_SCALE
        if X_PER_TOKEN:
            sa = tl.load(sx_ptr + rows * X_GROUPS, mask=row_mask, other=0.0)
        else:
            sa = tl.load(sx_ptr + rows * X_GROUPS + g, mask=row_mask, other=0.0)
        sb = tl.load(sw_ptr + (cols // BN_SCALE) * stride_sw + g, mask=n_mask, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    store_rows(out_ptr, acc, b_ptr, rows, cols, n, row_mask, n_mask, HAS_BIAS)


def fp8_block_gemm(codes: torch.Tensor, x_scales: torch.Tensor, x_group: int, w: torch.Tensor, w_scales: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`fp8_block_gemm_ref` in one Triton kernel: codes [M, K] e4m3 with x_scales [M, groups] (`x_group` 0: one per
    token; else the weight's block width), w [N, K] e4m3 with w_scales [ceil(N / bn), ceil(K / bk)]; [M, N] in
    `dtype`."""
    if not (fp8_block_gemm_usable(codes, w, block, x_group) and codes.dtype == torch.float8_e4m3fn
            and codes.is_contiguous()):
        raise ValueError(f"fp8_block_gemm: needs contiguous e4m3 codes [M, K] on a Triton device and an e4m3 w, blocks "
                         f"whose width {block[1]} a K step of 32 to 128 divides, and x groups of 0 or {block[1]}; got "
                         f"codes {tuple(codes.shape)} {codes.dtype}, w {tuple(w.shape)} {w.dtype}, x_group {x_group}")
    (m, k), n = codes.shape, w.shape[0]
    bn, bk = block
    if w.shape[1] != k or tuple(w_scales.shape) != (-(-n // bn), -(-k // bk)) or w_scales.stride(1) != 1 \
            or x_scales.shape != (m, 1 if x_group == 0 else -(-k // bk)) or not x_scales.is_contiguous():
        raise ValueError(f"fp8_block_gemm: shapes disagree: codes {tuple(codes.shape)}, x_scales "
                         f"{tuple(x_scales.shape)}, w {tuple(w.shape)}, w_scales {tuple(w_scales.shape)}, "
                         f"block {block}")
    out = torch.empty(m, n, dtype=dtype, device=codes.device)
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _fp8_block_gemm_kernel[grid](
        codes, x_scales, w, w_scales, bias if bias is not None else out, out, m, n, w_scales.stride(0), K=k,
        X_GROUPS=x_scales.shape[1], BN_SCALE=bn, BK_SCALE=bk, X_PER_TOKEN=x_group == 0, BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N, BLOCK_K=fp8_block_k_step(bk), HAS_BIAS=bias is not None, WIDEN=INTERPRET, num_warps=4,
    )  # fmt: skip
    return out
