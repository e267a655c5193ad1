"""Masks and scores as programs: ``mask_mod`` constructors and ``BlockMask`` (docs/masks.md).

A **mask_mod** is a plain JAX function ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True means the
query at raw position ``q_idx`` (``0..T-1``) of sequence ``b``, head ``h`` may see the key at raw
position ``kv_idx`` (``0..S-1``). The arguments are int32 arrays that broadcast as ``(B,1,1,1)``,
``(1,Hq,1,1)``, ``(1,1,T,1)`` and ``(1,1,1,S)`` (a backend may pass tiles of them). A **score_mod**
``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites the scaled logit elementwise.

The constructors here return mask_mods. Positions are raw, so they are aligned **top-left**:
``causal()`` is ``q_idx >= kv_idx`` (FlexAttention's), not the bottom-right ``causal=True`` of
``jaxattn.attention`` (which equals it when T == S). Importing this module imports no jax; the
functions import it when they run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

from .errors import InvalidInputError, InvalidTypeError

__all__ = [
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "and_",
    "as_segment_ids",
    "block_mask",
    "call_bits",
    "causal",
    "chunked_causal",
    "document",
    "from_bits",
    "indices",
    "mask_bits",
    "or_",
    "prefix_lm",
    "seen_words",
    "sees_diagonal",
    "sliding_window",
    "tile_lists",
]

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]

#: The states of a tile in ``BlockMask.kind``.
EMPTY, PARTIAL, FULL = 0, 1, 2


def _size(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(name, f"must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidInputError(name, f"must be >= {minimum}, got {value}")
    return value


def _array(name: str, value: Any, ndim: int, floating: bool, what: str) -> Any:
    """``value`` as a jax array of ``ndim`` dims, integer (or floating), else an error naming it."""
    import jax.numpy as jnp

    arr = jnp.asarray(value)
    if arr.ndim != ndim or not jnp.issubdtype(arr.dtype, jnp.floating if floating else jnp.integer):
        raise InvalidInputError(name, f"must be {what}, got {arr.dtype} {arr.shape}")
    return arr


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


#: The mask_mods the constructors know to keep every pair ``q_idx == kv_idx`` (``sees_diagonal``).
_diagonal: weakref.WeakSet[Any] = weakref.WeakSet({_causal})


def _on_diagonal(mask_mod: MaskMod) -> MaskMod:
    _diagonal.add(mask_mod)
    return mask_mod


def sees_diagonal(mask_mod: Any) -> bool:
    """Whether ``mask_mod`` is known, from the constructors that made it, to keep every pair
    ``q_idx == kv_idx``: then, with T == S and no other rule hiding a diagonal pair, every key is
    seen by some query and a kernel need not zero unread keys (``backend.zero_unseen_keys``).
    False for any other function: a user's mask_mod is not analysed."""
    try:
        return mask_mod in _diagonal
    except TypeError:  # not weakly referable: no constructor made it
        return False


def causal() -> MaskMod:
    """``q_idx >= kv_idx``: each query sees itself and the keys before it (top-left aligned)."""
    return _causal


@functools.lru_cache(maxsize=256)  # one function per window: calls with it share their traces
def sliding_window(left: int, right: int = 0) -> MaskMod:
    """``q_idx - left <= kv_idx <= q_idx + right`` (top-left aligned); ``right=0`` is a causal
    window of ``left`` keys before each query and the query itself."""
    lo, hi = _size("left", left), _size("right", right)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx >= q_idx - lo) & (kv_idx <= q_idx + hi)

    return _on_diagonal(mask_mod)


@functools.lru_cache(maxsize=256)
def chunked_causal(chunk: int) -> MaskMod:
    """Causal within chunks of ``chunk`` positions (``q_idx // chunk == kv_idx // chunk``), as
    Llama 4's local layers attend."""
    size = _size("chunk", chunk, 1)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx // size == kv_idx // size) & (q_idx >= kv_idx)

    return _on_diagonal(mask_mod)


