"""Attention in plain ``jax.numpy``: every feature of the contract, any platform.

This is the function behind the ``vanilla`` impl, and the one other plugins call for
fallbacks; ring attention can use it as its per-block kernel since it returns the
log-sum-exp. It forms the full ``(T, S)`` logits, so memory is ``O(T * S)`` per head.

Numerics: logits accumulate in the softmax dtype (``float32`` by default, never narrower
than the inputs); masked logits become the dtype's lowest finite value (an ``-inf`` would trip
``jax.debug_infs``) and weigh exactly 0; every place where ``-inf - -inf`` or
``0 / 0`` could appear is guarded, so a row with nothing to attend to gives zeros with
zero (finite) gradients. With ``kv_lengths`` K and V past each length are replaced by zeros
with a select (the cache may hold NaN there, and ``0 * NaN`` is NaN); a ``+inf`` sink zeroes its
head (``jaxattn.backend.sinks``). Grouped-query attention reshapes q to ``(B, T, Hkv, G, D)`` and
contracts against the Hkv K/V heads directly: repeated K/V are never materialised.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxattn import masks
from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads, zero_past_lengths, zero_unseen_keys

__all__ = ["VanillaResult", "vanilla_attention"]

Array = jax.Array


class VanillaResult(NamedTuple):
    """``output (B, T, Hq, Dv)`` in q's dtype; ``weights (B, Hq, T, S)``: the probabilities
    that multiplied V (after dropout), in q's dtype; ``lse (B, Hq, T)``: log-sum-exp of the
    final logits over visible real keys (sink excluded, ``-inf`` for empty rows), float32
    (float64 when the softmax runs in float64)."""

    output: Array
    weights: Array
    lse: Array


def _split_heads(x: ArrayLike, hq: int, hkv: int, name: str) -> Array:
    """Bring a ``(B|1, Hq|1, T|1, S|1)``-broadcastable array to ``(B|1, Hkv|1, G|1, T|1, S|1)``."""
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name}: rank {x.ndim} does not broadcast to (B, Hq, T, S)")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, h, t, s = x.shape
    if h == hq:
        return x.reshape(b, hkv, hq // hkv, t, s)
    if h == 1:
        return x.reshape(b, 1, 1, t, s)
    raise ValueError(f"{name}: head dim {h} is neither 1 nor Hq={hq}")


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else jnp.logical_and(a, b)


def _rank5(x: Array) -> Array:
    """A ``(..., T|1, S|1)`` rule at rank 5 ``(B|1, Hkv|1, G|1, T|1, S|1)``: every operand of the
    masking has the logits' rank, so it runs under ``jax_numpy_rank_promotion="raise"``."""
    return x.reshape((1,) * (5 - x.ndim) + x.shape)


def _visibility(
    t: int,
    s: int,
    hq: int,
    hkv: int,
    *,
    mask: Any,
    causal: bool,
    sliding_window: tuple[int, int] | None,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    kv_lengths: Any = None,
) -> Array | None:
    """Boolean of rank 5, broadcastable to ``(B, Hkv, G, T, S)``, True = attend; None when all visible."""
    visible: Array | None = None
    if mask is not None:
        visible = _split_heads(jnp.asarray(mask, dtype=bool), hq, hkv, "mask")
    j = _rank5(jnp.arange(s)[None, :])
    # Each sequence's keys end at L: S, or its own length in a dense cache of capacity S.
    end: Any = s if kv_lengths is None else jnp.asarray(kv_lengths).reshape(-1, 1, 1, 1, 1)
    # Bottom-right alignment: query i sits at key position i + L - T.
    aligned = _rank5(jnp.arange(t)[:, None]) + (end - t)
    if kv_lengths is not None:
        # A query at a negative position (T > L) is no token of the sequence: it sees nothing.
        visible = _and(visible, (j < end) & (aligned >= 0))
    if causal:
        visible = _and(visible, j <= aligned)
    if sliding_window is not None:
        left, right = sliding_window
        visible = _and(visible, (j >= aligned - left) & (j <= aligned + right))
    if q_segment_ids is not None or kv_segment_ids is not None:
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("q_segment_ids and kv_segment_ids must be given together")
        q_ids, kv_ids = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        same = q_ids[:, :, None] == kv_ids[:, None, :]  # (B, T, S)
        visible = _and(visible, same[:, None, None])
    return visible


