"""Attention on a device mesh: ``shard_map`` over batch and heads, and the sequence axis for ring.

``AttentionMetadata(mesh=..., batch_axis=..., head_axis=..., sequence_axis=...)`` names the
mesh axes; every impl then runs under ``shard_map`` with specs derived from them (see
docs/sharding.md). ``jaxattn.sharding.axes`` imports no jax; the rest loads on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "AttentionSpecs",
    "MeshAxes",
    "axis_size",
    "check_batch_heads",
    "kv_head_repeat",
    "local_metadata",
    "mesh_axes",
    "shard_map",
    "sharded_forward",
]

_LAZY = {
    "AttentionSpecs": ".specs",
    "MeshAxes": ".axes",
    "axis_size": ".compat",
    "check_batch_heads": ".wrap",
    "kv_head_repeat": ".axes",
    "local_metadata": ".wrap",
    "mesh_axes": ".axes",
    "shard_map": ".compat",
    "sharded_forward": ".wrap",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)


if TYPE_CHECKING:
    from .axes import MeshAxes, kv_head_repeat, mesh_axes
    from .compat import axis_size, shard_map
    from .specs import AttentionSpecs
    from .wrap import check_batch_heads, local_metadata, sharded_forward
