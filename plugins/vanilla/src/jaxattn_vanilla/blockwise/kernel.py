"""Blockwise attention in plain XLA: online softmax over key blocks, a custom VJP, O(T) memory.

This is the function behind the ``blockwise`` impl. It computes exactly what
``vanilla_attention`` computes (the contract in docs/contract.md), but never forms the
``(T, S)`` logits: queries are cut into blocks of ``block_q`` rows and keys into blocks of
``block_k`` columns, and only one ``block_q x block_k`` tile of logits (per batch and head)
exists at a time.

Forward: for each query block, a loop over the key blocks it can see keeps the running row
max ``m``, the running sum ``l`` and the unnormalised output (the online softmax of
FlashAttention); the result is the output and the log-sum-exp ``lse``.

Backward (``jax.custom_vjp``): the residuals are q, k, v, the output and ``lse``, all
``O(T)``. A loop over key blocks, and inside it over the query blocks that see them,
recomputes each tile's probabilities from ``lse``, accumulates ``dk`` and ``dv`` for the
key block and adds each tile's ``dq`` into one ``(B, T, Hq, D)`` buffer. Cotangents of
``lse`` (ring attention merges blocks through it), of the bias and of the sinks are
handled; an input that is not differentiated (``symbolic_zeros``) costs nothing, so a
large constant bias gets no gradient buffer.

Blocks that causal masking or a sliding window hide entirely are skipped: the key-block
range of each query block (and the query-block range of each key block) is computed from
the static shapes, and the loops run over those ranges only. Tiles are still masked
element by element, so the ranges only need to cover every visible key, never to be tight.

With ``kv_lengths`` (a dense KV cache of capacity S: keys ``j >= L_b`` invisible, causal and
the window aligned to ``L_b``) each tile's mask is built from the lengths, so memory stays
``O(T)``. The static skip keeps only what holds for every length ``<= S``: causal and the
window's right edge (aligned to S they hide a superset of what they hide aligned to any
``L_b <= S``), not the window's left edge (it moves left as ``L_b`` shrinks). At run time
each query block's key-block range is then narrowed to the lengths of the batch (keys past
``max(L)``, and left of the window of ``min(L)``, are never visited), so a cache filled to a
quarter costs about a quarter of the tiles.

Lengths that are not multiples of the blocks are padded and the padding masked. Rows with
no visible key give zeros (output and gradients) and ``lse = -inf``, never NaN. Each tile's K
and V past the lengths are zeroed with a select (the cache may hold NaN there), and a ``+inf``
sink zeroes its head (``jaxattn.backend.sinks``). Dropout
draws its keep-mask per tile from ``fold_in(dropout_rng, tile index)``, so the backward
regenerates exactly the mask the forward used (the mask therefore depends on the block
sizes, and forward and backward use the same ones when dropout is on).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.typing import ArrayLike

from jaxattn import masks
from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "BlockTiling",
    "BlockwiseResult",
    "block_tiling",
    "blockwise_attention",
    "blockwise_backward",
    "default_block",
    "key_block_ranges",
    "query_block_range",
]

Array = jax.Array

#: Default caps of the query and key blocks: a 512 x 1024 float32 tile is 2 MiB per batch
#: and head, large enough that a GPU's per-iteration overhead does not dominate, small
#: enough that the working set stays far below the O(T * S) of dense attention.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 1024


class BlockwiseResult(NamedTuple):
    """``output (B, T, Hq, Dv)`` in q's dtype; ``lse (B, Hq, T)``: log-sum-exp of the final
    logits over visible real keys (sink excluded, ``-inf`` for empty rows), float32 (float64
    when the softmax runs in float64)."""

    output: Array
    lse: Array


def default_block(n: int, cap: int) -> int:
    """The block for an axis of ``n``: the fewest blocks of at most ``cap``, made equal so
    that padding is under one row per block (1000 with cap 512 gives 2 blocks of 500)."""
    blocks = -(-n // cap)
    return -(-n // blocks)


def _key_span(rows: tuple[int, int], t: int, s: int, causal: bool,
              window: tuple[int, int] | None, kv_lengths: bool = False) -> tuple[int, int]:
    """Inclusive column range any query in ``rows`` (inclusive) can see; empty if lo > hi.

    With ``kv_lengths`` the range covers every length ``L <= S`` (query i at ``i + L - T``):
    the upper edges hold as for S, the window's lower edge is dropped.
    """
    offset = s - t  # bottom-right alignment: query i sits at key position i + S - T
    lo, hi = 0, s - 1
    if window is not None:
        if not kv_lengths:
            lo = max(lo, rows[0] + offset - window[0])
        hi = min(hi, rows[1] + offset + window[1])
    if causal:
        hi = min(hi, rows[1] + offset)
    return lo, hi


@dataclasses.dataclass(frozen=True)
class BlockTiling:
    """The tiling of one call: block sizes, padded lengths and the tiles each loop visits.

    ``k_first[i]`` / ``k_count[i]``: the key blocks query block ``i`` visits (forward and the
    dq part of the backward); ``q_first[j]`` / ``q_count[j]``: the query blocks that visit key
    block ``j`` (the backward's inner loop).
    """

    t: int
    s: int
    block_q: int
    block_k: int
    k_first: tuple[int, ...]
    k_count: tuple[int, ...]
    q_first: tuple[int, ...]
    q_count: tuple[int, ...]

    @property
    def num_q(self) -> int:
        return len(self.k_first)

    @property
    def num_k(self) -> int:
        return len(self.q_first)

    @property
    def t_padded(self) -> int:
        return self.num_q * self.block_q

    @property
    def s_padded(self) -> int:
        return self.num_k * self.block_k

    @property
    def tiles_visited(self) -> int:
        return sum(self.k_count)

    @property
    def dense(self) -> bool:
        """Every query block visits every key block (the loops can have static bounds)."""
        return all(c == self.num_k for c in self.k_count)


def block_tiling(t: int, s: int, block_q: int, block_k: int, *, causal: bool = False,
                window: tuple[int, int] | None = None, kv_lengths: bool = False) -> BlockTiling:
    """Tiles of a ``(t, s)`` problem with blocks capped at the lengths; pure Python.

    ``kv_lengths``: the tiles any per-sequence length ``0..S`` can need (see ``_key_span``).
    """
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    k_first, k_count = [], []
    for i in range(nq):
        lo, hi = _key_span((i * bq, min((i + 1) * bq, t) - 1), t, s, causal, window, kv_lengths)
        if lo > hi:
            k_first.append(0)
            k_count.append(0)
        else:
            k_first.append(lo // bk)
            k_count.append(hi // bk - lo // bk + 1)
    q_first, q_count = [], []
    for j in range(nk):
        # The spans are monotone in i, so the query blocks seeing key block j are contiguous;
        # taking min..max would stay correct (tiles are masked) even if they were not.
        seen = [i for i in range(nq) if k_count[i] and k_first[i] <= j < k_first[i] + k_count[i]]
        q_first.append(seen[0] if seen else 0)
        q_count.append(seen[-1] - seen[0] + 1 if seen else 0)
    return BlockTiling(t, s, bq, bk, tuple(k_first), tuple(k_count), tuple(q_first), tuple(q_count))


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable, non-array part of a call (the custom VJP's non-differentiable argument)."""

    scale: float
    soft_cap: float | None
    causal: bool
    window: tuple[int, int] | None
    softmax_dtype: str
    fwd_blocks: tuple[int, int]
    bwd_blocks: tuple[int, int]
    dropout_prob: float
    precision: Any
    #: The mask_mod and score_mod, closure-converted at the tile's shapes (``_convert``): called
    #: as ``mask_fn(b, h, q_idx, kv_idx, *mask_consts)`` and ``score_fn(score, b, h, q_idx,
    #: kv_idx, *score_consts)``, the arrays they close over passed explicitly (``_Mods``), so that
    #: the custom VJP can differentiate the score_mod's.
    mask_fn: Any = None
    score_fn: Any = None


class _Mods(NamedTuple):
    """A call's mask_mod / score_mod arrays: ``tiles (num_q, num_k)`` bool, the tiles some batch
    and head of the mask_mod sees (its block mask; None: every tile), and the closure constants."""

    tiles: Array | None
    mask_consts: tuple[Any, ...]
    score_consts: tuple[Any, ...]


class _Padded(NamedTuple):
    """One call's arrays, padded to the tiling's lengths, in the layouts the tiles slice."""

    q: Array  # (B, Tp, Hkv, G, D)
    k: Array  # (B, Sp, Hkv, D)
    v: Array  # (B, Sp, Hkv, Dv)
    bias: Array | None  # (B|1, Hkv|1, G|1, Tp|1, Sp|1)
    mask: Array | None  # same layout, bool
    q_seg: Array | None  # (B, Tp)
    kv_seg: Array | None  # (B, Sp)
    kv_len: Array | None  # (B,) int32, within 0..S
    mask_consts: tuple[Any, ...] = ()
    score_consts: tuple[Any, ...] = ()


def _pad_to(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _split_heads(x: Array, hq: int, hkv: int, name: str) -> Array:
    """``(B|1, Hq|1, T|1, S|1)`` (rank <= 4) to ``(B|1, Hkv|1, G|1, T|1, S|1)``."""
    if x.ndim > 4:
        raise ValueError(f"{name}: rank {x.ndim} does not broadcast to (B, Hq, T, S)")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, h, t, s = x.shape
    if h == hq:
        return x.reshape(b, hkv, hq // hkv, t, s)
    if h == 1:
        return x.reshape(b, 1, 1, t, s)
    raise ValueError(f"{name}: head dim {h} is neither 1 nor Hq={hq}")


def _pad_bt(x: Array | None, tiling: BlockTiling, value: Any) -> Array | None:
    """Pad the T and S axes of a split mask/bias where they are full (size-1 axes broadcast)."""
    if x is None:
        return None
    if x.shape[-2] != 1:
        x = _pad_to(x, -2 % x.ndim, tiling.t_padded, value)
    if x.shape[-1] != 1:
        x = _pad_to(x, -1 % x.ndim, tiling.s_padded, value)
    return x


def _pad_inputs(tiling: BlockTiling, q: Array, k: Array, v: Array, bias: Array | None, mask: Array | None,
                q_seg: Array | None, kv_seg: Array | None, kv_len: Array | None) -> _Padded:
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    return _Padded(
        q=_pad_to(qg, 1, tiling.t_padded),
        k=_pad_to(k, 1, tiling.s_padded),
        v=_pad_to(v, 1, tiling.s_padded),
        bias=_pad_bt(bias, tiling, 0),
        mask=_pad_bt(mask, tiling, False),
        q_seg=None if q_seg is None else _pad_to(q_seg, 1, tiling.t_padded),
        kv_seg=None if kv_seg is None else _pad_to(kv_seg, 1, tiling.s_padded),
        kv_len=kv_len,
    )


def _tile(x: Array, r0: Array, c0: Array, tiling: BlockTiling) -> Array:
    """The ``(.., bq|1, bk|1)`` tile of a split mask/bias; broadcast axes are not sliced."""
    if x.shape[-2] != 1:
        x = lax.dynamic_slice_in_dim(x, r0, tiling.block_q, axis=x.ndim - 2)
    if x.shape[-1] != 1:
        x = lax.dynamic_slice_in_dim(x, c0, tiling.block_k, axis=x.ndim - 1)
    return x


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else jnp.logical_and(a, b)


def _visible(st: _Static, tiling: BlockTiling, pd: _Padded, r0: Array, c0: Array) -> Array | None:
    """Boolean broadcastable to the tile ``(B, Hkv, G, bq, bk)``, True = attend; None if all."""
    # At the tile's rank 5, so that no operand needs rank promotion (which
    # jax_numpy_rank_promotion="raise" refuses).
    shape = (1, 1, 1, tiling.block_q, tiling.block_k)
    rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 3)
    cols = c0 + lax.broadcasted_iota(jnp.int32, shape, 4)
    offset = tiling.s - tiling.t
    keep: Array | None = None
    if tiling.t_padded != tiling.t:
        # Padded query rows are hidden too, so that their (discarded) logits can never
        # overflow into a NaN that a backward multiplication by zero would not remove.
        keep = _and(keep, rows < tiling.t)
    aligned: Array = rows + offset
    if pd.kv_len is not None:
        # A cache of capacity S: each sequence ends at its own length (which also hides the
        # padded columns), and causal / the window align to it. (B, 1, 1, bq, bk).
        length = pd.kv_len[:, None, None, None, None]
        aligned = rows + (length - tiling.t)
        # A query at a negative position (T > L) is no token of the sequence: it sees nothing.
        keep = _and(keep, (cols < length) & (aligned >= 0))
    elif tiling.s_padded != tiling.s:
        keep = _and(keep, cols < tiling.s)
    if st.causal:
        keep = _and(keep, cols <= aligned)
    if st.window is not None:
        left, right = st.window
        keep = _and(keep, (cols >= aligned - left) & (cols <= aligned + right))
    if pd.mask is not None:
        keep = _and(keep, _tile(pd.mask, r0, c0, tiling))
    if pd.q_seg is not None and pd.kv_seg is not None:
        qs = lax.dynamic_slice_in_dim(pd.q_seg, r0, tiling.block_q, axis=1)
        ks = lax.dynamic_slice_in_dim(pd.kv_seg, c0, tiling.block_k, axis=1)
        keep = _and(keep, (qs[:, :, None] == ks[:, None, :])[:, None, None])
    if st.mask_fn is not None:
        seen = jnp.asarray(st.mask_fn(*_tile_index(tiling, pd, r0, c0), *pd.mask_consts), dtype=bool)
        keep = _and(keep, _grouped(seen, pd, tiling))
    return keep


def _tile_index(tiling: BlockTiling, pd: _Padded, r0: Any, c0: Any) -> tuple[Array, Array, Array, Array]:
    """A mask_mod's arguments for one tile: ``b (B,1,1,1)``, ``h (1,Hq,1,1)``, ``q_idx (1,1,bq,1)``,
    ``kv_idx (1,1,1,bk)``, raw positions; padded rows and columns repeat the last (and are hidden)."""
    b, hq = pd.q.shape[0], pd.q.shape[2] * pd.q.shape[3]
    rows = r0 + lax.broadcasted_iota(jnp.int32, (1, 1, tiling.block_q, 1), 2)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, tiling.block_k), 3)
    batch, heads, _, _ = masks.indices(b, hq, 1, 1)
    return batch, heads, jnp.minimum(rows, tiling.t - 1), jnp.minimum(cols, tiling.s - 1)


