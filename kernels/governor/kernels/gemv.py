"""Matrix-vector products for decode steps of one token: out = x @ w.T (+ bias), x [1, K], w [N, K].

At batch 1 a decoder layer's matmuls are pure weight streaming, and cuBLAS's choices there leave bandwidth
unused on some llama3-8b shapes (docs/design/gemv.md). `gemv` streams the weight once, one program per BLOCK_N output
columns, with no split-K and no second kernel, and can fold the MLP's SiLU(gate)·up into its prologue
(`silu_mul=True`: x is the gate_up output [1, 2K]), which removes the separate SiLU·mul kernel from the step. With two
or more rows cuBLAS is as fast or faster on these shapes (same sweep), so the model keeps F.linear there.

Numerics: products accumulate in fp32 and round once to the output dtype, as a cuBLAS GEMM does, so results
differ from F.linear only by the order of the fp32 sum (in bf16, at most one output step). The SiLU·mul
prologue rounds where `elementwise.silu_mul_ref` rounds, so `gemv(gu, w, silu_mul=True)` computes what
`F.linear(silu_mul_ref(gu), w)` does up to that sum order. `gemv_ref` is the PyTorch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import chain_pdl, pdl_launch, round_to, silu_mul_ref, triton_usable
from governor.kernels.launch_policy import GemvConfig, LaunchPolicy, policy_for


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False
             ) -> torch.Tensor:
    """What `gemv` computes, in PyTorch: F.linear(x, w, bias), with x = silu_mul_ref(x) first if `silu_mul`."""
    return F.linear(silu_mul_ref(x) if silu_mul else x, w, bias)


def gemv_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` takes this product: one contiguous row of x, Triton available, and a contiguous weight in
    x's dtype."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and triton_usable(x) and w.dim() == 2
            and w.dtype == x.dtype and w.is_contiguous())


@triton.jit
def _w_tile(w_rows, ks, n_mask, K: tl.constexpr, EVEN: tl.constexpr):
    # The weight's [BLOCK_N, BLOCK_K] tile at columns ks, in fp32 (the mask is left out when the tiles are whole).
    if EVEN:
        return tl.load(w_rows + ks[None, :]).to(tl.float32)
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _x_tile(x_ptr, ks, K: tl.constexpr, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    # x's BLOCK_K values at ks in fp32 (SILU_MUL: SiLU(gate)·up from the gate_up row, rounded as silu_mul_ref).
    # x is a few KB: its mask costs nothing.
    x_mask = ks < K
    if SILU_MUL:
        gate = tl.load(x_ptr + ks, mask=x_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + ks, mask=x_mask, other=0.0).to(tl.float32)
        return round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    return tl.load(x_ptr + ks, mask=x_mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
    # Program: BLOCK_N outputs. The products accumulate elementwise in a [BLOCK_N, BLOCK_K] tile and reduce
    # once at the end. K is a compile-time constant: a model has a handful, and the trip count is then known.
    # Under PDL the first weight tile is read before waiting for the kernel before (which wrote x, not w): the
    # weight stream starts while that kernel finishes.
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < n
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    w = _w_tile(w_rows, kk, n_mask, K, EVEN_N and EVEN_K)
    if PDL:
        gdc_wait()
    acc = w * _x_tile(x_ptr, kk, K, SILU_MUL, dtype)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc += _w_tile(w_rows, ks, n_mask, K, EVEN_N and EVEN_K) * _x_tile(x_ptr, ks, K, SILU_MUL, dtype)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    # round_to: the interpreter would truncate a bare cast to bf16 (elementwise.round_to).
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


def _one_row_launch(name: str, x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                    policy: LaunchPolicy | None) -> tuple[GemvConfig, int, bool, torch.Tensor]:
    """What a one-row GEMV launch of [N, K] needs after its own checks: the bias checked, the policy's tile, its K
    step (`block_k_for`), whether it runs under PDL, and the output [1, N] in x's dtype."""
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    config = (policy or policy_for(x.device)).gemv
    pdl = chain_pdl(policy or policy_for(x.device), x.device)
    return config, block_k_for(config.block_k, k), pdl, torch.empty(1, n, dtype=x.dtype, device=x.device)