def prefix_lm(prefix_lengths: Any) -> MaskMod:
    """Prefix-LM: the first ``prefix_lengths[b]`` positions of sequence b (an int array ``(B,)``)
    are seen by every query (bidirectional); past them attention is causal."""
    lengths = _array("prefix_lengths", prefix_lengths, 1, False, "an int array (B,)")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < lengths[b]) | (q_idx >= kv_idx)

    return _on_diagonal(mask_mod)


def document(q_segment_ids: Any, kv_segment_ids: Any = None) -> MaskMod:
    """Packed documents: a query sees only keys of its own segment (``(B, T)`` and ``(B, S)`` int
    ids; one array serves both sides when T == S). ``and_(causal(), document(ids))`` is causal
    attention within each document."""
    q_ids = _array("q_segment_ids", q_segment_ids, 2, False, "an int array (B, T|S)")
    # The same object twice (a numpy array too, which _array converts anew) is one array.
    same = kv_segment_ids is None or kv_segment_ids is q_segment_ids
    kv_ids = q_ids if same else _array("kv_segment_ids", kv_segment_ids, 2, False, "an int array (B, T|S)")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    _documents[mask_mod] = (None, q_ids, kv_ids)
    # One array for both sides: position i's query and key share a segment.
    return _on_diagonal(mask_mod) if kv_ids is q_ids else mask_mod


#: The ``document()`` term of the mask_mods ``document`` and ``and_`` make: ``(rest, q ids, kv ids)``.
_documents: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()


def _split_document(mask_mod: Any) -> tuple[MaskMod | None, Any, Any] | None:
    """``(rest, q ids, kv ids)`` when ``mask_mod`` is ``document(...)`` or an ``and_`` of one
    ``document(...)`` and other mask_mods (``rest``: those, ANDed; None when there are none)."""
    try:
        return _documents.get(mask_mod)
    except TypeError:  # not weakly referable: no constructor made it
        return None


