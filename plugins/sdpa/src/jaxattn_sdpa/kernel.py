"""jaxattn's attention contract on top of ``jax.nn.dot_product_attention``.

One function, ``sdpa_attention``, for both of jax.nn's paths (``"xla"`` and ``"cudnn"``).
It adds nothing to the plain call: with no mask, bias, window, segment ids or sinks (and
causal with T == S), it *is* ``jax.nn.dot_product_attention(q, k, v, scale=..., is_causal=...)``.
The rest is translated exactly:

* causal / sliding window: bottom-right to jax.nn's top-left (``translate.structural_band``);
* segment ids: a ``(B, 1, T, S)`` mask, or sequence lengths when they are a (concrete)
  right-padding pattern;
* sinks (``softmax_aux``): one extra key at position 0 with K = V = 0 and a bias column equal
  to the sink logit, which joins the softmax denominator and adds nothing to the output.
  Prepending keeps the bottom-right alignment of every real key;
* rows with nothing to attend to: jax.nn masks with a large finite negative number, so such
  rows come out as the mean of V; we replace them by zeros (the contract) with a ``where``,
  which also zeroes their gradients. A bias entry of ``-inf`` is turned into a mask bit (and
  the bias there into 0), so that a row whose bias is ``-inf`` everywhere is found and zeroed
  like the others instead of being a softmax over nothing (NaN);
* a ``+inf`` sink: jax.nn gets a finite one and the head is zeroed (``jaxattn.backend.sinks``);
* ``kv_lengths`` (a dense KV cache of capacity S): without causal or a window that could cut
  (``translate.kv_band_restricts``; e.g. a T = 1 decode step, causal or not) they are jax.nn's
  ``key_value_seq_lengths``, nothing else. Otherwise the per-sequence bottom-right rule
  (query i at ``L_b - T + i``) is spelled out as a ``(B, 1, T, S)`` mask: jax.nn's causal
  and window are top-left, and cuDNN's ``PADDING_CAUSAL`` as well. A row that sees no key
  (``L_b = 0``, or ``L_b < T`` under causal) is shown key 0 (length 1, or one mask bit) and
  zeroed afterwards, so neither path ever computes a softmax over nothing: its output and
  every gradient through it are exactly zero, on cuDNN too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backend import UnsupportedError, split_absorbing_sinks, zero_absorbed_heads, zero_past_lengths

from .cudnn import EMPTY_ROWS_GRAD, band_is_native, sink_columns
from .translate import Band, band_row_valid, kv_band_restricts, padding_lengths, structural_band

__all__ = ["Implementation", "sdpa_attention"]

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
Implementation = Literal["xla", "cudnn"]


def _on_host(x: ArrayLike) -> np.ndarray | None:
    """``x`` as NumPy when its values are known at trace time (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _and_all(masks: Sequence[Array]) -> Array | None:
    out: Array | None = None
    for m in masks:
        out = m if out is None else jnp.logical_and(out, m)
    return out


def _band_mask(band: Band, t: int, s: int, offset: int = 0) -> Array:
    """``(1, 1, T, S)`` boolean of the band; keys shifted right by ``offset`` prepended columns."""
    i = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, s), 2)
    j = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, s), 3) - offset
    keep = j >= 0
    if band.lo is not None:
        keep = keep & (j >= i + band.lo)
    if band.hi is not None:
        keep = keep & (j <= i + band.hi)
    return keep


def _length_mask(q_len: np.ndarray, kv_len: np.ndarray, t: int, s: int) -> Array:
    q_ok = jnp.arange(t)[None, :, None] < jnp.asarray(q_len)[:, None, None]
    kv_ok = jnp.arange(s)[None, None, :] < jnp.asarray(kv_len)[:, None, None]
    return (q_ok & kv_ok)[:, None]


