"""Prototype: fp8 decode attention in Gluon, each warp its own keys, K/V loaded straight into registers."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2


def _bases(bits):
    return [list(b) for b in bits]


def layouts(W: int, TNW: int, D: int):
    """(mma, a, b, k_load, v_load) for W warps, TNW keys per warp per step, head_dim D."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    warp = [[1 << i, 0, 0] for i in range(W.bit_length() - 1)]
    # K as loaded: [W, keys, p] (p = physical head dim). A lane (g = lane // 4, c = lane % 4) holds keys g + 8j and
    # the D/4 contiguous dims c*D/4 .. c*D/4 + D/4 - 1, which the dot reads as logical dims 16i + 2c + {0, 1, 8, 9}.
    kreg = [[0, 0, 1 << i] for i in range((D // 4).bit_length() - 1)] + [
        [0, 8 << i, 0] for i in range((TNW // 8).bit_length() - 1)
    ]
    klane = [[0, 0, D // 4], [0, 0, D // 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    k_load = gl.DistributedLinearLayout(kreg, klane, warp, [], [W, TNW, D])
    # V as loaded: [W, keys, p]. A lane holds keys 2c + {0, 1, 8, 9} (+16 per k-step) and dims g*D/8 .. g*D/8 + D/8 - 1,
    # which the dot reads as logical output dims g + 8u.
    vreg = (
        [[0, 0, 1 << i] for i in range((D // 8).bit_length() - 1)]
        + [[0, 1, 0]]
        + [[0, 8 << i, 0] for i in range((TNW // 8).bit_length() - 1)]
    )
    vlane = [[0, 2, 0], [0, 4, 0], [0, 0, D // 8], [0, 0, D // 4], [0, 0, D // 2]]
    v_load = gl.DistributedLinearLayout(vreg, vlane, warp, [], [W, TNW, D])
    return mma, a, b, k_load, v_load


@gluon.jit
def _k_logical(k_raw, W: gl.constexpr, TNW: gl.constexpr, D: gl.constexpr):
    # [W, keys, p] with p = c*D/4 + 4i + 2*j1 + j0  ->  [W, k, keys] with k = 16i + 8*j1 + 2c + j0.
    x = gl.reshape(k_raw, [W, TNW, 4, D // 16, 2, 2])
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])
    x = gl.reshape(x, [W, TNW, D])
    return gl.permute(x, [0, 2, 1])


@gluon.jit
def _v_logical(v_raw, W: gl.constexpr, TNW: gl.constexpr, D: gl.constexpr):
    # [W, keys, p] with p = g*D/8 + u  ->  [W, keys, n] with n = g + 8u.
    x = gl.reshape(v_raw, [W, TNW, 8, D // 8])
    x = gl.permute(x, [0, 1, 3, 2])
    return gl.reshape(x, [W, TNW, D])


@gluon.jit
def _load_kv(
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    start,
    kv_end,
    kv_head,
    kkey,
    kp,
    vkey,
    vp,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: gl.constexpr,
):
    kpos = start + kkey
    kvalid = kpos < kv_end
    kblock = gl.load(bt_row + kpos // BLOCK_SIZE, mask=kvalid, other=0)
    koff = kblock * stride_kb + (kpos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    k_raw = gl.load(k_cache_ptr + koff[:, :, None] + kp[None, None, :], mask=kvalid[:, :, None], other=0.0)
    vpos = start + vkey
    vvalid = vpos < kv_end
    vblock = gl.load(bt_row + vpos // BLOCK_SIZE, mask=vvalid, other=0)
    voff = vblock * stride_vb + (vpos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
    v_raw = gl.load(v_cache_ptr + voff[:, :, None] + vp[None, None, :], mask=vvalid[:, :, None], other=0.0)
    return k_raw, v_raw


@gluon.jit
def _copy_kv(
    k_smem,
    v_smem,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    start,
    kv_end,
    kv_head,
    kkey,
    kp,
    vkey,
    vp,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: gl.constexpr,
):
    # cp.async of one step's K/V into a stage; each lane copies what it reads back (KL / VL), keys past kv_end zero.
    kpos = start + kkey
    kvalid = kpos < kv_end
    kblock = gl.load(bt_row + kpos // BLOCK_SIZE, mask=kvalid, other=0)
    koff = kblock * stride_kb + (kpos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    async_copy.async_copy_global_to_shared(
        k_smem, k_cache_ptr + koff[:, :, None] + kp[None, None, :], mask=kvalid[:, :, None]
    )
    vpos = start + vkey
    vvalid = vpos < kv_end
    vblock = gl.load(bt_row + vpos // BLOCK_SIZE, mask=vvalid, other=0)
    voff = vblock * stride_vb + (vpos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
    async_copy.async_copy_global_to_shared(
        v_smem, v_cache_ptr + voff[:, :, None] + vp[None, None, :], mask=vvalid[:, :, None]
    )
    async_copy.commit_group()


@gluon.jit
def _decode_fp8_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    num_q_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    GROUP: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    D: gl.constexpr,
    W: gl.constexpr,
    TNW: gl.constexpr,
    SPLIT: gl.constexpr,
    TILE_ALIGN: gl.constexpr,
    PREFETCH: gl.constexpr,
    STAGES: gl.constexpr,
    MMA: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    KL: gl.constexpr,
    VL: gl.constexpr,
):
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    if SPLIT:
        partition_size = gl.maximum(gl.cdiv(gl.cdiv(seq_len, num_splits), TILE_ALIGN), 1) * TILE_ALIGN
        kv_begin = split * partition_size
        kv_end = gl.minimum(seq_len, kv_begin + partition_size)
    else:
        kv_begin = 0
        kv_end = seq_len

    # q in the dot's A layout, dims permuted as K's are: logical k = 16i + 8*j1 + 2c + j0 reads physical
    # c*D/4 + 4i + 2*j1 + j0.
    qr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    qk = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, A)))
    qphys = ((qk >> 1) & 3) * (D // 4) + (qk >> 4) * 4 + ((qk >> 3) & 1) * 2 + (qk & 1)
    head = kv_head * GROUP + qr
    qmask = (qr < GROUP)[None, :, None] & (qk >= 0)[None, None, :]
    q_ptrs = q_ptr + seq * stride_qt + head[None, :, None] * stride_qh + qphys[None, None, :]
    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, A)))
    q_ptrs = q_ptrs + (wq * 0)[:, None, None]
    qmask = qmask & (wq >= 0)[:, None, None]
    q = gl.load(q_ptrs, mask=qmask, other=0.0).to(gl.float32)
    # bf16 q into fp16's range by a power of two (as _fp16_range); the max from a plain load of the group's rows.
    QB: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [W, 1], [1, 0])
    qb_r = gl.arange(0, 16, layout=gl.SliceLayout(1, QB))
    qb_d = gl.arange(0, D, layout=gl.SliceLayout(0, QB))
    qb = gl.load(
        q_ptr + seq * stride_qt + (kv_head * GROUP + qb_r)[:, None] * stride_qh + qb_d[None, :],
        mask=(qb_r < GROUP)[:, None] & (qb_d >= 0)[None, :],
        other=0.0,
    ).to(gl.float32)
    amax = gl.max(gl.max(gl.abs(qb), axis=1), axis=0)
    exponent = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    exponent = gl.minimum(gl.maximum(exponent, 8), 254)
    up = ((261 - exponent) << 23).to(gl.float32, bitcast=True)
    down = ((exponent - 7) << 23).to(gl.float32, bitcast=True)
    q = (q * up).to(gl.float16)
    qk_scale = qk_scale * gl.load(k_scale_ptr + kv_head) * down

    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    # K addresses: keys on [W, TNW] in KL's slice, dims along p.
    kw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, KL)))
    kn = gl.arange(0, TNW, layout=gl.SliceLayout(0, gl.SliceLayout(2, KL)))
    kp = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, KL)))
    kkey = kw[:, None] * TNW + kn[None, :]
    vw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL)))
    vn = gl.arange(0, TNW, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL)))
    vp = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    vkey = vw[:, None] * TNW + vn[None, :]
    sw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA)))
    sn = gl.arange(0, TNW, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    skey = sw[:, None] * TNW + sn[None, :]

    m_i = gl.full([W, 16], -1.0e30, gl.float32, gl.SliceLayout(2, MMA))
    l_i = gl.full([W, 16], 0.0, gl.float32, gl.SliceLayout(2, MMA))
    acc = gl.full([W, 16, D], 0.0, gl.float32, MMA)
    if STAGES > 0:
        SL: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [2, 1, 0])
        k_smem = gl.allocate_shared_memory(k_cache_ptr.dtype.element_ty, [STAGES, W, TNW, D], SL)
        v_smem = gl.allocate_shared_memory(v_cache_ptr.dtype.element_ty, [STAGES, W, TNW, D], SL)
        for st in gl.static_range(STAGES - 1):
            _copy_kv(
                k_smem.index(st),
                v_smem.index(st),
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                kv_begin + st * W * TNW,
                kv_end,
                kv_head,
                kkey,
                kp,
                vkey,
                vp,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                BLOCK_SIZE,
            )
    if PREFETCH:
        k_raw, v_raw = _load_kv(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_begin,
            kv_end,
            kv_head,
            kkey,
            kp,
            vkey,
            vp,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            BLOCK_SIZE,
        )
    for start in range(kv_begin, kv_end, W * TNW):
        it = (start - kv_begin) // (W * TNW)
        if STAGES > 0:
            nxt = (it + STAGES - 1) % STAGES
            _copy_kv(
                k_smem.index(nxt),
                v_smem.index(nxt),
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                start + (STAGES - 1) * W * TNW,
                kv_end,
                kv_head,
                kkey,
                kp,
                vkey,
                vp,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                BLOCK_SIZE,
            )
            async_copy.wait_group(STAGES - 1)
            k_cur = k_smem.index(it % STAGES).load(KL)
            v_cur = v_smem.index(it % STAGES).load(VL)
        elif PREFETCH:
            k_cur = k_raw
            v_cur = v_raw
            k_raw, v_raw = _load_kv(
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                start + W * TNW,
                kv_end,
                kv_head,
                kkey,
                kp,
                vkey,
                vp,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                BLOCK_SIZE,
            )
        else:
            k_cur, v_cur = _load_kv(
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                start,
                kv_end,
                kv_head,
                kkey,
                kp,
                vkey,
                vp,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                BLOCK_SIZE,
            )
        kt = gl.convert_layout(_k_logical(k_cur.to(gl.float16), W, TNW, D), B)
        s = mma_v2(q, kt, gl.full([W, 16, TNW], 0.0, gl.float32, MMA))
        s = s * qk_scale
        s = gl.where(((start + skey) < kv_end)[:, None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + gl.sum(p, axis=2)
        v = gl.convert_layout(_v_logical(v_cur.to(gl.float16), W, TNW, D), B)
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), A), v, acc * alpha[:, :, None])
        m_i = m_new

    acc = acc * gl.load(v_scale_ptr + kv_head)
    # Merge the warps: each ran its own keys.
    m_all = gl.maximum(gl.max(m_i, axis=0), -1.0e30)
    wgt = gl.exp2(m_i - m_all[None, :])
    l_all = gl.sum(l_i * wgt, axis=0)
    o = gl.sum(acc * wgt[:, :, None], axis=0)  # [16, D], logical output dims

    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    orow = gl.arange(0, 16, layout=gl.SliceLayout(1, OL))
    on = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
    ophys = (on & 7) * (D // 8) + (on >> 3)
    ohead = kv_head * GROUP + orow
    omask = (orow < GROUP)[:, None] & (on >= 0)[None, :]
    if SPLIT:
        row = (seq * num_q_heads + ohead).to(gl.int64) * num_splits + split
        gl.store(part_acc_ptr + row[:, None] * D + ophys[None, :], o, mask=omask)
        ML: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, MMA))
        mrow = gl.arange(0, 16, layout=ML)
        mrow_g = (seq * num_q_heads + kv_head * GROUP + mrow).to(gl.int64) * num_splits + split
        gl.store(part_m_ptr + mrow_g, m_all, mask=mrow < GROUP)
        gl.store(part_l_ptr + mrow_g, l_all, mask=mrow < GROUP)
    else:
        l_o = gl.convert_layout(l_all, gl.SliceLayout(1, OL))
        out = o / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        gl.store(
            out_ptr + seq * stride_ot + ohead[:, None] * stride_oh + ophys[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=omask,
        )


def launch(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    out,
    k_scale,
    v_scale,
    num_splits,
    part=None,
    W=4,
    TNW=16,
    tile_align=64,
    prefetch=False,
    stages=0,
):

    batch, hq, D = q.shape
    hkv = k_cache.shape[2]
    mma, a, b, kl, vl = layouts(W, TNW, D)
    split = num_splits > 1
    if split:
        part_acc, part_m, part_l = part
    else:
        part_acc = part_m = part_l = out
    _decode_fp8_kernel[(batch, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        k_scale,
        v_scale,
        scale * 1.4426950408889634,
        hq,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=hq // hkv,
        BLOCK_SIZE=k_cache.shape[1],
        D=D,
        W=W,
        TNW=TNW,
        SPLIT=split,
        TILE_ALIGN=tile_align,
        PREFETCH=prefetch,
        STAGES=stages,
        MMA=mma,
        A=a,
        B=b,
        KL=kl,
        VL=vl,
        num_warps=W,
    )
    return out
