"""A decoder layer's elementwise work, fused: residual add + RMSNorm, SiLU(gate) * up, rotary.

Each Triton kernel replaces several PyTorch kernels (a batch-1 decode step of an 8B model ran about 20
small kernels a layer, most of them these; docs/design/step-pipeline.md) and rounds exactly where the PyTorch code it
replaces rounds: every intermediate that code materializes in the model dtype is rounded to that dtype
here too, so outputs differ from the references only by the order of the fp32 sum in a norm and, on a GPU,
by Triton's approximate exp and rsqrt where PyTorch uses accurate ones (a last-bit difference before the
rounding to the model dtype, so at most one bf16 step). The references (`*_ref`) are the PyTorch code itself:
the oracle in tests and the CPU path.

Rotary lives here as math (`rotate_ref`, `rotate`); the kernel that also writes the rotated keys into
the paged KV cache is `paged_attention.rotary_write_kv` (in `paged_attention.kv_write`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.launch_policy import LaunchPolicy, policy_for

# Decided once, when the kernels are decorated: triton reads TRITON_INTERPRET at `@triton.jit` time.
INTERPRET = bool(triton.knobs.runtime.interpret)


def triton_usable(t: torch.Tensor) -> bool:
    """Whether Triton kernels can run on `t`: a CUDA tensor, or any tensor under TRITON_INTERPRET=1."""
    return t.is_cuda or INTERPRET


@functools.cache
def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (and Triton's gdc_* instructions): CUDA devices of compute capability 9.0+, and
    not under the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def chain_pdl(policy: LaunchPolicy, device: torch.device) -> bool:
    """Whether a launch of the decode chain's kernels (`LaunchPolicy.step_pdl`) runs under programmatic dependent
    launch on `device`. Such a kernel lets the next one launch as soon as all its programs have started
    (gdc_launch_dependents) and waits for the one before it to finish, and its writes to show, before it reads
    anything that kernel may have written or writes anything at all (gdc_wait). A kernel launched so after one that
    does not trigger simply starts when that one ends; the chain is the same in CUDA graphs (programmatic edges)."""
    return policy.step_pdl and has_pdl(device)


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch option of a kernel launched under programmatic dependent launch (`chain_pdl`)."""
    return {"launch_pdl": True} if pdl else {}


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype). F.rms_norm computes
    the normalization in fp32 and rounds once to x's dtype (one kernel on CUDA instead of six)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), the sum rounded to x's dtype; no residual: (RMSNorm(x), x)."""
    h = x if residual is None else residual + x
    return rms_norm_ref(h, weight, eps), h


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] = [gate | up]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rotate_ref(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by rotary rows cos_sin [T, 2, 1, D] (cos, sin with its first half negated).

    Hugging Face's rotate-half form, x * cos + rotate_half(x) * sin, written as roll(x, D/2) * signed sin:
    fewer kernels, bitwise the same (x * -s == -(x * s) in IEEE arithmetic)."""
    return x * cos_sin[:, 0] + x.roll(x.shape[-1] // 2, dims=-1) * cos_sin[:, 1]


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x (fp32) rounded to nearest-even in `dtype` and widened back: where the PyTorch code stores an
    intermediate. bf16 is rounded by hand: Triton's interpreter truncates fp32 -> bf16 casts (it ignores
    fp_downcast_rounding), the GPU rounds; by hand both round alike. The carry of the rounding would turn
    some NaNs (e.g. 0x7FFFFFFF) into zero or infinity, so NaN passes through unrounded."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype).to(tl.float32)


@triton.jit
def rms_rstd(x, n, eps):
    """1 / RMS of one row x (fp32, zero past its n values): the statistic of `rms_norm_ref`."""
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def rms_scale(x, rstd, w, dtype: tl.constexpr):
    """x (fp32) normalized by `rstd` and weighted by w (fp32), rounded where `rms_norm_ref` rounds."""
    return round_to(round_to(x * rstd, dtype) * w, dtype)