def _jax_nn_scale(scale: float | None, d: int) -> float | None:
    """``scale`` for jax.nn: None where it is jax.nn's own default ``1 / sqrt(D)``.

    Both paths apply the scale in float32 (XLA multiplies float32 logits, cuDNN takes a
    float attribute), and ``D ** -0.5`` (the contract's default) can differ from jax.nn's
    ``1 / np.sqrt(D)`` in the last bit of a float64. Passing None then gives the same
    numbers and the same program text as a direct jax.nn call (cuDNN's backend config
    spells the scale out as a float64).
    """
    if scale is not None and np.float32(scale) == np.float32(1.0 / np.sqrt(d)):
        return None
    return scale


@jax.custom_vjp
def _no_cudnn_bias_grad(x: Array) -> Array:
    """Identity whose gradient refuses: cuDNN returns no bias gradient for this layout."""
    return x


def _no_grad_fwd(x: Array) -> tuple[Array, None]:
    return x, None


def _no_grad_bwd(_: None, g: Array) -> tuple[Array]:
    raise UnsupportedError("cudnn", [
        "cuDNN computes the bias gradient only for a bias shared across the batch, (1, Hq, T, S); this "
        "call's bias tensor varies over the batch (a batched bias, mask or segment ids), so the gradient "
        "of the bias or sinks would be wrong; use impl='sdpa' (XLA) or a bias with batch dim 1",
    ])


_no_cudnn_bias_grad.defvjp(_no_grad_fwd, _no_grad_bwd)

#: Why cuDNN's gradient is refused when bottom-right causal leaves queries without keys.
@jax.custom_vjp
def _no_cudnn_empty_rows_grad(x: Array) -> Array:
    """Identity whose gradient refuses (see ``EMPTY_ROWS_GRAD``)."""
    return x


def _empty_rows_bwd(_: None, g: Array) -> tuple[Array]:
    raise UnsupportedError("cudnn", [EMPTY_ROWS_GRAD])


_no_cudnn_empty_rows_grad.defvjp(_no_grad_fwd, _empty_rows_bwd)


def _prepend_keys(x: Array, n: int) -> Array:
    """n zero keys (or values) in front: a sink's K and V are zero."""
    pad = jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
    return jnp.concatenate([pad, x], axis=1)


def _prepend_mask(m: Array, n: int) -> Array:
    """The sink column is always visible; parity columns never are."""
    shape = (*m.shape[:3], n)
    cols = jnp.zeros(shape, bool).at[..., 0].set(True)
    return jnp.concatenate([cols, m], axis=-1)


def _sink_bias(aux: Array, bias: Array | None, hq: int, s: int, n: int, dtype: Any) -> Array:
    """The bias with ``n`` columns in front: the sink logit in column 0, zeros after it.

    The sink columns are cast to ``dtype`` last (and ``_cudnn_operands`` widens before it
    casts), so the sinks' gradient is summed over queries in their own float32.
    """
    lead = (1, hq, 1) if bias is None else (bias.shape[0], hq, bias.shape[2])
    col = jnp.broadcast_to(aux.reshape(1, hq, 1, 1), (*lead, 1))
    cols = jnp.concatenate([col, jnp.zeros((*lead, n - 1), aux.dtype)], axis=-1).astype(dtype)
    rest = jnp.zeros((*lead, s), dtype) if bias is None else jnp.broadcast_to(bias.astype(dtype), (*lead, s))
    return jnp.concatenate([cols, rest], axis=-1)


def _row_valid(
    masks: Sequence[Array], band: Band | None, lengths: tuple[np.ndarray, np.ndarray] | None, t: int, s: int
) -> Array | np.ndarray | None:
    """Which query rows see a key: ``(b, h, T)`` (dims 1 where shared), or None if all do."""
    if masks:  # data-dependent: reduce the combined visibility (one pass over the mask)
        parts = list(masks)
        if band is not None:
            parts.append(_band_mask(band, t, s))
        if lengths is not None:
            parts.append(_length_mask(*lengths, t, s))
        vis = _and_all(parts)
        assert vis is not None
        return jnp.any(vis, axis=-1)
    valid = band_row_valid(band, t, s, None if lengths is None else lengths[1])
    if lengths is not None:
        valid = valid & (np.arange(t)[None, :] < lengths[0][:, None])
    if valid.all():
        return None
    return valid.reshape(-1 if valid.ndim == 2 else 1, 1, t)


