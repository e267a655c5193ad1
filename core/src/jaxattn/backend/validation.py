"""Checks of a call's arguments against the contract, and their normalisation.

Every check raises ``InvalidInputError`` naming the argument, the constraint and a way out.
The checks read only ``.shape`` and ``.dtype``, so they work on ``jax.ShapeDtypeStruct`` too.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

from ..errors import InvalidInputError, InvalidTypeError, checked_keywords
from ._dtypes import dtype_name
from .call import AttentionCall
from .metadata import DEFAULT_METADATA, AttentionMetadata, as_metadata, is_bool, positive, probability
from .problem import AttentionProblem
from .quantize import QUANTIZED_KV_DTYPES, check_kv_scales

__all__ = ["as_int", "check_ints", "check_sinks", "is_concrete", "positive", "resolve_call", "shape_of", "window_pair"]

_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def shape_of(x: Any, name: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise InvalidTypeError(name, f"expected an array, got {type(x).__name__}", "pass a jax.Array or a NumPy array")
    return tuple(int(d) for d in shape)


def check_ints(x: Any, name: str, want: tuple[int, ...], described: str, hint: str = "use jnp.int32") -> None:
    """``x`` an integer array of shape ``want`` (``described``: that shape as the error says it)."""
    shape = shape_of(x, name)
    if shape != want:
        raise InvalidInputError(name, f"must have shape {described}, got {shape}")
    if not dtype_name(x.dtype).startswith(("int", "uint")):
        raise InvalidInputError(name, f"must be integers, got {dtype_name(x.dtype)}", hint)


def _check_broadcast(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    labels = ("B", "Hq", "T", "S")
    if len(shape) > 4:
        raise InvalidInputError(name, f"has rank {len(shape)} {shape}; at most 4 dims broadcastable to (B, Hq, T, S)")
    padded = (1,) * (4 - len(shape)) + shape
    pairs = zip(labels, padded, target, strict=True)
    bad = [f"{lab}: {have} vs {want}" for lab, have, want in pairs if have not in (1, want)]
    if bad:
        raise InvalidInputError(
            name,
            f"shape {shape} does not broadcast to (B, Hq, T, S) = {target} ({'; '.join(bad)})",
            "each dim must be 1 or the full size; for per-KV-head masks repeat them over the query group",
        )


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, x, layout in (("q", q, "(B, T, Hq, D)"), ("k", k, "(B, S, Hkv, D)"), ("v", v, "(B, S, Hkv, Dv)")):
        shape = shape_of(x, name)
        if len(shape) != 4:
            raise InvalidInputError(
                name, f"must have rank 4 {layout}, got shape {shape}", "jaxattn uses the BTHD layout; add a batch axis"
            )
        narrow = name != "q" and dtype_name(x.dtype) in QUANTIZED_KV_DTYPES  # a quantized cache
        if dtype_name(x.dtype) not in _FLOAT_DTYPES and not narrow:
            raise InvalidInputError(name, f"dtype {dtype_name(x.dtype)} is not a floating dtype", "cast to bfloat16")
    (b, t, hq, d), (bk, s, hkv, dk), (bv, sv, hv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise InvalidInputError("k/v", f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if s != sv:
        raise InvalidInputError("v", f"sequence length {sv} differs from k's {s}")
    if hkv != hv:
        raise InvalidInputError("v", f"has {hv} heads but k has {hkv}")
    if d != dk:
        raise InvalidInputError("k", f"head dim {dk} differs from q's {d}", "q and k must share the head dim D")
    if d == 0 or v.shape[3] == 0 or hq == 0:
        raise InvalidInputError("q/k/v", f"empty dims (Hq={hq}, D={d}, Dv={v.shape[3]}): attention needs at least one "
                                "head and one feature", "drop the call, or give every head dim and Hq a size >= 1")
    if hkv == 0 or hq % hkv:
        raise InvalidInputError(
            "k", f"Hq={hq} query heads is not a multiple of Hkv={hkv} key/value heads",
            "GQA/MQA needs Hq % Hkv == 0; repeat K/V heads or change the head counts",
        )
    if t == 0 or s == 0:
        raise InvalidInputError("q/k", f"empty sequence (T={t}, S={s})")
    dq, dkk, dv = (dtype_name(x.dtype) for x in (q, k, v))
    if not dq == dkk == dv and not {dkk, dv} & QUANTIZED_KV_DTYPES:  # quantized: check_kv_scales
        raise InvalidInputError("k/v", f"dtypes differ: q {dq}, k {dkk}, v {dv}", "cast q, k and v to one dtype")


def as_int(x: Any) -> int | None:
    """``x`` as an int if it is an integer (Python or NumPy, never a bool), else None."""
    if is_bool(x):
        return None
    try:
        return operator.index(x)
    except TypeError:  # floats, strings, traced values
        return None


def window_pair(sliding_window: Any, longest: int | None = None) -> tuple[int, int] | None:
    """``sliding_window`` as ``(left, right)`` (an int w means ``(w, w)``).

    ``longest``: the longer of T and S. A side at least that wide hides nothing (no query is
    that far from a key), so it is clamped to it: the same attention, with sizes that every
    kernel can hold in int32 (``10**12`` means unbounded).
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, tuple | list) and len(sliding_window) == 2:
        raw = (sliding_window[0], sliding_window[1])
    elif as_int(sliding_window) is not None:
        raw = (sliding_window, sliding_window)
    else:
        raise InvalidTypeError("sliding_window", f"expected an int or a (left, right) pair, got {sliding_window!r}",
                                "None means no window")
    left, right = (as_int(x) for x in raw)
    hint = "(left, 0) with causal=True is a causal window of left keys before each query"
    if left is None or right is None:
        raise InvalidTypeError("sliding_window", f"sizes must be ints, got {raw!r}", hint)
    if left < 0 or right < 0:
        raise InvalidInputError("sliding_window", f"sizes must be >= 0, got {raw!r}", hint)
    if longest is not None:
        left, right = min(left, longest), min(right, longest)
    return (left, right)


