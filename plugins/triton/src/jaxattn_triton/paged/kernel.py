# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a @triton.jit parameter's annotation as its kind: tl.constexpr, or nothing for
# pointers and runtime scalars, which have no Python type to write.)
"""Split-K flash-decoding over a paged KV cache (paged decode, ragged paged attention, dense decode).

One program handles a *query block* (up to ``BLOCK_Q`` query tokens of one sequence), every
query head of one KV head (or a chunk of them, ``HEAD_CHUNK``), and one split of the keys the
block sees. Its rows are ``token x group head``, so each K/V tile is read once for the whole
GQA group instead of once per query head; rows are padded to ``BLOCK_M`` (>= 16, for
``tl.dot``). Keys are read tile by tile (``BLOCK_N`` tokens); each token's page comes from
the page table (one scalar load per tile when a tile never straddles pages, a per-row
gather otherwise), so any page size works and pages may be shared or permuted.

With ``KV_HEADS > 1`` a program takes that many adjacent KV heads (and all their query
heads): rows are ``token x KV head x group head`` and a tile's columns ``token x KV head``,
one contiguous run of the cache row per token; a row's scores outside its own head's columns
are masked to -inf, so its softmax and its ``P @ V`` see its head alone. For GQA 4 this
fills the 16 rows that one head's 4 query rows would pad to, at no extra MMA work.

Query blocks:

* uniform (``RAGGED=False``, paged decode and dense decode): sequence ``s`` owns tokens
  ``s*Q_LEN ... s*Q_LEN + Q_LEN - 1``; program ``pid`` is block ``pid % NBQ`` of sequence
  ``pid // NBQ``.
* ragged: sequence ``s`` owns tokens ``cu_q_lens[s] : cu_q_lens[s+1]``. Sequence ``s`` is
  allotted the programs from ``start(s) = cu_q_lens[s] // BLOCK_Q + s`` (``+ s`` only when
  ``BLOCK_Q > 1``: a block may then straddle two sequences' boundaries), which is at least
  ``cdiv(q_len_s, BLOCK_Q)`` of them; a binary search over ``cu_q_lens`` finds a program's
  sequence. Programs past ``start(num_seqs)`` cover the padding tokens: they attend to no key
  and so write zeros, which is how padding rows get their zeros without a memset.
* ragged with decode programs (``DECODE_Q > 0``): programs ``0 .. MAX_SEQS - 1`` come first,
  program ``s`` taking every query of sequence ``s`` when it has at most ``DECODE_Q`` of them
  (a decode step, a few speculative tokens), with tiles of their own (``DECODE_M`` rows,
  ``DECODE_N`` keys: a decode tile, not a prefill block of a few real rows); programs from
  ``MAX_SEQS`` on are the ragged allotment above, which gives such sequences no rows. Both kinds
  are branches of one kernel (one launch, so decode and prefill programs share the GPU at once);
  its shared memory is the larger branch's.

Key range of a block: the union of its rows' visible keys ``[pos - LEFT, pos + RIGHT]``
intersected with ``[0, kv_len)``, in tiles; it is cut into ``NUM_SPLITS`` even runs of tiles
(the split is ``program_id(2)``), each visited in three sweeps like the forward kernel:
masked tiles at the window's left edge, fully visible tiles without an element mask (the hot
loop), masked tiles at the right edge (the causal diagonal and the length tail).

Quantized caches (``K_QUANT``/``V_QUANT`` > 0, a compile-time specialisation: the 16-bit
path compiles exactly as before): K and V hold int8 or fp8 values, loaded narrow and converted
to q's dtype in registers (exact: int8 and both fp8 formats fit bf16 and fp16), the scales
applied in float32 after the products. With a bf16 q (``QK_F16``) Q K^T runs in fp16 instead,
each query row moved into fp16's range by a power of two of its own and the scores taking it
back with the K scale: K then widens the cheap way. An int8 K or V widened to fp16 comes
as ``(v + 128) * 2^-24`` (``widen.py``'s format 4, ``paged.launch.int8_offset``): the scores
lose ``128 sum(q)`` a row with the K scale, and the accumulator ``128 l`` once after the
sweeps, ``l`` summing P as the product saw it (rounded to fp16). Mode 1 is one scale per row (per tensor or
per KV head: the scores of a row times its head's K scale, the row's output times its head's V scale, once
at the end); mode 2 one per token and head, loaded per tile beside the values through the
scale's own ``(page, row, head)`` strides (0 along broadcast axes): each score column times its
K scale, each probability column times its V scale before ``P @ V``. Scales past a length are
loaded under the same mask as the values (``other=0``), so NaN there never enters a product;
rows that saw no key select zeros rather than multiplying by an unread V scale.

With ``NUM_SPLITS == 1`` the program normalises and writes the output and log-sum-exp
itself; otherwise it writes a float32 partial (unnormalised accumulator, running max in
base 2, running sum) that the splits' merge (``_merge_splits``) combines, adding the sinks,
in the same launch: each split takes a ticket from its program group's counter, zeroed before
the launch, once its partial is written, and the split that draws the last ticket merges every
split's partial of those rows.

A quantized V read as int32 words of 4 values (``V_WORDS``) is multiplied lane by lane: ``P @
V`` as four dots of Dv / 4 columns, one per byte lane, into an accumulator split the same way
and joined after the sweeps, so no widened tile changes layout through shared memory.
"""

