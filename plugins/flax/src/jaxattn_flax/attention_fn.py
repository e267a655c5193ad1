"""``dot_product_attention`` with Flax's ``attention_fn`` signature, dispatched by jaxattn.

``nnx.MultiHeadAttention(..., attention_fn=jaxattn_flax.dot_product_attention)`` and linen's
``MultiHeadDotProductAttention(..., attention_fn=...)`` call it as they call Flax's own
``dot_product_attention``; it runs the call through ``jaxattn.attention`` (``impl="auto"``
unless ``functools.partial(dot_product_attention, impl=...)`` names one).

What maps onto jaxattn, and how:

* shapes ``[batch..., T, H, D]`` with any number of batch dims (none included): the batch dims
  are flattened into one, and masks and biases broadcastable to ``[batch..., H, T, S]`` are
  broadcast over them first;
* ``mask`` of any dtype (Flax's ``make_causal_mask`` / ``make_attention_mask`` build float32
  ones): nonzero attends, as in Flax;
* ``is_causal`` (nnx): Flax aligns it top-left (query i sees keys ``j <= i``); with T == S that
  is jaxattn's ``causal=True``, otherwise a top-left mask;
* ``dtype`` and ``promote_dtype``: q, k and v are promoted as Flax does; the output has that dtype;
* ``precision``: the default matmul precision while the call is traced (the pure-JAX backends
  honour it; fused kernels compute at their own precision);
* dropout (``deterministic=False``, ``dropout_rate > 0``): jaxattn's dropout keeps each
  probability independently, after the softmax, scaled by ``1 / (1 - rate)``: Flax's
  ``broadcast_dropout=False``. ``vanilla`` draws the very keep-mask Flax draws
  (``bernoulli(dropout_rng, 1 - rate, (B, H, T, S))``). ``broadcast_dropout=True`` (one mask
  shared by every batch row and head) is refused unless B * H is 1;
* ``module`` (Flax's ``sow_weights=True``): the backend's attention weights are sown as
  ``attention_weights``, as Flax does; backends that form no weights are refused.

What cannot be honoured raises ``InvalidInputError`` naming the argument: the custom einsums of
linen's signature (AQT), broadcast dropout, weights together with dropout (Flax sows them
before dropout, jaxattn's are after it).

One difference on purpose: a query row with no visible key gives zeros (jaxattn's contract),
where Flax averages every value uniformly. Rows that see at least one key are equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import AttentionImpl, AttentionMechanisms, AttentionMetadata, InvalidInputError

__all__ = ["dot_product_attention"]

# jax_default_matmul_precision's values (the legacy names and the dot algorithm presets).
_PRECISIONS = {"default", "high", "highest", "bfloat16", "tensorfloat32", "float32"}


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] | None = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Any] | None = None,
    qk_attn_weights_einsum: Callable[..., Any] | None = None,
    attn_weights_value_einsum: Callable[..., Any] | None = None,
    *,
    impl: str | AttentionMechanisms | AttentionImpl | None = None,
    metadata: AttentionMetadata | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    block_mask: Any = None,
    **other: Any,
) -> Any:
    """Flax's ``dot_product_attention`` (nnx's and linen's signatures), run by jaxattn.

    Args:
        query, key, value: ``[batch..., T, Hq, D]``, ``[batch..., S, Hkv, D]``,
            ``[batch..., S, Hkv, Dv]``; Hq a multiple of Hkv (GQA).
        bias, mask: broadcastable to ``[batch..., Hq, T, S]``; the mask attends where nonzero.
        broadcast_dropout, dropout_rng, dropout_rate, deterministic: Flax's dropout
            (``broadcast_dropout=True`` is refused where it would share a mask).
        dtype, promote_dtype: the computation's dtype, as in Flax.
        precision: the matmul precision while the call is traced.
        module: sow the attention weights into it (Flax's ``sow_weights=True``).
        is_causal: a top-left causal mask, as in Flax.
        force_fp32_for_softmax: accepted: jaxattn's softmax is in ``metadata.softmax_dtype``
            (float32 by default) whatever the inputs' dtype.
        einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: must be None.
        other: keywords a later Flax may pass: accepted when None or False (nothing asked for),
            refused otherwise, by name.
        impl: the jaxattn impl (None: ``use_impl`` scope, ``$JAXATTN_IMPL``, else "auto").
        metadata, softmax_scale, logits_soft_cap, sliding_window: passed to ``jaxattn.attention``
            (Flax's scale is ``D ** -0.5``, the default).
        mask_mod, score_mod, block_mask: passed to ``jaxattn.attention`` (``jaxattn.masks``); their
            ``b`` indexes the flattened batch, and they combine with ``mask`` and ``is_causal``.

    Returns:
        ``[batch..., T, Hq, Dv]`` in the computation's dtype.
    """
    del force_fp32_for_softmax  # the softmax is float32 (metadata.softmax_dtype) either way
    _refuse_unhonoured(other, einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
                       attn_weights_value_einsum=attn_weights_value_einsum)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x).astype(dt) for x in (query, key, value))
    batch_shape = _check_shapes(query, key, value)
    nb, t, hq, s = len(batch_shape), query.shape[-3], query.shape[-2], key.shape[-3]
    q, k, v = (jnp.reshape(x, (math.prod(batch_shape), *x.shape[-3:])) for x in (query, key, value))
    mask = None if mask is None else _flat("mask", jnp.asarray(mask) != 0, batch_shape)
    bias = None if bias is None else _flat("bias", jnp.asarray(bias), batch_shape)
    causal = bool(is_causal) and t == s
    if is_causal and t != s:  # Flax's causal mask is top-left: jnp.tril(ones((T, S)))
        tril = jnp.tril(jnp.ones((t, s), bool))[None, None]
        mask = tril if mask is None else jnp.logical_and(mask, tril)

    dropout = not deterministic and dropout_rate > 0.0
    options = _options(dropout, dropout_rate, dropout_rng, broadcast_dropout and q.shape[0] * hq > 1,
                       softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                       mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask)

    with _matmul_precision(precision):
        if module is None:
            out = jaxattn.attention(q, k, v, impl=impl, mask=mask, bias=bias, causal=causal, metadata=metadata,
                                    **options)
        else:
            out = _attend_and_sow(module, q, k, v, mask, bias, causal, impl, metadata, options, batch_shape,
                                  dropout)
    return jnp.reshape(out, (*batch_shape, t, hq, out.shape[-1])) if nb != 1 else out


def _refuse_unhonoured(other: dict[str, Any], **einsums: Callable[..., Any] | None) -> None:
    """Refuse, by name, what no backend can honour: a keyword ``other`` that asks for something
    (neither None nor False) and a custom einsum."""
    asked = sorted(name for name, value in other.items() if value is not None and value is not False)
    if asked:
        raise InvalidInputError(", ".join(asked), "not an argument of Flax's dot_product_attention that jaxattn "
                                "knows how to honour", "leave it None, or use Flax's own attention for it")
    for name, fn in einsums.items():
        if fn is not None:
            raise InvalidInputError(name, "jaxattn's backends form their own products; a custom einsum "
                                    "(e.g. AQT's quantized one) cannot be honoured",
                                    "leave it None, or use Flax's own dot_product_attention for this module")


def _options(dropout: bool, dropout_rate: float, dropout_rng: Any, shared_keep_mask: bool,
             **given: Any) -> dict[str, Any]:
    """``jaxattn.attention``'s keywords for the dropout and for the options ``given`` (those not
    None). ``shared_keep_mask``: Flax's ``broadcast_dropout`` would share one mask between
    several batch rows and heads, which is refused."""
    options: dict[str, Any] = {}
    if dropout:
        if dropout_rng is None:
            raise InvalidInputError("dropout_rng", f"dropout_rate={dropout_rate} with deterministic=False needs a key",
                                    "pass dropout_rng (the Flax modules do from their 'dropout' rng stream)")
        if shared_keep_mask:
            raise InvalidInputError("broadcast_dropout", "jaxattn's backends keep each probability independently "
                                    "(per batch row, head, query and key); broadcast_dropout=True shares one "
                                    "keep-mask across batch rows and heads, which none can honour",
                                    "build the module with broadcast_dropout=False (independent masks, same rate)")
        options.update(dropout_prob=float(dropout_rate), dropout_rng=dropout_rng)
    options.update((name, value) for name, value in given.items() if value is not None)
    return options


def _check_shapes(query: Any, key: Any, value: Any) -> tuple[int, ...]:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise InvalidInputError(name, f"must be [batch..., length, heads, depth] (rank >= 3), got {x.shape}")
    if not query.ndim == key.ndim == value.ndim:
        raise InvalidInputError("key", f"query, key and value must have one rank, got {query.ndim}, {key.ndim}, "
                                f"{value.ndim}")
    batch_shape = tuple(query.shape[:-3])
    if tuple(key.shape[:-3]) != batch_shape or tuple(value.shape[:-3]) != batch_shape:
        raise InvalidInputError("key", f"batch dims differ: query {batch_shape}, key {key.shape[:-3]}, "
                                f"value {value.shape[:-3]}")
    if key.shape[-3] != value.shape[-3]:
        raise InvalidInputError("value", f"key and value lengths differ: {key.shape[-3]} and "
                                f"{value.shape[-3]}")
    return batch_shape


def _flat(name: str, x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``x`` broadcastable to ``[batch..., H, T, S]`` as a rank-4 array over the flattened batch."""
    nb = len(batch_shape)
    if x.ndim > nb + 3:
        raise InvalidInputError(name, f"must broadcast to [batch..., heads, q_length, kv_length] (rank {nb + 3}), "
                                f"got shape {x.shape}")
    x = jnp.reshape(x, (1,) * (nb + 3 - x.ndim) + x.shape)
    if nb == 1:
        return x
    lead = x.shape[:nb]
    if all(d == 1 for d in lead):
        return jnp.reshape(x, (1, *x.shape[nb:]))
    try:
        x = jnp.broadcast_to(x, (*batch_shape, *x.shape[nb:]))
    except ValueError:
        raise InvalidInputError(name, f"batch dims {lead} do not broadcast to {batch_shape}") from None
    return jnp.reshape(x, (math.prod(batch_shape), *x.shape[nb:]))


def _attend_and_sow(module: Any, q: Any, k: Any, v: Any, mask: Any, bias: Any, causal: bool, impl: Any,
                    metadata: AttentionMetadata | None, options: dict[str, Any], batch_shape: tuple[int, ...],
                    dropout: bool) -> Any:
    """The call, with its weights sown into ``module`` as Flax does for ``sow_weights=True``."""
    if dropout:
        raise InvalidInputError("module", "Flax sows the attention weights before dropout; jaxattn's are the "
                                "weights after it", "sow weights with deterministic=True, or drop sow_weights")
    chosen = impl if isinstance(impl, AttentionImpl) else jaxattn.get_impl(impl or "auto", metadata)
    result = chosen(q, k, v, mask, bias, None, causal, **options)
    if result.attention_weights is None:
        raise InvalidInputError("module", f"sow_weights needs the attention weights; impl {chosen.name()!r} "
                                "forms none for this call", "pass impl='vanilla' for calls that sow weights")
    weights = result.attention_weights
    weights = jnp.reshape(weights, (*batch_shape, *weights.shape[1:]))
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:  # a linen module
        module.sow("intermediates", "attention_weights", weights)
    return result.attention_outputs


@contextmanager
def _matmul_precision(precision: Any) -> Iterator[None]:
    if precision is None:
        yield
        return
    if isinstance(precision, tuple | list):
        if len(set(precision)) != 1:
            raise InvalidInputError("precision", f"one precision for both operands, got {precision}",
                                    "pass a single jax.lax.Precision")
        precision = precision[0]
    name = getattr(precision, "name", precision)
    if not isinstance(name, str) or (name.lower() not in _PRECISIONS and not hasattr(jax.lax.DotAlgorithmPreset,
                                                                                     name)):
        raise InvalidInputError("precision", f"not a matmul precision: {precision!r}",
                                "pass a jax.lax.Precision, one of its names, or None")
    with jax.default_matmul_precision(name.lower() if name.lower() in _PRECISIONS else name):
        yield