def check_sinks(softmax_aux: Any, hq: int) -> None:
    """``softmax_aux`` (None, or one floating sink logit per query head)."""
    if softmax_aux is None:
        return
    shape = shape_of(softmax_aux, "softmax_aux")
    if shape != (hq,):
        raise InvalidInputError("softmax_aux", f"must have shape (Hq,) = ({hq},), one sink logit per query head, "
                                f"got {shape}")
    if dtype_name(softmax_aux.dtype) not in _FLOAT_DTYPES:
        raise InvalidInputError("softmax_aux", f"must be floating (logits), got {dtype_name(softmax_aux.dtype)}",
                                "cast it to float32")


def _check_dropout_rng(rng: Any) -> None:
    """A PRNG key: a typed key of shape () (``jax.random.key``) or a raw uint32 key (``jax.random.PRNGKey``)."""
    dtype = dtype_name(getattr(rng, "dtype", "object"))
    shape = getattr(rng, "shape", None)
    typed = dtype.startswith("key") and shape == ()
    raw = dtype == "uint32" and shape is not None and len(shape) == 1
    if not (typed or raw):
        got = f"{dtype} array of shape {tuple(shape)}" if shape is not None else f"{type(rng).__name__} {rng!r}"
        raise InvalidTypeError("dropout_rng", f"must be one PRNG key, got {got}", "pass jax.random.key(seed)")


def _segment_ids(q_ids: Any, kv_ids: Any, b: int, t: int, s: int) -> tuple[Any, Any]:
    if q_ids is None and kv_ids is None:
        return None, None
    if q_ids is None or kv_ids is None:
        if t != s:
            missing = "q_segment_ids" if q_ids is None else "kv_segment_ids"
            raise InvalidInputError(missing, "is required when the other segment ids are given and T != S")
        q_ids = kv_ids if q_ids is None else q_ids
        kv_ids = q_ids if kv_ids is None else kv_ids
    for name, ids, want in (("q_segment_ids", q_ids, (b, t)), ("kv_segment_ids", kv_ids, (b, s))):
        check_ints(ids, name, want, f"{want} (B, {'T' if name[0] == 'q' else 'S'})", "use jnp.int32 ids")
    return q_ids, kv_ids


def is_concrete(x: Any) -> bool:
    """Whether ``x`` holds values (not a tracer or a ``ShapeDtypeStruct``): checks of values run
    only then; under ``jax.jit`` they cannot, and the contract says what happens instead."""
    if not hasattr(x, "shape") or type(x).__name__ == "ShapeDtypeStruct":
        return False
    try:
        import jax
    except ImportError:  # a NumPy array on a host without jax
        return True
    return not isinstance(x, jax.core.Tracer)