def _grouped(x: Array, pd: _Padded, tiling: BlockTiling) -> Array:
    """A ``(B|1, Hq|1, bq, bk)``-broadcastable tile as ``(B|1, Hkv|1, G|1, bq, bk)``."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, (x.shape[0], x.shape[1], tiling.block_q, tiling.block_k))
    return _split_heads(x, pd.q.shape[2] * pd.q.shape[3], pd.q.shape[2], "mask_mod")


def _select_seen(keep: Array, kb: Array, vb: Array) -> tuple[Array, Array]:
    """K and V of a tile with the keys no query of the tile sees replaced by zeros (a select: they
    may hold NaN, which ``p = 0`` times would keep). Keys hidden from the tile add nothing to it."""
    shape = jnp.broadcast_shapes(keep.shape, (kb.shape[0], kb.shape[2], 1, 1, kb.shape[1]))
    seen = jnp.any(jnp.broadcast_to(keep, shape), axis=(2, 3))  # (B, Hkv, bk)
    seen = jnp.broadcast_to(seen, (kb.shape[0], kb.shape[2], kb.shape[1])).transpose(0, 2, 1)[..., None]
    return jnp.where(seen, kb, jnp.zeros((), kb.dtype)), jnp.where(seen, vb, jnp.zeros((), vb.dtype))


def _kv_tiles(tiling: BlockTiling, pd: _Padded, c0: Array) -> tuple[Array, Array]:
    """K and V of key block ``c0``; with lengths, positions past them are zeros.

    A cache may hold anything past a length, NaN and Inf included (the contract): the logits'
    mask hides such keys from the softmax, but ``p = 0`` times a NaN value is NaN in ``P @ V``
    (and ``dS = 0`` times a NaN key in ``dq``), so they are replaced with a select.
    """
    kb = lax.dynamic_slice_in_dim(pd.k, c0, tiling.block_k, axis=1)
    vb = lax.dynamic_slice_in_dim(pd.v, c0, tiling.block_k, axis=1)
    if pd.kv_len is None:
        return kb, vb
    live = (c0 + lax.broadcasted_iota(jnp.int32, (1, tiling.block_k), 1)) < pd.kv_len[:, None]  # (B, bk)
    live = live[:, :, None, None]
    return jnp.where(live, kb, jnp.zeros((), kb.dtype)), jnp.where(live, vb, jnp.zeros((), vb.dtype))


def _logits(st: _Static, tiling: BlockTiling, pd: _Padded, qb: Array, kb: Array, vb: Array, r0: Array, c0: Array,
            sdtype: Any, pullback: bool = False) -> tuple[Array, Array | None, Any, Array, Array]:
    """Masked logits of one tile ``(B, Hkv, G, bq, bk)`` (-inf where hidden); with a soft cap,
    ``tanh(x / cap)`` (for the cap's derivative ``1 - tanh**2``); with a score_mod and
    ``pullback``, its VJP at the tile (``(d scores) -> (d scores before it, d its constants)``);
    and the tile's K and V (with a mask_mod, zeros at keys the tile does not see). Without a
    cap, a bias or a score_mod they are not yet scaled (``_unscaled``): see ``_factor``."""
    keep = _visible(st, tiling, pd, r0, c0)
    if st.mask_fn is not None and keep is not None:
        kb, vb = _select_seen(keep, kb, vb)
    x = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, precision=st.precision, preferred_element_type=sdtype)
    if not _unscaled(st, pd, sdtype):
        x = x * jnp.asarray(st.scale, sdtype)
    th = None
    if st.soft_cap is not None:
        cap = jnp.asarray(st.soft_cap, sdtype)
        th = jnp.tanh(x / cap)
        x = cap * th
    if pd.bias is not None:
        x = x + _tile(pd.bias, r0, c0, tiling).astype(sdtype)
    pull = None
    if st.score_fn is not None:
        index = _tile_index(tiling, pd, r0, c0)
        shape = x.shape

        def modded(x4: Array, consts: tuple[Any, ...]) -> Array:
            return jnp.asarray(st.score_fn(x4, *index, *consts)).astype(sdtype)

        x4 = x.reshape(shape[0], shape[1] * shape[2], *shape[3:])
        if pullback:
            x4, pull = jax.vjp(modded, x4, pd.score_consts)
        else:
            x4 = modded(x4, pd.score_consts)
        x = x4.reshape(shape)
    if keep is not None:
        x = jnp.where(keep, x, -jnp.inf)
    return x, th, pull, kb, vb


def _unscaled(st: _Static, pd: _Padded, sdtype: Any) -> bool:
    # A scale below the softmax dtype's smallest normal is applied to the logits first: flushed
    # to zero, as a factor it would make a hidden key's -inf * 0 = NaN (and the initial running
    # max's too), and logits scaled that small cannot overflow exp().
    return st.soft_cap is None and pd.bias is None and st.score_fn is None and st.scale >= float(jnp.finfo(sdtype).tiny)


def _factor(st: _Static, pd: _Padded, dtype: Any) -> Array:
    """What ``_logits`` left to multiply by. Plain logits take the scale after the max is
    subtracted, ``exp((x - m) * scale)``: XLA fuses ``x * scale - m`` into one multiply-add,
    whose exact product sits up to half an ulp of the rounded max away from it, and past ~2^32
    that gap alone overflows exp() (NaN out of finite inputs)."""
    return jnp.asarray(st.scale if _unscaled(st, pd, dtype) else 1.0, dtype)


def _dropout_keep(st: _Static, rng: Array, tiling: BlockTiling, i: Array, j: Array, shape: tuple[int, ...]) -> Array:
    key = jax.random.fold_in(rng, i * tiling.num_k + j)
    return jax.random.bernoulli(key, 1.0 - st.dropout_prob, shape)


def _dtypes(st: _Static, q: Array) -> tuple[Any, Any]:
    """(softmax dtype, accumulation dtype): never narrower than the inputs, resp. float32."""
    sdtype = jnp.promote_types(jnp.dtype(st.softmax_dtype), q.dtype)
    return sdtype, jnp.promote_types(sdtype, jnp.float32)


def _loop(dense_loop: bool, first: Array, count: Array, idx: Array, n_static: int, body: Any, init: Any) -> Any:
    """``fori_loop`` over a block range: static bounds when every block is visited, else the
    range looked up in the tiling's table (a while loop; the custom VJP never differentiates it)."""
    if dense_loop:
        return lax.fori_loop(0, n_static, body, init)
    start = first[idx]
    return lax.fori_loop(0, count[idx], lambda n, c: body(start + n, c), init)


def key_block_ranges(tiling: BlockTiling, kv_len: Array, *, causal: bool, window: tuple[int, int] | None,
                     xp: Any = jnp) -> tuple[Array, Array]:
    """``(first, last)`` ``(num_q,)``: each query block's key blocks, the tiling's narrowed to the
    batch's lengths (inclusive; empty where first > last).

    Query rows ``r0..r1`` of sequence b sit at ``L_b - T + r``; over the batch the visible keys
    lie within ``[min(L) - T + r0 - left, max(L) - T + r1 (+ right)]`` and below ``max(L)``, and
    none when ``max(L) - T + r1 < 0`` (rows at negative positions see nothing).
    ``xp``: the array namespace (``numpy`` evaluates the same rule on the host, for tests).
    """
    i = xp.arange(tiling.num_q, dtype=xp.int32)
    r0 = i * tiling.block_q
    r1 = xp.minimum(r0 + tiling.block_q, tiling.t) - 1
    shortest, longest = xp.min(kv_len), xp.max(kv_len)
    lo = xp.zeros_like(i)
    hi = xp.broadcast_to(longest - 1, i.shape)
    if causal:
        hi = xp.minimum(hi, longest - tiling.t + r1)
    # A row at a negative position (T > L) is no token of its sequence and sees nothing, causal
    # or not (docs/contract.md): a block of such rows in every sequence visits no key block.
    hi = xp.where(longest - tiling.t + r1 < 0, -1, hi)
    if window is not None:
        left, right = window
        lo = xp.maximum(lo, shortest - tiling.t + r0 - left)
        hi = xp.minimum(hi, longest - tiling.t + r1 + right)
    first = xp.asarray(tiling.k_first, xp.int32)
    last = first + xp.asarray(tiling.k_count, xp.int32) - 1
    return xp.maximum(first, lo // tiling.block_k), xp.minimum(last, hi // tiling.block_k)  # floor: hi < 0 is empty


def query_block_range(first: Array, last: Array, j: Array, xp: Any = jnp) -> tuple[Array, Array]:
    """``(start, count)`` of the query blocks whose key-block range holds key block ``j``
    (min to max: tiles in between are masked, so a gap would only cost time). ``j`` may be an
    array of key blocks; the results then have its shape."""
    j = xp.asarray(j)[..., None]
    sees = (first <= j) & (j <= last)
    n = sees.shape[-1]
    start = xp.argmax(sees, axis=-1).astype(xp.int32)
    end = (n - xp.argmax(sees[..., ::-1], axis=-1)).astype(xp.int32)
    return start, xp.where(xp.any(sees, axis=-1), end - start, 0)


def _run(start: Array, count: Array, body: Any, init: Any) -> Any:
    """``fori_loop`` over blocks ``start .. start + count - 1`` (a while loop)."""
    return lax.fori_loop(0, count, lambda n, c: body(start + n, c), init)


def _visit_table(tiling: BlockTiling, tiles: Array, ranges: tuple[Array, Array] | None) -> Array:
    """``(num_q, num_k)`` bool: the tiles to compute, those the tiling's ranges (static, or narrowed
    to the lengths) and the mask_mod's block mask both leave."""
    import numpy as np

    j = np.arange(tiling.num_k)[None, :]
    first, count = np.asarray(tiling.k_first)[:, None], np.asarray(tiling.k_count)[:, None]
    visit = jnp.logical_and(tiles, jnp.asarray((j >= first) & (j < first + count)))
    if ranges is not None:
        lo, hi = ranges
        visit = visit & (j >= lo[:, None]) & (j <= hi[:, None])
    return visit


def _order(visit: Array) -> tuple[Array, Array]:
    """Per row of ``visit``: its True columns first, ascending (``(rows, cols)`` int32), and their count."""
    order = jnp.argsort(jnp.logical_not(visit).astype(jnp.int8), axis=1, stable=True).astype(jnp.int32)
    return order, jnp.sum(visit, axis=1, dtype=jnp.int32)


def _forward(st: _Static, q: Array, k: Array, v: Array, bias: Array | None, aux: Array | None,
             mask: Array | None, q_seg: Array | None, kv_seg: Array | None,
             rng: Array | None, kv_len: Array | None, mods: _Mods | None = None) -> tuple[Array, Array]:
    """``(output (B, T, Hq, Dv) in the accumulation dtype, lse (B, Hq, T))``."""
    b, t, hq, _ = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    sdtype, adtype = _dtypes(st, q)
    tiling = block_tiling(t, s, *st.fwd_blocks, causal=st.causal, window=st.window, kv_lengths=kv_len is not None)
    pd = _pad_inputs(tiling, q, k, v, bias, mask, q_seg, kv_seg, kv_len)
    if mods is not None:
        pd = pd._replace(mask_consts=mods.mask_consts, score_consts=mods.score_consts)
    bq, bk = tiling.block_q, tiling.block_k
    factor = _factor(st, pd, sdtype)
    first = jnp.asarray(tiling.k_first, jnp.int32)
    count = jnp.asarray(tiling.k_count, jnp.int32)
    if kv_len is not None:
        first, last = key_block_ranges(tiling, kv_len, causal=st.causal, window=st.window)
        count = jnp.maximum(last - first + 1, 0)
    table = None
    if mods is not None and mods.tiles is not None:  # the block mask's tiles, in a table per query block
        table = _order(_visit_table(tiling, mods.tiles, None if kv_len is None else (first, last)))

    def q_block(_: None, i: Array) -> tuple[None, tuple[Array, Array]]:
        r0 = i * bq
        qb = lax.dynamic_slice_in_dim(pd.q, r0, bq, axis=1)

        def step(j: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            m, total, acc = state
            c0 = j * bk
            kb, vb = _kv_tiles(tiling, pd, c0)
            x, _, _, kb, vb = _logits(st, tiling, pd, qb, kb, vb, r0, c0, sdtype)
            m_new = jnp.maximum(m, jnp.max(x, axis=-1))  # in x's units (see _factor)
            # A row with nothing visible so far shifts by 0, not -inf: exp() then gives 0, not NaN.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
            p = jnp.exp((x - m_safe[..., None]) * factor)
            alpha = jnp.exp((m - m_safe) * factor)
            total = alpha * total + jnp.sum(p, axis=-1, dtype=adtype)
            if rng is not None:
                keep = _dropout_keep(st, rng, tiling, i, j, p.shape)
                p = jnp.where(keep, p / jnp.asarray(1.0 - st.dropout_prob, p.dtype), 0)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb, precision=st.precision,
                            preferred_element_type=adtype)
            return m_new, total, alpha[..., None] * acc + pv

        init = (
            jnp.full((b, hkv, g, bq), -jnp.inf, sdtype),
            jnp.zeros((b, hkv, g, bq), adtype),
            jnp.zeros((b, hkv, g, bq, dv), adtype),
        )
        if table is not None:
            order, n = table
            m, total, acc = lax.fori_loop(0, n[i], lambda c, st_: step(order[i, c], st_), init)
        elif kv_len is not None:
            m, total, acc = _run(first[i], count[i], step, init)
        else:
            m, total, acc = _loop(tiling.dense, first, count, i, tiling.num_k, step, init)
        m_safe = (jnp.where(jnp.isfinite(m), m, 0) * factor).astype(adtype)
        has = total > 0
        # A row that sees no key has lse -inf (the contract); a padded row (dropped below) 0, so
        # that no Inf the output lacks leaves the scan (jax.debug_infs checks what it returns).
        unseen: Array | float = -jnp.inf
        if tiling.t_padded != tiling.t:
            padded = r0 + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq), 3) >= tiling.t
            unseen = jnp.where(padded, 0.0, -jnp.inf).astype(adtype)
        lse = jnp.where(has, m_safe + jnp.log(jnp.where(has, total, 1)), unseen)
        if aux is None:
            out = acc / jnp.where(has, total, 1)[..., None]
        else:
            # The sink joins the denominator: out = acc / (total + exp(aux - m)), with no
            # lse - m to lose to rounding at huge logits. Guarded so that an empty row (acc = 0)
            # stays 0.
            sink = jnp.exp(aux.astype(adtype).reshape(1, hkv, g, 1) - m_safe)
            out = acc * jnp.where(has, 1 / (total + sink), 0)[..., None]
        return None, (out, lse)

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(tiling.num_q, dtype=jnp.int32))
    # (nq, B, Hkv, G, bq, Dv) -> (B, nq, bq, Hkv, G, Dv) -> (B, T, Hq, Dv)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, tiling.t_padded, hq, dv)[:, :t]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, hq, tiling.t_padded)[..., :t]
    return out, lse


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``x`` over the axes where ``shape`` broadcasts (size 1), keeping them."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