def _kv_positions(kv_len: Array, t: int) -> Array:
    """``(B, T)``: query i of sequence b sits at key position ``L_b - T + i``."""
    return kv_len[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]


def _kv_mask(kv_len: Array, t: int, s: int, causal: bool, window: tuple[int, int] | None) -> Array:
    """``(B, 1, T, S)``: keys ``j < L_b``, with causal and the window aligned to ``L_b``."""
    pos = _kv_positions(kv_len, t)[:, None, :, None]
    j = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, s), 3)
    keep = (j < kv_len[:, None, None, None]) & (pos >= 0)  # a query at a negative position sees nothing
    if causal:
        keep = keep & (j <= pos)
    if window is not None:
        left, right = window
        keep = keep & (j >= pos - left) & (j <= pos + right)
    return keep


def _kv_row_valid(kv_len: Array, t: int, causal: bool, window: tuple[int, int] | None) -> Array:
    """``(B, 1, T)``: whether the row sees a key; its keys are ``[first, last]``, so O(B * T)."""
    pos = _kv_positions(kv_len, t)
    first = jnp.zeros_like(pos)
    last = jnp.broadcast_to(kv_len[:, None] - 1, pos.shape)
    if causal:
        last = jnp.minimum(last, pos)
    if window is not None:
        left, right = window
        first = jnp.maximum(first, pos - left)
        last = jnp.minimum(last, pos + right)
    return ((first <= last) & (pos >= 0))[:, None, :]


def _show_key_zero(mask: Array, row_valid: Array) -> Array:
    """``mask`` with key 0 visible to rows that see nothing (they are zeroed afterwards)."""
    j = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, mask.shape[-1]), 3)
    return mask | (jnp.logical_not(row_valid)[..., None] & (j == 0))


def _kv_lengths_operands(
    kv_lengths: ArrayLike, masks: list[Array], t: int, s: int, causal: bool, window: tuple[int, int] | None,
    sinks: bool,
) -> tuple[list[Array], Array | None, Array]:
    """``(masks, native lengths or None, row_valid (b, h, T))`` of a call with ``kv_lengths``.

    Lengths outside 0..S (possible under jit, where they cannot be checked) are clamped.
    """
    kv_len = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, s)
    native: Array | None = kv_len
    if kv_band_restricts(t, s, causal, window):
        masks = [*masks, _kv_mask(kv_len, t, s, causal, window)]
        native = None
    if not masks:
        row_valid = _kv_row_valid(kv_len, t, causal, window)
        if not sinks:
            native = jnp.maximum(kv_len, 1)  # an empty sequence shows key 0 (zeroed below)
        return masks, native, row_valid
    combined = _and_all(masks)
    assert combined is not None
    visible = combined
    if native is not None:
        j = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, s), 3)
        visible = visible & (j < native[:, None, None, None])
    # A query at a negative position is no token of its sequence (native lengths would show it keys).
    row_valid = jnp.any(visible, axis=-1) & (_kv_positions(kv_len, t) >= 0)[:, None, :]
    if sinks:  # the sink column is always visible: no row is ever empty for the kernel
        return [combined], native, row_valid
    return [_show_key_zero(combined, row_valid)], None if native is None else jnp.maximum(native, 1), row_valid