def _check_length_values(name: str, lengths: Any, n: int, bound: str, hint: str) -> None:
    """Concrete lengths within 0..n (``bound``: n as the error says it; traced ones cannot be
    checked: the contract says what happens to them)."""
    import numpy as np

    values = np.asarray(lengths)
    bad = np.flatnonzero((values < 0) | (values > n))
    if bad.size:
        i = int(bad[0])
        raise InvalidInputError(name, f"{name}[{i}] = {int(values[i])} is outside 0..{bound}", hint)


#: Where ``causal`` and ``sliding_window`` put the queries when T != S.
ALIGNMENTS = ("bottom_right", "top_left")


def _check_padding(name: str, lengths: Any, b: int, n: int, dim: str) -> None:
    check_ints(lengths, name, (b,), f"(B,) = ({b},), one length per sequence", "use jnp.int32 lengths")
    if is_concrete(lengths):
        _check_length_values(name, lengths, n, f"{dim} = 0..{n}",
                             f"a length counts the real {'queries' if dim == 'T' else 'keys'} at the front")


def top_left_rules(t: int, s: int, causal: bool, window: tuple[int, int] | None
                   ) -> tuple[bool, tuple[int, int] | None, tuple[int, int | None, int | None] | None]:
    """``causal`` and ``window`` aligned top-left (query i at key position i, jax.nn's rule), as
    the bottom-right rules every backend runs: ``(causal, window, band)``.

    Top-left keeps ``i + lo <= j <= i + hi`` (``lo = -left``; ``hi = right``, at most 0 when
    causal); in bottom-right positions ``i' = i + S - T`` that is the window
    ``(left + S - T, hi - (S - T))``. When a bounded side comes out negative no window says it:
    then ``band`` is ``(1, lo, hi)`` (None = unbounded), spelled out as a ``(1, 1, T, S)`` mask.
    """
    if t == s or (not causal and window is None):
        return causal, window, None
    d = s - t
    lo = None if window is None else -window[0]
    hi = None if window is None else window[1]
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    left = None if lo is None else d - lo
    right = None if hi is None else hi - d
    if (left is not None and left < 0) or (right is not None and right < 0):
        return False, None, (1, lo, hi)
    longest = max(t, s)
    if right == 0:  # causal (bottom-right), with the window's left side if any
        return True, None if left is None else (min(left, longest), 0), None
    sides = (longest if left is None else min(left, longest), longest if right is None else min(right, longest))
    return False, sides, None


