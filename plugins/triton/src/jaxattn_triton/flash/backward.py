# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a @triton.jit parameter's annotation as its kind: tl.constexpr, or nothing for
# pointers and runtime scalars, which have no Python type to write.)
"""FlashAttention-2 backward kernels: preprocess, dK/dV, dQ.

* ``attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` (less the log-sum-exp
  output's cotangent), the base-2 log-sum-exp the other kernels normalise with (sinks
  folded in, ``+inf`` for rows that see no key so their probabilities come out as exact
  zeros), and each row's share of the sink gradient.
* ``attn_bwd_dkdv_kernel``: one program per key tile of one (batch, KV head); it loops
  over the query heads of the GQA group and over the query tiles that see the key tile,
  so dK/dV for a shared head are summed in registers without atomics. With a bias it
  also writes dBias (the logit gradient) for the tiles it visits.
  With ``FUSE_DQ`` it also adds each visited tile's ``dS @ K`` into a float32 dQ
  accumulator with atomic adds (FlashAttention-2's layout: five ``T x S x D`` products
  instead of seven, since ``Q K^T`` and ``dO V^T`` are not recomputed by a dQ kernel);
  the caller scales and casts the accumulator. Summation order is then not fixed.
  ``PART`` 1 or 2 makes it compute dV only or dK (and dBias, dQ) only: two launches
  that recompute ``Q K^T`` but each hold one accumulator, for head dims whose two
  accumulators do not fit in registers together.
* ``attn_bwd_dq_kernel``: one program per query tile, looping over key tiles like the
  forward (used when dQ is not fused, and always with ``masks.alibi``: it also sums each row's
  ``P dP``, ``P d`` and ``P dP d``, ``d = col - row``, into the slopes' gradient, exact where
  ``delta`` from the output rounded to q's dtype is not: positions up to S apart amplify its
  error).

Probabilities are recomputed from the saved log-sum-exp; the tile ranges and element
masks are the forward's (``common.py``), so masked tiles are skipped here too. With a
mask_mod each kernel walks its own tile lists (``ops.tile_lists``: dK/dV per key tile,
dQ per query tile), as the forward does.
"""

import triton
import triton.language as tl

