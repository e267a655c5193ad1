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

__all__ = ["zero_past_length", "zero_past_lengths", "zero_unseen_keys"]


def zero_past_length(x: Any, kv_lengths: Any) -> jax.Array:
    """A cache ``(B, S, H, D)`` with positions ``>= kv_lengths[b]`` replaced by zeros."""
    x = jnp.asarray(x)
    live = jnp.arange(x.shape[1])[None, :] < jnp.asarray(kv_lengths).reshape(-1, 1)  # (B, S)
    return jnp.where(live[:, :, None, None], x, jnp.zeros((), x.dtype))


def zero_past_lengths(k: Any, v: Any, kv_lengths: Any) -> tuple[jax.Array, jax.Array]:
    """K and V ``(B, S, H, D|Dv)`` with positions ``>= kv_lengths[b]`` replaced by zeros."""
    return zero_past_length(k, kv_lengths), zero_past_length(v, kv_lengths)


def zero_unseen_keys(visible: Any, k: Any, v: Any) -> tuple[jax.Array, jax.Array]:
    """K and V ``(B, S, Hkv, D|Dv)`` with every key that no query of its sequence and KV head
    sees replaced by zeros: ``visible`` is a boolean broadcastable to ``(B, Hq, T, S)`` (a
    mask_mod's keys that no query sees are unread, docs/masks.md)."""
    k, v = jnp.asarray(k), jnp.asarray(v)
    visible = jnp.asarray(visible, bool)
    visible = visible.reshape((1,) * (4 - visible.ndim) + visible.shape)
    s, hkv = k.shape[1], k.shape[2]
    seen = jnp.any(visible, axis=2)  # (B|1, Hq|1, S|1)
    seen = jnp.broadcast_to(seen, (seen.shape[0], max(seen.shape[1], hkv), s))
    hq = seen.shape[1]
    keep = jnp.any(seen.reshape(seen.shape[0], hkv, hq // hkv, s), axis=2).transpose(0, 2, 1)[..., None]
    return jnp.where(keep, k, jnp.zeros((), k.dtype)), jnp.where(keep, v, jnp.zeros((), v.dtype))