class _Shape:
    """Shape and dtype only: what the problem reads of a mask or segment ids lowered from options."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape, self.dtype = shape, dtype


#: Checks already passed, per call signature (shapes, dtypes, static options, metadata): a
#: repeated signature skips them. Values are never part of it (arrays may be traced).
_checked: dict[tuple[Any, ...], _Checked] = {}
MAX_CHECKED = 4096


@dataclasses.dataclass(frozen=True)
class _Checked:
    """What the checks of one call signature found: the problem and the normalised options."""

    problem: AttentionProblem
    causal: bool
    sliding_window: tuple[int, int] | None
    softmax_scale: float
    logits_soft_cap: float | None
    dropout_prob: float
    #: Top-left rules no window expresses: ``(1, lo, hi)``, made a mask (``top_left_rules``).
    band: tuple[int, int | None, int | None] | None = None
    #: Padding lengths become "segments" (segment ids) or, next to the caller's own ids, "mask".
    padding: str | None = None


def _check(q: Any, k: Any, v: Any, mask: Any, bias: Any, init_bias: Any, causal: Any, sliding_window: Any,
           q_segment_ids: Any, kv_segment_ids: Any, softmax_scale: Any, logits_soft_cap: Any, softmax_aux: Any,
           dropout_prob: Any, dropout_rng: Any, kv_lengths: Any, k_scale: Any, v_scale: Any,
           md: AttentionMetadata, q_padding_lengths: Any = None, kv_padding_lengths: Any = None,
           alignment: Any = "bottom_right", return_lse: Any = False) -> tuple[_Checked, Any]:
    """Every check of a call that reads no values: the problem it describes, and the bias
    (``init_bias()`` when only that is given)."""
    _check_qkv(q, k, v)
    # k and v share q's dtype, or are quantized alike with float32 scales (jaxattn.backend.quantize).
    kv_dtype = check_kv_scales(q, {"k": k, "v": v}, k_scale, v_scale, tuple(k.shape[:3]), "(B, S, Hkv)")
    b, t, hq, d = q.shape
    s = k.shape[1]
    if mask is not None:
        _check_broadcast("mask", shape_of(mask, "mask"), (b, hq, t, s))
        if dtype_name(mask.dtype) != "bool":
            raise InvalidInputError(
                "mask", f"must be boolean (True = attend), got {dtype_name(mask.dtype)}",
                "use mask.astype(bool), or pass an additive float mask as bias=",
            )
    if bias is None and init_bias is not None:
        if not callable(init_bias):
            raise InvalidInputError("init_bias", "must be a zero-argument callable returning the bias")
        bias = init_bias()
    if bias is not None:
        _check_broadcast("bias", shape_of(bias, "bias"), (b, hq, t, s))
        if dtype_name(bias.dtype) not in _FLOAT_DTYPES:
            raise InvalidInputError("bias", f"must be floating (additive), got {dtype_name(bias.dtype)}",
                                    "a boolean mask goes in mask=")
    if not is_bool(causal):
        raise InvalidTypeError("causal", f"must be a bool, got {type(causal).__name__} {causal!r}",
                                "pass causal=True or causal=False")
    q_ids, kv_ids = _segment_ids(q_segment_ids, kv_segment_ids, b, t, s)
    check_sinks(softmax_aux, hq)
    if kv_lengths is not None:
        check_ints(kv_lengths, "kv_lengths", (b,), f"(B,) = ({b},), one key count per sequence",
                   "use jnp.int32 lengths")
    p = md.dropout_prob if dropout_prob is None else probability("dropout_prob", dropout_prob)
    if dropout_rng is not None:
        _check_dropout_rng(dropout_rng)
    if p > 0 and dropout_rng is None:
        raise InvalidInputError("dropout_rng", f"is required when dropout_prob > 0 (got {p})",
                                "pass dropout_rng=jax.random.key(seed), or dropout_prob=0.0")
    scale = positive("softmax_scale", softmax_scale if softmax_scale is not None else md.softmax_scale)
    cap = positive("logits_soft_cap", logits_soft_cap if logits_soft_cap is not None else md.logits_soft_cap)
    window = window_pair(sliding_window, max(t, s))
    if not is_bool(return_lse):
        raise InvalidTypeError("return_lse", f"must be a bool, got {type(return_lse).__name__} {return_lse!r}")
    # Padding and top-left alignment are lowered here, once, into the rules every backend runs
    # (segment ids, a mask, a bottom-right window): no backend has to know them.
    if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
        raise InvalidInputError("alignment", f"must be one of {', '.join(map(repr, ALIGNMENTS))}, got {alignment!r}",
                                "'top_left' puts query i at key position i (jax.nn's rule)")
    band = None
    causal = bool(causal)
    if alignment == "top_left":
        if kv_lengths is not None:
            raise InvalidInputError("kv_lengths", "is a KV cache whose last T tokens are the queries (aligned "
                                    "bottom-right); it does not combine with alignment='top_left'",
                                    "keys past a length that are padding go in kv_padding_lengths")
        causal, window, band = top_left_rules(t, s, causal, window)
    padding = None
    for name, lengths, n, dim in (("q_padding_lengths", q_padding_lengths, t, "T"),
                                  ("kv_padding_lengths", kv_padding_lengths, s, "S")):
        if lengths is not None:
            _check_padding(name, lengths, b, n, dim)
            padding = "mask" if q_ids is not None else "segments"
    shape_mask: Any = mask
    if band is not None or padding == "mask":
        shape = (1, 1, t, s) if padding is None else (b, 1, t, s)
        if mask is not None:  # the caller's mask and these rules, together
            have = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
            shape = tuple(max(x, y) for x, y in zip(have, shape, strict=True))
        shape_mask = _Shape(shape, "bool")
    if padding == "segments":
        q_ids, kv_ids = _Shape((b, t), "int32"), _Shape((b, s), "int32")
    problem = AttentionProblem.from_inputs(
        q, k, v, mask=shape_mask, bias=bias, causal=causal, sliding_window=window, q_segment_ids=q_ids,
        kv_segment_ids=kv_ids, logits_soft_cap=cap, softmax_aux=softmax_aux, dropout_prob=p,
        dtype=md.runtime_dtype or q.dtype, kv_lengths=kv_lengths, needs_lse=return_lse,
    )
    assert problem.kv_dtype == kv_dtype  # one rule for both: jaxattn.backend.quantize
    checked = _Checked(problem=problem, causal=causal, sliding_window=window,
                       softmax_scale=scale if scale is not None else float(d) ** -0.5, logits_soft_cap=cap,
                       dropout_prob=p, band=band, padding=padding)
    return checked, bias


def _lowered(checked: _Checked, mask: Any, q_ids: Any, kv_ids: Any, q_padding_lengths: Any,
             kv_padding_lengths: Any, b: int, t: int, s: int) -> tuple[Any, Any, Any]:
    """The mask and segment ids that carry the call's padding and top-left band (``_check``)."""
    import jax.numpy as jnp

    i = jnp.arange(t, dtype=jnp.int32)
    j = jnp.arange(s, dtype=jnp.int32)
    q_real = None if q_padding_lengths is None else i[None, :] < jnp.asarray(q_padding_lengths)[:, None]  # (B, T)
    kv_real = None if kv_padding_lengths is None else j[None, :] < jnp.asarray(kv_padding_lengths)[:, None]
    if checked.padding == "segments":
        # Real tokens are segment 0, padded queries 1 and padded keys 2: a padded query sees no
        # key, a padded key no query, and a real query every real key.
        q_ids = jnp.zeros((b, t), jnp.int32) if q_real is None else jnp.where(q_real, 0, 1).astype(jnp.int32)
        kv_ids = jnp.zeros((b, s), jnp.int32) if kv_real is None else jnp.where(kv_real, 0, 2).astype(jnp.int32)
    rules = []
    if checked.band is not None:
        _, lo, hi = checked.band
        band = jnp.ones((t, s), bool)
        if lo is not None:
            band = band & (j[None, :] >= i[:, None] + lo)
        if hi is not None:
            band = band & (j[None, :] <= i[:, None] + hi)
        rules.append(band[None, None])
    if checked.padding == "mask":
        if q_real is not None:
            rules.append(q_real[:, None, :, None])
        if kv_real is not None:
            rules.append(kv_real[:, None, None, :])
    for rule in rules:
        mask = rule if mask is None else jnp.logical_and(mask, rule)
    if rules:
        mask = jnp.broadcast_to(mask, checked.problem.mask_shape)
    return mask, q_ids, kv_ids


