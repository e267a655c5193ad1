# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a @triton.jit parameter's annotation as its kind: tl.constexpr, or nothing for
# pointers and runtime scalars, which have no Python type to write.)
"""FlashAttention-2 forward kernel (online softmax over key/value tiles).

One program handles ``BLOCK_M`` query rows of one (batch, query head). Key/value tiles
are visited in three sweeps: masked tiles at the left edge of the visible band, fully
visible tiles with no element mask (the hot loop), masked tiles at the right edge
(the causal diagonal, the window edge, the key tail). Tiles outside the band are
never loaded, so causal and windowed attention cost what they compute. With a mask_mod
(``HAS_MOD``) the sweeps walk the query tile's list instead (``ops.tile_lists``): its
partial key tiles, masked by the packed bits, then its full ones, unmasked; empty tiles
are not on it. With ``masks.alibi`` (``HAS_ALIBI``) each score gains ``slope * (col - row)``,
the program's head's slope (``common.scores``).

All tensors are addressed by raw pointers and strides (last dimension contiguous), so
the same kernel runs from JAX (jax_triton) and on torch tensors (interpreter or GPU).
"""

import triton
import triton.language as tl

from jaxattn_triton.common import (
    LN2,
    LOG2E,
    mul_rounded,
    query_tile_key_range,
    scores,
    seen_keys,
)


