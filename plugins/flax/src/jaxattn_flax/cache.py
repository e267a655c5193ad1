"""Key/value caches for decoding with :class:`~jaxattn_flax.FlexibleAttentionModule`.

Two layouts, one class:

* **growing** (``index is None``): ``key``/``value`` hold exactly the positions seen so far.
  A step appends along the sequence axis and attends with ``causal=True``, whose bottom-right
  alignment lets the new queries see every cached key (a T=1 decode step sees them all). No
  mask is needed, so every backend that does causal attention can run it; shapes grow, so a
  jitted loop retraces per length.
* **fixed** (``index`` an int32 scalar): ``key``/``value`` are preallocated to a maximum
  length and ``index`` counts the valid positions. A step writes in place and attends over
  the whole buffer with ``kv_lengths`` (``index`` after the write, per sequence), so causal
  masking and a sliding window align to the last written token, not to the buffer's end
  (docs/contract.md, "Decode over a dense cache"); shapes stay static under ``jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    key: Any  # (B, L, Hkv, D)
    value: Any  # (B, L, Hkv, Dv)
    index: Any = None  # int32 scalar: valid positions of a fixed cache; None: a growing cache

    @classmethod
    def empty(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, dtype: Any = jnp.float32,
              value_head_dim: int | None = None) -> KVCache:
        """A fixed-size cache with nothing in it yet."""
        return cls(
            key=jnp.zeros((batch, max_length, num_kv_heads, head_dim), dtype),
            value=jnp.zeros((batch, max_length, num_kv_heads, value_head_dim or head_dim), dtype),
            index=jnp.zeros((), jnp.int32),
        )

    @classmethod
    def growing(cls, key: Any, value: Any) -> KVCache:
        """A growing cache that starts from ``key``/``value`` (e.g. a prefill's)."""
        return cls(key=key, value=value, index=None)

    @property
    def fixed(self) -> bool:
        return self.index is not None

    @property
    def max_length(self) -> int:
        return int(self.key.shape[1])

    def update(self, key: Any, value: Any) -> tuple[KVCache, Any, Any, Any]:
        """Add ``key``/``value`` (T new positions): the new cache, the keys and values to attend
        over, and for a fixed cache the valid positions of each sequence ``(B,)`` int32 (the
        call's ``kv_lengths``; None for a growing cache, whose every position is valid)."""
        if not self.fixed:
            keys = jnp.concatenate([self.key, key.astype(self.key.dtype)], axis=1)
            values = jnp.concatenate([self.value, value.astype(self.value.dtype)], axis=1)
            return KVCache(keys, values), keys, values, None
        t = key.shape[1]
        _check_room(self.index, t, self.max_length)
        start = (0, self.index, 0, 0)
        keys = jax.lax.dynamic_update_slice(self.key, key.astype(self.key.dtype), start)
        values = jax.lax.dynamic_update_slice(self.value, value.astype(self.value.dtype), start)
        lengths = jnp.full((key.shape[0],), self.index + t, jnp.int32)
        return KVCache(keys, values, self.index + t), keys, values, lengths


def valid_mask(lengths: Any, t: int, max_length: int, causal: bool, window: tuple[int, int] | None) -> Any:
    """``(B, 1, T, L)``: what ``kv_lengths=lengths`` with ``causal`` and ``window`` lets each of the
    T newest queries see, as a mask, for impls that take a mask but no ``kv_lengths``.

    Query i sits at position ``lengths - T + i`` (the contract's kv_lengths alignment)."""
    query_pos = (lengths[:, None] - t + jnp.arange(t)[None, :])[:, None, :, None]  # (B, 1, T, 1)
    key_pos = jnp.arange(max_length)[None, None, None, :]
    mask = key_pos < lengths[:, None, None, None]
    if causal:
        mask &= key_pos <= query_pos
    if window is not None:
        mask &= (key_pos >= query_pos - window[0]) & (key_pos <= query_pos + window[1])
    return mask

def _check_room(index: Any, t: int, length: int) -> None:
    # dynamic_update_slice clamps an overflowing write (it would overwrite the last positions
    # silently); an index known outside jit is checked here, a traced one cannot be.
    try:
        used = int(index)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if used + t > length:
        raise ValueError(f"KV cache overflow: {used} positions used + {t} new > max_length {length}; "
                         "allocate a longer cache (init_cache / KVCache.empty)")
