"""Infinite attention sinks, once for every backend.

A sink (``softmax_aux``, one raw logit per query head) joins the softmax denominator. The
contract gives its two infinite values a meaning: ``-inf`` is no sink (``exp(-inf) = 0``, which
every kernel computes as is), and ``+inf`` takes the whole mass, so each row of that head gets
probability 0 on every key: output zeros, gradients zero. Kernels would compute ``+inf``
as ``inf / inf`` or shift their running maximum by it, so a backend hands its kernel
:func:`split_absorbing_sinks`'s finite stand-in and zeroes those heads with
:func:`zero_absorbed_heads` afterwards. Both are selects, so no gradient reaches the stand-in
and nothing non-finite reaches the output.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["split_absorbing_sinks", "zero_absorbed_heads"]


def split_absorbing_sinks(softmax_aux: Any) -> tuple[jax.Array | None, jax.Array | None]:
    """``(sinks for the kernel, (Hq,) bool of the heads whose sink is +inf)``; (None, None) without sinks.

    The kernel's sinks equal ``softmax_aux`` except at ``+inf``, where they are 0 (any finite
    value does: those heads are zeroed afterwards).
    """
    if softmax_aux is None:
        return None, None
    aux = jnp.asarray(softmax_aux)
    absorbed = jnp.isposinf(aux)
    return jnp.where(absorbed, jnp.zeros((), aux.dtype), aux), absorbed


def zero_absorbed_heads(x: jax.Array, absorbed: jax.Array | None, head_axis: int) -> jax.Array:
    """``x`` with the heads an infinite sink absorbs set to zero (``x`` itself without sinks)."""
    if absorbed is None:
        return x
    shape = [1] * x.ndim
    shape[head_axis] = absorbed.shape[0]
    return jnp.where(absorbed.reshape(shape), jnp.zeros((), x.dtype), x)