import triton
import triton.language as tl

from jaxattn_triton.common import LN2, LOG2E, mul_rounded, tanh_f32
from jaxattn_triton.paged.widen import join_lanes, split_lanes, widen, word_lanes

#: The lse (and a split's max) of a row with no key: ``launch.NO_KEY_LSE``, which the launcher's
#: callers read without importing triton (launch imports this module, so it cannot import launch);
#: the kernel tests map it to -inf and compare those rows exactly.
NO_KEY_LSE = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _paged_sweep(
    acc,
    l_i,
    m_i,
    q,
    pos,
    hrow,
    lo,
    hi,
    k_base,
    v_base,
    ks_base,
    vs_base,
    k_row_scale,
    k_offset,
    pt_row,
    seq64,
    mw_rows,
    row_ok,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ksp,
    stride_kst,
    stride_ksh,
    stride_vsp,
    stride_vst,
    stride_vsh,
    offs_d,
    offs_dv,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_WORDS: tl.constexpr,
    K_WIDEN: tl.constexpr,
    ASM: tl.constexpr,
    PV_F16: tl.constexpr,
    QK_F16: tl.constexpr,
    MASK: tl.constexpr,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    EDGE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr,
    PAGE_PER_TILE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Without a soft cap the logit scale is folded into exp2's argument (one FMA per score).
    QK_SCALE: tl.constexpr = 1.0 * HAS_SOFTCAP + SM_SCALE * LOG2E * (1 - HAS_SOFTCAP)
    PAD_D: tl.constexpr = D != BLOCK_D
    PAD_DV: tl.constexpr = DV != BLOCK_DV
    # A tile's columns are BLOCK_N tokens x KV_HEADS heads, token-major: with every KV head of
    # a token in one program, a page's rows are read as one contiguous run.
    offs_c = tl.arange(0, BLOCK_N * KV_HEADS)
    col_tok = offs_c // KV_HEADS
    hcol = offs_c % KV_HEADS
    k_head = hcol * stride_kh
    if V_WORDS:
        # v_base is an int32 pointer: rows and heads in words of 4 values (strides % 4 == 0).
        v_head = hcol * (stride_vh // 4)
        offs_w = tl.arange(0, BLOCK_DV // 4)
    else:
        v_head = hcol * stride_vh
    TOKEN_SCALES: tl.constexpr = (K_QUANT == 2) or (V_QUANT == 2)
    # P @ V's operands: q's dtype, or fp16 (PV_F16, never with per-token V scales), where a
    # narrow V is exact and widens cheaper (e4m3: one hardware cvt per pair) and P in [0, 1]
    # loses nothing to fp16's range.
    if PV_F16:
        pv_dtype = tl.float16
    elif QK_F16:
        pv_dtype = tl.bfloat16  # q's own dtype: q was moved to fp16 for Q K^T alone
    else:
        pv_dtype = q.dtype
    if KV_HEADS > 1:
        own_head = hrow[:, None] == hcol[None, :]
    # Page-table entries are read one tile ahead (carried through the loop): K/V addresses
    # then depend on no load of their own iteration, so Triton's pipeliner keeps
    # num_stages - 1 K/V tiles in flight instead of spending a stage on the index load.
    # Entries at or past ``hi`` (<= kv_len) are never followed; they may hold anything.
    if not IDENTITY_PAGES:
        if PAGE_PER_TILE:
            page_next = tl.load(pt_row + lo // PAGE_SIZE, mask=lo < hi, other=0)
        else:
            offs_first = lo + col_tok
            page_next = tl.load(pt_row + offs_first // PAGE_SIZE, mask=offs_first < hi, other=0)
    if V_WORDS:
        # The accumulator as four lanes: lane i holds columns 4 w + i, each summing
        # P @ (byte i of V's words) in the loop below.
        a0, a1, a2, a3 = split_lanes(acc, acc.shape[0], BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + col_tok
        if IDENTITY_PAGES:
            # A dense cache seen as one page per sequence: no page-table read at all.
            k_rows = seq64 * stride_kp + offs_n.to(tl.int64) * stride_kt
            if V_WORDS:
                v_rows = seq64 * (stride_vp // 4) + offs_n.to(tl.int64) * (stride_vt // 4)
            else:
                v_rows = seq64 * stride_vp + offs_n.to(tl.int64) * stride_vt
            if TOKEN_SCALES:
                ks_rows = seq64 * stride_ksp + offs_n.to(tl.int64) * stride_kst + hcol * stride_ksh
                vs_rows = seq64 * stride_vsp + offs_n.to(tl.int64) * stride_vst + hcol * stride_vsh
        else:
            # One entry per tile when a tile never straddles pages, one per row otherwise.
            # Clamped: a corrupt entry reads a wrong page, never memory outside the cache.
            page = tl.minimum(tl.maximum(page_next, 0), NUM_PAGES - 1).to(tl.int64)
            if PAGE_PER_TILE:
                nxt = start_n + BLOCK_N
                page_next = tl.load(pt_row + nxt // PAGE_SIZE, mask=nxt < hi, other=0)
            else:
                offs_nxt = offs_n + BLOCK_N
                page_next = tl.load(pt_row + offs_nxt // PAGE_SIZE, mask=offs_nxt < hi, other=0)
            in_page = offs_n % PAGE_SIZE
            k_rows = page * stride_kp + in_page * stride_kt
            if V_WORDS:
                v_rows = page * (stride_vp // 4) + in_page * (stride_vt // 4)
            else:
                v_rows = page * stride_vp + in_page * stride_vt
            if TOKEN_SCALES:
                ks_rows = page * stride_ksp + in_page * stride_kst + hcol * stride_ksh
                vs_rows = page * stride_vsp + in_page * stride_vst + hcol * stride_vsh
        k_ptrs = k_base + (k_rows + k_head)[:, None] + offs_d[None, :]
        if V_WORDS:
            v_ptrs = v_base + (v_rows + v_head)[:, None] + offs_w[None, :]
        else:
            v_ptrs = v_base + (v_rows + v_head)[:, None] + offs_dv[None, :]
        if EDGE:
            # Rows at or past ``hi`` (<= kv_len: the sweep's end, which no row of the block sees
            # past) may be unwritten cache memory (possibly NaN bit patterns), or, where a tile
            # straddles pages, a stand-in page (the table entries past ``hi`` are not read): V
            # must be zero there, since 0 * NaN would reach the accumulator.
            live_n = offs_n < hi
            if MASK:
                # The mask_mod's bits of this tile (paged.visibility), before any K/V load: a
                # column no row of the block sees is not read (it may hold NaN).
                # A tile spans NW words of each row, loaded as NW row vectors (a word per row, not
                # a word address per element: those took 64 registers a thread at 64 x 64).
                NW: tl.constexpr = (BLOCK_N + 31) // 32
                w_first = start_n // 32
                col_word = offs_n // 32 - w_first
                col_bit = offs_n % 32
                seen = (col_word[None, :] < 0) & row_ok[:, None]  # all False, the tile's shape
                for w_k in tl.static_range(NW):
                    # (The word's bound as a row vector: the interpreter takes no scalar in a mask.)
                    w_ok = row_ok & (pos * 0 + (w_first + w_k) * 32 < hi)
                    words = tl.load(mw_rows + (w_first + w_k), mask=w_ok, other=0)
                    seen |= (col_word[None, :] == w_k) & (((words[:, None] >> col_bit[None, :]) & 1) != 0)
                seen &= live_n[None, :]
                if KV_HEADS > 1:
                    seen &= own_head
                live_n &= tl.max(seen.to(tl.int32), 0) > 0
            live = live_n[:, None]
            if PAD_D:
                k = tl.load(k_ptrs, mask=live & (offs_d[None, :] < D), other=0.0)
            else:
                k = tl.load(k_ptrs, mask=live, other=0.0)
            if V_WORDS:
                v = tl.load(v_ptrs, mask=live, other=0)
            elif PAD_DV:
                v = tl.load(v_ptrs, mask=live & (offs_dv[None, :] < DV), other=0.0)
            else:
                v = tl.load(v_ptrs, mask=live, other=0.0)
            # Scales there are unread like the values (NaN allowed): masked, 0.
            if K_QUANT == 2:
                ks = tl.load(ks_base + ks_rows, mask=live_n, other=0.0)
            if V_QUANT == 2:
                vs = tl.load(vs_base + vs_rows, mask=live_n, other=0.0)
        else:
            if PAD_D:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            else:
                k = tl.load(k_ptrs)
            if PAD_DV and not V_WORDS:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs)
            if K_QUANT == 2:
                ks = tl.load(ks_base + ks_rows)
            if V_QUANT == 2:
                vs = tl.load(vs_base + vs_rows)
        if V_WORDS:
            e0, e1, e2, e3 = word_lanes(v, V_WORDS, pv_dtype, ASM)
        # A quantized cache is converted to q's dtype here, in registers (a no-op otherwise).
        if K_WIDEN:
            k = widen(k, K_WIDEN, q.dtype, ASM)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        if K_WIDEN == 4:
            # K came as (v + 128) 2^-24: k_row_scale holds the 2^24, and each score, scaled,
            # carries the row's k_offset (128 sum(q) times its scale). One multiply-add a score.
            qk = qk * k_row_scale[:, None] - k_offset[:, None]
        elif K_QUANT == 1 or QK_F16:
            qk = qk * k_row_scale[:, None]
        if K_QUANT == 2:
            qk = qk * ks[None, :]
        if HAS_SOFTCAP:
            s = tanh_f32(qk * (SM_SCALE / SOFTCAP)) * (SOFTCAP * LOG2E)
        else:
            s = qk
        if EDGE:
            keep = offs_n[None, :] < hi
            if MASK:
                keep &= seen
            if HAS_LEFT:
                keep &= offs_n[None, :] >= pos[:, None] - LEFT
            if HAS_RIGHT:
                keep &= offs_n[None, :] <= pos[:, None] + RIGHT
            if KV_HEADS > 1:
                keep &= own_head
            s = tl.where(keep, s, float("-inf"))
        elif KV_HEADS > 1:
            s = tl.where(own_head, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE)
        if EDGE:
            # A row may have seen nothing yet: keep exp2(-inf - -inf) from making NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        # The scores rounded as m was (max(s) * QK_SCALE): never fused into the subtraction.
        p = tl.exp2(mul_rounded(s, QK_SCALE, ASM) - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        if V_QUANT == 2:
            # P @ (diag(vs) V) == (P diag(vs)) @ V: the scale joins the probabilities' columns.
            pv = (p * vs[None, :]).to(pv_dtype)
        else:
            pv = p.to(pv_dtype)
        if V_WORDS == 4:
            # An int8 V widened with its offset (widen.py): l sums P as the product sees it
            # (rounded to fp16), the offset's weight, taken out after the sweeps.
            l_i = l_i * alpha + tl.sum(pv.to(tl.float32), 1)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        if V_WORDS:
            # Four dots of Dv / 4 columns, one per byte lane: each lane's tile reaches the MMA
            # as it was widened, with no join into one tile (a layout change through shared
            # memory) before it.
            a0 = tl.dot(pv, e0, a0 * alpha[:, None])
            a1 = tl.dot(pv, e1, a1 * alpha[:, None])
            a2 = tl.dot(pv, e2, a2 * alpha[:, None])
            a3 = tl.dot(pv, e3, a3 * alpha[:, None])
        else:
            acc = tl.dot(pv, v.to(pv_dtype), acc * alpha[:, None])
        m_i = m_new
    if V_WORDS:
        acc = join_lanes(a0, a1, a2, a3, acc.shape[0], BLOCK_DV)
    return acc, l_i, m_i


@triton.jit
def _ragged_rows(pid, KvLens, CuQLens, NumSeqs, MAX_SEQS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                 BLOCK_Q: tl.constexpr, SKIP_Q: tl.constexpr):  # fmt: skip
    """``(seq, tok0, q_len, n_tok, tok_start, kv_len)`` of ragged program ``pid`` (the
    allotment in the module docstring); sequences of at most ``SKIP_Q`` queries get no rows
    here (the decode programs take them)."""
    ns = tl.minimum(tl.maximum(tl.load(NumSeqs), 0), MAX_SEQS)
    SPREAD: tl.constexpr = 1 if BLOCK_Q > 1 else 0
    # Largest s in [0, ns] with start(s) <= pid; start() is non-decreasing.
    s_lo = pid * 0
    s_hi = ns
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (s_lo + s_hi + 1) // 2
        start_mid = tl.load(CuQLens + mid) // BLOCK_Q + mid * SPREAD
        ok = start_mid <= pid
        s_lo = tl.where(ok, mid, s_lo)
        s_hi = tl.where(ok, s_hi, mid - 1)
    seq = s_lo
    real = seq < ns
    cu_s = tl.load(CuQLens + seq)
    cu_e = tl.load(CuQLens + seq + 1, mask=real, other=0)
    blk = pid - (cu_s // BLOCK_Q + seq * SPREAD)
    tok0 = blk * BLOCK_Q
    q_len = tl.where(real, cu_e - cu_s, 0)
    # Padding programs (seq == ns) take the padding tokens in BLOCK_Q runs, with no keys.
    n_tok = tl.where(real, q_len - tok0, BLOCK_Q)
    if SKIP_Q > 0:
        n_tok = tl.where(real & (q_len <= SKIP_Q), 0, n_tok)
    tok_start = cu_s + tok0
    kv_len = tl.load(KvLens + seq, mask=real, other=0)
    return seq, tok0, q_len, n_tok, tok_start, kv_len


@triton.jit
def _decode_rows(pid, KvLens, CuQLens, NumSeqs, MAX_SEQS: tl.constexpr, DECODE_Q: tl.constexpr):
    """``(seq, tok0, q_len, n_tok, tok_start, kv_len)`` of decode program ``pid`` (< MAX_SEQS):
    all of sequence ``pid``'s queries when it is real and has at most ``DECODE_Q``, else none."""
    ns = tl.minimum(tl.maximum(tl.load(NumSeqs), 0), MAX_SEQS)
    real = pid < ns
    cu_s = tl.load(CuQLens + pid)
    cu_e = tl.load(CuQLens + pid + 1)
    q_len = tl.where(real, cu_e - cu_s, 0)
    n_tok = tl.where(q_len <= DECODE_Q, q_len, 0)
    kv_len = tl.load(KvLens + pid, mask=real, other=0)
    return pid, pid * 0, q_len, n_tok, cu_s, kv_len


@triton.jit
def _paged_block(
    seq,
    tok0,
    q_len,
    n_tok,
    tok_start,
    kv_len,
    hkv,
    chunk,
    sid,
    Q,
    K,
    V,
    PageTable,
    Sink,
    KScale,
    VScale,
    MaskWords,
    MaskBounds,
    Out,
    Stat,
    Sum,
    Merged,
    MergedLse,
    Tickets,
    ticket,
    stride_qt: tl.constexpr,
    stride_qh: tl.constexpr,
    stride_kp: tl.constexpr,
    stride_kt: tl.constexpr,
    stride_kh: tl.constexpr,
    stride_vp: tl.constexpr,
    stride_vt: tl.constexpr,
    stride_vh: tl.constexpr,
    V_OFF: tl.constexpr,
    stride_ksp: tl.constexpr,
    stride_kst: tl.constexpr,
    stride_ksh: tl.constexpr,
    stride_vsp: tl.constexpr,
    stride_vst: tl.constexpr,
    stride_vsh: tl.constexpr,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_WORDS: tl.constexpr,
    K_WIDEN: tl.constexpr,
    ASM: tl.constexpr,
    PV_F16: tl.constexpr,
    QK_F16: tl.constexpr,
    MASK: tl.constexpr,
    stride_mt: tl.constexpr,
    stride_mh: tl.constexpr,
    stride_pt: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    CAPACITY: tl.constexpr,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr,
    PAGE_PER_TILE: tl.constexpr,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FUSE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program's query block: ``n_tok`` query tokens of sequence ``seq`` from ``tok_start``
    (block ``tok0`` of its ``q_len``), KV head ``hkv`` (chunk ``chunk`` of its group), key split
    ``sid``; attends and writes those rows."""
    n_tok = tl.minimum(tl.minimum(n_tok, BLOCK_Q), NUM_TOKENS - tok_start)
    n_tok = tl.maximum(n_tok, 0)
    # kv_lengths beyond the cache would index past the page table.
    kv_len = tl.minimum(tl.maximum(kv_len, 0), CAPACITY)
    pos_first = kv_len - q_len + tok0

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Rows are token x KV head x query head of the group (chunk), in that order.
    tok = offs_m // (HEAD_CHUNK * KV_HEADS)
    hrow = (offs_m // HEAD_CHUNK) % KV_HEADS
    g = chunk * HEAD_CHUNK + offs_m % HEAD_CHUNK
    row_ok = (tok < n_tok) & (g < GROUP)
    head = (hkv + hrow) * GROUP + g
    token = (tok_start + tok).to(tl.int64)
    pos = pos_first + tok

    q_ptrs = Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    # Keys seen by some row of the block, and the tiles every row sees in full.
    pos_last = pos_first + n_tok - 1
    if HAS_LEFT:
        lo = tl.maximum(pos_first - LEFT, 0)
    else:
        lo = pos_first * 0
    hi = kv_len
    if HAS_RIGHT:
        hi = tl.minimum(hi, pos_last + RIGHT + 1)
    if MASK:
        # The mask_mod's key bounds of the block's tokens (paged.visibility): the union of the
        # keys its rows see, and the intersection of their fully seen runs.
        bnd = MaskBounds + token * 4
        FAR: tl.constexpr = 1 << 30
        lo = tl.maximum(lo, tl.min(tl.load(bnd, mask=row_ok, other=FAR), 0))
        hi = tl.minimum(hi, tl.max(tl.load(bnd + 1, mask=row_ok, other=0), 0))
        m_full_lo = tl.max(tl.load(bnd + 2, mask=row_ok, other=0), 0)
        m_full_hi = tl.min(tl.load(bnd + 3, mask=row_ok, other=FAR), 0)
        mw_rows = MaskWords + token * stride_mt + head * stride_mh
    else:
        mw_rows = MaskWords
    empty = (hi <= lo) | (n_tok <= 0)
    lo = tl.where(empty, 0, lo // BLOCK_N * BLOCK_N)
    hi = tl.where(empty, 0, hi)
    if HAS_LEFT:
        full_lo = (tl.maximum(pos_last - LEFT, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(full_lo, lo)
    else:
        full_lo = lo
    full_hi = kv_len
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, pos_first + RIGHT + 1)
    if MASK:
        full_lo = tl.maximum(full_lo, (m_full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        full_hi = tl.minimum(full_hi, m_full_hi)
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N
    no_full = full_lo >= full_hi
    full_lo = tl.where(no_full, lo, full_lo)
    full_hi = tl.where(no_full, lo, full_hi)

    # This split's run of tiles, and its overlap with the fully visible ones.
    n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    a = lo + sid * per_split * BLOCK_N
    b = tl.minimum(a + per_split * BLOCK_N, hi)
    b = tl.maximum(b, a)
    f0 = tl.minimum(tl.maximum(full_lo, a), b)
    f1 = tl.minimum(tl.maximum(full_hi, f0), b)

    seq64 = seq.to(tl.int64)
    k_base = K + hkv.to(tl.int64) * stride_kh
    if V_WORDS:
        v_base = V.to(tl.pointer_type(tl.int32)) + (V_OFF // 4) + hkv.to(tl.int64) * (stride_vh // 4)
    else:
        v_base = V + V_OFF + hkv.to(tl.int64) * stride_vh
    pt_row = PageTable + seq64 * stride_pt
    ks_base = KScale + hkv.to(tl.int64) * stride_ksh
    vs_base = VScale + hkv.to(tl.int64) * stride_vsh
    if K_QUANT == 1:
        # One K scale per row (its KV head's, or the tensor's with stride 0): always in range.
        k_row_scale = tl.load(KScale + (hkv + hrow) * stride_ksh)
    else:
        k_row_scale = 1.0
    if QK_F16:
        # Each row times 2^e, its largest magnitude then in [2^14, 2^15) (e from the float32
        # exponent field, clamped so that 2^e and 2^-e are normal floats), rounded to fp16:
        # exact for a bf16 row but parts 2^28 below its largest. The scores take 2^-e back with
        # the K scale. A zero row stays zero; inf and NaN pass through as they would in bf16.
        q32 = q.to(tl.float32)
        top = (tl.max(tl.abs(q32), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.minimum(tl.maximum(141 - top, -126), 126)
        q = (q32 * ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        k_row_scale = k_row_scale * ((127 - e) << 23).to(tl.float32, bitcast=True)
    if K_WIDEN == 4:
        # K widens to (v + 128) 2^-24 (widen.py): the scores times 2^24 carry 128 sum(q) a row,
        # taken out with the scale (q is fp16 here: QK_F16's, or the caller's).
        k_offset = tl.sum(q.to(tl.float32), 1) * 128.0 * k_row_scale
        k_row_scale = k_row_scale * tl.full([BLOCK_M], 16777216.0, dtype=tl.float32)
    else:
        k_offset = 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _paged_sweep(
        acc, l_i, m_i, q, pos, hrow, a, f0, k_base, v_base, ks_base, vs_base, k_row_scale, k_offset, pt_row, seq64,
        mw_rows, row_ok, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, offs_d, offs_dv,
        K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK,
        SM_SCALE, SOFTCAP, LEFT, RIGHT, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, PAGE_PER_TILE, KV_HEADS, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _paged_sweep(
        acc, l_i, m_i, q, pos, hrow, f0, f1, k_base, v_base, ks_base, vs_base, k_row_scale, k_offset, pt_row, seq64,
        mw_rows, row_ok, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, offs_d, offs_dv,
        K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK,
        SM_SCALE, SOFTCAP, LEFT, RIGHT, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, PAGE_PER_TILE, KV_HEADS, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    acc, l_i, m_i = _paged_sweep(
        acc, l_i, m_i, q, pos, hrow, f1, b, k_base, v_base, ks_base, vs_base, k_row_scale, k_offset, pt_row, seq64,
        mw_rows, row_ok, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, offs_d, offs_dv,
        K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK,
        SM_SCALE, SOFTCAP, LEFT, RIGHT, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, PAGE_PER_TILE, KV_HEADS, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip

    if V_WORDS == 4:
        # V came as (v + 128) 2^-24 (widen.py): the accumulator holds 2^-24 (P V + 128 l), l the
        # sum of P as the products saw it (rounded to fp16). A row that saw nothing keeps 0.
        acc = acc * 16777216.0 - (l_i * 128.0)[:, None]
    if V_QUANT == 1:
        # One V scale per row, applied once; a row that saw no key (l_i == 0, acc == 0) selects
        # zeros, so an unread NaN scale cannot reach it.
        v_row_scale = tl.load(VScale + (hkv + hrow) * stride_vsh)
        acc = tl.where(l_i[:, None] > 0.0, acc * v_row_scale[:, None], 0.0)

    rows = token * HQ + head
    o_cols = offs_dv[None, :]
    o_mask = row_ok[:, None] & (o_cols < DV)
    if NUM_SPLITS == 1:
        out, lse = _normalised(acc, l_i, m_i, Sink, head, row_ok, HAS_SINK)
        tl.store(Out + rows[:, None] * DV + o_cols, out.to(Out.dtype.element_ty), mask=o_mask)
        tl.store(Stat + rows, lse, mask=row_ok)
    else:
        # Every split writes its rows, empty or not, so the merge never reads garbage. A row the
        # split saw no key of stores the lowest finite max (NO_KEY_LSE), not -inf, for the reason
        # launch.NO_KEY_LSE gives; the merge weighs its zero sum and accumulator the same.
        part = sid.to(tl.int64) * NUM_TOKENS * HQ + rows
        tl.store(Out + part[:, None] * DV + o_cols, acc, mask=o_mask)
        tl.store(Stat + part, tl.where(m_i == float("-inf"), NO_KEY_LSE, m_i), mask=row_ok)
        tl.store(Sum + part, l_i, mask=row_ok)
        if FUSE:
            # Every thread's stores precede the ticket (the barrier), and the ticket's release
            # makes them visible GPU-wide; the split that draws the last ticket acquires every
            # other split's partial with it, and merges the rows in place of a second launch.
            tl.debug_barrier()
            drawn = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if drawn == NUM_SPLITS - 1:
                out, lse = _merge_splits(Out, Stat, Sum, Sink, rows, head, row_ok, offs_dv, NUM_TOKENS * HQ, DV,
                                         NUM_SPLITS, HAS_SINK)  # fmt: skip
                tl.store(Merged + rows[:, None] * DV + o_cols, out.to(Merged.dtype.element_ty), mask=o_mask)
                tl.store(MergedLse + rows, lse, mask=row_ok)


@triton.jit
def paged_attn_kernel(
    Q,
    K,
    V,
    PageTable,
    KvLens,
    CuQLens,
    NumSeqs,
    Sink,
    KScale,
    VScale,
    MaskWords,
    MaskBounds,
    Out,
    Stat,
    Sum,
    Merged,
    MergedLse,
    Tickets,
    stride_qt: tl.constexpr,
    stride_qh: tl.constexpr,
    stride_kp: tl.constexpr,
    stride_kt: tl.constexpr,
    stride_kh: tl.constexpr,
    stride_vp: tl.constexpr,
    stride_vt: tl.constexpr,
    stride_vh: tl.constexpr,
    V_OFF: tl.constexpr,
    stride_ksp: tl.constexpr,
    stride_kst: tl.constexpr,
    stride_ksh: tl.constexpr,
    stride_vsp: tl.constexpr,
    stride_vst: tl.constexpr,
    stride_vsh: tl.constexpr,
    K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr,
    V_WORDS: tl.constexpr,
    K_WIDEN: tl.constexpr,
    ASM: tl.constexpr,
    PV_F16: tl.constexpr,
    QK_F16: tl.constexpr,
    MASK: tl.constexpr,
    stride_mt: tl.constexpr,
    stride_mh: tl.constexpr,
    stride_pt: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    MAX_SEQS: tl.constexpr,
    Q_LEN: tl.constexpr,
    RAGGED: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    CAPACITY: tl.constexpr,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr,
    PAGE_PER_TILE: tl.constexpr,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FUSE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DECODE_Q: tl.constexpr,
    DECODE_M: tl.constexpr,
    DECODE_N: tl.constexpr,
    DECODE_PAGE_PER_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    NUM_CHUNKS: tl.constexpr = (GROUP + HEAD_CHUNK - 1) // HEAD_CHUNK
    hkv = tl.program_id(1) // NUM_CHUNKS * KV_HEADS
    chunk = tl.program_id(1) % NUM_CHUNKS
    sid = tl.program_id(2)
    # The splits of one query block and head chunk share a ticket counter (FUSE).
    ticket = Tickets + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)

    if DECODE_Q > 0:
        # A ragged batch with decode programs: the first MAX_SEQS programs take one sequence
        # each, when it has at most DECODE_Q queries, with the decode tiles (DECODE_M rows,
        # DECODE_N keys a tile); the rest are the ragged allotment of BLOCK_Q-token blocks over
        # the other sequences (and the padding rows).
        if pid < MAX_SEQS:
            d_seq, d_tok0, d_q_len, d_n_tok, d_tok_start, d_kv_len = _decode_rows(
                pid, KvLens, CuQLens, NumSeqs, MAX_SEQS, DECODE_Q
            )
            _paged_block(
                d_seq, d_tok0, d_q_len, d_n_tok, d_tok_start, d_kv_len, hkv, chunk, sid, Q, K, V, PageTable, Sink,
                KScale, VScale, MaskWords, MaskBounds, Out, Stat, Sum, Merged, MergedLse, Tickets, ticket,
                stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp,
                stride_vt, stride_vh, V_OFF, stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst,
                stride_vsh, K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK, stride_mt, stride_mh,
                stride_pt, NUM_TOKENS, CAPACITY, HQ, GROUP,
                HEAD_CHUNK, KV_HEADS, D, DV, PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, DECODE_PAGE_PER_TILE, SM_SCALE,
                SOFTCAP, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_SINK, NUM_SPLITS, FUSE, DECODE_Q, DECODE_M,
                DECODE_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
        else:
            seq, tok0, q_len, n_tok, tok_start, kv_len = _ragged_rows(
                pid - MAX_SEQS, KvLens, CuQLens, NumSeqs, MAX_SEQS, SEARCH_STEPS, BLOCK_Q, DECODE_Q
            )
            _paged_block(
                seq, tok0, q_len, n_tok, tok_start, kv_len, hkv, chunk, sid, Q, K, V, PageTable, Sink, KScale,
                VScale, MaskWords, MaskBounds, Out, Stat, Sum, Merged, MergedLse, Tickets, ticket,
                stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp,
                stride_vt, stride_vh, V_OFF, stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst,
                stride_vsh, K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK, stride_mt, stride_mh,
                stride_pt, NUM_TOKENS, CAPACITY, HQ, GROUP,
                HEAD_CHUNK, KV_HEADS, D, DV, PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, PAGE_PER_TILE, SM_SCALE,
                SOFTCAP, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_SINK, NUM_SPLITS, FUSE, BLOCK_Q, BLOCK_M,
                BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
    else:
        if RAGGED:
            seq, tok0, q_len, n_tok, tok_start, kv_len = _ragged_rows(
                pid, KvLens, CuQLens, NumSeqs, MAX_SEQS, SEARCH_STEPS, BLOCK_Q, 0
            )
        else:
            NBQ: tl.constexpr = (Q_LEN + BLOCK_Q - 1) // BLOCK_Q
            seq = pid // NBQ
            tok0 = (pid % NBQ) * BLOCK_Q
            q_len = Q_LEN
            n_tok = Q_LEN - tok0
            tok_start = seq * Q_LEN + tok0
            kv_len = tl.load(KvLens + seq)
        _paged_block(
            seq, tok0, q_len, n_tok, tok_start, kv_len, hkv, chunk, sid, Q, K, V, PageTable, Sink, KScale,
            VScale, MaskWords, MaskBounds, Out, Stat, Sum, Merged, MergedLse, Tickets, ticket,
            stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp,
            stride_vt, stride_vh, V_OFF, stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst,
            stride_vsh, K_QUANT, V_QUANT, V_WORDS, K_WIDEN, ASM, PV_F16, QK_F16, MASK, stride_mt, stride_mh,
            stride_pt, NUM_TOKENS, CAPACITY, HQ, GROUP,
            HEAD_CHUNK, KV_HEADS, D, DV, PAGE_SIZE, NUM_PAGES, IDENTITY_PAGES, PAGE_PER_TILE, SM_SCALE,
            SOFTCAP, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_SINK, NUM_SPLITS, FUSE, BLOCK_Q, BLOCK_M,
            BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip


@triton.jit
def _merge_splits(OPart, MPart, LPart, Sink, rows, heads, ok, offs_dv, SPLIT: tl.constexpr, DV: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, HAS_SINK: tl.constexpr):  # fmt: skip
    """``(out, lse)`` of ``rows`` (flat ``token * HQ + head`` indices; ``heads`` their heads, ``ok``
    the real ones) from the splits' float32 partials, ``SPLIT`` rows apart; adds the sinks.

    One pass, rescaling as it goes, over an unrolled loop: no load depends on another, so every
    split's partial is in flight at once (the merge is the launch's tail when fused). The
    partials are read through L2 (``.cg``): in the fused launch other SMs wrote them."""
    m_run = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    l_run = tl.zeros(rows.shape, dtype=tl.float32)
    acc = tl.zeros([rows.shape[0], offs_dv.shape[0]], dtype=tl.float32)
    o_mask = ok[:, None] & (offs_dv[None, :] < DV)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(MPart + s * SPLIT + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(LPart + s * SPLIT + rows, mask=ok, other=0.0, cache_modifier=".cg")
        o_s = tl.load(OPart + (s * SPLIT + rows)[:, None] * DV + offs_dv[None, :], mask=o_mask, other=0.0,
                      cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, m_s)
        # Rows no split has seen yet keep -inf: exp2(-inf - -inf) must not make NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a, w = tl.exp2(m_run - m_ref), tl.exp2(m_s - m_ref)
        l_run = l_run * a + l_s * w
        acc = acc * a[:, None] + o_s * w[:, None]
        m_run = m_new
    return _normalised(acc, l_run, m_run, Sink, heads, ok, HAS_SINK)


@triton.jit
def _normalised(acc, l_i, m_i, Sink, heads, ok, HAS_SINK: tl.constexpr):
    """``(out, lse)`` of rows from their unnormalised accumulator ``acc``, running sum ``l_i`` and
    running max ``m_i`` (base 2), the sinks of ``heads`` joining the denominator; the
    log-sum-exp is over keys only (sinks excluded), natural units, ``NO_KEY_LSE`` (the lowest
    finite float32) for rows with no key."""
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_i)) * LN2, NO_KEY_LSE)
    if HAS_SINK:
        sink = tl.load(Sink + heads, mask=ok, other=0.0).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        # A -inf sink on a row with no key: exp2(-inf - -inf) must not make NaN.
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_fin)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
    # Rows with no visible key have acc == 0: divide by 1 and they give zeros.
    denom = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / denom[:, None], lse