from jaxattn_triton.common import (
    LOG2E,
    key_tile_query_range,
    mul_rounded,
    query_tile_key_range,
    scores,
    seen_keys,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    Out,
    DOut,
    Lse,
    DLse,
    Sink,
    Delta,
    LseB,
    DSinkRow,
    LseTerm,
    stride_ob: tl.constexpr,
    stride_ot: tl.constexpr,
    stride_oh: tl.constexpr,
    stride_dob: tl.constexpr,
    stride_dot: tl.constexpr,
    stride_doh: tl.constexpr,
    HQ: tl.constexpr,
    T: tl.constexpr,
    DV: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    h64 = h.to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    inb = (offs_m[:, None] < T) & (offs_dv[None, :] < DV)
    o = tl.load(
        Out + b64 * stride_ob + h64 * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :],
        mask=inb,
        other=0.0,
    )
    do = tl.load(
        DOut + b64 * stride_dob + h64 * stride_doh + offs_m[:, None] * stride_dot + offs_dv[None, :],
        mask=inb,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = (b64 * HQ + h64) * T + offs_m
    in_t = offs_m < T
    lse2 = tl.load(Lse + row, mask=in_t, other=float("-inf")) * LOG2E
    dlse = tl.load(DLse + row, mask=in_t, other=0.0)
    empty = lse2 == float("-inf")
    if HAS_SINK:
        sink2 = tl.load(Sink + h).to(tl.float32) * LOG2E
        mx = tl.maximum(lse2, sink2)
        tot2 = mx + tl.log2(tl.exp2(lse2 - mx) + tl.exp2(sink2 - mx))
        # d out / d sink = -p_sink * out, so d loss / d sink = -p_sink * rowsum(dO * O).
        tl.store(DSinkRow + row, -tl.exp2(sink2 - tot2) * delta, mask=in_t)
        # Real-key probabilities are the normalised ones times exp(lse_total - lse).
        real_scale = tl.where(empty, 0.0, tl.exp2(tot2 - lse2))
    else:
        tot2 = lse2
        real_scale = tl.where(empty, 0.0, 1.0)
    # The lse output's gradient adds dlse * p_real to every logit's gradient; folding it
    # into delta keeps the dS = P * (dP - delta) form of the other two kernels.
    delta = delta - dlse * real_scale
    if HAS_ALIBI:
        tl.store(LseTerm + row, dlse * real_scale, mask=in_t)  # the dQ kernel's slope gradient reads it
    # +inf makes exp2(s - lse) an exact 0 for rows that see no key (never NaN).
    tot2 = tl.where(tot2 == float("-inf"), float("inf"), tot2)
    tl.store(Delta + row, delta, mask=in_t)
    tl.store(LseB + row, tot2, mask=in_t)


@triton.jit
def _dkdv_sweep(
    dk,
    dv,
    k,
    v,
    cols,
    lo,
    hi,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    mask_ptr,
    bias_ptr,
    dbias_ptr,
    dq_ptr,
    qseg_ptr,
    kseg_ptr,
    bits_ptr,
    list_ptr,
    n0,
    stride_qt,
    stride_dot,
    stride_mt,
    stride_ms,
    stride_bt,
    stride_bs,
    stride_dbt,
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
    FUSE_DQ: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    TAIL_M: tl.constexpr = EDGE and (T % BLOCK_M != 0)
    # With a mask_mod, [lo, hi) indexes the key tile's list of query tiles (partial or full).
    STEP: tl.constexpr = 1 if HAS_MOD else BLOCK_M
    DO_DV: tl.constexpr = PART != 2
    DO_DK: tl.constexpr = PART != 1
    # See ``scores``: the logit scale is folded into exp2's argument on the plain path.
    SCALED: tl.constexpr = HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI
    QK_SCALE: tl.constexpr = 1.0 * SCALED + SM_SCALE * LOG2E * (1 - SCALED)
    for it in range(lo, hi, STEP):
        if HAS_MOD:
            start_m = tl.multiple_of(tl.load(list_ptr + it) * BLOCK_M, BLOCK_M)
        else:
            start_m = tl.multiple_of(it, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = do_ptr + offs_m[:, None] * stride_dot + offs_dv[None, :]
        if TAIL_M:
            q = tl.load(q_ptrs, mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), other=0.0)
            do = tl.load(do_ptrs, mask=(offs_m[:, None] < T) & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(lse_ptr + offs_m, mask=offs_m < T, other=float("inf"))
            delta = tl.load(delta_ptr + offs_m, mask=offs_m < T, other=0.0)
        else:
            if D != BLOCK_D or DV != BLOCK_DV:
                q = tl.load(q_ptrs, mask=offs_d[None, :] < D, other=0.0)
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
            lse = tl.load(lse_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        # Transposed orientation ([keys, queries]) so dK/dV come out of plain dots.
        qk_t = tl.dot(k, tl.trans(q))
        s_t, th_t = scores(
            qk_t, offs_m[None, :], cols, mask_ptr, bias_ptr, qseg_ptr, kseg_ptr, bits_ptr,
            stride_mt, stride_ms, stride_bt, stride_bs,
            SM_SCALE, SOFTCAP, T, S, DIAG, LEFT, RIGHT, EDGE,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, WORDS, n0, BLOCK_N,
            slope, HAS_ALIBI,
        )  # fmt: skip
        # No probability exceeds 1: the cap keeps an lse that lost an ulp against the max (its
        # trip through natural units; past ~2^32 an ulp alone overflows exp2) finite.
        p_t = tl.exp2(tl.minimum(mul_rounded(s_t, QK_SCALE, ASM) - lse[None, :], 0.0))
        if DO_DV:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        if DO_DK:
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_BIAS:
                # The bias is added to the logits, so its gradient is the logit gradient.
                inb = (offs_m[None, :] < T) & (cols < S)
                tl.store(dbias_ptr + offs_m[None, :] * stride_dbt + cols, ds_t, mask=inb)
            if HAS_SOFTCAP:
                ds_t = ds_t * (1.0 - th_t * th_t)
            ds_t16 = ds_t.to(q.dtype)
            dk = tl.dot(ds_t16, q, dk)
            if FUSE_DQ:
                # Unscaled: the caller multiplies the float32 sum by the softmax scale once.
                dq_part = tl.dot(tl.trans(ds_t16), k)
                dq_ptrs = dq_ptr + offs_m[:, None] * stride_qt + offs_d[None, :]
                if TAIL_M:
                    tl.atomic_add(dq_ptrs, dq_part, mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), sem="relaxed")
                elif D != BLOCK_D:
                    tl.atomic_add(dq_ptrs, dq_part, mask=offs_d[None, :] < D, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    QSeg,
    KSeg,
    DOut,
    LseB,
    Delta,
    Bits,
    Seen,
    List,
    Slopes,
    DK,
    DV_,
    DBias,
    DQAcc,
    stride_qb: tl.constexpr,
    stride_qt: tl.constexpr,
    stride_qh: tl.constexpr,
    stride_kb: tl.constexpr,
    stride_kn: tl.constexpr,
    stride_kh: tl.constexpr,
    stride_vb: tl.constexpr,
    stride_vn: tl.constexpr,
    stride_vh: tl.constexpr,
    stride_dob: tl.constexpr,
    stride_dot: tl.constexpr,
    stride_doh: tl.constexpr,
    stride_dkb: tl.constexpr,
    stride_dkn: tl.constexpr,
    stride_dkh: tl.constexpr,
    stride_dvb: tl.constexpr,
    stride_dvn: tl.constexpr,
    stride_dvh: tl.constexpr,
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
    HAS_SOFTCAP: tl.constexpr,
    HAS_MOD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    FUSE_DQ: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    DIAG: tl.constexpr = S - T
    HKV: tl.constexpr = HQ // GROUP
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // HKV).to(tl.int64)
    hkv64 = (pid_bh % HKV).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = offs_n[:, None]

    k_ptrs = K + b64 * stride_kb + hkv64 * stride_kh + cols * stride_kn + offs_d[None, :]
    v_ptrs = V + b64 * stride_vb + hkv64 * stride_vh + cols * stride_vn + offs_dv[None, :]
    if HAS_MOD:
        # Keys no query of this (batch, KV head) sees are never read (zeros: NaN there would
        # reach dQ through dS @ K and dK through V's products).
        live = seen_keys(Seen + b64 * stride_sb + hkv64 * stride_sh, offs_n, S)[:, None]
        k = tl.load(k_ptrs, mask=live & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_ptrs, mask=live & (offs_dv[None, :] < DV), other=0.0)
    elif S % BLOCK_N != 0 or D != BLOCK_D or DV != BLOCK_DV:
        k = tl.load(k_ptrs, mask=(cols < S) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_ptrs, mask=(cols < S) & (offs_dv[None, :] < DV), other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qseg_ptr = QSeg + b64 * T
    kseg_ptr = KSeg + b64 * S

    if not HAS_MOD:
        lo, full_lo, full_hi, hi = key_tile_query_range(n0, T, S, DIAG, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    for g in range(GROUP):
        h64 = hkv64 * GROUP + g
        q_ptr = Q + b64 * stride_qb + h64 * stride_qh
        do_ptr = DOut + b64 * stride_dob + h64 * stride_doh
        row_ptr = (b64 * HQ + h64) * T
        mask_ptr = Mask + b64 * stride_mb + h64 * stride_mh
        bias_ptr = Bias + b64 * stride_bb + h64 * stride_bh
        # dBias is a dense (B, HQ, T, S) float32 buffer; the caller reduces it to the
        # bias's broadcast shape.
        dbias_ptr = DBias + row_ptr * S
        # The dQ accumulator has q's (B, T, Hq, D) layout, in float32.
        dq_ptr = DQAcc + b64 * stride_qb + h64 * stride_qh
        bits_ptr = Bits + b64 * stride_wb + h64 * stride_wh
        list_ptr = List + b64 * stride_lb + h64 * stride_lh + tl.program_id(0) * stride_lr
        if HAS_MOD:
            # This head's list for the key tile (ops.tile_lists): partial query tiles, then full.
            n_part = tl.load(list_ptr)
            n_all = n_part + tl.load(list_ptr + 1)
            lo, full_lo, full_hi, hi = 0, n_part, n_all, n_all
            list_ptr += 2
        if HAS_ALIBI:
            slope = tl.load(Slopes + h64).to(tl.float32)
        else:
            slope = 0.0
        dk, dv = _dkdv_sweep(
            dk, dv, k, v, cols, lo, full_lo, q_ptr, do_ptr, LseB + row_ptr, Delta + row_ptr,
            mask_ptr, bias_ptr, dbias_ptr, dq_ptr, qseg_ptr, kseg_ptr, bits_ptr, list_ptr, n0, stride_qt,
            stride_dot, stride_mt, stride_ms, stride_bt, stride_bs, S, offs_d, offs_dv, slope,
            SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM, FUSE_DQ,
            PART, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip
        dk, dv = _dkdv_sweep(
            dk, dv, k, v, cols, full_lo, full_hi, q_ptr, do_ptr, LseB + row_ptr, Delta + row_ptr,
            mask_ptr, bias_ptr, dbias_ptr, dq_ptr, qseg_ptr, kseg_ptr, bits_ptr, list_ptr, n0, stride_qt,
            stride_dot, stride_mt, stride_ms, stride_bt, stride_bs, S, offs_d, offs_dv, slope,
            SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, False,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM, FUSE_DQ,
            PART, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip
        dk, dv = _dkdv_sweep(
            dk, dv, k, v, cols, full_hi, hi, q_ptr, do_ptr, LseB + row_ptr, Delta + row_ptr,
            mask_ptr, bias_ptr, dbias_ptr, dq_ptr, qseg_ptr, kseg_ptr, bits_ptr, list_ptr, n0, stride_qt,
            stride_dot, stride_mt, stride_ms, stride_bt, stride_bs, S, offs_d, offs_dv, slope,
            SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM, FUSE_DQ,
            PART, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip

    dk_ptrs = DK + b64 * stride_dkb + hkv64 * stride_dkh + cols * stride_dkn + offs_d[None, :]
    dv_ptrs = DV_ + b64 * stride_dvb + hkv64 * stride_dvh + cols * stride_dvn + offs_dv[None, :]
    if PART != 1:
        dk = dk * SM_SCALE
        if S % BLOCK_N != 0 or D != BLOCK_D:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=(cols < S) & (offs_d[None, :] < D))
        else:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
    if PART != 2:
        if S % BLOCK_N != 0 or DV != BLOCK_DV:
            tl.store(dv_ptrs, dv.to(DV_.dtype.element_ty), mask=(cols < S) & (offs_dv[None, :] < DV))
        else:
            tl.store(dv_ptrs, dv.to(DV_.dtype.element_ty))


@triton.jit
def _dq_sweep(
    dq,
    pdp,
    pd,
    pdpd,
    q,
    do,
    lse,
    delta,
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
    TAIL_N: tl.constexpr = EDGE and (S % BLOCK_N != 0)
    STEP: tl.constexpr = 1 if HAS_MOD else BLOCK_N  # see _fwd_sweep
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
        s, th = scores(
            qk, rows, offs_n[None, :], mask_ptr, bias_ptr, qseg_ptr, kseg_ptr, bits_ptr,
            stride_mt, stride_ms, stride_bt, stride_bs,
            SM_SCALE, SOFTCAP, T, S, DIAG, LEFT, RIGHT, EDGE,
            HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, WORDS, start_n, BLOCK_N,
            slope, HAS_ALIBI,
        )  # fmt: skip
        p = tl.exp2(tl.minimum(mul_rounded(s, QK_SCALE, ASM) - lse[:, None], 0.0))  # see _dkdv_sweep
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if HAS_ALIBI:
            # The rows' sums of P dP, P d and P dP d (d = col - row, the slope's derivative of
            # the score): the slope's gradient from them, exactly (attn_bwd_dq_kernel).
            dist = (offs_n[None, :] - rows).to(tl.float32)
            pdp += tl.sum(p * dp, 1)
            pw = p * dist
            pd += tl.sum(pw, 1)
            pdpd += tl.sum(pw * dp, 1)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq, pdp, pd, pdpd


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    QSeg,
    KSeg,
    DOut,
    LseB,
    Delta,
    Bits,
    Seen,
    List,
    Slopes,
    LseTerm,
    DQ,
    DSlope,
    stride_qb: tl.constexpr,
    stride_qt: tl.constexpr,
    stride_qh: tl.constexpr,
    stride_kb: tl.constexpr,
    stride_kn: tl.constexpr,
    stride_kh: tl.constexpr,
    stride_vb: tl.constexpr,
    stride_vn: tl.constexpr,
    stride_vh: tl.constexpr,
    stride_dob: tl.constexpr,
    stride_dot: tl.constexpr,
    stride_doh: tl.constexpr,
    stride_dqb: tl.constexpr,
    stride_dqt: tl.constexpr,
    stride_dqh: tl.constexpr,
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
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    h64 = h.to(tl.int64)
    hkv64 = (h // GROUP).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m[:, None]

    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + rows * stride_qt + offs_d[None, :]
    do_ptrs = DOut + b64 * stride_dob + h64 * stride_doh + rows * stride_dot + offs_dv[None, :]
    row_ptr = (b64 * HQ + h64) * T
    if T % BLOCK_M != 0 or D != BLOCK_D or DV != BLOCK_DV:
        q = tl.load(q_ptrs, mask=(rows < T) & (offs_d[None, :] < D), other=0.0)
        do = tl.load(do_ptrs, mask=(rows < T) & (offs_dv[None, :] < DV), other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
    lse = tl.load(LseB + row_ptr + offs_m, mask=offs_m < T, other=float("inf"))
    delta = tl.load(Delta + row_ptr + offs_m, mask=offs_m < T, other=0.0)

    k_ptr = K + b64 * stride_kb + hkv64 * stride_kh
    v_ptr = V + b64 * stride_vb + hkv64 * stride_vh
    mask_ptr = Mask + b64 * stride_mb + h64 * stride_mh
    bias_ptr = Bias + b64 * stride_bb + h64 * stride_bh
    qseg_ptr = QSeg + b64 * T
    kseg_ptr = KSeg + b64 * S
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    pd = tl.zeros([BLOCK_M], dtype=tl.float32)
    pdpd = tl.zeros([BLOCK_M], dtype=tl.float32)

    bits_ptr = Bits + b64 * stride_wb + h64 * stride_wh
    seen_ptr = Seen + b64 * stride_sb + hkv64 * stride_sh
    list_ptr = List + b64 * stride_lb + h64 * stride_lh + pid_m * stride_lr
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32)
    else:
        slope = 0.0
    if HAS_MOD:
        n_part = tl.load(list_ptr)  # see attn_fwd_kernel
        n_all = n_part + tl.load(list_ptr + 1)
        lo, full_lo, full_hi, hi = 0, n_part, n_all, n_all
        list_ptr += 2
    else:
        lo, full_lo, full_hi, hi = query_tile_key_range(m0, S, DIAG, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    dq, pdp, pd, pdpd = _dq_sweep(
        dq, pdp, pd, pdpd, q, do, lse, delta, rows, lo, full_lo, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr,
        kseg_ptr, bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt,
        stride_bs, offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    dq, pdp, pd, pdpd = _dq_sweep(
        dq, pdp, pd, pdpd, q, do, lse, delta, rows, full_lo, full_hi, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr,
        kseg_ptr, bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt,
        stride_bs, offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, False,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    dq, pdp, pd, pdpd = _dq_sweep(
        dq, pdp, pd, pdpd, q, do, lse, delta, rows, full_hi, hi, k_ptr, v_ptr, mask_ptr, bias_ptr, qseg_ptr,
        kseg_ptr, bits_ptr, seen_ptr, list_ptr, stride_kn, stride_vn, stride_mt, stride_ms, stride_bt,
        stride_bs, offs_d, offs_dv, slope, SM_SCALE, SOFTCAP, T, S, D, DV, DIAG, LEFT, RIGHT, True,
        HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEG, HAS_SOFTCAP, HAS_MOD, HAS_ALIBI, WORDS, ASM,
        BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip

    if HAS_ALIBI:
        # The slope's gradient of these rows: sum_ij ds_ij d_ij with ds = P (dP - delta_i +
        # lse_term_i), where delta_i = sum_j P dP exactly (the preprocess's rowsum(dO * O) reads
        # the output rounded to q's dtype, whose error d would amplify: keys ~1000 positions off).
        lse_term = tl.load(LseTerm + row_ptr + offs_m, mask=offs_m < T, other=0.0)
        rows_share = pdpd - (pdp - lse_term) * pd
        tl.store(DSlope + (b64 * HQ + h64) * tl.num_programs(0) + pid_m, tl.sum(rows_share, 0))
    dq = dq * SM_SCALE
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows * stride_dqt + offs_d[None, :]
    if T % BLOCK_M != 0 or D != BLOCK_D:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(rows < T) & (offs_d[None, :] < D))
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
