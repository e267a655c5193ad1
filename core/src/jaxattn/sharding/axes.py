"""Mesh axes of a call: which mesh axes shard the batch, the heads and the sequence, and their sizes.

Pure Python (no jax import). The axis names themselves are checked where they are given,
by ``AttentionMetadata``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..backend.metadata import AttentionMetadata, axis_tuple, describe_axes
from ..errors import InvalidInputError

__all__ = ["MeshAxes", "kv_head_repeat", "mesh_axes"]


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The resolved axes of one mesh, with their sizes (a product for a tuple of axes)."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]
    sequence: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]  # every axis of the mesh, in mesh order

    def size(self, axes: tuple[str, ...]) -> int:
        table = dict(self.sizes)
        return math.prod(table[a] for a in axes)

    @property
    def batch_size(self) -> int:
        return self.size(self.batch)

    @property
    def head_size(self) -> int:
        return self.size(self.heads)

    @property
    def sequence_size(self) -> int:
        return self.size(self.sequence)

    def spec_entry(self, axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
        """A ``PartitionSpec`` entry: None, one name, or a tuple of names."""
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes

    def check_divides(self, what: str, argument: str, size: int, axes: tuple[str, ...], field: str) -> None:
        """``InvalidInputError`` naming the dimension, the axis and both sizes when ``size`` does not split."""
        parts = self.size(axes)
        if axes and size % parts:
            raise InvalidInputError(
                argument,
                f"{what} {size} is not divisible by mesh axis {describe_axes(axes)} of size {parts} "
                f"(AttentionMetadata.{field})",
                f"pad {what} to a multiple of {parts}, or shard it over other mesh axes",
            )


def mesh_axes(metadata: AttentionMetadata) -> MeshAxes | None:
    """The axes of ``metadata.mesh`` (None when the metadata carries no mesh)."""
    mesh = metadata.mesh
    if mesh is None:
        return None
    shape: Any = mesh.shape  # an ordered mapping axis name -> size
    return MeshAxes(
        batch=axis_tuple(metadata.batch_axis),
        heads=axis_tuple(metadata.head_axis),
        sequence=axis_tuple(metadata.sequence_axis),
        sizes=tuple((str(name), int(size)) for name, size in shape.items()),
    )


def kv_head_repeat(heads_q: int, heads_kv: int, parts: int) -> int:
    """How many times to repeat each K/V head so that ``parts`` head shards each see whole groups.

    Query head ``h`` reads K/V head ``h // (Hq // Hkv)``. Sharding Hq contiguously into
    ``parts`` pieces keeps that mapping local when Hkv divides into the same pieces; otherwise
    (e.g. MQA, Hkv=1 over 4 devices) each K/V head is repeated ``parts // gcd(Hkv, parts)``
    times, the fewest copies that make the repeated heads divisible. ``Hq % parts == 0``
    guarantees the group size is a multiple of that factor.
    """
    if parts <= 1 or heads_kv % parts == 0:
        return 1
    return parts // math.gcd(heads_kv, parts)