def block_k_for(block_k: int, k: int) -> int:
    """The K step of a launch: the largest power-of-two fraction of the policy's `block_k` (down to 128) that divides
    K, so that every step is whole and unmasked; `block_k` itself when none does. On an H200 a masked last step cost
    up to 2x: down at TP 2 (K = 7,168), 32.5 us with 2,048-column steps against 17.9 with 1,024 (docs/design/gemv.md).
    """
    step = block_k
    while k % step and step > 128:
        step //= 2
    return step if k % step == 0 else block_k


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, *,
         policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`gemv_ref` in one Triton kernel, for x [1, K] (or [1, 2K] with `silu_mul`), a contiguous w [N, K] and
    an optional bias [N]; returns [1, N] in x's dtype. `policy`: the launch settings, its `gemv` tile and warps
    (None: the device's)."""
    if not gemv_usable(x, w):
        raise ValueError(f"gemv: needs a contiguous x [1, K] and w [N, K] of one dtype on a Triton "
                         f"device; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} (use F.linear "
                         f"for more rows)")
    n, k = w.shape
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x has {x.shape[1]} columns; w [N, {k}] needs {2 * k if silu_mul else k}"
                         f"{' (gate and up side by side)' if silu_mul else ''}")
    config, block_k, pdl, out = _one_row_launch("gemv", x, bias, n, k, policy)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, out if bias is None else bias, out, n, K=k, BLOCK_N=config.block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % block_k == 0, PDL=pdl, num_warps=config.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out


# --- fp8 weights ------------------------------------------------------------------------------------------------
# A pre-quantized (or load-quantized) fp8 linear: w [N, K] in e4m3 and a float32 scale per (bn, bk) block of it,
# scale [ceil(N / bn), ceil(K / bk)] (one row per output feature: (1, K); one per block: fp8 checkpoints' 128 x 128).
# The weight is W = w * scale, rounded to the activation dtype (as models/quantization.py's reference path builds
# it); `fp8_gemv` computes x @ W.T for one row without building W, reading the weight's bytes once.


def fp8_gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `fp8_gemv` computes, in PyTorch: F.linear(x, (w * scale per block) in x's dtype, bias)."""
    bn, bk = block
    n, k = w.shape
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return F.linear(x, (w.float() * s).to(x.dtype), bias)


def fp8_gemv_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `fp8_gemv` takes this product: one contiguous row of x, Triton available, a contiguous e4m3 weight."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and triton_usable(x) and w.dim() == 2
            and w.dtype == torch.float8_e4m3fn and w.is_contiguous())


