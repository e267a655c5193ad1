"""The dense decode for JAX on NVIDIA GPUs: ``q (B, T, Hq, D)``, T small, over a dense cache.

* :func:`dense_decode`: q ``(B, T, Hq, D)`` over a dense ``(B, S, Hkv, D)`` cache with optional
  per-sequence lengths, forward only (a quantized cache too);
* :func:`decode_with_flash_grad`: the same, differentiable: the VJP is FlashAttention-2's
  backward (``flash.ops``) on this forward's output and log-sum-exp.

Both run the split-K kernel (``paged.kernel``) with the cache in its dense layout
(``paged.launch.DENSE``: one "page" per sequence, read in place through strides, no table and
no copy); its JAX launch helpers come from ``paged.ops``. ``reference`` (beside this module)
states what they compute in NumPy. The arrays follow the serving contract: query ``i`` of
sequence ``b`` sits at position ``kv_lengths[b] - T + i``; rows without a visible key are zeros.

On a CUDA GPU the kernel launches through ``jax_triton`` (imported on first call); with
``interpret=True`` it runs in the Triton interpreter on torch CPU tensors through
``jax.pure_callback`` (tests; ``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn.backend import zero_past_lengths
from jaxattn_triton.paged import launch as LP
from jaxattn_triton.paged.ops import (
    _cache_dtype,
    _execute_all,
    _forward,
    _int32,
    _no_key_inf,
    _num_sms,
    _scale_fields,
    _scales,
    _sinks,
    _spec,
    _tiles,
)

Array = jax.Array

__all__ = ["decode_with_flash_grad", "dense_decode", "dense_spec", "visibility_mask"]


def dense_spec(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: bool = False,
    k_scale: Any = None,
    v_scale: Any = None,
) -> LP.PagedSpec:
    """The :class:`~jaxattn_triton.paged.launch.PagedSpec` of a :func:`dense_decode` call
    (arrays or ``ShapeDtypeStruct``s, the scales too); raises ``ValueError`` with the reasons
    it cannot run."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("dense_decode takes BTHD arrays: q (B, T, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv)")
    b, t, _, d = (int(x) for x in q.shape)
    kb, s, hkv, kd = (int(x) for x in k.shape)
    if kb != b or kd != d or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} do not match")
    if s < 1:
        raise ValueError("the cache must hold at least one position")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype, got {k.dtype}, {v.dtype}")
    cache_dtype = _cache_dtype(q, k)
    scale_fields = _scale_fields(cache_dtype, k_scale, v_scale, (b, s, hkv))
    pair = (window, window) if isinstance(window, int) else window
    left, right = (None, None) if pair is None else pair
    if causal:
        right = 0 if right is None else min(int(right), 0)
    return _spec(
        q, (b, s, hkv), int(v.shape[3]), layout=LP.DENSE, max_seqs=b, q_len=t, pages_per_seq=1,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, window_left=left, window_right=right,
        sinks=sinks, cache_dtype=cache_dtype, scale_fields=scale_fields,
    )  # fmt: skip


