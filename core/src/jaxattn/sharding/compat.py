"""``shard_map`` and axis queries across the jax versions jaxattn supports (jax >= 0.10).

``shard_map`` lives at ``jax.shard_map`` in current releases and at
``jax.experimental.shard_map.shard_map`` in older ones; its replication check is called
``check_vma`` in the former and ``check_rep`` in the latter.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["abstract_mesh", "axis_size", "shard_map"]


def _check_flag(fn: Callable[..., Any]) -> str:
    params = inspect.signature(fn).parameters
    return "check_vma" if "check_vma" in params else "check_rep"


def shard_map(f: Callable[..., Any], *, mesh: Any, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``shard_map(f)`` with the replication check off.

    The check is off because kernels (Pallas calls, custom calls) have no replication rules
    in every jax version. It is not needed for correctness: with it off, jax divides the
    cotangents of outputs replicated over unmentioned axes and sums (psum) the cotangents
    of replicated inputs, which is exact for bodies whose replicated outputs really are
    replicated, as attention's are.
    """
    new = getattr(jax, "shard_map", None)
    run: Callable[..., Any]
    if new is not None:
        run = new(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_check_flag(new): False})
        return run
    from jax.experimental.shard_map import shard_map as old  # jax without jax.shard_map

    run = old(f, mesh, in_specs, out_specs, **{_check_flag(old): False})
    return run


def axis_size(name: str | tuple[str, ...]) -> int:
    """The (static) size of a bound mesh axis, inside ``shard_map``."""
    size = getattr(jax.lax, "axis_size", None)
    if size is not None:
        return int(size(name))
    return int(jax.lax.psum(1, name))


def abstract_mesh(axes: tuple[tuple[str, int], ...]) -> Any:
    """A ``jax.sharding.AbstractMesh`` of ``(name, size)`` axes: a mesh's shape without devices,
    enough for ``explain`` to plan a sharded call on a machine that lacks those devices."""
    from jax.sharding import AbstractMesh

    return AbstractMesh(tuple(s for _, s in axes), tuple(n for n, _ in axes))
