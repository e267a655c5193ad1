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
are not on it.

All tensors are addressed by raw pointers and strides (last dimension contiguous), so
the same kernel runs from JAX (jax_triton) and on torch tensors (interpreter or GPU).
"""

import triton
import triton.language as tl

from jaxattn_triton.common import LN2, LOG2E, key_tile_scores, mul_rounded, query_tile_walk


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

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    bits_ptr = Bits + b64 * stride_wb + h64 * stride_wh
    seen_ptr = Seen + b64 * stride_sb + hkv64 * stride_sh
    list_ptr = List + b64 * stride_lb + h64 * stride_lh + pid_m * stride_lr
    lo, full_lo, full_hi, hi, list_ptr = query_tile_walk(list_ptr, m0, S, DIAG, LEFT, RIGHT, HAS_MOD, BLOCK_M, BLOCK_N)
    # See ``scores``: the logit scale is folded into exp2's argument on the plain path.
    SCALED: tl.constexpr = HAS_SOFTCAP or HAS_BIAS
    QK_SCALE: tl.constexpr = 1.0 * SCALED + SM_SCALE * LOG2E * (1 - SCALED)
    # With a mask_mod, the bounds index the query tile's list of key tiles (partial or full).
    STEP: tl.constexpr = 1 if HAS_MOD else BLOCK_N
    bounds = (lo, full_lo, full_hi, hi)
    # The three sweeps: partial tiles (EDGE), full ones, partial ones.
    for sweep in tl.static_range(3):
        EDGE = sweep != 1  # a constexpr (not declared one: it is not reassigned)
        # A row can only become all -inf where some element mask applies; the hot loop
        # without one skips the guard that keeps exp2(-inf - -inf) from producing NaN.
        MAY_BE_EMPTY = EDGE or HAS_MASK or HAS_SEG or HAS_BIAS
        for it in range(bounds[sweep], bounds[sweep + 1], STEP):
            s, _, _, v = key_tile_scores(
                it, q, rows, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr, kseg_ptr, bits_ptr, seen_ptr, list_ptr,
                stride_kn, stride_vn, stride_mt, stride_ms, stride_bt, stride_bs, offs_d, offs_dv,
                SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, EDGE, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                HAS_SEG, HAS_SOFTCAP, HAS_MOD, WORDS, BLOCK_N, BLOCK_D, BLOCK_DV,
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