def _window(sliding_window: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if sliding_window is None or isinstance(sliding_window, tuple):
        return sliding_window
    return (int(sliding_window), int(sliding_window))


def _scores(
    q: Array,
    k: Array,
    visible: Array | None,
    *,
    scale: float,
    sdtype: Any,
    bias: ArrayLike | None,
    logits_soft_cap: float | None,
    score_mod: Any,
    precision: jax.lax.PrecisionLike,
) -> tuple[Array, bool]:
    """The masked logits ``(B, Hkv, G, T, S)`` in ``sdtype``, and whether the scale is still to
    be applied (True: the logits are plain and unscaled; the softmax multiplies it in)."""
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    qg = q.reshape(b, t, hkv, groups, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=precision, preferred_element_type=sdtype)
    # Plain logits keep their scale out until after the max is subtracted: XLA fuses
    # ``logits * scale - max`` into one multiply-add, whose exact product sits up to half an
    # ulp of the (rounded) max away from it, and past ~2^32 that gap alone overflows exp().
    # ``(logits - max) * scale`` has nothing to fuse; the max weighs exactly exp(0). A scale
    # below the softmax dtype's smallest normal is applied first instead: flushed to zero, as
    # a factor it would make a hidden key's -inf * 0 = NaN, and such logits cannot be large.
    unscaled = (logits_soft_cap is None and bias is None and score_mod is None
                and scale >= float(jnp.finfo(sdtype).tiny))
    if not unscaled:
        logits = logits * jnp.asarray(scale, sdtype)
    if logits_soft_cap is not None:
        cap = jnp.asarray(logits_soft_cap, sdtype)
        logits = cap * jnp.tanh(logits / cap)
    if bias is not None:
        logits = logits + _split_heads(bias, hq, hkv, "bias").astype(sdtype)
    if score_mod is not None:  # on the (B, Hq, T, S) scores, before masking
        modded = jnp.asarray(score_mod(logits.reshape(b, hq, t, s), *masks.indices(b, hq, t, s)))
        logits = modded.astype(sdtype).reshape(b, hkv, groups, t, s)
    # Masked logits become the dtype's lowest finite value, not -inf: jax.debug_infs(True) flags
    # every -inf an operation makes (jax.nn masks with a finite number for the same reason).
    # The exponent is masked again in _softmax, so such a logit weighs exactly exp(lowest) = 0.
    if visible is not None:
        logits = jnp.where(visible, logits, jnp.asarray(jnp.finfo(sdtype).min, sdtype))
    return logits, unscaled


def _softmax(
    logits: Array, visible: Array | None, softmax_aux: Any, factor: Array, sdtype: Any
) -> tuple[Array, Array]:
    """The probabilities over the keys (an optional sink ``softmax_aux (Hq,)`` in the
    denominator only) and the log-sum-exp over the visible keys, of ``logits * factor``
    (``factor`` is the scale where the logits are unscaled, else 1)."""
    _, hkv, groups = logits.shape[:3]
    lowest = jnp.asarray(jnp.finfo(sdtype).min, sdtype)
    row_max = jnp.max(logits, axis=-1)  # (B, Hkv, G, T); lowest on empty rows
    aux = None
    if softmax_aux is not None:
        aux = jnp.asarray(softmax_aux, sdtype).reshape(1, hkv, groups, 1)
        row_max = jnp.maximum(row_max, aux / factor)
    # The softmax is invariant to the shift, so it needs no gradient; an empty row (every key
    # masked, or a bias of -inf on all of them) shifts by 0, so that its exponents stay
    # exp(lowest) = 0 (or exp(-inf) = 0) rather than exp(-inf + inf) = nan.
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max) & (row_max > lowest), row_max, 0))
    exponent = (logits - shift[..., None]) * factor
    if visible is not None:
        exponent = jnp.where(visible, exponent, lowest)
    exp = jnp.exp(exponent)
    key_sum = jnp.sum(exp, axis=-1)
    denom = key_sum if aux is None else key_sum + jnp.exp(aux - shift * factor)
    shift = shift * factor
    probs = exp / jnp.where(denom > 0, denom, 1)[..., None]
    has_keys = key_sum > 0
    lse = jnp.where(has_keys, shift + jnp.log(jnp.where(has_keys, key_sum, 1)), -jnp.inf)
    return probs, lse


