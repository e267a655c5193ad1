"""Where each sequence position lives on the ring, and moving between layouts.

``contiguous``: device ``i`` of ``n`` holds rows ``[i*L, (i+1)*L)`` (how a sharded array is
laid out). ``zigzag``: the sequence is cut into ``2n`` chunks and device ``i`` holds chunks
``i`` and ``2n-1-i``, so that under causal masking every device has the same amount of
visible work (an early chunk with little to see, a late one with much). Inputs arrive
contiguous; ``to_zigzag`` moves them with two ``ppermute``s of half a shard each (each
device sends each of its two chunks to exactly one device), ``from_zigzag`` moves results
back.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LAYOUTS",
    "Layout",
    "device_rows",
    "from_zigzag",
    "key_columns",
    "positions",
    "put_device_rows",
    "to_zigzag",
    "zigzag_permutation",
]

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")
AxisName = str | tuple[str, ...]


def zigzag_permutation(length: int, n: int) -> np.ndarray:
    """Global row order of the zigzag layout: device ``i`` holds rows ``perm[i*L:(i+1)*L]``.

    ``x[:, zigzag_permutation(T, n)]`` lists the rows in the order the devices hold them
    (for inspecting the layout, or for data prepared in that order).
    """
    if length % (2 * n):
        raise ValueError(f"zigzag needs the length {length} to be a multiple of 2 * {n}")
    c = length // (2 * n)
    chunks = [(i, 2 * n - 1 - i) for i in range(n)]
    return np.concatenate([np.arange(m * c, (m + 1) * c) for pair in chunks for m in pair])


def _dest(chunk: int, n: int) -> int:
    """The device that holds ``chunk`` in the zigzag layout."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _halves(x: Any, axis: int) -> tuple[Any, Any]:
    half = x.shape[axis] // 2
    return (jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))


def to_zigzag(x: Any, axis: int, axis_name: AxisName, n: int) -> Any:
    """Contiguous shard (chunks ``2d``, ``2d+1`` on device ``d``) -> zigzag shard, along ``axis``."""
    if n == 1:
        return x
    even, odd = _halves(x, axis)
    got_even = jax.lax.ppermute(even, axis_name, [(d, _dest(2 * d, n)) for d in range(n)])
    got_odd = jax.lax.ppermute(odd, axis_name, [(d, _dest(2 * d + 1, n)) for d in range(n)])
    # Device i receives chunks i and 2n-1-i, one even and one odd; chunk i goes first.
    i_even = jax.lax.axis_index(axis_name) % 2 == 0
    first = jnp.where(i_even, got_even, got_odd)
    second = jnp.where(i_even, got_odd, got_even)
    return jnp.concatenate([first, second], axis=axis)


def from_zigzag(x: Any, axis: int, axis_name: AxisName, n: int) -> Any:
    """Zigzag shard -> contiguous shard along ``axis`` (the inverse of ``to_zigzag``)."""
    if n == 1:
        return x
    first, second = _halves(x, axis)
    i_even = jax.lax.axis_index(axis_name) % 2 == 0
    even = jnp.where(i_even, first, second)
    odd = jnp.where(i_even, second, first)
    back_even = jax.lax.ppermute(even, axis_name, [(_dest(2 * d, n), d) for d in range(n)])
    back_odd = jax.lax.ppermute(odd, axis_name, [(_dest(2 * d + 1, n), d) for d in range(n)])
    return jnp.concatenate([back_even, back_odd], axis=axis)


def positions(layout: Layout, index: Any, n: int, local: int) -> Any:
    """Global positions ``(local,)`` of the rows device ``index`` holds (``index`` may be traced)."""
    if layout == "contiguous":
        return index * local + jnp.arange(local)
    c = local // 2
    return jnp.concatenate([index * c + jnp.arange(c), (2 * n - 1 - index) * c + jnp.arange(c)])


def device_rows(x: Any, layout: Layout, src: Any, n: int, local: int, axis: int) -> Any:
    """The rows along ``axis`` (global order) that device ``src`` holds in ``layout``."""
    if layout == "contiguous":
        return jax.lax.dynamic_slice_in_dim(x, src * local, local, axis=axis)
    c = local // 2
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, src * c, c, axis=axis),
                            jax.lax.dynamic_slice_in_dim(x, (2 * n - 1 - src) * c, c, axis=axis)], axis=axis)


def put_device_rows(x: Any, rows: Any, layout: Layout, src: Any, n: int, local: int, axis: int) -> Any:
    """``x`` with device ``src``'s rows along ``axis`` replaced by ``rows`` (inverse of :func:`device_rows`)."""
    if layout == "contiguous":
        return jax.lax.dynamic_update_slice_in_dim(x, rows, src * local, axis=axis)
    c = local // 2
    first, second = _halves(rows, axis)
    x = jax.lax.dynamic_update_slice_in_dim(x, first, src * c, axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(x, second, (2 * n - 1 - src) * c, axis=axis)


def key_columns(x: Any, layout: Layout, src: Any, n: int, local: int) -> Any:
    """Columns (last axis, global key order) of the keys that device ``src`` holds; size-1 axes pass."""
    if x.shape[-1] == 1:
        return x
    return device_rows(x, layout, src, n, local, x.ndim - 1)
