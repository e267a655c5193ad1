"""``AttentionMetadata``: every knob of an attention call, each with a sensible default."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._dtypes import dtype_name
from .errors import InvalidInputError, InvalidTypeError

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["DEFAULT_METADATA", "AttentionMetadata", "AxisName", "as_metadata", "axis_tuple", "describe_axes",
           "is_bool", "positive", "probability"]

AxisName = str | tuple[str, ...] | None

_PLATFORMS = (None, "cpu", "gpu", "tpu", "cuda", "rocm")
_AXIS_FIELDS = ("batch_axis", "head_axis", "sequence_axis")


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Configuration shared by every backend. ``AttentionMetadata()`` is always valid.

    A call's own arguments (``softmax_scale=``, ``logits_soft_cap=``, ``dropout_prob=``) win
    over the fields of the same name here.
    """

    runtime_dtype: str | None = None
    softmax_dtype: str = "float32"
    softmax_scale: float | None = None
    logits_soft_cap: float | None = None
    dropout_prob: float = 0.0
    block_q: int | None = None
    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    mesh: Mesh | None = None
    batch_axis: AxisName = None
    head_axis: AxisName = None
    sequence_axis: AxisName = None
    platform: str | None = None
    interpret: bool = False
    allow_fallback: bool = True
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Canonical dtype strings keep metadata hashable and jax-free.
        if self.runtime_dtype is not None:
            object.__setattr__(self, "runtime_dtype", dtype_name(self.runtime_dtype))
        object.__setattr__(self, "softmax_dtype", dtype_name(self.softmax_dtype))
        if self.platform is not None:
            object.__setattr__(self, "platform", str(self.platform).lower())
        if self.platform not in _PLATFORMS:
            raise ValueError(
                f"AttentionMetadata.platform: {self.platform!r} is not one of cpu, gpu, tpu, cuda, rocm "
                "(or None to detect the device)"
            )
        probability("AttentionMetadata.dropout_prob", self.dropout_prob)
        positive("AttentionMetadata.softmax_scale", self.softmax_scale)
        positive("AttentionMetadata.logits_soft_cap", self.logits_soft_cap)
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"AttentionMetadata.{name}: must be a positive int or None, got {value!r}")
        object.__setattr__(self, "extra", dict(self.extra))
        _check_axes(self)

        # Hashed on every dispatch (impl and choice caches): compute it once.
        object.__setattr__(self, "_hash", self._compute_hash())

    def _compute_hash(self) -> int:
        items = tuple(
            tuple(sorted(self.extra.items())) if f.name == "extra" else getattr(self, f.name)
            for f in dataclasses.fields(self)
        )
        return hash(items)

    def __hash__(self) -> int:
        return self._hash  # type: ignore[no-any-return,attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        # String hashes differ between processes: never carry one across a pickle.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_hash", self._compute_hash())

    def replace(self, **changes: Any) -> AttentionMetadata:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def block_sizes(self) -> dict[str, int]:
        """The tile sizes that were set explicitly."""
        names = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")
        return {n: v for n in names if (v := getattr(self, n)) is not None}


_NUMBER_HINTS = {
    "softmax_scale": "None gives the default D ** -0.5",
    "logits_soft_cap": "None means no soft cap",
    "dropout_prob": "0.0 means no dropout",
}


def is_bool(x: Any) -> bool:
    """A Python or NumPy bool (NumPy's is named ``bool`` in NumPy 2, ``bool_`` before), without importing NumPy."""
    return isinstance(x, bool) or type(x).__name__ in ("bool", "bool_")


def _real(name: str, value: Any) -> float:
    """``value`` as a float, or ``InvalidInputError`` naming ``name``: numbers only (no bools or
    strings), and static ones (they pick kernels at trace time)."""
    hint = _NUMBER_HINTS.get(name.rsplit(".", 1)[-1])
    if is_bool(value) or isinstance(value, str | bytes):
        raise InvalidTypeError(name, f"must be a real number, got {type(value).__name__} {value!r}", hint)
    try:
        return float(value)
    except OverflowError:  # an int past float's range: a number, but not a finite one
        return math.inf
    except (TypeError, ValueError) as err:  # jax's ConcretizationTypeError is a TypeError
        if type(err).__module__.startswith("jax"):
            raise InvalidTypeError(name, "must be a Python number (static), not a traced array",
                                    "pass it outside jax.jit's traced arguments (static_argnames)") from None
        raise InvalidTypeError(name, f"must be a real number, got {type(value).__name__} {value!r}", hint) from None


def positive(name: str, value: Any) -> float | None:
    """``value`` as a finite float > 0 (None stays None), else ``InvalidInputError`` naming ``name``."""
    if value is None:
        return None
    out = _real(name, value)
    if not (math.isfinite(out) and out > 0):
        raise InvalidInputError(name, f"must be finite and > 0, got {value!r}",
                                _NUMBER_HINTS.get(name.rsplit(".", 1)[-1]))
    return out


def probability(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1), else ``InvalidInputError`` naming ``name``."""
    out = _real(name, value)
    if not 0.0 <= out < 1.0:
        raise InvalidInputError(name, f"must be in [0, 1), got {value!r}", _NUMBER_HINTS["dropout_prob"])
    return out


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


def _check_axes(metadata: AttentionMetadata) -> None:
    """Raise ``ValueError`` naming the field when the axis names do not fit ``metadata.mesh``.

    Without a mesh the names are allowed: the call then runs inside the caller's own
    ``shard_map`` where those axes are bound (see docs/sharding.md).
    """
    seen: dict[str, str] = {}
    for field in _AXIS_FIELDS:
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


#: The metadata of calls that pass none (shared, so a call does not build one).
DEFAULT_METADATA = AttentionMetadata()


def as_metadata(metadata: Any) -> AttentionMetadata:
    """``metadata``, or the default for None; anything else is an ``InvalidTypeError``."""
    if metadata is None:
        return DEFAULT_METADATA
    if not isinstance(metadata, AttentionMetadata):
        raise InvalidTypeError("metadata", f"must be an AttentionMetadata, got {type(metadata).__name__}",
                               "pass jaxattn.AttentionMetadata(...), or None for the defaults")
    return metadata
