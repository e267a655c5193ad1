"""``jaxattn.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and meaning,
run by the backend jaxattn picks.

Everything is translated into one ``jaxattn.attention`` call: rank-3 ``(T, N, H)`` inputs get a
batch axis, ``is_causal`` and ``local_window_size`` keep jax.nn's top-left alignment
(``alignment="top_left"``), ``query_seq_lengths`` / ``key_value_seq_lengths`` are padding
(``q_padding_lengths`` / ``kv_padding_lengths``), ``return_residual=True`` asks for the
log-sum-exp (``return_lse``) and returns it as jax.nn does: ``(B, T, N)`` (or ``(T, N)``), natural
log, in the key's dtype, without a gradient. The arguments are checked as jax.nn checks them, and
a bad one raises a ``ValueError`` (jaxattn's ``InvalidInputError``), as there.

Deliberate difference: a query row that sees no key at all (every key masked, a key length of 0)
gives zeros and an lse of ``-inf``; jax.nn gives the mean of every value row (its masking uses a
large finite negative number, so such a softmax is uniform) and a large negative finite lse.
"""

from __future__ import annotations

import math
from typing import Any

from ..backend.validation import as_int, is_concrete
from ..errors import ImplNotFoundError, InvalidInputError, InvalidTypeError

__all__ = ["dot_product_attention"]

def _ensure_4d(x: Any) -> Any:
    import jax.numpy as jnp

    x = jnp.asarray(x)
    return jnp.expand_dims(x, tuple(range(4 - x.ndim))) if x.ndim < 4 else x