@triton.jit
def _fwd_sweep(
    acc,
    l_i,
    m_i,
    q,
    rows,
    lo,
    hi,
    k_ptr,
    v_ptr,
    mask_ptr,
    bias_ptr,
    qseg_ptr,
    kseg_ptr,
    bits_ptr,
    seen_ptr,
    list_ptr,
    stride_kn,
    stride_vn,
    stride_mt,
    stride_ms,
    stride_bt,
    stride_bs,
    offs_d,
    offs_dv,
    slope,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    DIAG: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    EDGE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_MOD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # A row can only become all -inf where some element mask applies; the hot loop
    # without one skips the guard that keeps exp2(-inf - -inf) from producing NaN.
    MAY_BE_EMPTY: tl.constexpr = EDGE or HAS_MASK or HAS_SEG or HAS_BIAS
    TAIL_N: tl.constexpr = EDGE and (S % BLOCK_N != 0)
    # With a mask_mod, [lo, hi) indexes the query tile's list of key tiles (partial or full).
    STEP: tl.constexpr = 1 if HAS_MOD else BLOCK_N
    # See ``scores``: the logit scale is folded into exp2's argument on the plain path.
    SCALED: tl.constexpr = HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI
    QK_SCALE: tl.constexpr = 1.0 * SCALED + SM_SCALE * LOG2E * (1 - SCALED)
    for it in range(lo, hi, STEP):
        if HAS_MOD:
            start_n = tl.multiple_of(tl.load(list_ptr + it) * BLOCK_N, BLOCK_N)
        else:
            start_n = tl.multiple_of(it, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_ptr + offs_n[:, None] * stride_vn + offs_dv[None, :]
        if HAS_MOD and EDGE:
            live = seen_keys(seen_ptr, offs_n, S)[:, None]
            k = tl.load(k_ptrs, mask=live & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs, mask=live & (offs_dv[None, :] < DV), other=0.0)
        elif TAIL_N:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < S) & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < S) & (offs_dv[None, :] < DV), other=0.0)
        elif D != BLOCK_D or DV != BLOCK_DV:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))
        s, _ = scores(
            qk, rows, offs_n[None, :], mask_ptr, bias_ptr, qseg_ptr, kseg_ptr, bits_ptr,
            stride_mt, stride_ms, stride_bt, stride_bs,
            SM_SCALE, SOFTCAP, T, S, DIAG, LEFT, RIGHT, EDGE,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, WORDS, start_n, BLOCK_N,
            slope, HAS_ALIBI,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE)
        if MAY_BE_EMPTY:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        # The scores rounded as m was: a fused s * QK_SCALE - m overflows exp2 at huge logits.
        p = tl.exp2(mul_rounded(s, QK_SCALE, ASM) - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    QSeg,
    KSeg,
    Sink,
    Bits,
    Seen,
    List,
    Slopes,
    Out,
    Lse,
    stride_qb: tl.constexpr,
    stride_qt: tl.constexpr,
    stride_qh: tl.constexpr,
    stride_kb: tl.constexpr,
    stride_kn: tl.constexpr,
    stride_kh: tl.constexpr,
    stride_vb: tl.constexpr,
    stride_vn: tl.constexpr,
    stride_vh: tl.constexpr,
    stride_ob: tl.constexpr,
    stride_ot: tl.constexpr,
    stride_oh: tl.constexpr,
    stride_mb: tl.constexpr,
    stride_mh: tl.constexpr,
    stride_mt: tl.constexpr,
    stride_ms: tl.constexpr,
    stride_bb: tl.constexpr,
    stride_bh: tl.constexpr,
    stride_bt: tl.constexpr,
    stride_bs: tl.constexpr,
    stride_wb: tl.constexpr,
    stride_wh: tl.constexpr,
    stride_sb: tl.constexpr,
    stride_sh: tl.constexpr,
    stride_lb: tl.constexpr,
    stride_lh: tl.constexpr,
    stride_lr: tl.constexpr,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_MOD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    REVERSE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    DIAG: tl.constexpr = S - T
    if REVERSE_M:
        # With a causal band the last query tiles do the most work: start them first so
        # the tail of the grid is made of short programs.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    # int64 base offsets: B*T*H*D overflows int32 for long sequences.
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hkv64 = (h // GROUP).to(tl.int64)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m[:, None]

    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + rows * stride_qt + offs_d[None, :]
    if T % BLOCK_M != 0 or D != BLOCK_D:
        q = tl.load(q_ptrs, mask=(rows < T) & (offs_d[None, :] < D), other=0.0)
    else:
        q = tl.load(q_ptrs)
    k_ptr = K + b64 * stride_kb + hkv64 * stride_kh
    v_ptr = V + b64 * stride_vb + hkv64 * stride_vh
    mask_ptr = Mask + b64 * stride_mb + h64 * stride_mh
    bias_ptr = Bias + b64 * stride_bb + h64 * stride_bh
    qseg_ptr = QSeg + b64 * T
    kseg_ptr = KSeg + b64 * S

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    bits_ptr = Bits + b64 * stride_wb + h64 * stride_wh
    seen_ptr = Seen + b64 * stride_sb + hkv64 * stride_sh
    list_ptr = List + b64 * stride_lb + h64 * stride_lh + pid_m * stride_lr
    # masks.alibi's slope of this head (a dummy, unread, without one).
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32)
    else:
        slope = 0.0
    if HAS_MOD:
        # The query tile's list (ops.tile_lists): its partial key tiles, then its full ones;
        # empty tiles are not on it.
        n_part = tl.load(list_ptr)
        n_all = n_part + tl.load(list_ptr + 1)
        lo, full_lo, full_hi, hi = 0, n_part, n_all, n_all
        list_ptr += 2
    else:
        lo, full_lo, full_hi, hi = query_tile_key_range(m0, S, DIAG, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_sweep(
        acc, l_i, m_i, q, rows, lo, full_lo, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr, kseg_ptr,
        bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt, stride_bs,
        offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_sweep(
        acc, l_i, m_i, q, rows, full_lo, full_hi, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr, kseg_ptr,
        bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt, stride_bs,
        offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, False,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_sweep(
        acc, l_i, m_i, q, rows, full_hi, hi, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr, kseg_ptr,
        bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt, stride_bs,
        offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip

    # Log-sum-exp over real keys only (sinks excluded), natural units; -inf for rows
    # that see no key.
    lse = (m_i + tl.log2(l_i)) * LN2
    if HAS_SINK:
        # The sink joins the denominator only: rescale onto max(m, sink) and add it.
        sink = tl.load(Sink + h).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
    # Rows with nothing to attend have l == 0 and acc == 0: divide by 1 to give zeros.
    denom = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / denom[:, None]

    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + rows * stride_ot + offs_dv[None, :]
    if T % BLOCK_M != 0 or DV != BLOCK_DV:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows < T) & (offs_dv[None, :] < DV))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    lse_ptrs = Lse + (b64 * HQ + h64) * T + offs_m
    if T % BLOCK_M != 0:
        tl.store(lse_ptrs, lse, mask=offs_m < T)
    else:
        tl.store(lse_ptrs, lse)
