"""Quantized KV caches (int8, float8): the formats, ``quantize_kv`` / ``dequantize_kv``, and the
check of a call's ``k_scale`` / ``v_scale``.

A quantized cache is a pair ``(values, scale)``: ``values`` of dtype int8, float8_e4m3fn or
float8_e5m2, shaped like the float cache, and ``scale`` float32, broadcastable against the
cache's shape without its last axis (``()`` one scale per tensor, ``(Hkv,)`` per head, the full
``(num_pages, page_size, Hkv)`` / ``(B, S, Hkv)`` per token and head). The cache *means*
``values.astype(float32) * scale[..., None]`` (:func:`dequantize_kv`); attention over it is
attention over that (docs/contract.md, "Quantized caches").

What a backend receives: a call over a quantized cache reaches only backends that declare
``Feature.QUANTIZED_KV``; their forward gets the narrow cache untouched plus keyword arguments
``k_scale`` and ``v_scale``, float32 of rank 3 (``(1|num_pages, 1|page_size, 1|Hkv)`` for pages,
``(1|B, 1|S, 1|Hkv)`` for a dense cache: a size-1 axis is broadcast, so a kernel reads scale
``[p, r, h]`` at ``p * stride0 + r * stride1 + h * stride2`` with stride 0 on size-1 axes).
Scales of positions past a sequence's length are unread like the values there (they may be NaN).

jax is imported inside the functions that compute, so the contract layer stays cheap to import.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError, InvalidTypeError
from ._dtypes import dtype_name

__all__ = [
    "GRANULARITIES",
    "KV_DTYPE_FLAGS",
    "QUANTIZED_KV_DTYPES",
    "check_kv_scales",
    "dequantize_kv",
    "dequantize_visible",
    "kv_format_max",
    "quantize_kv",
    "scale_rank3",
]

#: The storage dtypes of a quantized cache, with the largest magnitude each represents: int8 is
#: symmetric (-127..127, so that 0 is exact and the range is the same both ways), the float8
#: formats use their largest finite value.
_FORMAT_MAX: dict[str, float] = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
QUANTIZED_KV_DTYPES: frozenset[str] = frozenset(_FORMAT_MAX)

#: ``quantize_kv``'s granularities: one scale per tensor, per KV head, per token and KV head.
GRANULARITIES: tuple[str, ...] = ("tensor", "head", "token")

#: The command lines' short names of the formats (``--kv-dtype``): fp8 is float8_e4m3fn.
KV_DTYPE_FLAGS: dict[str, str] = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _shape(x: Any, name: str) -> tuple[int, ...]:
    # validation.shape_of's twin would be an import cycle: validation imports this module.
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise InvalidTypeError(name, f"expected an array, got {type(x).__name__}",
                               "pass a jax.Array, e.g. jnp.asarray(x, jnp.float32)")
    return tuple(int(d) for d in shape)


def kv_format_max(dtype: Any) -> float:
    """The magnitude a scale maps the block's absmax to: the format's largest value (127 for int8)."""
    name = dtype_name(dtype)
    if name not in _FORMAT_MAX:
        raise InvalidInputError("dtype", f"{name} is not a quantized KV format",
                                f"use one of {', '.join(sorted(QUANTIZED_KV_DTYPES))}")
    return _FORMAT_MAX[name]


def quantize_kv(x: Any, dtype: Any, granularity: str = "token") -> tuple[Any, Any]:
    """``(values, scale)`` of a float cache ``x`` (``(..., Hkv, D)``, e.g. pages or ``(B, S, Hkv, D)``).

    ``dtype``: ``int8`` (symmetric, round to nearest, clipped to [-127, 127]), ``float8_e4m3fn``
    or ``float8_e5m2`` (saturated to the largest finite value). ``granularity``: ``"tensor"``
    (scale ``()``), ``"head"`` (``(Hkv,)``) or ``"token"`` (``x.shape[:-1]``, one scale per token
    and head: new tokens can be quantized and written on their own, see docs/serving.md). Each
    scale maps its block's absmax to the format's largest value; an all-zero block gets scale 1
    (finite, and its values are 0). A scale is never below float32's smallest normal (about
    1.2e-38, which XLA does not flush): a block whose absmax is under the format's largest value
    times that (int8 1.5e-36, float8_e4m3fn 5.3e-36, float8_e5m2 6.7e-34) maps to fewer levels,
    finite and dequantizing to itself within them. ``x`` must be finite.
    """
    import jax.numpy as jnp

    qmax = kv_format_max(dtype)
    shape = _shape(x, "x")
    if len(shape) < 2:
        raise InvalidInputError("x", f"must have rank >= 2 (..., Hkv, D), got shape {shape}",
                                "pass pages (num_pages, page_size, Hkv, D) or a cache (B, S, Hkv, D)")
    if granularity not in GRANULARITIES:
        raise InvalidInputError("granularity", f"must be one of {GRANULARITIES}, got {granularity!r}",
                                "'token' suits caches written a token at a time")
    wide = jnp.asarray(x).astype(jnp.float32)
    mag = jnp.abs(wide)
    if granularity == "tensor":
        absmax = jnp.max(mag)
    elif granularity == "head":
        absmax = jnp.max(mag, axis=tuple(i for i in range(len(shape)) if i != len(shape) - 2))
    else:
        absmax = jnp.max(mag, axis=-1)
    # A zero block: any finite scale reproduces it; 1 avoids 0/0. A tiny block's absmax / qmax
    # would be a float32 subnormal, which XLA flushes to zero (0/0 = NaN in float8, 0 in int8):
    # the scale is clamped to the smallest normal, so such a block keeps fewer levels, never NaN.
    tiny = float(jnp.finfo(jnp.float32).tiny)
    scale = jnp.where(absmax > 0, jnp.maximum(absmax / qmax, tiny), 1.0).astype(jnp.float32)
    scaled = jnp.clip(wide / scale[..., None], -qmax, qmax)  # saturate: float8 casts overflow to NaN/inf
    name = dtype_name(dtype)
    values = jnp.round(scaled).astype(jnp.int8) if name == "int8" else scaled.astype(jnp.dtype(name))
    return values, scale


def dequantize_kv(values: Any, scale: Any) -> Any:
    """The float32 cache a quantized one means: ``values.astype(float32) * scale[..., None]``."""
    import jax.numpy as jnp

    return jnp.asarray(values).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[..., None]


def dequantize_visible(values: Any, scale: Any, kv_lengths: Any = None, dtype: Any = None) -> Any:
    """A dense quantized cache ``(B, S, H, D)`` dequantized into ``dtype`` (float32 by default),
    zero at every position at or past ``kv_lengths`` ``(B,)``: values and scales there are unread
    and may be NaN. Both are replaced by zeros with a select *before* they are multiplied, so no
    NaN reaches the product or its gradient (``0 * NaN`` is NaN: selecting the product would
    leave ``d scale = values * 0`` NaN where a value is). What the references attend over."""
    import jax.numpy as jnp

    from .unread import zero_past_length

    dtype = jnp.dtype(dtype or jnp.float32)
    scale = jnp.broadcast_to(jnp.asarray(scale).astype(dtype), values.shape[:-1])
    wide = values.astype(dtype)
    if kv_lengths is not None:
        wide = zero_past_length(wide, kv_lengths)
        scale = zero_past_length(scale[..., None], kv_lengths)[..., 0]
    return wide * scale[..., None]


def check_kv_scales(q: Any, caches: dict[str, Any], k_scale: Any, v_scale: Any,
                    scale_shape: tuple[int, ...], scale_axes: str) -> str | None:
    """Check a call's cache dtypes against q and its scales; return the quantized storage dtype
    (``"int8"``...) or None for a float cache.

    ``caches`` maps argument names to the cache arrays (``{"k": k, "v": v}``, ``{"k_pages": ...,
    "v_pages": ...}`` or ``{"kv_pages": ...}``); ``scale_shape`` is the cache's shape without its
    last axis, which the scales must broadcast against (``scale_axes`` names its axes for errors).
    A float cache must have q's dtype and no scales; a quantized one needs both scales, float32.
    """
    for label, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:  # a number or a list is no scale array, whatever the cache
            _shape(scale, label)
    qd = dtype_name(q.dtype)
    names = list(caches)
    kinds = {name: dtype_name(x.dtype) for name, x in caches.items()}
    quantized = [n for n in names if kinds[n] in QUANTIZED_KV_DTYPES]
    if not quantized:
        for name in names:
            if kinds[name] != qd:
                raise InvalidInputError(name, f"dtype {kinds[name]} differs from q's {qd}",
                                        "cast the cache or q to one dtype (or quantize the cache: jaxattn.quantize_kv)")
        for label, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise InvalidInputError(label, f"is given, but the cache is {kinds[names[0]]}, not quantized",
                                        "drop it, or quantize the cache with jaxattn.quantize_kv")
        return None
    fmt = kinds[quantized[0]]
    for name in names:
        if kinds[name] != fmt:
            raise InvalidInputError(name, f"dtype {kinds[name]} differs from {quantized[0]}'s {fmt}: K and V must be "
                                    "quantized alike", f"quantize both to {fmt} (jaxattn.quantize_kv)")
    for label, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise InvalidInputError(label, f"is required with a cache of dtype {fmt} (it means "
                                    "values.astype(float32) * scale[..., None])",
                                    "jaxattn.quantize_kv returns (values, scale)")
        shape = _shape(scale, label)
        if dtype_name(scale.dtype) != "float32":
            raise InvalidInputError(label, f"must be float32, got {dtype_name(scale.dtype)}", "scale.astype(float32)")
        padded = (1,) * (len(scale_shape) - len(shape)) + shape
        if len(shape) > len(scale_shape) or any(s not in (1, want) for s, want in zip(padded, scale_shape,
                                                                                      strict=True)):
            raise InvalidInputError(label, f"shape {shape} does not broadcast against the cache's {scale_axes} = "
                                    f"{scale_shape}", "use () per tensor, (Hkv,) per head, or the full shape per "
                                    "token and head")
    return fmt


def scale_rank3(scale: Any) -> Any:
    """``scale`` as float32 of rank 3 (size-1 axes in front): what a backend's forward receives."""
    import jax.numpy as jnp

    scale = jnp.asarray(scale, jnp.float32)
    return jnp.reshape(scale, (1,) * (3 - scale.ndim) + tuple(scale.shape))