def _hidden_keys(
    mask: Array | None, bias: Array | None, q_segment_ids: ArrayLike | None, kv_segment_ids: ArrayLike | None,
    has_kv_lengths: bool, t: int, s: int,
) -> tuple[list[Array], Array | None, tuple[np.ndarray, np.ndarray] | None]:
    """``(masks, bias, lengths)``: the masks that hide keys (the call's, the bias's ``-inf``
    entries, the segment ids'), the bias with those entries 0, and the segment ids as
    ``(query, key)`` sequence lengths where they are a concrete right-padding pattern (then no
    mask of theirs; not with ``kv_lengths``, which are the keys' lengths)."""
    masks: list[Array] = [] if mask is None else [mask]
    if bias is not None:
        # jax.nn adds the bias and masks with a finite number: a row whose bias is -inf on
        # every key is a softmax over nothing (NaN, in the output and every gradient). The
        # contract calls such a row empty: a -inf bias entry becomes a hidden key, like a mask
        # bit, so the row is found, shown key 0 and zeroed as every other empty row.
        masks.append(bias > -jnp.inf)
        bias = jnp.where(masks[-1], bias, jnp.zeros((), bias.dtype))
    lengths: tuple[np.ndarray, np.ndarray] | None = None
    if q_segment_ids is not None and kv_segment_ids is not None:
        q_ids, kv_ids = _on_host(q_segment_ids), _on_host(kv_segment_ids)
        if q_ids is not None and kv_ids is not None and not has_kv_lengths:
            lengths = padding_lengths(q_ids, kv_ids)
        if lengths is not None and lengths[0].min() == t and lengths[1].min() == s:
            lengths = None  # one segment spanning everything: nothing to mask
        elif lengths is None:
            masks.append(jnp.asarray(q_segment_ids)[:, None, :, None] == jnp.asarray(kv_segment_ids)[:, None, None, :])
    return masks, bias, lengths


def _with_sink_keys(
    softmax_aux: Array, n: int, hq: int, k: Array, v: Array, bias: Array | None, masks: list[Array],
    lengths: tuple[np.ndarray, np.ndarray] | None, kv_native: Array | None, band: Band | None,
) -> tuple[Array, Array, Array, list[Array], tuple[np.ndarray, np.ndarray] | None, Array | None, Band | None]:
    """The operands with ``n`` sink keys prepended (K = V = 0, the sink logit as their bias
    column): ``(k, v, bias, masks, lengths, kv_native, band)``, every key index shifted by n."""
    s = k.shape[1]
    bias_dtype = softmax_aux.dtype if bias is None else jnp.promote_types(softmax_aux.dtype, bias.dtype)
    sink_bias = _sink_bias(softmax_aux, bias, hq, s, n, bias_dtype)  # cuDNN's cast comes later
    k, v = _prepend_keys(k, n), _prepend_keys(v, n)
    masks = [_prepend_mask(m, n) for m in masks]
    if n > 1 and not masks:
        masks = [_prepend_mask(jnp.ones((1, 1, 1, s), bool), n)]
    if lengths is not None:
        lengths = (lengths[0], lengths[1] + n)
    if kv_native is not None:
        kv_native = kv_native + n
    if band is not None:
        band = Band(None, band.hi + n if band.hi is not None else None)
    return k, v, sink_bias, masks, lengths, kv_native, band