def _check_like_jax_nn(name: str, x: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """jax.nn's own checks of an argument: rank, dtype, the dims it fixes (-1 = any)."""
    if x is None:
        return
    if x.ndim != len(shape):
        raise InvalidInputError(name, f"must have rank {len(shape)}, got shape {tuple(x.shape)}",
                                "jax.nn.dot_product_attention's layouts: BTNH or TNH, masks and biases BNTS")
    if dtype is not None and x.dtype != dtype:
        raise InvalidInputError(name, f"dtype must be {dtype}, got {x.dtype}")
    for i, (have, want) in enumerate(zip(x.shape, shape, strict=True)):
        if want != -1 and have != want:
            raise InvalidInputError(name, f"shape must be {tuple(shape)} (-1: any), got {tuple(x.shape)} "
                                    f"(dim {i})")


def _scale(scale: Any, h: int) -> tuple[float, Any]:
    """``(softmax_scale, factor for q or None)``: jaxattn scales by a finite positive number; any
    other scale jax.nn takes (zero, negative, traced) multiplies q instead."""
    if scale is None:
        return h ** -0.5, None
    value: float | None = None
    if (isinstance(scale, int | float) and not isinstance(scale, bool)) or (is_concrete(scale) and scale.ndim == 0):
        value = float(scale)
    if value is not None and math.isfinite(value) and value > 0:
        return value, None
    return 1.0, scale


def _impl_name(implementation: Any, candidates: tuple[str, ...], supports: Any) -> str | None:
    """The jaxattn impl for jax.nn's ``implementation``: None is jaxattn's own choice ("auto",
    unless ``use_impl`` or ``$JAXATTN_IMPL`` name one); "xla" the first of ``candidates`` that
    accepts the call (sdpa is jax.nn's XLA path itself, vanilla the pure-JAX reference that also
    returns the lse and runs float64); "cudnn" cuDNN; any other string a jaxattn impl name."""
    if implementation != "xla":  # a name that is not one is refused by get_impl, naming it
        return implementation  # type: ignore[no-any-return]  # None, "cudnn" (jaxattn's too) or an impl name
    for name in candidates:
        try:
            if not supports(name):
                return name
        except ImplNotFoundError:
            continue
    return candidates[-1]  # declines with every reason


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention``, run by jaxattn: the same arguments, the same result.

    query ``(B, T, N, H)`` or ``(T, N, H)``; key and value ``(B, S, K, H)`` or ``(S, K, H)`` (N a
    multiple of K: grouped-query attention); bias and mask broadcastable to ``(B, N, T, S)``
    (fewer dims get leading ones); ``is_causal`` and ``local_window_size=(left, right)`` (an int
    w is ``(w, w)``) align top-left: query i sees key j when ``j <= i`` and
    ``i - left <= j <= i + right``. ``query_seq_lengths`` / ``key_value_seq_lengths`` (int32
    ``(B,)``) mark the rest padding: padded queries give zeros, padded keys are seen by none.

    ``implementation``: None lets jaxattn choose (``use_impl``, ``$JAXATTN_IMPL``, else "auto",
    which, with ``return_residual``, picks among backends that return the log-sum-exp); "xla"
    runs sdpa (jax.nn's XLA path; on an NVIDIA GPU sdpa takes cuDNN where it runs the call and
    its backward) where it accepts the call, else vanilla (jaxattn's pure-JAX reference); "cudnn"
    cuDNN; any other string names a jaxattn impl. A chosen impl that cannot run the call raises
    ``UnsupportedError`` with every reason.

    Returns the output, query's shape; with ``return_residual=True`` ``(output, lse)``, lse
    ``(B, T, N)`` (``(T, N)``) in the key's dtype, natural log, without a gradient.

    Unlike jax.nn, a query row that sees no key gives zeros (and an lse of ``-inf``), not the
    mean of every value row.
    """
    import jax
    import jax.numpy as jnp

    from .calls import attention, get_impl

    out_shape = tuple(jnp.shape(query))
    q, k, v = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    bias = None if bias is None else _ensure_4d(bias)
    mask = None if mask is None else _ensure_4d(mask)
    q_lengths = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_lengths = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    b, s, kh, h = k.shape
    _check_like_jax_nn("value", v, (b, s, kh, h), k.dtype)
    _check_like_jax_nn("query", q, (b, -1, -1, h), k.dtype)
    _check_like_jax_nn("mask", mask, (-1, -1, -1, -1), jnp.dtype(bool))
    _check_like_jax_nn("bias", bias, (-1, -1, -1, -1), None)
    _check_like_jax_nn("query_seq_lengths", q_lengths, (b,), jnp.dtype("int32"))
    _check_like_jax_nn("key_value_seq_lengths", kv_lengths, (b,), jnp.dtype("int32"))
    if kh == 0 or q.shape[2] % kh:
        raise InvalidInputError("query", f"has {q.shape[2]} heads, not a multiple of the {kh} key/value heads")
    window: Any = local_window_size
    if as_int(window) is not None:
        window = (window, window)
    softmax_scale, factor = _scale(scale, h)
    if factor is not None:  # jax.nn multiplies the float32 logits; the same product, one step earlier
        q = (q.astype(jnp.promote_types(q.dtype, jnp.float32)) * factor).astype(q.dtype)
    if not isinstance(return_residual, bool):
        raise InvalidTypeError("return_residual", f"must be a bool, got {return_residual!r}")
    features: dict[str, Any] = {
        "mask": mask, "bias": bias, "causal": is_causal, "sliding_window": window, "softmax_scale": softmax_scale,
        "q_padding_lengths": q_lengths, "kv_padding_lengths": kv_lengths, "alignment": "top_left",
        "return_lse": return_residual,
    }

    def supports(name: str) -> list[str]:
        return list(get_impl(name).supports(q, k, v, **features))

    try:
        name = _impl_name(implementation, ("sdpa", "vanilla"), supports)
    except ImplNotFoundError as err:
        raise InvalidInputError("implementation", str(err)) from err
    try:
        result = attention(q, k, v, impl=name, **features)
    except ImplNotFoundError as err:  # jax.nn raises ValueError for an implementation it lacks
        raise InvalidInputError("implementation", str(err),
                                "None, 'xla', 'cudnn' or a name jaxattn.list_impls() lists") from err
    if not return_residual:
        return jnp.reshape(result, out_shape)
    out, lse = result  # lse (B, N, T) float32
    lse = jnp.transpose(lse, (0, 2, 1)).astype(k.dtype)
    return jnp.reshape(out, out_shape), jax.lax.stop_gradient(jnp.reshape(lse, out_shape[:-1]))