class _Rows(NamedTuple):
    """The backward's per-row terms, padded to the tiling's ``Tp`` rows: ``dout (B, Tp, Hkv, G, Dv)``;
    ``big (B, Hkv, G, Tp)``, the full log-normaliser (sinks included; 0 where not finite);
    ``row (B, Hkv, G, Tp)``, the softmax backward's row term (``dlse``'s share included)."""

    dout: Array
    big: Array
    row: Array


class _Tiles(NamedTuple):
    """What every tile of the backward reads besides its own blocks."""

    st: _Static
    tiling: BlockTiling
    pd: _Padded
    rows: _Rows
    factor: Array  # see _factor
    sdtype: Any
    adtype: Any
    rng: Array | None


#: A key block's gradients carried across its query blocks: dK and dV of the block, dQ, dbias
#: (None unless wanted) and the score_mod's constants' (None for an integer constant).
_TileState = tuple[Array, Array, Array, Array | None, Any]


def _row_terms(tiling: BlockTiling, q: Array, hkv: int, out: Array, lse: Array, aux: Array | None,
               dout: Array | None, dlse: Array | None, want_daux: bool,
               adtype: Any) -> tuple[_Rows, Array | None]:
    """The per-row terms every tile reads, and the sinks' gradient ``daux (Hq,)`` (None unless
    wanted): both depend on rows only, so they are computed once, outside the tile loops."""
    b, t, hq, dv = out.shape
    g = hq // hkv
    lse_g = lse.reshape(b, hkv, g, t).astype(adtype)
    aux_g = None if aux is None else aux.astype(adtype).reshape(1, hkv, g, 1)
    big = lse_g if aux_g is None else jnp.logaddexp(lse_g, aux_g)  # the full log-normaliser
    if dout is None:
        dout = jnp.zeros(out.shape, q.dtype)
    # delta_i = sum_j p_ij dP_ij = dO_i . O_i, the softmax backward's row term.
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(adtype), out.astype(adtype)).reshape(b, hkv, g, t)
    row = delta
    if dlse is not None:
        # d lse_i / d x_ij = exp(x_ij - lse_i) = p_ij * exp(big_i - lse_i) (1 without sinks).
        ratio = jnp.where(jnp.isfinite(lse_g), jnp.exp(big - jnp.where(jnp.isfinite(lse_g), lse_g, 0)), 0)
        row = row - dlse.reshape(b, hkv, g, t).astype(adtype) * ratio
    daux = None
    if want_daux and aux_g is not None and aux is not None:
        sink = jnp.exp(aux_g - big)  # the sink's probability; big >= aux, so finite
        daux = (-jnp.sum(sink * delta, axis=(0, 3))).reshape(hq).astype(aux.dtype)
    rows = _Rows(dout=_pad_to(dout.reshape(b, t, hkv, g, dv), 1, tiling.t_padded),
                 big=_pad_to(jnp.where(jnp.isfinite(big), big, 0), 3, tiling.t_padded),
                 row=_pad_to(row, 3, tiling.t_padded))
    return rows, daux