def as_segment_ids(call: Any) -> tuple[MaskMod | None, Any, Any]:
    """``(mask_mod, q_segment_ids, kv_segment_ids)`` of ``call`` (an ``AttentionCall``) for a kernel
    that takes segment ids: where the problem allows (``mask_mod_documents``) the document term
    as ``(B, T)`` and ``(B, S)`` int32 ids, traced or not, and the rest (None: nothing left);
    else the call's own."""
    import jax.numpy as jnp

    split = _split_document(call.mask_mod)
    if split is None or not call.problem.mask_mod_documents:
        return call.mask_mod, call.q_segment_ids, call.kv_segment_ids
    b, t, s = call.q.shape[0], call.q.shape[1], call.k.shape[1]
    q_ids, kv_ids = (jnp.broadcast_to(ids, n).astype(jnp.int32) for ids, n in ((split[1], (b, t)), (split[2], (b, s))))
    return split[0], q_ids, kv_ids


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi (attention with linear biases) as a score_mod: ``score + slopes[h] * (kv_idx - q_idx)``,
    raw positions, ``slopes`` a float ``(Hq,)`` array (traced and differentiated like any captured
    array). Any backend with score_mods runs it as a function; a kernel that cannot execute one
    (the Triton ``flash_attn2``) recognises it (``alibi_slopes``) and adds the term in registers."""
    values = _array("slopes", slopes, 1, True, "a float array (Hq,), one slope per query head")

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + values[h].astype(score.dtype) * (kv_idx - q_idx).astype(score.dtype)

    _alibis[score_mod] = values
    return score_mod


#: The slopes of the score_mods ``alibi`` makes.
_alibis: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def alibi_slopes(call: Any) -> Any:
    """The ``(Hq,)`` slopes of ``call``'s score_mod (an ``AttentionCall``) when it is ``alibi(...)``
    (``call.problem.score_mod_alibi``), else None."""
    return _alibis.get(call.score_mod) if call.problem.score_mod_alibi else None


def _combine(name: str, mods: tuple[MaskMod, ...], both: Callable[[Any, Any], Any]) -> MaskMod:
    if not mods:
        raise InvalidInputError(name, "needs at least one mask_mod")
    for mod in mods:
        if not callable(mod):
            raise InvalidTypeError(name, f"takes mask_mods (functions), got {type(mod).__name__}")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = both(out, mod(b, h, q_idx, kv_idx))
        return out

    return mask_mod


def and_(*mods: MaskMod) -> MaskMod:
    """A key is visible when every mask_mod allows it."""
    both = _combine("and_", mods, lambda x, y: x & y)
    parts = [_split_document(mod) for mod in mods]
    if sum(part is not None for part in parts) == 1:  # one document term: the rest beside it
        (inner, q_ids, kv_ids), = (part for part in parts if part is not None)
        rest = [mod for mod, part in zip(mods, parts, strict=True) if part is None]
        rest += [] if inner is None else [inner]
        _documents[both] = (None if not rest else rest[0] if len(rest) == 1 else and_(*rest), q_ids, kv_ids)
    return _on_diagonal(both) if all(map(sees_diagonal, mods)) else both


def or_(*mods: MaskMod) -> MaskMod:
    """A key is visible when any mask_mod allows it."""
    either = _combine("or_", mods, lambda x, y: x | y)
    return _on_diagonal(either) if any(map(sees_diagonal, mods)) else either


@functools.cache
def _register() -> None:
    """Make ``BlockMask`` a pytree (once, lazily: registering needs jax), so that it passes
    through ``jax.jit`` as an argument: ``kind`` is its leaf, the sizes are static."""
    import jax

    jax.tree_util.register_dataclass(BlockMask, ["kind", "bits"], ["shape", "block_q", "block_kv"])  # data, meta


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Which ``block_q x block_kv`` tiles of a mask_mod's ``(B, Hq, T, S)`` grid are empty, partial
    or full: ``kind`` int8 ``(B|1, Hq|1, ceil(T / block_q), ceil(S / block_kv))``, 0 empty (no
    visible pair: backends skip it), 1 partial, 2 full. Blocks are capped at T and S. Built by
    ``block_mask``; passed as ``block_mask=`` with its mask_mod to every call it describes.
    ``bits``: the visibility itself, packed (``mask_bits``), when built with ``bits=True``;
    a kernel that cannot run the mask_mod reads its partial tiles from them."""

    kind: Any
    shape: tuple[int, int, int, int]  # (B|1, Hq|1, T, S) it was built for
    block_q: int
    block_kv: int
    bits: Any = None

    def __post_init__(self) -> None:
        _register()

    def counts(self) -> tuple[int, int, int] | None:
        """``(empty, partial, full)`` tiles (over every batch and head), None when ``kind`` is traced."""
        import jax
        import numpy as np

        if isinstance(self.kind, jax.core.Tracer):
            return None

        kind = np.asarray(self.kind)
        return int((kind == EMPTY).sum()), int((kind == PARTIAL).sum()), int((kind == FULL).sum())

    def __repr__(self) -> str:
        counts = self.counts()
        where = "traced" if counts is None else "empty {}, partial {}, full {}".format(*counts)
        return f"BlockMask(shape={self.shape}, blocks={self.block_q}x{self.block_kv}, {where})"


def indices(B: int, Hq: int, T: int, S: int) -> tuple[Any, Any, Any, Any]:
    """A mask_mod's / score_mod's index arguments over the whole grid: int32 ``b (B,1,1,1)``,
    ``h (1,Hq,1,1)``, ``q_idx (1,1,T,1)``, ``kv_idx (1,1,1,S)`` (raw positions)."""
    import jax.numpy as jnp

    def along(axis: int, n: int) -> Any:
        return jnp.arange(n, dtype=jnp.int32).reshape((1,) * axis + (n,) + (1,) * (3 - axis))

    return along(0, B), along(1, Hq), along(2, T), along(3, S)