def _jax_nn_options(
    band: Band | None, lengths: tuple[np.ndarray, np.ndarray] | None, kv_native: Array | None, cudnn: bool,
    t: int, s_all: int,
) -> dict[str, Any]:
    """jax.nn's keyword arguments for a native band (causal, a local window) and sequence lengths."""
    kwargs: dict[str, Any] = {}
    if band is not None:
        if band.is_top_left_causal:
            kwargs["is_causal"] = True
        elif cudnn:  # band_is_native: causal with a left edge
            kwargs.update(is_causal=True, local_window_size=band.local_window_size(t, s_all))
        else:
            kwargs["local_window_size"] = band.local_window_size(t, s_all)
    if lengths is not None:
        kwargs["query_seq_lengths"] = jnp.asarray(lengths[0], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(lengths[1], jnp.int32)
    if kv_native is not None:
        kwargs["key_value_seq_lengths"] = kv_native
    return kwargs


def sdpa_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    softmax_scale: float | None = None,
    softmax_aux: Array | None = None,
    kv_lengths: ArrayLike | None = None,
    implementation: Implementation = "xla",
) -> Array:
    """Attention with the contract's semantics (docs/contract.md) through ``jax.nn.dot_product_attention``.

    ``mask`` / ``bias`` are rank 4, broadcastable to ``(B, Hq, T, S)``; ``kv_lengths (B,)``
    makes k and v a cache of capacity S (docs/contract.md). Returns ``(B, T, Hq, D)`` in q's
    dtype. The caller has checked what ``implementation`` supports.
    """
    _, t, hq, _ = q.shape
    s = k.shape[1]
    cudnn = implementation == "cudnn"
    if kv_lengths is not None:  # the cache may hold NaN past a length: jax.nn would multiply it by 0
        k, v = zero_past_lengths(k, v, jnp.clip(jnp.asarray(kv_lengths), 0, s))
    softmax_aux, absorbed = split_absorbing_sinks(softmax_aux)
    # With kv_lengths the band depends on each sequence's length: _kv_lengths_operands has it.
    band = None if kv_lengths is not None else structural_band(t, s, causal, sliding_window)

    masks, bias, lengths = _hidden_keys(mask, bias, q_segment_ids, kv_segment_ids, kv_lengths is not None, t, s)

    kv_native: Array | None = None
    row_valid: Array | np.ndarray | None
    if kv_lengths is not None:
        masks, kv_native, row_valid = _kv_lengths_operands(
            kv_lengths, masks, t, s, causal, sliding_window, softmax_aux is not None)
    else:
        row_valid = _row_valid(masks, band, lengths, t, s)

    # Prepended sink keys shift every real key by n; bottom-right alignment is unchanged.
    n = 0 if softmax_aux is None else (sink_columns(s) if cudnn else 1)
    native = band is None or (band_is_native(t, s, band) if cudnn else True)
    if n and band is not None and (cudnn or band.lo is not None):
        native = False  # a left edge would hide the sink at key 0: spell the band out instead
    if band is not None and not native:
        masks.append(_band_mask(band, t, s))
        band = None
    s_all = s + n

    if n:
        assert softmax_aux is not None
        k, v, bias, masks, lengths, kv_native, band = _with_sink_keys(softmax_aux, n, hq, k, v, bias, masks,
                                                                      lengths, kv_native, band)

    combined = _and_all(masks)
    if cudnn:
        combined, bias = _cudnn_operands(combined, bias, q, t, s_all)

    out: Array = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=combined, scale=_jax_nn_scale(softmax_scale, q.shape[-1]),
        implementation=implementation, **_jax_nn_options(band, lengths, kv_native, cudnn, t, s_all),
    )
    if row_valid is not None:
        # (b, h, T) -> (b, T, h, 1) against the (B, T, Hq, D) output.
        keep = jnp.transpose(jnp.asarray(row_valid), (0, 2, 1))[..., None]
        out = jnp.where(keep, out, jnp.zeros((), out.dtype))
    if cudnn and causal and t > s:
        out = _no_cudnn_empty_rows_grad(out)
    return zero_absorbed_heads(out, absorbed, 2)


def _cudnn_operands(mask: Array | None, bias: Array | None, q: Array, t: int, s: int) -> tuple[Any, Any]:
    """Bring mask and bias to what cuDNN accepts: full (T, S) extent, bias in q's dtype.

    A bias carrying gradients (the user's, or sinks) is widened to every query head, the one
    layout, ``(1, Hq, T, S)``, for which cuDNN computes the bias gradient; when it also varies
    over the batch that gradient is refused rather than returned wrong.
    """
    if mask is not None:
        mask = jnp.broadcast_to(mask, (*mask.shape[:2], t, s))
    if bias is not None:
        hq = q.shape[2]
        bias = jnp.broadcast_to(bias, (bias.shape[0], hq, t, s)).astype(q.dtype)
        if bias.shape[0] > 1 or (mask is not None and mask.shape[0] > 1):
            bias = _no_cudnn_bias_grad(bias)
    return mask, bias
