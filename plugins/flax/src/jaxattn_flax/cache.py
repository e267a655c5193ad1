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

**Capacity.** A fixed cache holds ``max_length`` positions. A write past them is an
``InvalidInputError`` when ``index`` is concrete (eager calls). Under ``jit`` it cannot raise:
the write is dropped (the cache's keys, values and ``index`` stay as they were), the call's
outputs are NaN (never numbers that look right), and ``overflowed`` (a bool scalar, part of
the cache) becomes and stays True, for the caller to read after the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn import InvalidInputError

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    key: Any  # (B, L, Hkv, D)
    value: Any  # (B, L, Hkv, Dv)
    index: Any = None  # int32 scalar: valid positions of a fixed cache; None: a growing cache
    overflowed: Any = None  # bool scalar of a fixed cache: a write was dropped for want of room (under jit)

    @classmethod
    def empty(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, dtype: Any = jnp.float32,
              value_head_dim: int | None = None) -> KVCache:
        """A fixed-size cache with nothing in it yet."""
        return cls(
            key=jnp.zeros((batch, max_length, num_kv_heads, head_dim), dtype),
            value=jnp.zeros((batch, max_length, num_kv_heads, value_head_dim or head_dim), dtype),
            index=jnp.zeros((), jnp.int32),
            overflowed=jnp.zeros((), bool),
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

    def update(self, key: Any, value: Any) -> tuple[KVCache, Any, Any, Any, Any]:
        """Add ``key``/``value`` (T new positions): the new cache, the keys and values to attend
        over, for a fixed cache the valid positions of each sequence ``(B,)`` int32 (the call's
        ``kv_lengths``; None for a growing cache, whose every position is valid), and whether the
        write fit (a bool scalar for a fixed cache, None for a growing one). A write that does not
        fit raises when ``index`` is concrete; traced, it leaves the cache as it was."""
        if not self.fixed:
            keys = jnp.concatenate([self.key, key.astype(self.key.dtype)], axis=1)
            values = jnp.concatenate([self.value, value.astype(self.value.dtype)], axis=1)
            return KVCache(keys, values), keys, values, None, None
        t = key.shape[1]
        _check_room(self.index, t, self.max_length)
        fits = self.index + t <= self.max_length
        start = (0, self.index, 0, 0)
        keys, values = (_write(buf, x, start, fits) for buf, x in ((self.key, key), (self.value, value)))
        index = jnp.where(fits, self.index + t, self.index).astype(jnp.int32)
        lengths = jnp.full((key.shape[0],), index, jnp.int32)
        overflowed = jnp.logical_or(False if self.overflowed is None else self.overflowed, ~fits)
        return KVCache(keys, values, index, overflowed), keys, values, lengths, fits


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

def _write(buffer: Any, x: Any, start: tuple[Any, ...], fits: Any) -> Any:
    """``x`` written at ``start``, or (where it does not fit) what was there: dynamic_update_slice
    clamps an overflowing start and would overwrite the newest positions. Selecting on the
    slice, not the buffer, keeps the update in place."""
    old = jax.lax.dynamic_slice(buffer, start, x.shape)  # clamped as the update below is
    return jax.lax.dynamic_update_slice(buffer, jnp.where(fits, x.astype(buffer.dtype), old), start)


def _check_room(index: Any, t: int, length: int) -> None:
    # An index known outside jit is checked here; a traced one cannot raise (update() then drops
    # the write and the caller's outputs become NaN, with the cache's overflowed flag set).
    if t > length:  # static: no index makes room
        raise InvalidInputError("key_states", f"KV cache overflow: {t} new positions > max_length {length}",
                                "allocate a longer cache (init_cache / KVCache.empty)")
    try:
        used = int(index)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if used + t > length:
        raise InvalidInputError("key_states", f"KV cache overflow: {used} positions used + {t} new > max_length "
                                f"{length}", "allocate a longer cache (init_cache / KVCache.empty)")