def _tile_grads(ctx: _Tiles, i: Array, j: Array, kb0: Array, vb0: Array, state: _TileState) -> _TileState:
    """``state`` with the gradients of tile (query block ``i``, key block ``j``) added; ``kb0``
    and ``vb0`` are key block ``j``'s K and V."""
    st, tiling, pd, adtype = ctx.st, ctx.tiling, ctx.pd, ctx.adtype
    bq = tiling.block_q
    dk, dvv, dq, db, dc = state
    r0, c0 = i * bq, j * tiling.block_k
    qb = lax.dynamic_slice_in_dim(pd.q, r0, bq, axis=1)
    dob = lax.dynamic_slice_in_dim(ctx.rows.dout, r0, bq, axis=1)
    big_b = lax.dynamic_slice_in_dim(ctx.rows.big, r0, bq, axis=3)
    row_b = lax.dynamic_slice_in_dim(ctx.rows.row, r0, bq, axis=3)
    x, th, pull, kb, vb = _logits(st, tiling, pd, qb, kb0, vb0, r0, c0, ctx.sdtype, pullback=True)
    # No probability exceeds 1. XLA may fuse x * factor - big into a multiply-add (see
    # _factor): the cap keeps that gap, past ~2^32, from overflowing exp().
    p = jnp.exp(jnp.minimum(x.astype(adtype) * ctx.factor - big_b[..., None], 0))
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dob.astype(pd.v.dtype), vb, precision=st.precision,
                    preferred_element_type=adtype)
    if ctx.rng is not None:
        inv_keep = 1.0 / (1.0 - st.dropout_prob)
        keep = _dropout_keep(st, ctx.rng, tiling, i, j, p.shape)
        pz = jnp.where(keep, p * inv_keep, 0)
        dp = jnp.where(keep, dp * inv_keep, 0)
    else:
        pz = p
    dvv = dvv + jnp.einsum("bkgqs,bqkgd->bskd", pz.astype(dob.dtype), dob, precision=st.precision,
                           preferred_element_type=adtype)
    ds = p * (dp - row_b[..., None])  # d loss / d (final logits); 0 where hidden
    if pull is not None:  # through the score_mod: to the scores before it, and to its constants
        ds4, dc_tile = pull(ds.reshape(ds.shape[0], -1, *ds.shape[3:]).astype(x.dtype))
        ds = ds4.reshape(ds.shape).astype(adtype)
        dc = tuple(None if a is None else a + g_.astype(adtype) for a, g_ in zip(dc, dc_tile, strict=True))
    if db is not None and pd.bias is not None:
        start = [0, 0, 0, r0 if db.shape[3] != 1 else 0, c0 if db.shape[4] != 1 else 0]
        part = _reduce_to(ds, db.shape)
        db = lax.dynamic_update_slice(db, lax.dynamic_slice(db, start, part.shape) + part, start)
    if th is not None:
        ds = ds * (1 - jnp.square(th.astype(adtype)))
    ds = ds * jnp.asarray(st.scale, adtype)
    dq_b = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(pd.k.dtype), kb, precision=st.precision,
                      preferred_element_type=adtype)
    dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, r0, bq, axis=1) + dq_b, r0, axis=1)
    dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(pd.q.dtype), qb, precision=st.precision,
                         preferred_element_type=adtype)
    return dk, dvv, dq, db, dc


