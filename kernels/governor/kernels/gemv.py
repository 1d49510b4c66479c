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

from governor.kernels.elementwise import chain_pdl, pdl_launch, round_to, silu_mul_ref, silu_mul_values, triton_usable
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
    # One return (structured control flow): an early return in a function that another calls did not compile on
    # sm_90 (Triton 3.6's conversion to TritonGPU left the branch's values unresolved).
    if EVEN:
        w = tl.load(w_rows + ks[None, :])
    else:
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0)
    return w.to(tl.float32)


@triton.jit
def x_tile(x_ptr, ks, K: tl.constexpr, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    # x's BLOCK_K values at ks in fp32 (SILU_MUL: SiLU(gate)·up from the gate_up row, rounded as silu_mul_ref).
    # x is a few KB: its mask costs nothing.
    x_mask = ks < K
    if SILU_MUL:
        return silu_mul_values(x_ptr, ks, x_mask, K, dtype)
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
    acc = w * x_tile(x_ptr, kk, K, SILU_MUL, dtype)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc += _w_tile(w_rows, ks, n_mask, K, EVEN_N and EVEN_K) * x_tile(x_ptr, ks, K, SILU_MUL, dtype)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    # round_to: the interpreter would truncate a bare cast to bf16 (elementwise.round_to).
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


def one_row_output(name: str, x: torch.Tensor, bias: torch.Tensor | None, n: int,
                    policy: LaunchPolicy, dtype: torch.dtype | None = None) -> tuple[bool, torch.Tensor]:
    """What every one-row GEMV launch of N outputs needs after its own checks: the bias checked, whether it runs
    under PDL, and the output [1, N] in `dtype` (None: x's), which the bias must share."""
    dtype = dtype or x.dtype
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        raise ValueError(f"{name}: bias must be [{n}] in {dtype}, got {tuple(bias.shape)} {bias.dtype}")
    return chain_pdl(policy, x.device), torch.empty(1, n, dtype=dtype, device=x.device)


def _one_row_launch(name: str, x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                    policy: LaunchPolicy | None, dtype: torch.dtype | None = None
                    ) -> tuple[GemvConfig, int, bool, torch.Tensor]:
    """`_one_row_output`, and the policy's tile (`fp8_gemv` for fp8_gemv, else `gemv`) and its K step over K
    (`block_k_for`)."""
    policy = policy or policy_for(x.device)
    pdl, out = one_row_output(name, x, bias, n, policy, dtype)
    config = policy.fp8_gemv if name == "fp8_gemv" else policy.gemv
    return config, block_k_for(config.block_k, k), pdl, out


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
# The weight is W = w * scale; `fp8_gemv` computes x @ W.T for one row in fp32 without building W, reading the
# weight's bytes once, and rounds once to x's dtype. It never rounds W itself (the reference path's dense W is
# rounded to the activation dtype; a sum over exact products is at least as close to the quantized model). So that
# each weight byte costs a conversion and a multiply-add and no more, a scale is applied where it is constant:
# - one column block (per-row scales, the load-quantized and per-channel formats): to each row's sum, at the end;
# - a program's rows within one row block (128 x 128 blocks and a tile of 4 rows): to x, once per K step;
# - any other blocking: to each weight element (its scale gathered per element: the slow general case).


def fp8_gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `fp8_gemv` computes, in PyTorch: x times the exact weight (w * its block's scale), in fp32, plus bias,
    rounded once to x's dtype."""
    bn, bk = block
    n, k = w.shape
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return F.linear(x.float(), w.float() * s, None if bias is None else bias.float()).to(x.dtype)


def fp8_gemv_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `fp8_gemv` takes this product: one contiguous row of x, Triton available, a contiguous e4m3 weight."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and triton_usable(x) and w.dim() == 2
            and w.dtype == torch.float8_e4m3fn and w.is_contiguous())


FP8_SCALE_PER_ELEMENT, FP8_SCALE_PER_ROW, FP8_SCALE_ON_X = 0, 1, 2  # where `fp8_gemv` applies the scales


def fp8_scale_mode(block: tuple[int, int], k: int, block_n: int) -> int:
    """Where a launch of `block_n`-row tiles applies the scales of `block`-sized blocks over K inputs."""
    bn, bk = block
    if bk >= k:
        return FP8_SCALE_PER_ROW
    return FP8_SCALE_ON_X if bn % block_n == 0 else FP8_SCALE_PER_ELEMENT


@triton.jit
def _fp8_w_tile(w_rows, s_rows, ks, n_mask, K: tl.constexpr, BK_SCALE: tl.constexpr, EVEN: tl.constexpr,
                SCALE: tl.constexpr):
    # The codes' [BLOCK_N, BLOCK_K] tile at columns ks in fp32; with per-element scales, each times its own.
    w = _w_tile(w_rows, ks, n_mask, K, EVEN)
    if SCALE == 0:
        if EVEN:
            w *= tl.load(s_rows[:, None] + (ks // BK_SCALE)[None, :])
        else:
            w *= tl.load(s_rows[:, None] + (ks // BK_SCALE)[None, :], mask=n_mask[:, None] & (ks < K)[None, :],
                         other=0.0)
    return w


@triton.jit
def _fp8x_tile(x_ptr, s_row, ks, K: tl.constexpr, BK_SCALE: tl.constexpr, SCALE: tl.constexpr,
                dtype: tl.constexpr):
    # x's BLOCK_K values in fp32; with the scales on x's side, each times its column block's scale in the program's
    # row block (`s_row`: that row of the scales).
    x = x_tile(x_ptr, ks, K, False, dtype)
    if SCALE == 2:
        x *= tl.load(s_row + ks // BK_SCALE, mask=ks < K, other=0.0)
    return x


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, n, stride_s, K: tl.constexpr, BN_SCALE: tl.constexpr,
                     BK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr):
    # `_gemv_kernel` with the weight in e4m3 and a scale per block: same program shape, same PDL prologue; SCALE says
    # where the scales apply (FP8_SCALE_*).
    dtype = out_ptr.dtype.element_ty
    first = tl.program_id(0) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    n_mask = cols < n
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (cols // BN_SCALE).to(tl.int64) * stride_s
    s_row = s_ptr + (first // BN_SCALE).to(tl.int64) * stride_s  # the program's row block (SCALE 2)
    kk = tl.arange(0, BLOCK_K)
    even = EVEN_N and EVEN_K
    if PDL:
        gdc_launch_dependents()
    w = _fp8_w_tile(w_rows, s_rows, kk, n_mask, K, BK_SCALE, even, SCALE)
    if PDL:
        gdc_wait()
    acc = w * _fp8x_tile(x_ptr, s_row, kk, K, BK_SCALE, SCALE, dtype)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc += _fp8_w_tile(w_rows, s_rows, ks, n_mask, K, BK_SCALE, even, SCALE) * \
            _fp8x_tile(x_ptr, s_row, ks, K, BK_SCALE, SCALE, dtype)[None, :]
    out = tl.sum(acc, axis=1)
    if SCALE == 1:
        out *= tl.load(s_rows, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, round_to(out, dtype).to(dtype), mask=n_mask)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, *, policy: LaunchPolicy | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_gemv_ref` in one Triton kernel for x [1, K], an e4m3 w [N, K] and its float32 block scales; returns
    [1, N] in `out_dtype` (None: x's; W8A8 passes its rounded x in float32 and asks for the model's dtype). The launch
    takes the policy's `fp8_gemv` tile and warps (None: the device's)."""
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
    config, block_k, pdl, out = _one_row_launch("fp8_gemv", x, bias, n, k, policy, out_dtype)
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, scale, out if bias is None else bias, out, n, scale.stride(0), K=k, BN_SCALE=bn, BK_SCALE=bk,
        BLOCK_N=config.block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % block_k == 0, SCALE=fp8_scale_mode(block, k, config.block_n), PDL=pdl,
        num_warps=config.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out