def _checked_sizes(mask_mod: MaskMod, **sizes: int) -> None:
    for name, value in sizes.items():
        _size(name, value, 1)
    if not callable(mask_mod):
        raise InvalidTypeError("mask_mod", f"must be a function (b, h, q_idx, kv_idx) -> bool, got "
                               f"{type(mask_mod).__name__}")


def _pack(seen: Any) -> Any:
    """``(..., 32 * W)`` booleans -> ``(..., W)`` int32 words, key ``32 w + j`` at bit j of word w."""
    import jax
    import jax.numpy as jnp

    shifts = jnp.arange(32, dtype=jnp.uint32).reshape((1,) * seen.ndim + (32,))  # rank promotion "raise"
    words = seen.reshape(*seen.shape[:-1], -1, 32).astype(jnp.uint32) << shifts
    return jax.lax.bitcast_convert_type(jnp.sum(words, axis=-1, dtype=jnp.uint32), jnp.int32)  # distinct bits: exact


#: Booleans of a mask_mod's result evaluated at once before they are classified and packed: few,
#: large steps on a GPU (16 at T = S = 16k for a mask_mod of neither b nor h, where one row of
#: 128-row tiles a step took 128: 6.5x the time on an H200), bounded memory everywhere.
_STEP_ELEMENTS = 1 << 24