def _unpad_grads(tiling: BlockTiling, q: Array, k: Array, v: Array, bias: Array | None,
                 score_consts: tuple[Any, ...], dq: Array, dk: Array, dvv: Array, db: Array | None,
                 dc: Any) -> tuple[Array, Array, Array, Array | None, Any]:
    """The accumulated gradients in their inputs' shapes and dtypes: dQ from ``(B, Tp, Hkv, G, D)``,
    dK and dV from ``(num_k, B, bk, Hkv, D)`` (one per key block), dbias unpadded on its full axes."""
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    dq = dq[:, :t].reshape(b, t, hq, d).astype(q.dtype)
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, tiling.s_padded, hkv, d)[:, :s].astype(k.dtype)
    dvv = dvv.transpose(1, 0, 2, 3, 4).reshape(b, tiling.s_padded, hkv, dv)[:, :s].astype(v.dtype)
    dbias = None
    if db is not None and bias is not None:
        if db.shape[3] != 1:
            db = db[:, :, :, :t]
        if db.shape[4] != 1:
            db = db[..., :s]
        dbias = db.astype(bias.dtype)
    dconsts = tuple(None if g_ is None else g_.astype(jnp.result_type(c)) for g_, c in zip(dc, score_consts,
                                                                                        strict=True))
    return dq, dk, dvv, dbias, dconsts


