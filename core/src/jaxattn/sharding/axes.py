"""Mesh axes of a call: which mesh axes shard the batch, the heads and the sequence.

Pure Python (no jax import): ``AttentionMetadata`` validates its axis names with it, and
``not_supported_reasons`` asks it why an impl cannot honour a sequence axis, so discovery,
listing and ``explain`` stay cheap.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..metadata import AttentionMetadata

__all__ = [
    "MeshAxes",
    "axis_tuple",
    "check_metadata_axes",
    "describe_axes",
    "kv_head_repeat",
    "mesh_axes",
    "sequence_reasons",
]

_FIELDS = ("batch_axis", "head_axis", "sequence_axis")


def axis_tuple(axis: str | Iterable[str] | None) -> tuple[str, ...]:
    """``None`` -> ``()``, ``"data"`` -> ``("data",)``, ``("data", "fsdp")`` unchanged."""
    if axis is None:
        return ()
    if isinstance(axis, str):
        return (axis,)
    return tuple(str(a) for a in axis)


def describe_axes(axes: tuple[str, ...]) -> str:
    """How error messages name one or several mesh axes."""
    return repr(axes[0]) if len(axes) == 1 else "(" + ", ".join(repr(a) for a in axes) + ")"


def check_metadata_axes(metadata: AttentionMetadata) -> None:
    """Raise ``ValueError`` naming the field when the axis names do not fit ``metadata.mesh``.

    Without a mesh the names are allowed: the call then runs inside the caller's own
    ``shard_map`` where those axes are bound (see docs/sharding.md).
    """
    seen: dict[str, str] = {}
    for field in _FIELDS:
        value = getattr(metadata, field)
        if value is not None and not (isinstance(value, str) or (
                isinstance(value, tuple) and value and all(isinstance(a, str) for a in value))):
            raise ValueError(
                f"AttentionMetadata.{field}: expected a mesh axis name or a non-empty tuple of names, got {value!r}"
            )
        for name in axis_tuple(value):
            if name in seen:
                raise ValueError(
                    f"AttentionMetadata.{field}: mesh axis {name!r} is already used by {seen[name]}; "
                    "each mesh axis can shard only one dimension"
                )
            seen[name] = field
    mesh = metadata.mesh
    if mesh is None:
        return
    names = tuple(getattr(mesh, "axis_names", ()))
    unknown = [n for n in seen if n not in names]
    if unknown:
        raise ValueError(
            f"AttentionMetadata: mesh axes {unknown} ({', '.join(seen[n] for n in unknown)}) are not axes of "
            f"metadata.mesh, whose axes are {list(names)}"
        )


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


def sequence_reasons(impl_name: str, sequence_parallel: bool, metadata: AttentionMetadata) -> list[str]:
    """Why an impl cannot honour ``metadata.sequence_axis`` (empty when it can or none is set)."""
    if metadata.sequence_axis is None or sequence_parallel:
        return []
    return [
        f"metadata.sequence_axis={metadata.sequence_axis!r} shards the sequence, but {impl_name} runs whole "
        "sequences on each device (shard_map over batch and heads only); use impl='ring' (which runs a "
        "per-block kernel such as vanilla), or leave sequence_axis unset"
    ]
