# mypy: allow-untyped-defs, allow-incomplete-defs
# (Triton reads a @triton.jit parameter's annotation as its kind: tl.constexpr, or nothing for
# pointers and runtime scalars, which have no Python type to write.)
"""Triton helpers every kernel of this package shares (flash's forward and backward, the paged kernel).

Conventions used by every kernel in this package:

* Logits are carried in base-2 units (natural logits times log2(e)) so the softmax
  uses ``exp2``, which maps to a single MUFU instruction; ``LOG2E`` is folded into the
  scale. Log-sum-exp values handed between kernels are base-2 as well, except the
  user-visible one, which the forward kernel stores in natural units.
* Window bounds ``LEFT``/``RIGHT`` are always finite: "unbounded" is encoded by the
  launcher as a value larger than ``T + S`` so that the tile-range arithmetic needs no
  branches; ``HAS_LEFT``/``HAS_RIGHT`` only decide whether an element mask is built.
* ``DIAG`` is ``S - T``: query ``i`` sits at key position ``i + DIAG`` (bottom-right
  alignment), the reference point of causal masking and of sliding windows.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh_f32(x):
    # tanh through exp2 because tl has no tanh that runs both under the interpreter and
    # on CUDA; 1 - 2 / (e^{2x} + 1) saturates correctly to +-1 for large |x|.
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def mul_rounded(x, c: tl.constexpr, ASM: tl.constexpr):
    """``x * c`` (float32) rounded once, as a product of its own: the compiler cannot fuse it
    into a later add (``mul.rn``), so ``exp2(mul_rounded(s, c) - m)`` with ``m`` the max of
    the same rounded products is exactly ``exp2(0)`` at the max, whatever their magnitude. A
    fused ``fma(s, c, -m)`` takes the exact product, up to half an ulp of ``m`` above it: past
    ``|m|`` ~ 2^32 that gap alone makes ``exp2`` overflow or vanish. The interpreter (``ASM``
    off) fuses nothing, and a product by one (scores already scaled) has nothing to fuse."""
    if c == 1.0:
        return x
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, tl.full(x.shape, c, tl.float32)],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return x * c


@triton.jit
def query_tile_key_range(
    m0,
    S: tl.constexpr,
    DIAG: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key ranges seen by query rows ``[m0, m0 + BLOCK_M)``.

    Returns ``lo, full_lo, full_hi, hi``: tiles in ``[lo, full_lo)`` and
    ``[full_hi, hi)`` need an element mask (window edge or key tail), tiles in
    ``[full_lo, full_hi)`` are visible to every row of the block and are processed
    without one. Tiles outside ``[lo, hi)`` are fully masked and skipped.
    """
    lo = tl.maximum(m0 + DIAG - LEFT, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(tl.maximum(m0 + BLOCK_M + DIAG + RIGHT, 0), S)
    full_lo = (tl.maximum(m0 + BLOCK_M - 1 + DIAG - LEFT, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.maximum(m0 + DIAG + RIGHT + 1, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum(full_hi, S // BLOCK_N * BLOCK_N)
    # No fully visible tile: one masked sweep over [lo, hi) does all the work.
    empty = full_lo >= full_hi
    full_lo = tl.where(empty, lo, full_lo)
    full_hi = tl.where(empty, lo, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def key_tile_query_range(
    n0,
    T: tl.constexpr,
    S: tl.constexpr,
    DIAG: tl.constexpr,
    LEFT: tl.constexpr,
    RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query ranges that see keys ``[n0, n0 + BLOCK_N)``; same contract as above."""
    lo = tl.maximum(n0 - RIGHT - DIAG, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(tl.maximum(n0 + BLOCK_N + LEFT - DIAG, 0), T)
    full_lo = (tl.maximum(n0 + BLOCK_N - 1 - DIAG - RIGHT, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.maximum(n0 - DIAG + LEFT + 1, 0) // BLOCK_M * BLOCK_M
    full_hi = tl.minimum(full_hi, T // BLOCK_M * BLOCK_M)
    # A key tile that runs past S needs the key-tail mask on every query tile.
    empty = (full_lo >= full_hi) | (n0 + BLOCK_N > S)
    full_lo = tl.where(empty, lo, full_lo)
    full_hi = tl.where(empty, lo, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def scores(
    qk,
    rows,
    cols,
    mask_ptr,
    bias_ptr,
    qseg_ptr,
    kseg_ptr,
    bits_ptr,
    stride_mt,
    stride_ms,
    stride_bt,
    stride_bs,
    SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
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
    WORDS: tl.constexpr,
    col0,
    NCOL: tl.constexpr,
    slope,
    HAS_ALIBI: tl.constexpr,
):
    """Mask raw ``q.k`` products; base-2 logits are ``s * QK_SCALE`` (see the kernels).

    Without soft cap or bias ``s`` stays the raw product and the caller folds the scale
    into ``exp2(s * scale - m)``, one FMA per element in the hot loop; otherwise ``s`` is
    already in base-2 units and the scale is 1. ``rows``/``cols`` are the query/key
    indices broadcast to the tile's orientation (``[M, 1]``/``[1, N]`` in the forward,
    transposed in dK/dV), so one helper serves both. ``EDGE`` asks for the window and
    tail masks (tiles at the edge of the visible band). Also returns ``tanh(x / c)`` for
    the soft-cap derivative (the raw product when there is no cap; callers ignore it).
    ``HAS_MOD``: a mask_mod's packed visibility (``jaxattn.masks.mask_bits``: ``WORDS`` int32
    words a query row, key ``32 w + j`` at bit j of word w) hides keys of a partial tile
    (``EDGE``: ``NCOL`` keys from ``col0``); a full tile has no element mask at all.
    ``HAS_ALIBI``: ``masks.alibi``'s term ``slope * (col - row)`` (raw positions, the head's
    ``slope``) is added after the soft cap and the bias, as a score_mod acts.
    """
    if HAS_SOFTCAP:
        th = tanh_f32(qk * (SM_SCALE / SOFTCAP))
        s = th * (SOFTCAP * LOG2E)
    elif HAS_BIAS or HAS_ALIBI:
        th = qk
        s = qk * (SM_SCALE * LOG2E)
    else:
        th = qk
        s = qk
    inb = (rows < T) & (cols < S)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rows * stride_bt + cols * stride_bs, mask=inb, other=0.0)
        s += b.to(tl.float32) * LOG2E
    if HAS_ALIBI:
        s += (slope * LOG2E) * (cols - rows).to(tl.float32)
    if EDGE:
        keep = cols < S
        if HAS_LEFT:
            keep &= cols >= rows + (DIAG - LEFT)
        if HAS_RIGHT:
            keep &= cols <= rows + (DIAG + RIGHT)
        s = tl.where(keep, s, float("-inf"))
    if HAS_MASK:
        m = tl.load(mask_ptr + rows * stride_mt + cols * stride_ms, mask=inb, other=0)
        s = tl.where(m != 0, s, float("-inf"))
    if HAS_MOD and EDGE:
        # The tile's NW words of each query row, loaded as NW vectors over the rows (a word
        # address per element takes a register per element: it spilled at D 256).
        NW: tl.constexpr = (NCOL + 31) // 32
        w0 = col0 // 32
        col_word = cols // 32 - w0
        col_bit = cols % 32
        row_ok = rows < T
        seen = (col_word < 0) & row_ok  # all False, the tile's shape
        for w_k in tl.static_range(NW):
            # (The word's bound as a vector: the interpreter takes no scalar in a mask.)
            words = tl.load(bits_ptr + rows * WORDS + (w0 + w_k), mask=row_ok & (rows * 0 + w0 + w_k < WORDS),
                            other=0)  # fmt: skip
            seen |= (col_word == w_k) & (((words >> col_bit) & 1) != 0)
        s = tl.where(seen, s, float("-inf"))
    if HAS_SEG:
        qs = tl.load(qseg_ptr + rows, mask=rows < T, other=-1)
        ks = tl.load(kseg_ptr + cols, mask=cols < S, other=-2)
        s = tl.where(qs == ks, s, float("-inf"))
    return s, th


@triton.jit
def seen_keys(seen_ptr, offs_n, S: tl.constexpr):
    """Which keys ``offs_n`` some query of this (batch, KV head) sees under a mask_mod (words
    packed as its bits). The others may hold anything (NaN: the contract says they are unread),
    and a product with zero would carry it: they are loaded as zeros."""
    w = tl.load(seen_ptr + offs_n // 32, mask=offs_n < S, other=0)
    return ((w >> (offs_n % 32)) & 1) != 0