def _backward(st: _Static, q: Array, k: Array, v: Array, bias: Array | None, aux: Array | None,
              mask: Array | None, q_seg: Array | None, kv_seg: Array | None, rng: Array | None,
              kv_len: Array | None, out: Array, lse: Array, dout: Array | None, dlse: Array | None,
              want_dbias: bool, want_daux: bool,
              mods: _Mods | None = None) -> tuple[Array, Array, Array, Array | None, Array | None, Any]:
    """``(dq, dk, dv, dbias, daux, d score_mod constants)``: a scan over key blocks, each a loop
    over the query blocks that see it (dK and dV stay in the loop's carry; dQ and dbias are
    accumulated across key blocks)."""
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    sdtype, adtype = _dtypes(st, q)
    tiling = block_tiling(t, s, *st.bwd_blocks, causal=st.causal, window=st.window, kv_lengths=kv_len is not None)
    pd = _pad_inputs(tiling, q, k, v, bias, mask, q_seg, kv_seg, kv_len)
    if mods is not None:
        pd = pd._replace(mask_consts=mods.mask_consts, score_consts=mods.score_consts)
    rows, daux = _row_terms(tiling, q, hkv, out, lse, aux, dout, dlse, want_daux, adtype)
    ctx = _Tiles(st, tiling, pd, rows, _factor(st, pd, sdtype), sdtype, adtype, rng)
    first = jnp.asarray(tiling.q_first, jnp.int32)
    count = jnp.asarray(tiling.q_count, jnp.int32)
    dense = all(c == tiling.num_q for c in tiling.q_count)
    ranges = None if kv_len is None else key_block_ranges(tiling, kv_len, causal=st.causal, window=st.window)

    dq0 = jnp.zeros((b, tiling.t_padded, hkv, hq // hkv, d), adtype)
    db0 = None if not (want_dbias and pd.bias is not None) else jnp.zeros(pd.bias.shape, adtype)
    # The score_mod's constants' gradients, summed over the tiles (zeros of each; None for integers).
    dc0 = tuple(jnp.zeros(jnp.shape(c), adtype) if jnp.issubdtype(jnp.result_type(c), jnp.inexact) else None
                for c in pd.score_consts)
    table = None
    if mods is not None and mods.tiles is not None:  # per key block, the query blocks that see it
        table = _order(_visit_table(tiling, mods.tiles, ranges).T)

    def k_block(carry: tuple[Array, Array | None, Any], j: Array) -> tuple[tuple[Array, Array | None, Any],
                                                                          tuple[Array, Array]]:
        kb0, vb0 = _kv_tiles(tiling, pd, j * tiling.block_k)

        def step(i: Array, state: _TileState) -> _TileState:
            return _tile_grads(ctx, i, j, kb0, vb0, state)

        dq, db, dc = carry
        bk = tiling.block_k
        init = (jnp.zeros((b, bk, hkv, d), adtype), jnp.zeros((b, bk, hkv, dv), adtype), dq, db, dc)
        if table is not None:
            order, n = table
            dk, dvv, dq, db, dc = lax.fori_loop(0, n[j], lambda c, st_: step(order[j, c], st_), init)
        elif ranges is not None:
            dk, dvv, dq, db, dc = _run(*query_block_range(*ranges, j), step, init)
        else:
            dk, dvv, dq, db, dc = _loop(dense, first, count, j, tiling.num_q, step, init)
        return (dq, db, dc), (dk, dvv)

    (dq, db, dc), (dk, dvv) = lax.scan(k_block, (dq0, db0, dc0), jnp.arange(tiling.num_k, dtype=jnp.int32))
    dq, dk, dvv, dbias, dconsts = _unpad_grads(tiling, q, k, v, bias, pd.score_consts, dq, dk, dvv, db, dc)
    return dq, dk, dvv, dbias, daux, dconsts


def _primal(st: _Static, q: Array, k: Array, v: Array, bias: Array | None, aux: Array | None,
            mask: Array | None, q_seg: Array | None, kv_seg: Array | None,
            rng: Array | None, kv_len: Array | None, mods: _Mods | None = None) -> tuple[Array, Array]:
    out, lse = _forward(st, q, k, v, bias, aux, mask, q_seg, kv_seg, rng, kv_len, mods)
    return out.astype(q.dtype), lse


_attend = jax.custom_vjp(_primal, nondiff_argnums=(0,))


def _value(x: Any) -> Any:
    return x.value if isinstance(x, CustomVJPPrimal) else x


def _perturbed(x: Any) -> bool:
    return bool(x.perturbed) if isinstance(x, CustomVJPPrimal) else True


def _nonzero(ct: Any) -> Array | None:
    return None if isinstance(ct, SymbolicZero) else ct


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Residuals:
    arrays: tuple[Any, ...]
    want_dbias: bool = dataclasses.field(metadata={"static": True})
    want_daux: bool = dataclasses.field(metadata={"static": True})


def _unwrap(x: Any) -> Any:
    return jax.tree_util.tree_map(_value, x, is_leaf=lambda y: isinstance(y, CustomVJPPrimal))


def _attend_fwd(st: _Static, *args: Any) -> tuple[tuple[Array, Array], _Residuals]:
    values = [_unwrap(a) for a in args]
    out, lse = _forward(st, *values)
    res = _Residuals((*values, out, lse), want_dbias=_perturbed(args[3]), want_daux=_perturbed(args[4]))
    return (out.astype(values[0].dtype), lse), res


def _attend_bwd(st: _Static, res: _Residuals, cts: tuple[Any, Any]) -> tuple[Any, ...]:
    q, k, v, bias, aux, mask, q_seg, kv_seg, rng, kv_len, mods, out, lse = res.arrays
    dout, dlse = (_nonzero(c) for c in cts)
    dq, dk, dv, dbias, daux, dconsts = _backward(st, q, k, v, bias, aux, mask, q_seg, kv_seg, rng, kv_len, out, lse,
                                                 dout, dlse, res.want_dbias, res.want_daux, mods)
    dmods = None if mods is None else _Mods(None, tuple(None for _ in mods.mask_consts), dconsts)
    return dq, dk, dv, dbias, daux, None, None, None, None, None, dmods


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)

#: The same without symbolic zeros, for calls with neither a bias nor sinks, where they would skip
#: nothing but an unused lse cotangent: jax 0.10 cannot run a custom_vjp with symbolic zeros inside
#: an eagerly differentiated ``shard_map`` (NotImplementedError), and ring attention's blocks run there.
_attend_dense = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_attend_dense.defvjp(_attend_fwd, _attend_bwd)


def _window(sliding_window: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        return (sliding_window, sliding_window)
    left, right = sliding_window
    return (int(left), int(right))


def blockwise_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: ArrayLike | None = None,
    dropout_prob: float = 0.0,
    dropout_rng: Array | None = None,
    kv_lengths: ArrayLike | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    block_mask: Any = None,
    softmax_dtype: Any = jnp.float32,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> BlockwiseResult:
    """Attention with the contract's semantics in ``O(T)`` memory; see the module docstring.

    Shapes as ``vanilla_attention``: q ``(B, T, Hq, D)``, k ``(B, S, Hkv, D)``, v ``(B, S,
    Hkv, Dv)``; mask (bool, True = attend) and bias broadcastable to ``(B, Hq, T, S)``
    (size-1 dims are never broadcast in memory); segment ids ``(B, T)`` and ``(B, S)`` (one
    set serves both sides when T == S); ``softmax_aux (Hq,)``; ``kv_lengths (B,)`` (keys at and
    past a sequence's length are invisible, causal and the window align to it; values outside
    0..S, which jit cannot check, are clamped). Blocks default to
    ``default_block(T, 512)`` and ``default_block(S, 1024)``; the backward's blocks default
    to the forward's, and with dropout they must be the forward's (the keep-mask is drawn
    per tile).

    ``mask_mod`` and ``score_mod`` (``jaxattn.masks``) are evaluated per tile; tiles the mask_mod
    leaves empty for every batch and head (its ``block_mask``, built here when not given) are
    skipped, forward and backward. A ``block_mask``'s blocks are then the blocks, and the
    backward's blocks are the forward's (the functions are traced once, at the tile's shapes).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        if t != s:
            raise ValueError("q_segment_ids and kv_segment_ids must be given together when T != S")
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    rng = None
    if dropout_prob > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_prob > 0 needs dropout_rng")
        rng = dropout_rng
    # Capped here as block_tiling caps them, so that equal effective blocks compare equal.
    fwd = (min(block_q or default_block(t, DEFAULT_BLOCK_Q), t), min(block_k or default_block(s, DEFAULT_BLOCK_K), s))
    if block_mask is not None:
        fwd = (int(block_mask.block_q), int(block_mask.block_kv))
    bwd = (min(block_q_bwd or fwd[0], t), min(block_k_bwd or fwd[1], s))
    if mask_mod is not None or score_mod is not None:
        bwd = fwd
    if rng is not None and bwd != fwd:
        raise ValueError(f"with dropout the backward blocks {bwd} must equal the forward's {fwd}: "
                         "the keep-mask is drawn per tile")
    st = _Static(
        scale=float(d) ** -0.5 if softmax_scale is None else float(softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        causal=bool(causal),
        window=_window(sliding_window),
        softmax_dtype=jnp.dtype(softmax_dtype).name,
        fwd_blocks=(int(fwd[0]), int(fwd[1])),
        bwd_blocks=(int(bwd[0]), int(bwd[1])),
        dropout_prob=float(dropout_prob),
        precision=precision,
    )
    mods = None
    if mask_mod is not None or score_mod is not None:
        st, mods = _convert(st, b, hq, t, s, q.dtype, mask_mod, score_mod, block_mask)
    bias_g = None if bias is None else _split_heads(jnp.asarray(bias), hq, hkv, "bias")
    mask_g = None if mask is None else _split_heads(jnp.asarray(mask, dtype=bool), hq, hkv, "mask")
    aux, absorbed = split_absorbing_sinks(softmax_aux)
    q_seg = None if q_segment_ids is None else jnp.asarray(q_segment_ids)
    kv_seg = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    kv_len = None if kv_lengths is None else jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, s)
    attend = _attend if bias_g is not None or aux is not None or score_mod is not None else _attend_dense
    out, lse = attend(st, q, k, v, bias_g, aux, mask_g, q_seg, kv_seg, rng, kv_len, mods)
    return BlockwiseResult(output=zero_absorbed_heads(out, absorbed, 2), lse=lse)


def _convert(st: _Static, b: int, hq: int, t: int, s: int, dtype: Any, mask_mod: Any, score_mod: Any,
             block_mask: Any) -> tuple[_Static, _Mods]:
    """``st`` with the mask_mod and score_mod closure-converted at the tile's shapes (so that the
    arrays they close over, traced or differentiated, cross the custom VJP as arguments), and
    their arrays: the tiles the mask_mod's block mask leaves (built here when not given)."""
    bq, bk = st.fwd_blocks
    index = (jnp.zeros((b, 1, 1, 1), jnp.int32), jnp.zeros((1, hq, 1, 1), jnp.int32),
             jnp.zeros((1, 1, bq, 1), jnp.int32), jnp.zeros((1, 1, 1, bk), jnp.int32))
    mask_fn = score_fn = None
    mask_consts: tuple[Any, ...] = ()
    score_consts: tuple[Any, ...] = ()
    tiles = None
    if mask_mod is not None:
        mask_fn, found = jax.closure_convert(mask_mod, *index)
        mask_consts = tuple(found)
        if block_mask is None:
            block_mask = masks.block_mask(mask_mod, b, hq, t, s, block_q=bq, block_kv=bk)
        tiles = jnp.any(block_mask.kind != 0, axis=(0, 1))  # (num_q, num_k): seen by some batch and head
    if score_mod is not None:
        sdtype = jnp.promote_types(jnp.dtype(st.softmax_dtype), dtype)
        score_fn, found = jax.closure_convert(score_mod, jnp.zeros((b, hq, bq, bk), sdtype), *index)
        score_consts = tuple(found)
    return dataclasses.replace(st, mask_fn=mask_fn, score_fn=score_fn), _Mods(tiles, mask_consts, score_consts)


def blockwise_backward(
    q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array | None, d_lse: Array | None, *,
    mask: Array | None = None, causal: bool = False, q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None, softmax_scale: float | None = None, logits_soft_cap: float | None = None,
    softmax_dtype: Any = jnp.float32, block_q: int | None = None, block_k: int | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of attention's ``(out, lse)`` at cotangents ``(d_out, d_lse)``, from the
    residuals of *another* kernel's forward: this module's blockwise backward, ``O(T)`` memory.

    For kernels whose forward is fast but whose lse has no gradient (cuDNN through
    ``return_residual``): ring attention pairs such a forward with this backward
    (``ring_block_impl="cudnn+blockwise"``). ``out`` and ``lse`` must be the forward's: the
    contract's output and ``(B, Hq, T)`` log-sum-exp (``-inf`` for rows with nothing visible).
    Full or top-left causal attention with an optional mask and segment ids, as the ring's
    blocks are; no bias, window, sinks, dropout or lengths.
    """
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    s, hkv = k.shape[1], k.shape[2]
    blocks = (min(block_q or default_block(t, DEFAULT_BLOCK_Q), t),
              min(block_k or default_block(s, DEFAULT_BLOCK_K), s))
    st = _Static(
        scale=float(d) ** -0.5 if softmax_scale is None else float(softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), causal=bool(causal), window=None,
        softmax_dtype=jnp.dtype(softmax_dtype).name, fwd_blocks=blocks, bwd_blocks=blocks, dropout_prob=0.0,
        precision=precision,
    )
    mask_g = None if mask is None else _split_heads(jnp.asarray(mask, dtype=bool), hq, hkv, "mask")
    dq, dk, dv, _, _, _ = _backward(st, q, k, v, None, None, mask_g, q_segment_ids, kv_segment_ids, None, None, out,
                                    lse, d_out, d_lse, False, False)
    return dq, dk, dv
