"""Dynamic fp8 quantization of activations, as a W8A8 product quantizes its input.

Each token (`group` 0), or each run of `group` consecutive features of a token (the last may be ragged), gets the
scale s = max(|x|) / 448 (at least the smallest normal float32, so an all-zero slice stays zero) and the e4m3 codes
x / s rounded to nearest, ties to even: `fp8_quantize_ref` in PyTorch (the oracle and the CPU path) and
`fp8_quantize` in one Triton kernel.

The kernel computes the codes' bits with integer arithmetic rather than a float8 conversion: Triton's interpreter
converts float32 to float8 wrongly (it truncated -7.87 to -4 in a probe), so a kernel that converted could not be
checked on a CPU, while integer arithmetic is exact everywhere. For |v| of at least 2^-6 (e4m3's smallest normal),
e4m3 keeps the top 3 of float32's 23 mantissa bits: adding 2^19 - 1 plus the lowest kept bit to v's bits and
shifting right by 20 rounds to nearest even and carries into the exponent, and the exponent bias moves from 127 to
7. Below 2^-6 the code is the subnormal count of 2^-9 steps, |v| * 512 rounded to an integer by adding 2^23 in
float32 (exact: the sum's spacing is 1) and reading the integer back from the sum's bits. Divisions are IEEE
(`div_rn`), as PyTorch's are, so the codes and scales are bit for bit those of the reference.

`fp8_round` gives what those codes stand for, code times scale, for a product that multiplies x as rounded (the
one-row fp8 GEMV; in float32, so that it multiplies what the GEMMs of the codes do): the same kernel writes the
rounded magnitude (float32's bits with the 20 dropped ones cleared, or the subnormal count times 2^-9, both exact)
times the scale instead of the code. A NaN or an infinity in a slice makes the slice's scale and codes NaN, as in
PyTorch (infinity over infinity); every other slice is unaffected.

Before a one-row W8A8 layer the rounding rides on the kernel that writes the layer's input, so that a decode step
runs no kernel of its own for it: `add_rms_norm_fp8` is `add_rms_norm` writing the rounded normed row (the input of
qkv and gate_up), and `fp8_round(gate_up, group, silu_mul=True)` rounds SiLU(gate)·up as it computes it (the input
of down). Both give exactly the values of the reference on the row the unfused kernels would have written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from governor.kernels.elementwise import (
    add_rms_norm_row,
    chain_pdl,
    pdl_launch,
    round_to,
    row_warps,
    silu_mul_values,
    triton_usable,
)
from governor.kernels.launch_policy import LaunchPolicy, policy_for

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
_BLOCK_MAX = 16384  # features a program holds at a time (a group up to this long is read once)


def fp8_quantize_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, K] float8_e4m3fn, scales [rows, ceil(K / g)] float32) of a 2-D x, g = `group` or K."""
    rows, k = x.shape
    g = group or k
    groups = -(-k // g)
    xf = F.pad(x.float(), (0, groups * g - k)).reshape(rows, groups, g)
    amax = xf.abs().amax(-1)
    # Divided by a tensor on x's device, not by a Python number: CUDA's division by a CPU scalar multiplies by its
    # reciprocal, which is one float32 step off IEEE division for some amax.
    scales = (amax / amax.new_full((), E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (xf / scales[..., None]).to(FP8_DTYPE).reshape(rows, groups * g)[:, :k]
    return codes.contiguous(), scales


def fp8_round_ref(x: torch.Tensor, group: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [rows, K] as its e4m3 codes stand for it: each code times its scale, in float32, returned in `dtype` (None:
    x's). In float32 these are the values a product of the codes multiplies (a code has 4 significant bits, so its
    product with the scale is exact to float32's last bit)."""
    codes, scales = fp8_quantize_ref(x, group)
    g = group or x.shape[1]
    return (codes.float() * scales.repeat_interleave(g, dim=1)[:, :x.shape[1]]).to(dtype or x.dtype)


@triton.jit
def _e4m3(v, VALUES: tl.constexpr):
    # Float32 v (|v| <= 448) rounded to e4m3, nearest even: its float8_e4m3fn bits as int32 in [0, 255], or (VALUES)
    # the rounded value in float32.
    # A NaN (a NaN or infinite input makes its whole slice NaN, as in PyTorch) stays NaN: code 0x7F with its sign.
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    a = magnitude.to(tl.float32, bitcast=True)
    steps = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # 2^-9 steps; 8388608 = 2^23
    is_normal = magnitude >= (121 << 23)  # 121 << 23: the bits of 2^-6
    is_nan = magnitude > 0x7F800000
    if VALUES:
        rounded = tl.where(is_normal, (normal << 20).to(tl.float32, bitcast=True), steps.to(tl.float32) * 0.001953125)
        rounded = tl.minimum(rounded, 448.0)
        return tl.where(is_nan, v, tl.where(bits < 0, -rounded, rounded))
    else:
        code = tl.where(is_nan, 0x7F, tl.minimum(tl.where(is_normal, normal - (120 << 3), steps), 0x7E))
        return ((bits >> 24) & 0x80) | code  # 0x7E: 448, the largest finite code


@triton.jit
def _group_scale(amax, nans):
    # A group's scale from its largest magnitude and whether it holds a NaN (the GPU's maximum drops NaNs, so they
    # are counted apart): NaN then, as in PyTorch.
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    return tl.where(nans > 0, tl.full(scale.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), scale)


@triton.jit
def e4m3_round_row(x, G: tl.constexpr, BLOCK: tl.constexpr):
    """A row held by one program (fp32 [BLOCK], zero past its values) as `fp8_round_ref` rounds it with groups of G
    features (G divides BLOCK; G = BLOCK: one scale for the row), in float32."""
    xg = tl.reshape(x, [BLOCK // G, G])
    scale = _group_scale(tl.max(tl.abs(xg), 1), tl.max((xg != xg).to(tl.int32), 1))[:, None]
    return tl.reshape(_e4m3(tl.math.div_rn(xg, scale), True) * scale, [BLOCK])


@triton.jit
def _x_values(x_row, cols, mask, K: tl.constexpr, SILU_MUL: tl.constexpr):
    # x's values at cols in fp32; SILU_MUL: SiLU(gate)·up of the gate_up row [gate | up] (K each), rounded as
    # `silu_mul_ref` rounds in x's dtype.
    if SILU_MUL:
        return silu_mul_values(x_row, cols, mask, K, x_row.dtype.element_ty)
    return tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fp8_quantize_kernel(x_ptr, out_ptr, scales_ptr, stride_x, K: tl.constexpr, G: tl.constexpr,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr, VALUES: tl.constexpr, SILU_MUL: tl.constexpr):
    # One program per (row, group): the group's largest magnitude, then its codes (or the values they stand for).
    # A group of up to BLOCK features is read once and held in registers; a longer one is read twice, a BLOCK at a
    # time (its largest magnitude first). A serial loop over a long row is latency-bound: in 1,024-feature tiles, with
    # SiLU·mul computed in each pass, the rounding of o's 4,096 features and down's 14,336 took 8.6 us a launch on
    # average on an H200 (docs/performance/quantized-weights.md).
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1)
    start = gi * G
    x_row = x_ptr + row * stride_x
    if G <= BLOCK:
        cols = start + tl.arange(0, BLOCK)
        mask = (cols < K) & (tl.arange(0, BLOCK) < G)
        xv = _x_values(x_row, cols, mask, K, SILU_MUL)
        scale = _group_scale(tl.max(tl.abs(xv), 0), tl.max((xv != xv).to(tl.int32), 0))
        tl.store(scales_ptr + row * GROUPS + gi, scale)
        _store_e4m3(out_ptr + row * K + cols, tl.math.div_rn(xv, scale), scale, mask, VALUES)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        nans = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, G, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            mask = (cols < K) & (off + tl.arange(0, BLOCK) < G)
            xv = _x_values(x_row, cols, mask, K, SILU_MUL)
            amax = tl.maximum(amax, tl.abs(xv))
            nans = tl.maximum(nans, (xv != xv).to(tl.int32))
        scale = _group_scale(tl.max(amax, 0), tl.max(nans, 0))
        tl.store(scales_ptr + row * GROUPS + gi, scale)
        for off in range(0, G, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            mask = (cols < K) & (off + tl.arange(0, BLOCK) < G)
            _store_e4m3(out_ptr + row * K + cols, tl.math.div_rn(_x_values(x_row, cols, mask, K, SILU_MUL), scale),
                        scale, mask, VALUES)


@triton.jit
def _store_e4m3(out, v, scale, mask, VALUES: tl.constexpr):
    # v = x / scale rounded to e4m3: its codes (uint8), or (VALUES) the values they stand for in out's dtype.
    if VALUES:
        dtype = out.dtype.element_ty
        tl.store(out, round_to(_e4m3(v, True) * scale, dtype).to(dtype), mask=mask)
    else:
        tl.store(out, _e4m3(v, False).to(tl.uint8), mask=mask)


def quantize_block(group: int) -> int:
    """The features a quantizing program holds at a time for groups of `group` (a power of two)."""
    return min(triton.next_power_of_2(group), _BLOCK_MAX)


def _launch(x: torch.Tensor, group: int, out: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """The scales; `out` gets the codes (uint8) or the rounded values (in its own dtype), of x or (`silu_mul`) of
    SiLU(gate)·up of x = [gate | up]."""
    rows, k = out.shape
    g = group or k
    groups = -(-k // g)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        # A group of thousands of features is one program's: 16 warps took a one-row quantization of 4,096 features
        # from 3.6 to 2.1 us on an H200, of 14,336 from 10.3 to 4.0, in tiles of 1,024 (docs/design/gemv.md; the
        # sweep, scripts/quantized-gemv-sweep.py, times the launch as shipped).
        _fp8_quantize_kernel[(rows, groups)](x, out, scales, x.stride(0), K=k, G=g, GROUPS=groups,
                                             BLOCK=quantize_block(g),
                                             VALUES=out.dtype != torch.uint8, SILU_MUL=silu_mul,
                                             num_warps=16 if g >= 2048 else 4)
    return scales


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or not triton_usable(x):
        raise ValueError(f"{name}: needs a 2-D x with contiguous rows on a Triton device, got {tuple(x.shape)} "
                         f"strides {x.stride()} on {x.device}")


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_quantize_ref` in one Triton kernel, for a 2-D x with contiguous rows where Triton runs (`triton_usable`)."""
    _check(x, "fp8_quantize")
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    return codes.view(FP8_DTYPE), _launch(x, group, codes)


def fp8_round(x: torch.Tensor, group: int, dtype: torch.dtype | None = None, *, silu_mul: bool = False
              ) -> torch.Tensor:
    """`fp8_round_ref` in one Triton kernel, for the same x as `fp8_quantize`; `silu_mul`: of `silu_mul_ref(x)`
    for x = gate_up [rows, 2K], computed in the same kernel (its intermediate rounded in x's dtype)."""
    _check(x, "fp8_round")
    if silu_mul and x.shape[1] % 2:
        raise ValueError(f"fp8_round: silu_mul needs gate_up [rows, 2K], got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1], dtype=dtype or x.dtype,
                      device=x.device)
    _launch(x, group, out, silu_mul)
    return out


def norm_rounding_supported(group: int, n: int) -> bool:
    """Whether `add_rms_norm_fp8` rounds rows of n features in groups of `group` (0: per token): the row is one
    group, or the groups are a power of two (they tile the program's padded row)."""
    return group == 0 or group >= n or (group & (group - 1)) == 0


@triton.jit
def _add_rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n, eps, stride_x, stride_r, stride_o, stride_h,
                             HAS_RESIDUAL: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program per row: `elementwise._add_rms_norm_kernel`, storing the normed row rounded to e4m3's values.
    row = tl.program_id(0).to(tl.int64)
    normed, cols, mask = add_rms_norm_row(x_ptr, res_ptr, w_ptr, h_ptr, row, n, eps, stride_x, stride_r, stride_h,
                                          HAS_RESIDUAL, BLOCK, PDL)
    tl.store(out_ptr + row * stride_o + cols, e4m3_round_row(normed, G, BLOCK), mask=mask)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group: int, *,
                     policy: LaunchPolicy | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_round_ref(norm(x + residual), group, float32), x + residual) in one kernel, for x [T, n] (and the
    residual) with contiguous rows on a Triton device: `elementwise.add_rms_norm` writing what the W8A8 layer after
    it multiplies instead of the normed row (`norm_rounding_supported(group, n)` must hold)."""
    _check(x, "add_rms_norm_fp8")
    t, n = x.shape
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"add_rms_norm_fp8: the residual must be [T, n] like x {tuple(x.shape)} with contiguous rows")
    if not norm_rounding_supported(group, n):
        raise ValueError(f"add_rms_norm_fp8: groups of {group} over rows of {n} features: needs per-token scales, "
                         "one group per row, or groups of a power of two")
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    h = x if residual is None else torch.empty_like(x)
    if t:
        policy = policy or policy_for(x.device)
        block = triton.next_power_of_2(n)
        r = x if residual is None else residual  # never read without a residual
        pdl = chain_pdl(policy, x.device)
        _add_rms_norm_fp8_kernel[(t,)](x, r, weight, out, h, n, eps, x.stride(0), r.stride(0), out.stride(0),
                                       h.stride(0), HAS_RESIDUAL=residual is not None,
                                       G=block if group == 0 or group >= n else group, BLOCK=block, PDL=pdl,
                                       num_warps=row_warps(policy, n), **pdl_launch(pdl))
    return out, h