def dense_decode(
    q: Array,
    k: Array,
    v: Array,
    kv_lengths: Array | None = None,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: Array | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    num_splits: int | None = None,
    tiles: LP.PagedTiles | None = None,
    return_lse: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
    """Decode-shaped attention (T small) of ``q (B, T, Hq, D)`` over a dense BTHD cache.

    Keys ``j >= kv_lengths[b]`` (default: the cache's length S) are invisible; query ``i``
    sits at position ``kv_lengths[b] - T + i``, the reference of ``causal`` and of
    ``window = (left, right)`` (an int w means (w, w)). Returns ``(B, T, Hq, Dv)``, and with
    ``return_lse`` also the log-sum-exp ``(B, Hq, T)`` float32 (sinks excluded). A quantized
    cache takes ``k_scale``/``v_scale`` broadcasting against ``(B, S, Hkv)`` (forward only).
    """
    b, t, hq, _ = q.shape
    dv = v.shape[3]
    if b == 0 or t == 0:
        out = jnp.zeros((b, t, hq, dv), q.dtype)
        return (out, jnp.zeros((b, hq, t), jnp.float32)) if return_lse else out
    spec = dense_spec(
        q, k, v, causal=causal, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window=window, sinks=sinks is not None, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    lengths = jnp.full((b,), k.shape[1], jnp.int32) if kv_lengths is None else _int32(kv_lengths, "kv_lengths", (b,))
    sink_arr = _sinks(sinks, hq)
    _, ks, vs = _scales(spec.cache_dtype, k_scale, v_scale, tuple(k.shape[:3]))
    chosen = _tiles(spec, tiles, num_splits)
    out, lse = _forward(spec, chosen, interpret, *_dense_inputs(q, k, v, sink_arr, lengths), ks, vs)
    out = out.reshape(b, t, hq, dv)
    # -inf only where an lse is asked for (paged.ops._no_key_inf): an eager call under debug_infs.
    asked: Any = _lse_of(lse, b, t, hq) if return_lse else None
    if kv_lengths is not None:
        out, asked = _emptied(out, asked, _real_rows(lengths, t))
    return (out, asked) if return_lse else out


def _emptied(out: Array, lse: Any, real: Array) -> tuple[Array, Any]:
    """``out (B, T, Hq, Dv)`` and ``lse (B, Hq, T)`` (or None) with the rows ``real``
    (``_real_rows``) marks False empty: zeros and -inf."""
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out, None if lse is None else jnp.where(real[:, None, :], lse, -jnp.inf)


def _real_rows(lengths: Array, t: int) -> Array:
    """``(B, T)``: False at the queries at a negative position (``L_b - T + i < 0``), whose rows
    are empty (zeros, lse -inf). Such a query is no token of its sequence (docs/contract.md); the
    kernel would show it the keys below the length when nothing cuts."""
    return jnp.clip(lengths, 0, None)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :] >= 0


def _lse_of(lse: Array, b: int, t: int, hq: int) -> Array:
    """The kernel's ``(B * T, Hq)`` lse as ``(B, Hq, T)``, rows of no key at -inf."""
    return _no_key_inf(jnp.transpose(lse.reshape(b, t, hq), (0, 2, 1)))


def _dense_inputs(q: Array, k: Array, v: Array, sinks: Array, lengths: Array) -> tuple[Array, ...]:
    """``_forward``'s array arguments for a dense cache (one page per sequence, no table)."""
    b, t, hq, d = q.shape
    dummy = jnp.zeros((1,), jnp.int32)
    return q.reshape(b * t, hq, d), k, v, sinks, dummy, lengths, dummy, dummy


def decode_with_flash_grad(
    q: Array,
    k: Array,
    v: Array,
    kv_lengths: Array | None = None,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: Array | None = None,
    flash_tiles: Any = None,
    flash_overrides: dict[str, int] | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """:func:`dense_decode` that can be differentiated.

    Returns ``(out (B, T, Hq, Dv), lse (B, Hq, T))`` like ``ops.flash_attention``. The forward
    is the split-K kernel; the VJP is FlashAttention-2's backward kernels (``ops``) run on
    this forward's output and log-sum-exp, which are what they need. With ``kv_lengths`` the
    backward takes the visibility as a ``(B, 1, T, S)`` mask built from the lengths (keys
    ``j < L_b``, causal and window aligned to ``L_b - T + i``), the forward's own rule, so
    the gradients are those of the forward (the flash kernels have no per-sequence lengths).
    ``flash_tiles`` is that backward's :class:`~jaxattn_triton.flash.launch.Tiles`; when None they
    are tuned ones for its spec, with ``flash_overrides`` (metadata block sizes) applied.
    """
    from jaxattn_triton.flash.ops import make_spec

    b, t, hq, _ = q.shape
    s = k.shape[1]
    mask = None if kv_lengths is None else jax.ShapeDtypeStruct((b, 1, t, s), jnp.int8)
    fspec = make_spec(
        q, k, v, mask=mask, causal=causal and mask is None, sliding_window=window if mask is None else None,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks is not None,
    )  # fmt: skip
    if b == 0 or t == 0:
        return jnp.zeros((b, t, hq, v.shape[3]), q.dtype), jnp.full((b, hq, t), -jnp.inf, jnp.float32)
    if flash_tiles is None:
        from jaxattn_triton.tuning import tiles_for

        flash_tiles = tiles_for(fspec, interpret=interpret, overrides=flash_overrides)
    pspec = dense_spec(
        q, k, v, causal=causal, softmax_scale=fspec.softmax_scale, logits_soft_cap=logits_soft_cap,
        window=window, sinks=sinks is not None,
    )  # fmt: skip
    ptiles = LP.default_tiles(pspec, _num_sms())
    if kv_lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    else:
        lengths = _int32(kv_lengths, "kv_lengths", (b,))
    return _decode_vjp(pspec, ptiles, fspec, flash_tiles, interpret, q, k, v, _sinks(sinks, hq), lengths)


def visibility_mask(spec: LP.PagedSpec, lengths: Array) -> Array:
    """``(B, 1, T, S)`` int8: which keys each query of a dense-decode call sees (the kernel's rule).

    Key ``j`` is visible to query ``i`` of sequence ``b`` when ``j < L_b`` and, with
    ``pos = L_b - T + i``, ``pos - left <= j <= pos + right`` for the bounded sides; lengths
    are clamped to ``0..S`` as the kernel clamps them.
    """
    assert spec.q_len is not None
    t, s = spec.q_len, spec.page_size
    lens = jnp.clip(lengths.astype(jnp.int32), 0, s)[:, None, None, None]
    i = jnp.arange(t, dtype=jnp.int32)[None, None, :, None]
    j = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
    pos = lens - t + i
    seen = (j < lens) & (pos >= 0)  # a query at a negative position is no token: it sees nothing
    if spec.window_left is not None:
        seen &= j >= pos - spec.window_left
    if spec.window_right is not None:
        seen &= j <= pos + spec.window_right
    return seen.astype(jnp.int8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _decode_vjp(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    q: Array, k: Array, v: Array, sinks: Array, lengths: Array,
) -> tuple[Array, Array]:  # fmt: skip
    b, t, hq, _ = q.shape
    q2, k2, v2, sinks2, table, lengths2, cu, ns = _dense_inputs(q, k, v, sinks, lengths)
    # The kernels' argument order (paged.launch.attention), not _forward's.
    out, lse = _execute_all(pspec, ptiles, [q2, k2, v2, table, lengths2, cu, ns, sinks2], interpret)  # no scales
    out, lse = out.reshape(b, t, hq, v.shape[3]), _lse_of(lse, b, t, hq)
    if fspec.mask_shape is not None:  # kv_lengths given (the backward's mask is built from them)
        out, lse = _emptied(out, lse, _real_rows(lengths, t))
    return out, lse


def _decode_vjp_fwd(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    q: Array, k: Array, v: Array, sinks: Array, lengths: Array,
) -> tuple[tuple[Array, Array], tuple[Array, ...]]:  # fmt: skip
    out, lse = _decode_vjp(pspec, ptiles, fspec, ftiles, interpret, q, k, v, sinks, lengths)
    return (out, lse), (q, k, v, sinks, lengths, out, lse)


def _decode_vjp_bwd(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    residuals: tuple[Array, ...], cotangents: tuple[Array, Array],
) -> tuple[Array | None, ...]:  # fmt: skip
    from jaxattn_triton.flash.ops import _flash_bwd

    q, k, v, sinks, lengths, out, lse = residuals
    # The flash backward's optional inputs, absent here: one-element dummies as in ops. With
    # kv_lengths its spec has a mask instead of causal/window: the visibility, built here.
    bias = jnp.zeros((1,), jnp.float32)
    mask = jnp.zeros((1,), jnp.int8) if fspec.mask_shape is None else visibility_mask(pspec, lengths)
    if fspec.mask_shape is not None:
        # The cache may hold NaN past a length; the flash backward multiplies it by its zero
        # probabilities (dq = dS K, dP = dO V^T), so it gets zeros there, by a select.
        k, v = zero_past_lengths(k, v, jnp.clip(lengths, 0, k.shape[1]))
    seg = jnp.zeros((1,), jnp.int32)
    # (seg twice more: no mask_mod, so no bits and no seen keys; and no masks.alibi slopes.)
    no_slopes = jnp.zeros((1,), jnp.float32)
    grads = _flash_bwd(fspec, ftiles, interpret, (q, k, v, bias, sinks, mask, seg, seg, seg, seg, no_slopes, out,
                                                  lse), cotangents)  # fmt: skip
    dq, dk, dv, _, dsinks = grads[:5]
    # lengths are integers: no cotangent.
    return dq, dk, dv, dsinks, None


_decode_vjp.defvjp(_decode_vjp_fwd, _decode_vjp_bwd)
