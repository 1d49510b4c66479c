"""W8A8 products of several rows over fp8 weights: out = (x codes · x scales) @ (w codes · w scales).T (+ bias), both
sides e4m3, the weight's scales per (BN_SCALE, BK_SCALE) block: DeepSeek's and Qwen3-FP8's 128 x 128 blocks, or one
scale per output feature (block (1, K): fp8 quantized at load, compressed-tensors' per-channel fp8). x's scales are per
1 × BK_SCALE group of a token's features, or per token (`fp8_quant.fp8_quantize`).

Each program sums a K step's codes in one `tl.dot` (e4m3 inputs, fp32 accumulator: the tensor cores' fp8 path on
sm_90) and scales the partial sum by its row's and column's scales before adding it: every K step lies in one scale
block (the step divides BK_SCALE); where one block spans all of K (a scale per output feature) the sums are scaled
once, at the end. The products of codes are exact, the sums fp32, the result rounded once to the output dtype (on
sm_90, Triton may let an e4m3 dot sum part of a K step at the tensor cores' reduced precision, as cuBLAS's
fast-accumulation mode does: its `max_num_imprecise_acc` default, left as is). Under the interpreter, whose dot takes
no fp8, the codes are widened to fp32 first (exactly).

Two launches of the one kernel (`fp8_block_gemm`):
- decode steps (up to the policy's `fp8_gemm_split_max_rows` rows, at most FP8_GEMM_SPLIT_MAX_ROWS: decode
  batches, speculative verification) stream the weight as the one-row GEMVs do: one program holds every row, a
  block of output features and a chunk of K, and the chunks' partial sums meet in the split GEMV's epilogue
  (`packed_gemv._split_k_finish`), so that the weight is read once and the grid fills the GPU whatever the batch;
  the policy's `fp8_gemm_split_tile`;
- longer steps (prefill chunks) tile the rows too, each program over all of K, the loads pipelined:
  `fp8_gemm_tile`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from governor.kernels.elementwise import INTERPRET, triton_usable
from governor.kernels.launch_policy import LaunchPolicy, policy_for
from governor.kernels.packed_gemv import _split_counters, _split_k_finish

_BLOCK_K_MAX = 128
FP8_GEMM_SPLIT_MAX_ROWS = 64  # the most rows the split launch takes (one program holds them all)
FP8_GEMM_MAX_SPLITS = 8  # the most chunks the split launch cuts K into (`fp8_gemm_split_chunk`)


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


def fp8_gemm_splits_k(rows: int, policy: LaunchPolicy) -> bool:
    """Whether a step of `rows` rows takes the split launch under `policy`."""
    return rows <= min(policy.fp8_gemm_split_max_rows, FP8_GEMM_SPLIT_MAX_ROWS)


def fp8_gemm_split_chunk(k: int, step: int, max_chunk: int) -> int:
    """The chunk of K a program of the split launch takes: the step doubled while it stays within `max_chunk` and
    below K, then further while more than FP8_GEMM_MAX_SPLITS chunks would cover K (the last chunk may be partial:
    its steps are masked). On an H200 llama3-8b's down_proj (K 14,336) took 22.4 us at 8 rows in 7 chunks of 2,048
    against 31.5 in 14 of 1,024, while 4,096-input products lose with chunks of 2,048 (gate_up 44.5 against 41.0)."""
    chunk = step
    while chunk * 2 <= max_chunk and chunk * 2 <= k:
        chunk *= 2
    while -(-k // chunk) > FP8_GEMM_MAX_SPLITS:
        chunk *= 2
    return chunk


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, ws_ptr, cnt_ptr, out_ptr, m, n, stride_sw,
                           K: tl.constexpr, X_GROUPS: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                           X_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                           HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr):
    # Program (i, j, r): output features i * BLOCK_N.., input features j * CHUNK.. in K steps of BLOCK_K, rows
    # r * BLOCK_M.. (the split launch has one row block, the unsplit one a single chunk: SPLITS == 1).
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, n_mask = rows < m, cols < n
    k_first = tl.program_id(1) * CHUNK
    ONE_SCALE: tl.constexpr = BK_SCALE >= K  # one scale a row and one a column for all of K: applied at the end
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, CHUNK, BLOCK_K):
        k0 = k_first + k_step
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: w's rows as columns
        if WIDEN:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if ONE_SCALE:
            acc += part
        else:
            g = k0 // BK_SCALE
            if X_PER_TOKEN:
                sa = tl.load(sx_ptr + rows * X_GROUPS, mask=row_mask, other=0.0)
            else:
                sa = tl.load(sx_ptr + rows * X_GROUPS + g, mask=row_mask, other=0.0)
            sb = tl.load(sw_ptr + (cols // BN_SCALE) * stride_sw + g, mask=n_mask, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
    if ONE_SCALE:
        sa = tl.load(sx_ptr + rows * X_GROUPS, mask=row_mask, other=0.0)
        sb = tl.load(sw_ptr + (cols // BN_SCALE) * stride_sw, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    offs = tl.reshape(rows.to(tl.int64)[:, None] * n + cols[None, :], [BLOCK_M * BLOCK_N])
    bias_offs = tl.reshape(tl.broadcast_to(cols[None, :], [BLOCK_M, BLOCK_N]), [BLOCK_M * BLOCK_N])
    mask = tl.reshape(row_mask[:, None] & n_mask[None, :], [BLOCK_M * BLOCK_N])
    _split_k_finish(tl.reshape(acc, [BLOCK_M * BLOCK_N]), ws_ptr, cnt_ptr, out_ptr, b_ptr, offs, mask, m * n, SPLITS,
                    SPLITS_P2, HAS_BIAS, bias_offs)


def fp8_block_gemm(codes: torch.Tensor, x_scales: torch.Tensor, x_group: int, w: torch.Tensor, w_scales: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype, *,
                   policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`fp8_block_gemm_ref` in one Triton kernel: codes [M, K] e4m3 with x_scales [M, groups] (`x_group` 0: one per
    token; else the weight's block width), w [N, K] e4m3 with w_scales [ceil(N / bn), ceil(K / bk)] (a scale per
    output feature: block (1, K), w_scales [N, 1]); [M, N] in `dtype`. The launch takes the policy's tiles (`policy`,
    None: the device's)."""
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
    policy = policy or policy_for(codes.device)
    step = fp8_block_k_step(bk)
    if fp8_gemm_splits_k(m, policy):
        block_n, max_chunk, warps, stages = policy.fp8_gemm_split_tile
        block_m, chunk = max(16, triton.next_power_of_2(m)), fp8_gemm_split_chunk(k, step, max_chunk)
    else:
        block_m, block_n, warps, stages = policy.fp8_gemm_tile
        chunk = triton.cdiv(k, step) * step
    splits, blocks = triton.cdiv(k, chunk), triton.cdiv(n, block_n)
    out = torch.empty(m, n, dtype=dtype, device=codes.device)
    ws = torch.empty(splits if splits > 1 else 0, m * n, dtype=torch.float32, device=codes.device)
    _fp8_block_gemm_kernel[(blocks, splits, triton.cdiv(m, block_m))](
        codes, x_scales, w, w_scales, bias if bias is not None else out, ws, _split_counters(codes.device, blocks), out,
        m, n, w_scales.stride(0), K=k, X_GROUPS=x_scales.shape[1], BN_SCALE=bn, BK_SCALE=bk,
        X_PER_TOKEN=x_group == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=step, CHUNK=chunk, SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), HAS_BIAS=bias is not None, WIDEN=INTERPRET, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
