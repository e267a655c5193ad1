"""``ImplRef``: an implementation's one declaration, read by registration and by its class.

A plugin's registration module states each impl once: its names, op kind, platforms, priority,
description and capabilities (dtypes, head dims, features, fallback, sequence parallelism), and
the names it takes over from another distribution. Discovery and listing read it without
importing the impl's module (or whatever kernel library that pulls in); the class binds to it,
``class VanillaAttention(AttentionImpl, declaration=VANILLA)``, and takes every stated value
from it (``Backend.__init_subclass__``), so nothing is spelled twice.

A capability left unstated (``None``) is the class's own: the declaration of a plain class
(one that does not bind) may state only what listing needs, and the class keeps the rest.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Collection
from typing import Any

from ..errors import PluginError
from .capabilities import PLATFORM_TOKENS, Feature
from .names import normalize_name

__all__ = ["CLASS_FIELDS", "KINDS", "RESERVED", "DeclarationError", "ImplRef", "check_declaration"]

#: The name no impl may take: it means "choose" wherever a name is accepted.
RESERVED = "auto"

#: The op kinds a backend can serve.
KINDS = ("dense", "paged")

#: The declaration's fields that are class attributes of the impl (``Backend``'s ClassVars) of
#: the same name; names are the class's ``names()`` and the kind is its base class's.
CLASS_FIELDS = ("platforms", "priority", "description", "dtypes", "head_dims", "features", "fallback_impl",
                "sequence_parallel")


class DeclarationError(PluginError):
    """An impl's class disagrees with its ``ImplRef`` (or cannot bind to it)."""


@dataclasses.dataclass(frozen=True)
class ImplRef:
    """One impl, declared: the class it is (``"package.module:ClassName"``, imported on first
    use), its names (the first is its name, the rest aliases), op kind, platforms, priority,
    description and capabilities.

    ``overrides`` lists the names this backend deliberately takes over, at a higher priority,
    from another distribution's backend of the same kind on a platform both serve (a faster
    kernel for a name jaxattn-vanilla provides everywhere, say). Taking such a name without
    declaring it is a clash: see ``Registry.conflicting``.

    ``dtypes``, ``head_dims`` (an inclusive ``(lo, hi)`` range or a set of sizes), ``features``,
    ``fallback_impl`` and ``sequence_parallel`` mean what ``Backend``'s class attributes of
    those names mean; ``None`` (and an empty description) leaves them to the class.
    """

    target: str
    names: tuple[str, ...]
    platforms: tuple[str, ...]
    priority: int = 0
    description: str = ""
    kind: str = "dense"  # "dense" (AttentionImpl) or "paged" (PagedAttentionImpl)
    overrides: tuple[str, ...] = ()
    dtypes: Collection[str] | None = None
    head_dims: tuple[int, int] | Collection[int] | None = None
    features: Collection[Feature] | None = None
    fallback_impl: str | None = None
    sequence_parallel: bool | None = None

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise PluginError(f"ImplRef target {self.target!r} must look like 'package.module:ClassName'")
        put = object.__setattr__  # frozen: normalised once, here
        put(self, "names", tuple(normalize_name(n) for n in _as_tuple(self.names)))
        put(self, "platforms", tuple(_as_tuple(self.platforms)))
        put(self, "overrides", tuple(normalize_name(n) for n in _as_tuple(self.overrides)))
        check_declaration(self.target, self.names, self.platforms, self.kind)
        stray = sorted(set(self.overrides) - set(self.names))
        if stray:
            raise PluginError(f"{self.target}: overrides {stray}, which are not among its names {self.names}; "
                              "a backend can only take over names it provides")
        if self.dtypes is not None:
            put(self, "dtypes", frozenset(_as_tuple(self.dtypes)))
        if self.head_dims is not None:
            put(self, "head_dims", _head_dims(self.target, self.head_dims))
        if self.features is not None:
            put(self, "features", _features(self.target, self.features))
        if self.fallback_impl is not None:
            put(self, "fallback_impl", normalize_name(self.fallback_impl, "fallback_impl"))

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    def class_values(self) -> dict[str, Any]:
        """The class attributes this declaration states (``CLASS_FIELDS``), as the class holds them."""
        values: dict[str, Any] = {}
        for field in CLASS_FIELDS:
            value = getattr(self, field)
            if value is None or (field == "description" and not value):
                continue  # unstated: the class's own
            values[field] = frozenset(value) if field == "platforms" else value
        return values

    def load(self) -> Any:
        """The object ``target`` names (imports its module)."""
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


def _as_tuple(value: str | Collection[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _head_dims(what: str, dims: tuple[int, int] | Collection[int]) -> tuple[int, int] | frozenset[int]:
    """A ``(lo, hi)`` tuple is a range; any other collection a set of sizes."""
    if isinstance(dims, tuple):
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and 1 <= dims[0] <= dims[1]:
            return (dims[0], dims[1])
        raise PluginError(f"{what}: head_dims {dims!r}: a tuple is an inclusive range (lo, hi) with 1 <= lo <= hi; "
                          "give a set for a list of sizes")
    sizes = frozenset(dims)
    if not sizes or not all(isinstance(d, int) and d >= 1 for d in sizes):
        raise PluginError(f"{what}: head_dims {dims!r} must be a (lo, hi) range or a non-empty set of sizes")
    return sizes


def _features(what: str, features: Collection[Feature | str]) -> frozenset[Feature]:
    try:
        return frozenset(Feature(f) for f in features)
    except ValueError as err:
        raise PluginError(f"{what}: {err}; features are jaxattn.Feature members") from None


def check_declaration(what: str, names: tuple[str, ...], platforms: tuple[str, ...], kind: str) -> None:
    """Raise ``PluginError`` unless an impl has a name, a known kind and known platforms."""
    if not names or "" in names:
        raise PluginError(f"{what}: declares {'an empty' if names else 'no'} name; an impl needs a name (names=(...))")
    if RESERVED in names:
        raise PluginError(f"{what}: the name {RESERVED!r} is reserved (impl='auto' means: let jaxattn choose); "
                          "give the impl a name of its own")
    if kind not in KINDS:
        raise PluginError(f"{what}: kind {kind!r} is not one of {KINDS}")
    unknown = set(platforms) - PLATFORM_TOKENS
    if not platforms or unknown:
        raise PluginError(f"{what}: platforms {platforms} must be a non-empty subset of {sorted(PLATFORM_TOKENS)}")