def _dropout(probs: Array, dropout_prob: float, dropout_rng: Array | None, hq: int, sdtype: Any) -> Array:
    """The weights that multiply V: ``probs (B, Hkv, G, T, S)`` after dropout, whose keep-mask
    is drawn at ``(B, Hq, T, S)`` (the contract's shape) and whose kept weights are rescaled."""
    weights = probs
    if dropout_prob > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_prob > 0 needs dropout_rng")
        b, hkv, groups, t, s = probs.shape
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_prob, (b, hq, t, s))
        keep = keep.reshape(b, hkv, groups, t, s)
        weights = jnp.where(keep, probs / jnp.asarray(1.0 - dropout_prob, sdtype), 0)
    return weights


def vanilla_attention(
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
    softmax_dtype: Any = jnp.float32,
    precision: jax.lax.PrecisionLike = None,
) -> VanillaResult:
    """Attention with the contract's semantics (docs/contract.md); see the module docstring for numerics.

    Shapes: q ``(B, T, Hq, D)``, k ``(B, S, Hkv, D)``, v ``(B, S, Hkv, Dv)``; mask (bool,
    True = attend) and bias broadcastable to ``(B, Hq, T, S)``; segment ids ``(B, T)`` and
    ``(B, S)``; ``softmax_aux (Hq,)``; ``kv_lengths (B,)`` (keys past a sequence's length are
    invisible, causal and window align to it). ``dropout_prob`` must be a Python float; the keep-mask
    is ``jax.random.bernoulli(dropout_rng, 1 - p, (B, Hq, T, S))``. ``mask_mod`` and
    ``score_mod`` (``jaxattn.masks``) are evaluated densely over the grid; keys that no query of
    a sequence's KV head sees are then replaced by zeros with a select (they may hold NaN). Unused results (weights,
    lse) cost nothing under ``jit``: XLA drops them.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    groups = hq // hkv
    if kv_lengths is not None:
        k, v = zero_past_lengths(k, v, kv_lengths)  # the cache may hold NaN past a length
    softmax_aux, absorbed = split_absorbing_sinks(softmax_aux)
    # Never compute the softmax narrower than the inputs (float64 tests stay float64).
    sdtype = jnp.promote_types(jnp.dtype(softmax_dtype), q.dtype)
    scale = float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)

    visible = _visibility(
        t,
        s,
        hq,
        hkv,
        mask=mask,
        causal=causal,
        sliding_window=_window(sliding_window),
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        kv_lengths=kv_lengths,
    )
    if mask_mod is not None:
        seen = jnp.asarray(mask_mod(*masks.indices(b, hq, t, s)), dtype=bool)
        visible = _and(visible, _split_heads(seen, hq, hkv, "mask_mod"))
        # 0 * NaN in P @ V (or a gradient) is NaN: the unread keys are replaced by a select.
        k, v = zero_unseen_keys(jnp.broadcast_to(visible, (b, hkv, groups, t, s)).reshape(b, hq, t, s), k, v)

    logits, unscaled = _scores(q, k, visible, scale=scale, sdtype=sdtype, bias=bias,
                               logits_soft_cap=logits_soft_cap, score_mod=score_mod, precision=precision)
    factor = jnp.asarray(scale if unscaled else 1.0, sdtype)
    probs, lse = _softmax(logits, visible, softmax_aux, factor, sdtype)
    weights = _dropout(probs, dropout_prob, dropout_rng, hq, sdtype)

    out = jnp.einsum(
        "bkgts,bskd->btkgd",
        weights.astype(v.dtype),
        v,
        precision=precision,
        preferred_element_type=jnp.promote_types(v.dtype, jnp.float32),
    )
    return VanillaResult(
        output=zero_absorbed_heads(out.reshape(b, t, hq, v.shape[-1]).astype(q.dtype), absorbed, 2),
        weights=zero_absorbed_heads(weights.reshape(b, hq, t, s).astype(q.dtype), absorbed, 1),
        lse=lse.reshape(b, hq, t).astype(jnp.promote_types(sdtype, jnp.float32)),
    )