def _rows_at_once(mask_mod: MaskMod, B: int, Hq: int, T: int, width: int, unit: int) -> int:
    """Query rows evaluated a step: a multiple of ``unit`` (a tile's rows), doubled while the step
    holds at most :data:`_STEP_ELEMENTS` booleans of the result (its leading dims are those the
    mask_mod varies along) and the rows fall short of ``T``."""
    import jax

    shape = jax.eval_shape(lambda: mask_mod(*indices(B, Hq, T, width))).shape
    rows, lead = unit, math.prod(shape[:-2]) if len(shape) == 4 else 1
    while rows < T and lead * 2 * rows * width <= _STEP_ELEMENTS:
        rows *= 2
    return min(rows, -(-T // unit) * unit)


def _evaluate(mask_mod: MaskMod, B: int, Hq: int, T: int, S: int, bq: int, bk: int, bits: bool) -> tuple[Any, Any]:
    """``(kind, bits)`` of ``block_mask`` and ``mask_bits`` from one pass over the rows, a step of
    whole ``bq``-row tiles at a time (:func:`_rows_at_once`); bits None unless asked for."""
    import jax
    import jax.numpy as jnp

    nq, nk, nw = -(-T // bq), -(-S // bk), -(-S // 32)
    width = max(nk * bk, 32 * nw if bits else 0)
    step = _rows_at_once(mask_mod, B, Hq, T, width, bq)
    per_step, steps = step // bq, -(-T // step)
    b, h, _, _ = indices(B, Hq, 1, 1)
    cols = jnp.arange(width, dtype=jnp.int32)
    kv_idx = jnp.minimum(cols, S - 1).reshape(1, 1, 1, -1)  # padding reads the last key, then is dropped
    col_ok = (cols < S).reshape(1, 1, 1, -1)

    def row(i: Any) -> Any:
        rows = i * step + jnp.arange(step, dtype=jnp.int32)
        q_idx = jnp.minimum(rows, T - 1).reshape(1, 1, -1, 1)
        seen = jnp.asarray(mask_mod(b, h, q_idx, kv_idx))
        lead = tuple(seen.shape[:2]) if seen.ndim == 4 else (1, 1)
        seen = jnp.broadcast_to(seen, (*lead, step, width))
        ok = (rows < T).reshape(1, 1, step, 1) & col_ok
        tiles = (*lead, per_step, bq, nk, bk)
        has = jnp.any((seen & ok)[..., : nk * bk].reshape(tiles), axis=(3, 5))
        full = jnp.all((seen | ~ok)[..., : nk * bk].reshape(tiles), axis=(3, 5))
        kind = jnp.where(full, FULL, jnp.where(has, PARTIAL, EMPTY)).astype(jnp.int8)
        return kind, (_pack((seen & col_ok)[..., : 32 * nw]) if bits else kind)

    kind, words = jax.lax.map(row, jnp.arange(steps, dtype=jnp.int32))  # (steps, B|1, Hq|1, ...)
    kind = jnp.transpose(kind, (1, 2, 0, 3, 4)).reshape(*kind.shape[1:3], steps * per_step, nk)[:, :, :nq]
    if not bits:
        return kind, None
    words = jnp.transpose(words, (1, 2, 0, 3, 4)).reshape(*words.shape[1:3], steps * step, nw)
    return kind, words[:, :, :T]


def block_mask(mask_mod: MaskMod, B: int, Hq: int, T: int, S: int, *, block_q: int = 128,
               block_kv: int = 128, bits: bool = False) -> BlockMask:
    """Evaluate ``mask_mod`` once over the ``(B, Hq, T, S)`` grid and classify its tiles.

    ``B`` or ``Hq`` may be 1 for a mask_mod that does not depend on them (the BlockMask then
    serves any batch or head count). Works under ``jax.jit`` too (the mask_mod may close over
    traced arrays); memory is bounded: about 2^24 booleans a step (at least one row of tiles).
    ``bits=True`` also keeps the packed visibility (``mask_bits``, in the same pass), for
    kernels that read partial tiles from it (the Triton ``flash_attn2``).
    """
    _checked_sizes(mask_mod, B=B, Hq=Hq, T=T, S=S, block_q=block_q, block_kv=block_kv)
    bq, bk = min(block_q, T), min(block_kv, S)
    kind, words = _evaluate(mask_mod, B, Hq, T, S, bq, bk, bool(bits))
    return BlockMask(kind=kind, shape=(int(kind.shape[0]), int(kind.shape[1]), T, S), block_q=bq, block_kv=bk,
                     bits=words)


def mask_bits(mask_mod: MaskMod, B: int, Hq: int, T: int, S: int, *, block_q: int | None = None) -> Any:
    """The mask_mod's visibility packed 32 keys to a word: int32 ``(B|1, Hq|1, T, ceil(S / 32))``,
    bit ``j`` of word ``w`` in row ``i`` set when query ``i`` sees key ``32 w + j`` (keys past S
    are 0). 1/8 of a boolean mask; a dimension is 1 when the mask_mod's result does not vary
    along it. For kernels that cannot execute a traced function: they read these words for
    partial tiles. Evaluated about 2^24 booleans a step (at least ``block_q`` rows), under
    ``jax.jit`` too."""
    _checked_sizes(mask_mod, B=B, Hq=Hq, T=T, S=S, block_q=1 if block_q is None else block_q)
    return _evaluate(mask_mod, B, Hq, T, S, min(block_q or 1, T), S, True)[1]


def from_bits(bits: Any, S: int, *, block_q: int = 128, block_kv: int = 128) -> BlockMask:
    """The ``BlockMask`` of any tiling, classified from ``mask_bits`` words (the mask_mod is not
    evaluated again; ``bits`` kept in it): a kernel whose tiles differ from a given block mask's
    classifies its own. Reads the words once: ``(B|1, Hq|1, T, ceil(S / 32))`` int32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    lead, T = tuple(int(n) for n in bits.shape[:2]), int(bits.shape[2])
    _size("S", S, 1)
    bq, bk = min(_size("block_q", block_q, 1), T), min(_size("block_kv", block_kv, 1), S)
    if tuple(bits.shape[2:]) != (T, -(-S // 32)):
        raise InvalidInputError("bits", f"must be (B|1, Hq|1, T, ceil(S / 32)) words for S={S}, got {bits.shape}")
    nq, nk, unit = -(-T // bq), -(-S // bk), math.gcd(bk, 32)  # a tile spans whole units of a word
    words = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    shifts = jnp.arange(0, 32, unit, dtype=jnp.uint32).reshape((1,) * words.ndim + (-1,))  # words' rank + 1
    units = ((words[..., None] >> shifts) & np.uint32((1 << unit) - 1)).reshape(*lead, T, -1)
    width = nk * bk // unit
    units = jnp.pad(units[..., :width], ((0, 0), (0, 0), (0, nq * bq - T), (0, max(0, width - units.shape[-1]))))
    count = np.clip(S - unit * np.arange(width), 0, unit)
    expect = jnp.asarray(((1 << count) - 1).astype(np.uint32)).reshape(1, 1, 1, -1)  # a unit's keys below S, all seen
    pad = (jnp.arange(nq * bq) >= T).reshape(1, 1, -1, 1)
    tiles = (*lead, nq, bq, nk, bk // unit)
    has = jnp.any((units != 0).reshape(tiles), axis=(3, 5))
    full = jnp.all(((units == expect) | pad).reshape(tiles), axis=(3, 5))
    kind = jnp.where(full, FULL, jnp.where(has, PARTIAL, EMPTY)).astype(jnp.int8)
    return BlockMask(kind=kind, shape=(*lead, T, S), block_q=bq, block_kv=bk, bits=bits)  # type: ignore[arg-type]


def call_bits(mask_mod: MaskMod | None, block_mask: BlockMask | None, B: int, Hq: int, T: int, S: int, *,
              window: tuple[int | None, int | None] = (None, None), rules: tuple[MaskMod, ...] = ()) -> Any:
    """The packed visibility (``mask_bits``) a kernel applies for a call: ``mask_mod`` ANDed with
    the call's other rules, so the kernel applies one. ``window``: the sides ``(left, right)`` of
    a bottom-right band (None: unbounded; a right side of 0 is ``causal=True``); ``rules``: more
    mask_mods (segment ids, a dense mask). A ``block_mask`` built with ``bits=True`` gives the
    mask_mod's bits (the mask_mod is not evaluated again; the rules are)."""
    import jax.numpy as jnp

    diag, (left, right) = S - T, window
    rules += () if left is None else (lambda b, h, qi, kv: kv >= qi + (diag - left),)
    rules += () if right is None else (lambda b, h, qi, kv: kv <= qi + (diag + right),)
    given = None if block_mask is None else block_mask.bits
    if given is not None and not rules:
        return jnp.asarray(given)
    words = mask_bits(and_(*rules) if given is not None else and_(mask_mod, *rules), B, Hq, T, S)  # type: ignore[arg-type]
    return jnp.asarray(words if given is None else given & words)


def tile_lists(bits: Any, S: int, *, block_q: int, block_kv: int, by_keys: bool = False) -> Any:
    """The tiles a kernel visits under ``bits`` (``mask_bits``) at its tile sizes, int32
    ``(B|1, Hq|1, n, 2 + m)``: per tile of ``block_q`` query rows (``by_keys``: of ``block_kv``
    keys) the number of partial and of full tiles of the other side, then the indices of all
    of them: partial ones first, then full ones, each run ascending, then the empty ones, which a
    kernel reading the counts never loads. A tile that runs past T or S is partial at most, as a
    kernel reads a full one unmasked."""
    import jax.numpy as jnp

    T = int(bits.shape[2])
    kind = from_bits(bits, S, block_q=block_q, block_kv=block_kv).kind
    nq, nk = int(kind.shape[2]), int(kind.shape[3])
    # At kind's rank 4: jax_numpy_rank_promotion="raise" refuses lower-rank operands.
    tail = (jnp.arange(nq) == nq - 1).reshape(1, 1, nq, 1) & (T % block_q != 0)
    tail |= (jnp.arange(nk) == nk - 1).reshape(1, 1, 1, nk) & (S % block_kv != 0)
    kind = jnp.where(tail & (kind == FULL), PARTIAL, kind)
    if by_keys:
        kind = jnp.swapaxes(kind, 2, 3)
    rank = jnp.where(kind == PARTIAL, 0, jnp.where(kind == FULL, 1, 2))
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack([jnp.sum(kind == PARTIAL, -1), jnp.sum(kind == FULL, -1)], -1).astype(jnp.int32)
    return jnp.concatenate([counts, order], -1)


def seen_words(bits: Any, heads_kv: int) -> Any:
    """The keys some query of each sequence and KV head sees under ``bits`` (``mask_bits``): the
    words ORed over the rows and the query heads of each GQA group, int32 ``(B|1, Hkv|1, W)``.
    The other keys are unread (they may hold NaN): a kernel that loads whole blocks zeroes them."""
    import jax
    import numpy as np

    lead0, lead1, t, w = (int(n) for n in bits.shape)
    grouped = bits.reshape(lead0, heads_kv if lead1 > 1 else 1, -1, t, w)
    return jax.lax.reduce(grouped, np.int32(0), jax.lax.bitwise_or, (2, 3))


# -- checks (the validation layer calls these once per call signature) --------------------------

#: Functions already checked, per (argument, function, shapes), with whether they are static: a
#: repeated call skips the trace.
_checked: dict[tuple[Any, ...], bool] = {}


def _check_mod(name: str, fn: Any, b: int, hq: int, t: int, s: int, paged: bool = False) -> bool:
    """Trace ``fn`` once (``jax.make_jaxpr``) at the call's index shapes: it must take the
    arguments and return booleans broadcastable to ``(B, Hq, T, S)`` (mask_mod) or a floating
    score of the logits' shape ``(B, Hq, T, S)`` (score_mod). Returns whether it is *static*:
    it closes over no traced array and its result does not vary with ``b`` (a kernel that
    takes masks as host data, such as splash's, can evaluate it when it is built). ``paged``:
    a paged call's mask_mod, called per query row with ``(1,1,1)``, ``(1,Hq,1)``, ``(1,1,1)``,
    ``(1,1,S)`` (``s``: the table's capacity)."""
    args = "(b, h, q_idx, kv_idx)" if name == "mask_mod" else "(score, b, h, q_idx, kv_idx)"
    if not callable(fn):
        raise InvalidTypeError(name, f"must be a function {args}, got {type(fn).__name__}",
                               "see jaxattn.masks for constructors")
    key: tuple[Any, ...] = (name, fn, b, hq, t, s, paged)
    try:
        if key in _checked:
            return _checked[key]
    except TypeError:  # an unhashable callable: checked every time
        key = ()
    import jax
    import jax.numpy as jnp

    shapes: list[tuple[int, ...]] = [(b, 1, 1, 1), (1, hq, 1, 1), (1, 1, t, 1), (1, 1, 1, s)]
    grid: tuple[int, ...] = (b, hq, t, s)
    if paged:
        shapes, grid = [(1, 1, 1), (1, hq, 1), (1, 1, 1), (1, 1, s)], (1, hq, s)
    example = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes]
    if name == "score_mod":
        example.insert(0, jax.ShapeDtypeStruct((b, hq, t, s), jnp.float32))
    given = ", ".join(f"{a.dtype} {a.shape}" for a in example)
    hint = f"{name} is called as {name}{args} with arrays {given}"
    try:
        jaxpr, out = jax.make_jaxpr(fn, return_shape=True)(*example)
    except Exception as err:  # the user's function failed: say which argument it was
        raise InvalidInputError(name, f"failed when traced: {type(err).__name__}: {err}", hint) from None
    shape, dtype = getattr(out, "shape", None), str(getattr(out, "dtype", ""))
    if name == "mask_mod":
        try:
            fits = shape is not None and len(shape) <= len(grid) and jnp.broadcast_shapes(shape, grid) == grid
        except ValueError:
            fits = False
        if dtype != "bool" or not fits:
            raise InvalidInputError(name, f"must return booleans broadcastable to {grid}, "
                                    f"got {dtype or type(out).__name__} {shape}", hint)
    elif shape != (b, hq, t, s) or not jnp.issubdtype(dtype or "object", jnp.floating):
        raise InvalidInputError(name, f"must return a floating score of the logits' shape (B, Hq, T, S) = "
                                f"{(b, hq, t, s)}, got {dtype or type(out).__name__} {shape}", hint)
    static = not any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts) and (b == 1 or (shape or (1,))[0] == 1
                                                                                 or len(shape or ()) < 4)
    if key:
        if len(_checked) >= 256:
            _checked.clear()
        _checked[key] = static
    return static


def check_paged_mask_mod(mask_mod: Any, hq: int, capacity: int) -> None:
    """A paged call's mask_mod (``mask_mod(seq, h, q_pos, kv_pos) -> bool``, positions within the
    sequence), checked once per function and shapes; ``InvalidInputError`` naming it otherwise."""
    _check_mod("mask_mod", mask_mod, 1, hq, 1, capacity, paged=True)


def check_mods(problem: Any, mask_mod: Any, score_mod: Any, block: Any) -> Any:
    """``problem`` (an ``AttentionProblem``) recording the call's mask_mod, score_mod and block
    mask, after checking them (``InvalidInputError`` naming the argument)."""
    b, hq, t, s = problem.batch, problem.heads_q, problem.seq_q, problem.seq_k
    static = mask_mod is not None and _check_mod("mask_mod", mask_mod, b, hq, t, s)
    alibi_term = False
    if score_mod is not None:
        _check_mod("score_mod", score_mod, b, hq, t, s)
        try:
            slopes = _alibis.get(score_mod)
        except TypeError:  # not weakly referable: no constructor made it
            slopes = None
        if slopes is not None and tuple(slopes.shape) != (hq,):
            # jnp indexing clamps: slopes for other heads would be read silently.
            raise InvalidInputError("score_mod", f"masks.alibi's slopes have shape {tuple(slopes.shape)}, the "
                                    f"call has Hq = {hq} query heads", f"pass one slope per query head, ({hq},)")
        alibi_term = slopes is not None
    sparsity = None
    if block is not None:
        if not isinstance(block, BlockMask):
            raise InvalidTypeError("block_mask", f"must be a jaxattn.masks.BlockMask, got {type(block).__name__}",
                                   "build it with jaxattn.masks.block_mask(mask_mod, B, Hq, T, S)")
        if mask_mod is None:
            raise InvalidInputError("block_mask", "describes a mask_mod, but the call has none",
                                    "pass the mask_mod it was built from as mask_mod=")
        bb, bh, bt, bs = block.shape
        if bb not in (1, b) or bh not in (1, hq) or (bt, bs) != (t, s):
            raise InvalidInputError("block_mask", f"was built for (B, Hq, T, S) = {block.shape}, the call is "
                                    f"{(b, hq, t, s)} (B and Hq may be 1)",
                                    "build one per shape with jaxattn.masks.block_mask")
        counts = block.counts()
        sparsity = None if counts is None else (block.block_q, block.block_kv, *counts)
    split = _split_document(mask_mod)
    documents = split is not None and not problem.segment_ids and all(
        ids.ndim == 2 and ids.shape[0] in (1, b) and ids.shape[1] == n for ids, n in ((split[1], t), (split[2], s)))
    if documents and split is not None and split[0] is not None:
        documents = _check_mod("mask_mod", split[0], b, hq, t, s)  # the rest must be static
    return dataclasses.replace(problem, mask_mod=mask_mod is not None, mask_mod_static=static,
                               mask_mod_documents=documents, score_mod=score_mod is not None,
                               score_mod_alibi=alibi_term, block_sparsity=sparsity)


def with_sparsity(problem: Any, mask_mod: Any, block_q: int | None = None, block_kv: int | None = None) -> Any:
    """``problem`` with the tiles of its mask_mod (``block_sparsity``), built here when the call
    gave no concrete block mask (``explain``); unchanged when the mask_mod's captures are traced."""
    if mask_mod is None or problem.block_sparsity is not None:
        return problem
    bm = block_mask(mask_mod, problem.batch, problem.heads_q, problem.seq_q, problem.seq_k,
                    block_q=block_q or 128, block_kv=block_kv or 128)
    counts = bm.counts()
    if counts is None:
        return problem
    return dataclasses.replace(problem, block_sparsity=(bm.block_q, bm.block_kv, *counts))