def _signature(md: AttentionMetadata, arrays: tuple[Any, ...], options: tuple[Any, ...],
               sliding_window: Any) -> tuple[Any, ...]:
    """The signature of a dense call, everything its checks read: the key of their memo.

    Each array's shape and dtype (None where absent), each option with its type (``True == 1``,
    but a bool is no int), the window as written, and the metadata unless it is the default.
    Raises AttributeError where an argument is no array, and hashing the key TypeError where an option
    is unhashable: the call is then checked without its memo, and the checks say what is wrong."""
    return (tuple([None if x is None else (x.shape, x.dtype) for x in arrays]),
            tuple([(x.__class__, x) for x in options]), None if sliding_window is None else repr(sliding_window),
            None if md is DEFAULT_METADATA else md)


def _prepared(md: AttentionMetadata, checked: _Checked, arrays: tuple[Any, ...], q_padding_lengths: Any,
              kv_padding_lengths: Any) -> tuple[Any, ...]:
    """``arrays`` (q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux, dropout_rng,
    kv_lengths, k_scale, v_scale), in that order, as a forward receives them (``resolve_call``'s
    ``prepare``), with the call's padding and top-left band lowered into its mask or segment ids."""
    import jax.numpy as jnp
    import numpy as np

    q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux, dropout_rng, kv_lengths = [
        jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in arrays[:10]
    ]
    k_scale, v_scale = arrays[10:]
    if md.runtime_dtype is not None:
        dtype = jnp.dtype(md.runtime_dtype)
        q = q.astype(dtype)
        if checked.problem.kv_dtype is None:
            k, v = k.astype(dtype), v.astype(dtype)
    if mask is not None and mask.ndim < 4:
        mask = jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
    if checked.band is not None or checked.padding is not None:
        mask, q_segment_ids, kv_segment_ids = _lowered(checked, mask, q_segment_ids, kv_segment_ids,
                                                       q_padding_lengths, kv_padding_lengths, q.shape[0],
                                                       q.shape[1], k.shape[1])
    if bias is not None and bias.ndim < 4:
        bias = jnp.reshape(bias, (1,) * (4 - bias.ndim) + tuple(bias.shape))
    if checked.problem.kv_dtype is not None:
        from .quantize import scale_rank3

        k_scale, v_scale = scale_rank3(k_scale), scale_rank3(v_scale)
    return q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux, dropout_rng, kv_lengths, k_scale, v_scale