@triton.jit
def _scaled_w_tile(w_rows, s_rows, ks, n_mask, K: tl.constexpr, BK_SCALE: tl.constexpr, EVEN: tl.constexpr,
                   dtype: tl.constexpr):
    # The weight's [BLOCK_N, BLOCK_K] tile at columns ks times each entry's block scale, rounded to the activation
    # dtype as the reference's dequantized weight is, in fp32.
    if EVEN:
        w = tl.load(w_rows + ks[None, :]).to(tl.float32)
        s = tl.load(s_rows + (ks // BK_SCALE)[None, :])
    else:
        mask = n_mask[:, None] & (ks < K)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_rows + (ks // BK_SCALE)[None, :], mask=mask, other=0.0)
    return round_to(w * s, dtype)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, n, stride_s, K: tl.constexpr, BN_SCALE: tl.constexpr,
                     BK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # `_gemv_kernel` with the weight in e4m3 and a scale per block: same program shape, same PDL prologue.
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < n
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (cols // BN_SCALE).to(tl.int64)[:, None] * stride_s
    kk = tl.arange(0, BLOCK_K)
    even = EVEN_N and EVEN_K
    if PDL:
        gdc_launch_dependents()
    w = _scaled_w_tile(w_rows, s_rows, kk, n_mask, K, BK_SCALE, even, dtype)
    if PDL:
        gdc_wait()
    acc = w * _x_tile(x_ptr, kk, K, False, dtype)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc += _scaled_w_tile(w_rows, s_rows, ks, n_mask, K, BK_SCALE, even, dtype) * \
            _x_tile(x_ptr, ks, K, False, dtype)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, *, policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`fp8_gemv_ref` in one Triton kernel for x [1, K], an e4m3 w [N, K] and its float32 block scales; returns
    [1, N] in x's dtype. The launch takes the policy's `gemv` tile and warps (None: the device's)."""
    if not fp8_gemv_usable(x, w):
        raise ValueError(f"fp8_gemv: needs a contiguous x [1, K] on a Triton device and a contiguous float8_e4m3fn "
                         f"w [N, K]; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    bn, bk = block
    if x.shape[1] != k:
        raise ValueError(f"fp8_gemv: x has {x.shape[1]} columns; w [N, {k}] needs {k}")
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)) or scale.dtype != torch.float32 or scale.stride(1) != 1:
        raise ValueError(f"fp8_gemv: scale must be float32 [{-(-n // bn)}, {-(-k // bk)}] (blocks of {bn} x {bk}) "
                         f"with contiguous rows, got {tuple(scale.shape)} {scale.dtype}")
    config, block_k, pdl, out = _one_row_launch("fp8_gemv", x, bias, n, k, policy)
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, scale, out if bias is None else bias, out, n, scale.stride(0), K=k, BN_SCALE=bn, BK_SCALE=bk,
        BLOCK_N=config.block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % block_k == 0, PDL=pdl, num_warps=config.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out


# --- AWQ int4 weights -----------------------------------------------------------------------------------------------
# AWQ's GEMM layout (models/quantization.py): qweight [K, N/8] int32, 8 four-bit codes per int32 along the output
# features, nibble j holding column AWQ_ORDER[j] = (0, 2, 4, 6, 1, 3, 5, 7)[j] of its eight; qzeros [G, N/8] packed
# the same way; scales [G, N] float16; G = K / group_size. W[o, i] = (q[i, o] - z[i // group_size, o]) *
# s[i // group_size, o], computed in fp32 and rounded to the activation dtype (as the reference path builds it).


def awq_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `awq_gemv` computes, in PyTorch: the weight unpacked and dequantized in fp32, rounded to x's dtype."""
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=qweight.device)  # column c's nibble (AWQ_ORDER inverted)
    shifts = 4 * order.repeat(qweight.shape[1])

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return (packed.repeat_interleave(8, dim=1) >> shifts) & 0xF

    groups = torch.arange(qweight.shape[0], device=qweight.device) // group_size
    w = (unpack(qweight) - unpack(qzeros)[groups]).float() * scales.float()[groups]  # [K, N]
    return F.linear(x, w.t().to(x.dtype), bias)


def packed_gemv_usable(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `awq_gemv` or `gptq_gemv` takes this product: one contiguous row of x, Triton available, a contiguous
    int32 qweight."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and triton_usable(x) and qweight.dim() == 2
            and qweight.dtype == torch.int32 and qweight.is_contiguous())


@triton.jit
def _awq_w_tile(qw_ptr, qz_ptr, s_ptr, ks, cols, n, K: tl.constexpr, GROUP: tl.constexpr, dtype: tl.constexpr):
    # The dequantized weight's [BLOCK_K, BLOCK_N] tile (input features ks, output features cols), in fp32, rounded
    # to the activation dtype.
    packs = n // 8
    shifts = ((cols % 8) // 2 + (cols % 2) * 4) * 4  # column c's nibble: (c % 8) // 2, plus 4 for odd c
    mask = (ks < K)[:, None] & (cols < n)[None, :]
    groups = ks // GROUP
    q = (tl.load(qw_ptr + ks.to(tl.int64)[:, None] * packs + (cols // 8)[None, :], mask=mask, other=0)
         >> shifts[None, :]) & 0xF
    z = (tl.load(qz_ptr + groups.to(tl.int64)[:, None] * packs + (cols // 8)[None, :], mask=mask, other=0)
         >> shifts[None, :]) & 0xF
    s = tl.load(s_ptr + groups.to(tl.int64)[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return round_to((q - z).to(tl.float32) * s, dtype)


@triton.jit
def _packed_w_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, K: tl.constexpr, GROUP: tl.constexpr,
                   BITS: tl.constexpr, GPTQ: tl.constexpr, dtype: tl.constexpr):
    # The dequantized weight's tile in either format (GPTQ: its BITS-bit codes and g_idx; AWQ: 4 bits, GROUP).
    if GPTQ:
        w = _gptq_w_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, K, BITS, dtype)
    else:
        w = _awq_w_tile(qw_ptr, qz_ptr, s_ptr, ks, cols, n, K, GROUP, dtype)
    return w


@triton.jit
def _packed_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, out_ptr, n, K: tl.constexpr, GROUP: tl.constexpr,
                        BITS: tl.constexpr, GPTQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    # One-row GEMV over AWQ's (GPTQ False) or GPTQ's packed integer weights. Program: BLOCK_N output features (AWQ:
    # whole packs of 8). The K loop accumulates [BLOCK_K, BLOCK_N] products and reduces over K once at the end; the
    # first weight tile (with its zeros and scales) is read before waiting for x (PDL), as `_gemv_kernel`.
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    w = _packed_w_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, kk, cols, n, K, GROUP, BITS, GPTQ, dtype)
    if PDL:
        gdc_wait()
    acc = w * _x_tile(x_ptr, kk, K, False, dtype)[:, None]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc += _packed_w_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, K, GROUP, BITS, GPTQ, dtype) * \
            _x_tile(x_ptr, ks, K, False, dtype)[:, None]
    out = tl.sum(acc, axis=0)
    n_mask = cols < n
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


AWQ_BLOCK_N = 64  # output features a program takes: 8 packs of 8
AWQ_BLOCK_K = 64  # input features a K step takes


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, *, policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`awq_gemv_ref` in one Triton kernel for x [1, K] and AWQ's packed int4 tensors; returns [1, N] in x's dtype.
    Its tile (AWQ_BLOCK_N x AWQ_BLOCK_K, 4 warps) is a first choice, not yet measured on a GPU; `policy` only
    decides PDL (None: the device's)."""
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
    return _packed_launch("awq_gemv", x, qweight, qzeros, scales, None, bias, n, k, group_size, 4, policy)


def _packed_launch(name: str, x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: torch.Tensor | None, bias: torch.Tensor | None, n: int, k: int, group_size: int, bits: int,
                   policy: LaunchPolicy | None) -> torch.Tensor:
    """A checked AWQ (`g_idx` None) or GPTQ product's launch of `_packed_gemv_kernel`: the bias checked, PDL decided
    by `policy` (None: the device's), the output [1, N] in x's dtype."""
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    pdl = chain_pdl(policy or policy_for(x.device), x.device)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _packed_gemv_kernel[(triton.cdiv(n, AWQ_BLOCK_N),)](
        x, qweight, qzeros, scales, qweight if g_idx is None else g_idx, out if bias is None else bias, out, n, K=k,
        GROUP=group_size, BITS=bits, GPTQ=g_idx is not None, BLOCK_N=AWQ_BLOCK_N, BLOCK_K=AWQ_BLOCK_K,
        HAS_BIAS=bias is not None, PDL=pdl, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return out


# --- GPTQ int4 / int8 weights ---------------------------------------------------------------------------------------
# GPTQ (checkpoint format v1): qweight [K / p, N] int32 with p = 32 / bits codes per int32 along the input features,
# lowest bits first; qzeros [G, N / p] packed the same way along the output features, each stored one less than the
# zero point; scales [G, N]; g_idx [K] the group of each input feature (act-order checkpoints scatter them). The weight
# is W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], in fp32, rounded to the activation dtype.


def gptq_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `gptq_gemv` computes, in PyTorch: the weight unpacked and dequantized in fp32, rounded to x's dtype."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = bits * torch.arange(per, device=qweight.device)
    q = ((qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & mask).reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, per)) & mask).reshape(qzeros.shape[0], -1) + 1  # [G, N]
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]  # [K, N]
    return F.linear(x, w.t().to(x.dtype), bias)


@triton.jit
def _gptq_w_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, ks, cols, n, K: tl.constexpr, BITS: tl.constexpr,
                 dtype: tl.constexpr):
    # The dequantized weight's [BLOCK_K, BLOCK_N] tile (input features ks, output features cols), in fp32, rounded
    # to the activation dtype.
    per: tl.constexpr = 32 // BITS
    code_mask: tl.constexpr = (1 << BITS) - 1
    k_mask = ks < K
    mask = k_mask[:, None] & (cols < n)[None, :]
    groups = tl.load(g_ptr + ks, mask=k_mask, other=0).to(tl.int64)
    q = (tl.load(qw_ptr + (ks // per).to(tl.int64)[:, None] * n + cols[None, :], mask=mask, other=0)
         >> ((ks % per) * BITS)[:, None]) & code_mask
    z = ((tl.load(qz_ptr + groups[:, None] * (n // per) + (cols // per)[None, :], mask=mask, other=0)
          >> ((cols % per) * BITS)[None, :]) & code_mask) + 1
    s = tl.load(s_ptr + groups[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return round_to((q - z).to(tl.float32) * s, dtype)


def gptq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int, bias: torch.Tensor | None = None, *, policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`gptq_gemv_ref` in one Triton kernel for x [1, K] and GPTQ's packed 4- or 8-bit tensors (act-order included:
    each input feature's group is read from g_idx); returns [1, N] in x's dtype. Its tile (AWQ's, 4 warps) is a first
    choice, not yet measured on a GPU; `policy` only decides PDL (None: the device's)."""
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
    return _packed_launch("gptq_gemv", x, qweight, qzeros, scales, g_idx, bias, n, k, 0, bits, policy)