@triton.jit
def silu_mul_values(gu_row, cols, mask, n, dtype: tl.constexpr):
    """SiLU(gate) * up at `cols` of one gate_up row ([gate | up], n each) in fp32, rounded where `silu_mul_ref`
    rounds; zero where masked."""
    gate = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + n + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)


@triton.jit
def rotate(x, x_half, cos, sin, dtype: tl.constexpr):
    """`rotate_ref` of one head: x, x rolled by D/2, cos and signed sin, all fp32; rounded as the reference."""
    return round_to(round_to(x * cos, dtype) + round_to(x_half * sin, dtype), dtype)


@triton.jit
def norm_row_start(w_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The start of a one-program-per-row norm kernel in the decode chain: the row's columns, their mask and the norm
    weight in fp32, loaded before waiting for the kernel before (PDL), since no earlier kernel writes a weight."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if PDL:
        gdc_launch_dependents()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    return cols, mask, w


@triton.jit
def add_rms_norm_row(x_ptr, res_ptr, w_ptr, h_ptr, row, n, eps, stride_x, stride_r, stride_h,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row of `add_rms_norm_ref` in a one-program-per-row kernel: stores x + residual (HAS_RESIDUAL) and returns
    (the normed row in fp32, rounded to x's dtype where the reference rounds, its columns, their mask); zero past n."""
    dtype = x_ptr.dtype.element_ty
    cols, mask, w = norm_row_start(w_ptr, n, BLOCK, PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = round_to(h + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(h_ptr + row * stride_h + cols, h.to(dtype), mask=mask)
    return rms_scale(h, rms_rstd(h, n, eps), w, dtype), cols, mask


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n, eps,
                         stride_x, stride_r, stride_o, stride_h,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program per row.
    row = tl.program_id(0).to(tl.int64)
    normed, cols, mask = add_rms_norm_row(x_ptr, res_ptr, w_ptr, h_ptr, row, n, eps, stride_x, stride_r, stride_h,
                                          HAS_RESIDUAL, BLOCK, PDL)
    tl.store(out_ptr + row * stride_o + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 policy: LaunchPolicy | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one kernel for x [T, n] (the residual, when given, is [T, n] too). `policy`: the launch
    settings (None: the device's)."""
    if not triton_usable(x):
        return add_rms_norm_ref(x, residual, weight, eps)
    if x.dim() != 2 or x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape
                                                                        or residual.stride(-1) != 1)):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual must be [T, n] with contiguous rows")
    t, n = x.shape
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    if t:
        if policy is None:
            policy = policy_for(x.device)
        r = x if residual is None else residual  # never read without a residual
        pdl = chain_pdl(policy, x.device)
        _add_rms_norm_kernel[(t,)](x, r, weight, out, h, n, eps, x.stride(0), r.stride(0), out.stride(0),
                                   h.stride(0), HAS_RESIDUAL=residual is not None,
                                   BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=row_warps(policy, n),
                                   **pdl_launch(pdl))
    return out, h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    # Program (row, column block).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, silu_mul_values(gu_ptr + row * stride_gu, cols, mask, n, dtype).to(dtype),
             mask=mask)


def silu_mul(gate_up: torch.Tensor, *, policy: LaunchPolicy | None = None) -> torch.Tensor:
    """`silu_mul_ref` in one kernel: gate_up [T, 2I] -> [T, I]. `policy`: the launch settings (None: the device's)."""
    if not triton_usable(gate_up):
        return silu_mul_ref(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        if policy is None:
            policy = policy_for(gate_up.device)
        _silu_mul_kernel[(t, triton.cdiv(n, policy.silu_block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                                BLOCK=policy.silu_block)
    return out


def row_warps(policy: LaunchPolicy, n: int) -> int:
    """Warps of a one-program-per-row kernel over rows of n values: enough threads that a row is a few per thread."""
    return max(1, min(policy.row_max_warps, n // policy.row_values_per_warp))
