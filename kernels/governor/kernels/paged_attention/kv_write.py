"""Writes into the paged KV cache: `write_kv` (K/V rows to their slots) and `rotary_write_kv` (rotary, optional
per-head RMSNorms and the K/V write of a qkv projection, in one kernel), each beside its PyTorch reference
(`write_kv_ref`, `rotary_write_kv_ref`), and the fp8 quantization they share (`_to_cache_dtype` on the host,
`_quantize_e4m3` in the kernels: the same bytes either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import (
    INTERPRET,
    chain_pdl,
    pdl_launch,
    rms_norm_ref,
    rms_rstd,
    rms_scale,
    rotate,
    rotate_ref,
    triton_usable,
)
from governor.kernels.launch_policy import LaunchPolicy, policy_for

from .checks import FP8_MAX, _check_cache, _require_pow2_head_dim


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store `key`/`value` [T, num_kv_heads, head_dim] at `slot_mapping` [T] (int64) in place.

    Slots < 0 are padding and are skipped. Plain torch indexing; the boolean mask syncs with the
    host, so this is the CPU path (`write_kv` uses a kernel on GPU, safe in CUDA graphs).
    An fp8 cache needs `k_scale`/`v_scale` [num_kv_heads] and stores clamp(x / scale, ±448) (see
    the package docstring).
    """
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(key[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(value[keep], v_cache.dtype, v_scale)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """[T, num_kv_heads, head_dim] -> the cache's dtype; fp8 divides by the head's scale and saturates."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # One program per (token, kv head): one contiguous head_dim row each for K and V.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d)
    if FP8:
        k = _quantize_e4m3(k, tl.load(k_scale_ptr + head), INTERPRET)
        v = _quantize_e4m3(v, tl.load(v_scale_ptr + head), INTERPRET)
    kc = k_cache_ptr + slot * stride_kc_slot + head * stride_kc_h + d
    vc = v_cache_ptr + slot * stride_vc_slot + head * stride_vc_h + d
    tl.store(kc, k.to(kc.dtype.element_ty))
    tl.store(vc, v.to(vc.dtype.element_ty))


@triton.jit
def _quantize_e4m3(x, scale, INTERPRET: tl.constexpr):
    # Returns fp32 values the caller casts to e4m3 (round to nearest even on GPU).
    # div_rn is IEEE division, as torch's: the kernel stores the same bytes as write_kv_ref.
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if INTERPRET:
        # The interpreter's fp32 -> e4m3 cast rounds ties away from zero, drops the mantissa carry
        # (127.99 -> 64) and mangles subnormals, but converts representable values exactly; so
        # round to the e4m3 grid here. Grid spacing is 2^(exponent - 3), and 2^-9 below 2^-6
        # (subnormals). Adding 1.5 * 2^23 * spacing moves |y| into a binade whose fp32 spacing is
        # exactly `spacing`, so fp32's own round-to-nearest-even does the rounding.
        bits = y.to(tl.int32, bitcast=True)
        exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
        spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        magic = spacing * 12582912.0
        r = (tl.abs(y) + magic) - magic
        # Sign from the sign bit, and by a product: the interpreter's negation turns 0.0 into +0.0,
        # while torch stores a negative value that rounds to zero as -0.0.
        y = tl.where(bits < 0, -1.0, 1.0) * r
    return y


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store `key`/`value` [T, num_kv_heads, head_dim] at `slot_mapping` [T] (int64) in place.

    Slots < 0 are padding and are skipped. On CUDA (or under TRITON_INTERPRET=1) a Triton kernel
    does it without a host sync, so it can be captured in a CUDA graph; otherwise `write_kv_ref`.
    An fp8 cache needs `k_scale`/`v_scale` [num_kv_heads]; the bytes stored equal `write_kv_ref`'s.
    """
    if not triton_usable(key):
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    fp8 = _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _require_pow2_head_dim(head_dim, "write_kv")
    # Flattened slot view: stride over (block, offset) pairs is the offset stride when blocks are dense.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_flat,
        v_flat,
        slot_mapping,
        k_scale if fp8 else k_flat,  # never dereferenced unless FP8
        v_scale if fp8 else v_flat,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        HEAD_DIM=head_dim,
        FP8=fp8,
        INTERPRET=INTERPRET,
    )


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    stride_t,
    stride_cs,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, head) over the q heads then the kv heads: a q head is normed/rotated in place, a kv
    # head's rotated key and its value go to the cache. Heads sit side by side in a qkv row, so
    # `head * HEAD_DIM` addresses q head `head` and, past NUM_HEADS, key head `head - NUM_HEADS`.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:  # the decode chain (elementwise.chain_pdl): qkv is the kernel before's output
        gdc_launch_dependents()
        gdc_wait()
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + token * stride_t
    cs = cos_sin_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cs
    if head < NUM_HEADS:
        y = rotated_head(row + head * HEAD_DIM, d, cs, q_norm_ptr, eps, QK_NORM, HEAD_DIM)
        tl.store(row + head * HEAD_DIM + d, y.to(qkv_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # the flat slot view: a slot is a "block" of one token
            store_rotated_kv(row, d, cs, k_norm_ptr, eps, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot,
                             0, head - NUM_HEADS, NUM_HEADS, NUM_KV_HEADS, stride_kc_slot, 0, stride_kc_h,
                             stride_vc_slot, 0, stride_vc_h, HEAD_DIM, QK_NORM, FP8, INTERPRET)


@triton.jit
def rotated_head(head, d, cs, w_ptr, eps, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One head of a qkv row (`head`: its first value) normed by `w_ptr`'s weight (QK_NORM) and rotated by the
    rotary row `cs` (cos, then signed sin), in fp32 rounded where `rotary_write_kv_ref` rounds."""
    dtype = head.dtype.element_ty
    d_half = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2)[d] = x[(d + D/2) mod D]
    x = tl.load(head + d).to(tl.float32)
    x_half = tl.load(head + d_half).to(tl.float32)
    if QK_NORM:
        # The norm is per element after one shared statistic: normalize x, and x_half with x's statistic.
        rstd = rms_rstd(x, HEAD_DIM, eps)
        x = rms_scale(x, rstd, tl.load(w_ptr + d).to(tl.float32), dtype)
        x_half = rms_scale(x_half, rstd, tl.load(w_ptr + d_half).to(tl.float32), dtype)
    return rotate(x, x_half, tl.load(cs + d).to(tl.float32), tl.load(cs + HEAD_DIM + d).to(tl.float32), dtype)


@triton.jit
def rotated_heads(heads, d, mask, cs, w_ptr, eps, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """`rotated_head` of several heads at once: `heads` [R, 1] points at each one's first value (rows where `mask` is
    false read zeros); returns [R, HEAD_DIM]."""
    dtype = heads.dtype.element_ty
    d_half = (d + HEAD_DIM // 2) % HEAD_DIM
    x = tl.load(heads + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_half = tl.load(heads + d_half[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # rms_rstd of each row
        x = rms_scale(x, rstd, tl.load(w_ptr + d).to(tl.float32)[None, :], dtype)
        x_half = rms_scale(x_half, rstd, tl.load(w_ptr + d_half).to(tl.float32)[None, :], dtype)
    cos = tl.load(cs + d).to(tl.float32)[None, :]
    sin = tl.load(cs + HEAD_DIM + d).to(tl.float32)[None, :]
    return rotate(x, x_half, cos, sin, dtype)


@triton.jit
def store_rotated_kv(row, d, cs, k_norm_ptr, eps, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, offset,
                     kv_head, num_heads, num_kv_heads, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                     stride_vh, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """A token's key of kv head `kv_head`, normed (QK_NORM) and rotated, and its value, from its qkv `row` into the
    cache at (`block`, `offset`), quantized to e4m3 with the head's scales (FP8)."""
    k = rotated_head(row + (num_heads + kv_head) * HEAD_DIM, d, cs, k_norm_ptr, eps, QK_NORM, HEAD_DIM)
    v = tl.load(row + (num_heads + num_kv_heads + kv_head) * HEAD_DIM + d)
    if FP8:
        k = _quantize_e4m3(k, tl.load(k_scale_ptr + kv_head), INTERPRET)
        v = _quantize_e4m3(v, tl.load(v_scale_ptr + kv_head), INTERPRET)
    kc = k_cache_ptr + block * stride_kb + offset * stride_kt + kv_head * stride_kh + d
    vc = v_cache_ptr + block * stride_vb + offset * stride_vt + kv_head * stride_vh + d
    tl.store(kc, k.to(kc.dtype.element_ty))
    tl.store(vc, v.to(vc.dtype.element_ty))


def _qkv_views(qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D]: views of a qkv projection row [q | k | v]."""
    t, num_kv_heads, head_dim = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * kv_size or qkv.stride(-1) != 1:
        raise ValueError(f"rotary_write_kv: qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[T, {q_size + 2 * kv_size}] with contiguous rows, got {tuple(qkv.shape)}")
    return (qkv[:, :q_size].view(t, num_heads, head_dim), qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads,
            head_dim), qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))


def rotary_write_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of a qkv projection [T, (Hq + 2 Hkv) D] by their tokens' rotary rows
    `cos_sin[positions]` (`cos_sin` [max_positions, 2, D]: cos, and sin with its first half negated), after
    the per-head RMSNorms `q_norm`/`k_norm` [D] when given (Qwen3); store the rotated k and v at
    `slot_mapping` like `write_kv_ref`. Returns the rotated q [T, Hq, D] (a new tensor; qkv is unchanged)."""
    q, k, v = _qkv_views(qkv, num_heads, k_cache)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    rows = cos_sin[positions].unsqueeze(2)
    q, k = rotate_ref(q, rows), rotate_ref(k, rows)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


def rotary_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    policy: LaunchPolicy | None = None,
) -> torch.Tensor:
    """`rotary_write_kv_ref` in one kernel, without a host sync (CUDA-graph safe). The rotated q is written
    into qkv in place and returned as a view [T, Hq, D]; k in qkv is left unrotated. Same rounding as the
    reference (`elementwise` module docstring); the cache bytes equal `write_kv`'s for the same k and v.
    `policy`: the launch settings (None: the device's)."""
    if not triton_usable(qkv):
        q = _qkv_views(qkv, num_heads, k_cache)[0]
        return q.copy_(rotary_write_kv_ref(qkv, positions, cos_sin, num_heads, k_cache, v_cache, slot_mapping,
                                           q_norm=q_norm, k_norm=k_norm, eps=eps, k_scale=k_scale, v_scale=v_scale))
    q, fp8 = check_rotary_args("rotary_write_kv", qkv, positions, cos_sin, num_heads, k_cache, v_cache, slot_mapping,
                               q_norm, k_norm, k_scale, v_scale)
    t, num_kv_heads, head_dim = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    if t == 0:
        return q
    if policy is None:
        policy = policy_for(qkv.device)
    # One warp keeps a per-head norm's sum in the warp; measured up to rotary_one_warp_max_tokens tokens.
    one_warp = q_norm is not None and t <= policy.rotary_one_warp_max_tokens
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    pdl = chain_pdl(policy, qkv.device)
    _rotary_write_kv_kernel[(t, num_heads + num_kv_heads)](
        qkv, positions, cos_sin,
        q_norm if q_norm is not None else cos_sin, k_norm if k_norm is not None else cos_sin,  # unread w/o QK_NORM
        k_flat, v_flat, slot_mapping,
        k_scale if fp8 else k_flat, v_scale if fp8 else v_flat,  # never dereferenced unless FP8
        eps, qkv.stride(0), cos_sin.stride(0),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        QK_NORM=q_norm is not None,
        FP8=fp8,
        INTERPRET=INTERPRET,
        PDL=pdl,
        num_warps=policy.rotary_qk_norm_num_warps if one_warp else policy.rotary_num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip
    return q


def check_rotary_args(name: str, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Validate the arguments of a launch that rotates a qkv projection and writes its K/V (`rotary_write_kv`, and
    decode attention with the rotary folded in); return the q view [T, Hq, D] and whether the cache is fp8."""
    q, k, v = _qkv_views(qkv, num_heads, k_cache)
    fp8 = _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    t, _, head_dim = k.shape
    _require_pow2_head_dim(head_dim, name)
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{name}: pass both q_norm and k_norm, or neither")
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, head_dim) or not cos_sin.is_contiguous():
        raise ValueError(f"{name}: cos_sin must be a contiguous [max_positions, 2, {head_dim}], "
                         f"got {tuple(cos_sin.shape)}")
    if positions.shape != (t,):
        raise ValueError(f"{name}: positions must be [{t}], got {tuple(positions.shape)}")
    return q, fp8


def _check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate write_kv's arguments; return whether the cache is fp8."""
    fp8 = _check_cache(k_cache, v_cache, k_scale, v_scale)
    expected = (key.shape[0], k_cache.shape[2], k_cache.shape[3])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[T, num_kv_heads, head_dim] = {expected} to match the cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"write_kv: slot_mapping must be int64 [{key.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv: key and value need a contiguous last (head_dim) dimension")
    return fp8