@checked_keywords("an attention call")
def resolve_call(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    init_bias: Callable[[], Any] | None = None,
    causal: bool = False,
    sliding_window: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    dropout_prob: float | None = None,
    dropout_rng: Any = None,
    kv_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    block_mask: Any = None,
    q_padding_lengths: Any = None,
    kv_padding_lengths: Any = None,
    alignment: str = "bottom_right",
    return_lse: bool = False,
    metadata: AttentionMetadata | None = None,
    prepare: bool = False,
) -> AttentionCall:
    """Validate a call and fill its defaults from ``metadata`` (call arguments win): the one
    ``AttentionCall`` the call runs as.

    Arrays may be ``jax.ShapeDtypeStruct``s (``explain``, ``supports``) unless ``prepare`` is set,
    which also normalises them as a forward receives them: NumPy arrays as JAX arrays, q, k and v
    in ``metadata.runtime_dtype`` (a quantized cache as it is), mask and bias at rank 4, the scales
    float32 at rank 3.
    """
    md = DEFAULT_METADATA if metadata is None else as_metadata(metadata)
    # init_bias is called in the checks' order (after q, k, v and mask): such calls are not memoised.
    lazy = bias is None and init_bias is not None
    try:
        key: tuple[Any, ...] | None = _signature(
            md, (q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux, dropout_rng, kv_lengths, k_scale,
                 v_scale, q_padding_lengths, kv_padding_lengths),
            (causal, softmax_scale, logits_soft_cap, dropout_prob, alignment, return_lse), sliding_window)
        checked = None if lazy else _checked.get(key)  # type: ignore[arg-type]
    except (AttributeError, TypeError):  # not arrays, or unhashable options: the checks say what is wrong
        key = checked = None
    if checked is None:
        checked, bias = _check(q, k, v, mask, bias, init_bias, causal, sliding_window, q_segment_ids, kv_segment_ids,
                               softmax_scale, logits_soft_cap, softmax_aux, dropout_prob, dropout_rng, kv_lengths,
                               k_scale, v_scale, md, q_padding_lengths, kv_padding_lengths, alignment, return_lse)
        if key is not None and not lazy:
            if len(_checked) >= MAX_CHECKED:
                _checked.clear()
            _checked[key] = checked
    if kv_lengths is not None and is_concrete(kv_lengths):
        _check_length_values("kv_lengths", kv_lengths, k.shape[1], f"S = 0..{k.shape[1]} (the cache's capacity)",
                             "a length counts the valid keys at the front of k and v")
    if key is not None and checked.padding is not None:  # memoised: the values still need their check
        for name, lengths, n, dim in (("q_padding_lengths", q_padding_lengths, q.shape[1], "T"),
                                      ("kv_padding_lengths", kv_padding_lengths, k.shape[1], "S")):
            if lengths is not None:
                _check_padding(name, lengths, q.shape[0], n, dim)
    problem = checked.problem
    if mask_mod is not None or score_mod is not None or block_mask is not None:
        from ..masks import check_mods  # traces each function once per signature

        problem = check_mods(problem, mask_mod, score_mod, block_mask)
    if (q_segment_ids is None) != (kv_segment_ids is None):  # one set for both sides (T == S: checked)
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids
    if prepare:
        (q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux, dropout_rng, kv_lengths, k_scale,
         v_scale) = _prepared(md, checked, (q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux,
                                            dropout_rng, kv_lengths, k_scale, v_scale), q_padding_lengths,
                              kv_padding_lengths)
    return AttentionCall(
        problem=problem, metadata=md, q=q, k=k, v=v, mask=mask, bias=bias, causal=checked.causal,
        sliding_window=checked.sliding_window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        softmax_scale=checked.softmax_scale, logits_soft_cap=checked.logits_soft_cap, softmax_aux=softmax_aux,
        dropout_prob=checked.dropout_prob, dropout_rng=dropout_rng, kv_lengths=kv_lengths, k_scale=k_scale,
        v_scale=v_scale, mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask,
    )
