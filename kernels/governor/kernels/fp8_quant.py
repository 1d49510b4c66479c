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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from governor.kernels.elementwise import round_to, triton_usable

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
_BLOCK_MAX = 1024  # features a program reads at a time


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
def _fp8_quantize_kernel(x_ptr, out_ptr, scales_ptr, stride_x, K: tl.constexpr, G: tl.constexpr,
                         GROUPS: tl.constexpr, BLOCK: tl.constexpr, VALUES: tl.constexpr):
    # One program per (row, group): the group's largest magnitude, then its codes (or the values they stand for).
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1)
    start = gi * G
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)  # the GPU's maximum drops NaNs: they are counted apart
    for off in range(0, G, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (cols < K) & (off + tl.arange(0, BLOCK) < G)
        xv = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xv))
        nans = tl.maximum(nans, (xv != xv).to(tl.int32))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), 448.0), 1.1754943508222875e-38)
    scale = tl.where(tl.max(nans, 0) > 0, tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), scale)
    tl.store(scales_ptr + row * GROUPS + gi, scale)
    for off in range(0, G, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = (cols < K) & (off + tl.arange(0, BLOCK) < G)
        v = tl.math.div_rn(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32), scale)
        if VALUES:
            dtype = out_ptr.dtype.element_ty
            tl.store(out_ptr + row * K + cols, round_to(_e4m3(v, True) * scale, dtype).to(dtype), mask=mask)
        else:
            tl.store(out_ptr + row * K + cols, _e4m3(v, False).to(tl.uint8), mask=mask)


def _launch(x: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """The scales; `out` gets the codes (uint8) or the rounded values (in its own dtype)."""
    rows, k = x.shape
    g = group or k
    groups = -(-k // g)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        # A group of thousands of features is one program's serial loop: 16 warps took a one-row quantization of
        # 4,096 features from 3.6 to 2.1 us on an H200, of 14,336 from 10.3 to 4.0 (docs/design/gemv.md; the sweep,
        # scripts/quantized-gemv-sweep.py, times the launch as shipped).
        _fp8_quantize_kernel[(rows, groups)](x, out, scales, x.stride(0), K=k, G=g, GROUPS=groups,
                                             BLOCK=min(triton.next_power_of_2(g), _BLOCK_MAX),
                                             VALUES=out.dtype != torch.uint8, num_warps=16 if g >= 2048 else 4)
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


def fp8_round(x: torch.Tensor, group: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_round_ref` in one Triton kernel, for the same x as `fp8_quantize`."""
    _check(x, "fp8_round")
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    _launch(x, group, out)
    return out
