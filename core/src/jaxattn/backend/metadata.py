"""``AttentionMetadata``: every knob of an attention call, each with a sensible default."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, InvalidTypeError, did_you_mean
from ._dtypes import dtype_name

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["DEFAULT_METADATA", "EASYDEL_ALIASES", "AttentionMetadata", "AxisName", "as_metadata", "axis_tuple",
           "check_split", "describe_axes", "is_bool", "positive", "probability"]

AxisName = str | tuple[str, ...] | None

_PLATFORMS = (None, "cpu", "gpu", "tpu", "cuda", "rocm")
_AXIS_FIELDS = ("batch_axis", "head_axis", "sequence_axis")


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Configuration shared by every backend. ``AttentionMetadata()`` is always valid.

    A call's own arguments (``softmax_scale=``, ``logits_soft_cap=``, ``dropout_prob=``) win
    over the fields of the same name here. Every field is checked here, at construction:
    ``InvalidTypeError`` for a value of the wrong type (a string for a bool, an int for an axis
    name), ``InvalidInputError`` for a wrong value (``softmax_dtype="int8"``, ``block_q=0``),
    each naming the field. ``extra`` maps option names (str) to hashable values that backends
    read (``ring_comm``...).

    EasyDeL's field names are accepted as aliases (``EASYDEL_ALIASES``):
    ``runtime_softmax_dtype`` is ``softmax_dtype``, ``soft_cap`` ``logits_soft_cap``,
    ``blocksize_q`` / ``blocksize_k`` ``block_q`` / ``block_k``, ``sequence_axis_name``
    ``sequence_axis`` and ``backend`` (the device: ``"cpu"``, ``"gpu"``, ``"tpu"``)
    ``platform``. Those jaxattn has no field for are recorded in ``easydel`` (a read-only
    mapping, left out of equality and the hash) and change nothing: ``blocksize_b`` (jaxattn
    never blocks the batch), ``partition_axis`` and ``partition_manager`` (jaxattn shards only
    over ``mesh`` with ``batch_axis`` / ``head_axis`` / ``sequence_axis``: set those),
    ``base_config`` (no model config is read) and ``scan_ring_attention`` (the ring backend
    picks its own loop; ``extra={"ring_comm": ...}`` picks how K/V travel). An alias given
    together with its jaxattn field, with another value, is an ``InvalidInputError``.
    ``...`` (EasyDeL's "not given") and None given to an alias mean not given.
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
    #: EasyDeL fields without a jaxattn meaning, as given (see the class docstring).
    easydel: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Canonical dtype strings keep metadata hashable and jax-free.
        if self.runtime_dtype is not None:
            object.__setattr__(self, "runtime_dtype", _float_dtype("runtime_dtype", self.runtime_dtype))
        object.__setattr__(self, "softmax_dtype", _float_dtype("softmax_dtype", self.softmax_dtype))
        object.__setattr__(self, "platform", _platform(self.platform))
        probability("AttentionMetadata.dropout_prob", self.dropout_prob)
        positive("AttentionMetadata.softmax_scale", self.softmax_scale)
        positive("AttentionMetadata.logits_soft_cap", self.logits_soft_cap)
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps", "num_stages"):
            _positive_int(f"AttentionMetadata.{name}", getattr(self, name))
        for name in ("interpret", "allow_fallback"):
            if not is_bool(getattr(self, name)):
                raise InvalidTypeError(f"AttentionMetadata.{name}", f"must be a bool, got "
                                       f"{type(getattr(self, name)).__name__} {getattr(self, name)!r}",
                                       "pass True or False")
        object.__setattr__(self, "extra", _options("extra", self.extra))
        object.__setattr__(self, "easydel", MappingProxyType(dict(self.easydel)))
        _check_mesh(self.mesh)
        _check_axes(self)

        # Hashed on every dispatch (impl and choice caches): compute it once.
        object.__setattr__(self, "_hash", self._compute_hash())

    def _compute_hash(self) -> int:
        items = tuple(
            tuple(sorted(self.extra.items())) if f.name == "extra" else getattr(self, f.name)
            for f in dataclasses.fields(self) if f.compare
        )
        return hash(items)

    def __hash__(self) -> int:
        return self._hash  # type: ignore[no-any-return,attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        # String hashes differ between processes: never carry one across a pickle.
        state = {k: v for k, v in self.__dict__.items() if k != "_hash"}
        state["easydel"] = dict(self.easydel)  # a mappingproxy does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "easydel", MappingProxyType(dict(state.get("easydel", {}))))
        object.__setattr__(self, "_hash", self._compute_hash())

    def replace(self, **changes: Any) -> AttentionMetadata:
        """A copy with some fields changed (EasyDeL's names too)."""
        return dataclasses.replace(self, **_translate(changes, self))

    @property
    def block_sizes(self) -> dict[str, int]:
        """The tile sizes that were set explicitly."""
        names = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")
        return {n: v for n in names if (v := getattr(self, n)) is not None}


#: EasyDeL's ``AttentionMetadata`` field names -> jaxattn's field, or None for those recorded in
#: ``AttentionMetadata.easydel`` without effect (the class docstring says why for each).
EASYDEL_ALIASES: dict[str, str | None] = {
    "runtime_softmax_dtype": "softmax_dtype", "soft_cap": "logits_soft_cap", "blocksize_q": "block_q",
    "blocksize_k": "block_k", "sequence_axis_name": "sequence_axis", "backend": "platform",
    "blocksize_b": None, "partition_axis": None, "partition_manager": None, "base_config": None,
    "scan_ring_attention": None,
}


def _translate(kwargs: dict[str, Any], current: AttentionMetadata | None = None) -> dict[str, Any]:
    """``kwargs`` with EasyDeL's names mapped onto jaxattn's (recorded ones into ``easydel``);
    an unknown name is an ``InvalidInputError`` with the closest field names."""
    fields = {f.name for f in dataclasses.fields(AttentionMetadata)}
    out = {k: v for k, v in kwargs.items() if k in fields}
    recorded = dict(out.get("easydel", current.easydel if current is not None else {}))
    for name, value in kwargs.items():
        if name in fields:
            continue
        if name not in EASYDEL_ALIASES:
            raise InvalidInputError(f"AttentionMetadata({name}=...)", "is not a field"
                                    + did_you_mean(name, sorted(fields | set(EASYDEL_ALIASES))),
                                    "the fields are listed in help(jaxattn.AttentionMetadata)")
        target = EASYDEL_ALIASES[name]
        if value is ... or value is None:  # EasyDeL's "not given" and its defaults: jaxattn's too
            continue
        if target is None:
            if name == "blocksize_b":
                _positive_int("AttentionMetadata.blocksize_b", value)
            if name == "scan_ring_attention" and not is_bool(value):
                raise InvalidTypeError("AttentionMetadata.scan_ring_attention", f"must be a bool, got {value!r}")
            recorded[name] = value
            continue
        if name == "backend":
            value = str(getattr(value, "value", value))  # EasyDeLBackends members are str enums
        if target in out and out[target] != value:
            raise InvalidInputError(f"AttentionMetadata.{name}", f"is EasyDeL's name of {target}, given too "
                                    f"with another value ({value!r} vs {out[target]!r})", "pass one of them")
        out[target] = value
    if recorded or "easydel" in out:
        out["easydel"] = recorded
    return out


_dataclass_init = AttentionMetadata.__init__


@functools.wraps(_dataclass_init)
def _init(self: AttentionMetadata, *args: Any, **kwargs: Any) -> None:
    _dataclass_init(self, *args, **_translate(kwargs))


AttentionMetadata.__init__ = _init  # type: ignore[method-assign]  # EasyDeL's names and unknown ones, checked


_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _float_dtype(field: str, value: Any) -> str:
    """A floating dtype's canonical name, else an error naming ``AttentionMetadata.<field>``."""
    argument = f"AttentionMetadata.{field}"
    if value is None:  # numpy reads None as float64
        raise InvalidTypeError(argument, "must be a dtype or dtype name, got None", "'float32' is the default")
    try:
        name = dtype_name(value)
    except (TypeError, ValueError):
        raise InvalidTypeError(argument, f"must be a dtype or dtype name, got {type(value).__name__} {value!r}",
                               f"one of {', '.join(_FLOAT_DTYPES)}") from None
    if name not in _FLOAT_DTYPES:
        raise InvalidInputError(argument, f"must be a floating dtype, got {value!r}"
                                + did_you_mean(name, _FLOAT_DTYPES), f"one of {', '.join(_FLOAT_DTYPES)}")
    return name


def _platform(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidTypeError("AttentionMetadata.platform", f"must be a str or None, got {type(value).__name__} "
                               f"{value!r}", "one of cpu, gpu, tpu, cuda, rocm; None detects the device")
    name = value.strip().lower()
    if name not in _PLATFORMS:
        raise InvalidInputError("AttentionMetadata.platform", f"{value!r} is not one of cpu, gpu, tpu, cuda, rocm"
                                + did_you_mean(name, [p for p in _PLATFORMS if p]), "or None to detect the device")
    return name


def _positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if is_bool(value) or not isinstance(value, int):
        raise InvalidTypeError(name, f"must be a positive int or None, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise InvalidInputError(name, f"must be a positive int or None, got {value!r}", "None picks a default")


def _options(field: str, value: Any) -> dict[str, Any]:
    """``value`` as a dict of str keys and hashable values (metadata is hashed on every call)."""
    if not isinstance(value, Mapping):
        raise InvalidTypeError(f"AttentionMetadata.{field}", f"must be a mapping, got {type(value).__name__}",
                               "e.g. extra={'ring_comm': 'all_gather'}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidTypeError(f"AttentionMetadata.{field}", f"keys must be str, got {key!r}")
        try:
            hash(item)
        except TypeError:
            raise InvalidTypeError(f"AttentionMetadata.{field}[{key!r}]", f"must be hashable, got "
                                   f"{type(item).__name__}", "use a tuple for a list, a frozenset for a set") from None
    return dict(value)


def _check_mesh(mesh: Any) -> None:
    """A ``jax.sharding.Mesh`` (or ``AbstractMesh``) or None. A mesh implies jax is imported, so
    the check imports nothing."""
    if mesh is None:
        return
    sharding = sys.modules.get("jax.sharding")
    kinds = tuple(k for k in (getattr(sharding, "Mesh", None), getattr(sharding, "AbstractMesh", None)) if k)
    if not kinds or not isinstance(mesh, kinds):
        raise InvalidTypeError("AttentionMetadata.mesh", f"must be a jax.sharding.Mesh or None, got "
                               f"{type(mesh).__name__}", "e.g. jax.make_mesh((4,), ('seq',))")


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


def check_split(metadata: AttentionMetadata, what: str, argument: str, size: int, field: str) -> None:
    """``InvalidInputError`` naming the dimension, the axis and both sizes when ``size`` does not
    split over the mesh axes of ``metadata.<field>`` (``batch_axis``, ``head_axis``): what a call
    under ``shard_map`` checks before its kernel, and ``explain`` before it names a backend."""
    axes = axis_tuple(getattr(metadata, field))
    if metadata.mesh is None or not axes:
        return
    sizes = dict(metadata.mesh.shape)
    parts = math.prod(int(sizes[a]) for a in axes)
    if size % parts:
        raise InvalidInputError(
            argument, f"{what} {size} is not divisible by mesh axis {describe_axes(axes)} of size {parts} "
            f"(AttentionMetadata.{field})", f"pad {what} to a multiple of {parts}, or shard it over other mesh axes")


def _check_axes(metadata: AttentionMetadata) -> None:
    """Raise ``InvalidInputError`` naming the field when the axis names do not fit ``metadata.mesh``
    (``InvalidTypeError`` for a value that is no axis name).

    Without a mesh the names are allowed: the call then runs inside the caller's own
    ``shard_map`` where those axes are bound (see docs/sharding.md).
    """
    seen: dict[str, str] = {}
    for field in _AXIS_FIELDS:
        value = getattr(metadata, field)
        if value is not None and not (isinstance(value, str) or (
                isinstance(value, tuple) and value and all(isinstance(a, str) for a in value))):
            raise InvalidTypeError(f"AttentionMetadata.{field}", "expected a mesh axis name or a non-empty tuple of "
                                   f"names, got {type(value).__name__} {value!r}", "None leaves it unsharded")
        for name in axis_tuple(value):
            if name in seen:
                raise InvalidInputError(f"AttentionMetadata.{field}", f"mesh axis {name!r} is already used by "
                                        f"{seen[name]}; each mesh axis can shard only one dimension")
            seen[name] = field
    mesh = metadata.mesh
    if mesh is None:
        return
    names = tuple(getattr(mesh, "axis_names", ()))
    unknown = [n for n in seen if n not in names]
    if unknown:
        raise InvalidInputError(f"AttentionMetadata.{seen[unknown[0]]}", f"mesh axes {unknown} "
                                f"({', '.join(seen[n] for n in unknown)}) are not axes of metadata.mesh, whose axes "
                                f"are {list(names)}{did_you_mean(unknown[0], names)}")


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
