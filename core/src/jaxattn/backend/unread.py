"""Cache positions no query may see, kept out of the numbers with selects.

The contract lets a KV cache hold any bit pattern where no query reads: positions at or past a
sequence's length, and pages listed past its last page (NaN and Inf included: a freed page, a
fresh ``jnp.empty``). Masking the logits hides such keys from the softmax, but ``0 * NaN`` is
NaN, so a hidden NaN value still reaches ``P @ V``, and a hidden NaN key reaches ``dq = dS @ K``.
A backend whose kernel multiplies by its masks therefore replaces those positions with zeros,
by a select, before the kernel reads them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["zero_past_length", "zero_past_lengths"]


def zero_past_length(x: Any, kv_lengths: Any) -> jax.Array:
    """A cache ``(B, S, H, D)`` with positions ``>= kv_lengths[b]`` replaced by zeros."""
    x = jnp.asarray(x)
    live = jnp.arange(x.shape[1])[None, :] < jnp.asarray(kv_lengths).reshape(-1, 1)  # (B, S)
    return jnp.where(live[:, :, None, None], x, jnp.zeros((), x.dtype))


def zero_past_lengths(k: Any, v: Any, kv_lengths: Any) -> tuple[jax.Array, jax.Array]:
    """K and V ``(B, S, H, D|Dv)`` with positions ``>= kv_lengths[b]`` replaced by zeros."""
    return zero_past_length(k, kv_lengths), zero_past_length(v, kv_lengths)
