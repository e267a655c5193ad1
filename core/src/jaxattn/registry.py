"""Providers of implementation names, per platform and priority, and name resolution."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

from .backend import Backend
from .capabilities import PLATFORM_TOKENS, platform_matches
from .errors import ImplNotFoundError, PluginError
from .names import normalize_name

__all__ = ["ImplInfo", "ImplRef", "Provider", "Registry"]


@dataclasses.dataclass(frozen=True)
class ImplRef:
    """A lazy reference to a backend class (``AttentionImpl`` or ``PagedAttentionImpl`` subclass):
    ``"package.module:ClassName"``.

    The names, platforms, priority and op kind are declared here so that discovery and listing
    never import the module (and whatever kernel library it pulls in).
    """

    target: str
    names: tuple[str, ...]
    platforms: tuple[str, ...]
    priority: int = 0
    description: str = ""
    kind: str = "dense"  # "dense" (AttentionImpl) or "paged" (PagedAttentionImpl)

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise PluginError(f"ImplRef target {self.target!r} must look like 'package.module:ClassName'")
        object.__setattr__(self, "names", tuple(normalize_name(n) for n in _as_tuple(self.names)))
        object.__setattr__(self, "platforms", tuple(_as_tuple(self.platforms)))
        _check_declaration(self.target, self.names, self.platforms, self.kind)

    def load(self) -> type[Backend[Any]]:
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]


def _as_tuple(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


#: The op kinds a backend can serve.
KINDS = ("dense", "paged")


def _check_declaration(what: str, names: tuple[str, ...], platforms: tuple[str, ...], kind: str) -> None:
    if not names:
        raise PluginError(f"{what}: declares no name")
    if kind not in KINDS:
        raise PluginError(f"{what}: kind {kind!r} is not one of {KINDS}")
    unknown = set(platforms) - PLATFORM_TOKENS
    if not platforms or unknown:
        raise PluginError(f"{what}: platforms {platforms} must be a non-empty subset of {sorted(PLATFORM_TOKENS)}")


@dataclasses.dataclass
class Provider:
    """One implementation as registered: who provides it, for which platforms, how it loads."""

    names: tuple[str, ...]
    platforms: tuple[str, ...]
    priority: int
    source: type[Backend[Any]] | ImplRef
    plugin: str
    distribution: str | None = None
    version: str | None = None
    description: str = ""
    kind: str = "dense"
    error: BaseException | None = None
    _cls: type[Backend[Any]] | None = None

    @classmethod
    def from_source(cls, source: Any, plugin: str, distribution: str | None, version: str | None) -> Provider:
        if isinstance(source, ImplRef):
            return cls(source.names, source.platforms, source.priority, source, plugin, distribution, version,
                       source.description, source.kind)
        if isinstance(source, type) and issubclass(source, Backend):
            names, platforms = source.names(), tuple(sorted(source.platforms))
            _check_declaration(source.__qualname__, names, platforms, source.kind)
            return cls(names, platforms, source.priority, source, plugin, distribution, version,
                       source.description or (source.__doc__ or "").strip().split("\n")[0], source.kind,
                       _cls=source)
        raise PluginError(
            f"plugin {plugin!r} registered {source!r}; expected an AttentionImpl or PagedAttentionImpl subclass, "
            "or a jaxattn.ImplRef"
        )

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def origin(self) -> str:
        return self.distribution or self.plugin

    def load(self) -> type[Backend[Any]]:
        """The impl class (imports its module on first use); re-raises a load failure."""
        if self._cls is not None:
            return self._cls
        if self.error is not None:
            raise PluginError(f"impl {self.name!r} from {self.origin} failed to load: {self.error}") from self.error
        assert isinstance(self.source, ImplRef)
        try:
            impl_cls = self.source.load()
        except Exception as err:
            self.error = err
            raise PluginError(f"impl {self.name!r} from {self.origin} failed to load: {err}") from err
        declared = set(self.names)
        if (not declared <= set(impl_cls.names()) or set(self.platforms) != set(impl_cls.platforms)
                or self.kind != impl_cls.kind):
            self.error = PluginError(
                f"{self.source.target} declares names {impl_cls.names()} / platforms {sorted(impl_cls.platforms)}"
                f" / kind {impl_cls.kind!r} but its ImplRef says {self.names} / {self.platforms} / {self.kind!r}"
            )
            raise self.error
        self._cls = impl_cls
        return impl_cls

    def runs_on(self, platform: str, vendor: str | None) -> bool:
        return platform_matches(self.platforms, platform, vendor)

    def overlaps(self, other: Provider) -> bool:
        """Whether the two could both serve some platform."""
        for platform, vendor in (("cpu", None), ("tpu", None), ("gpu", "cuda"), ("gpu", "rocm")):
            if self.runs_on(platform, vendor) and other.runs_on(platform, vendor):
                return True
        return False


@dataclasses.dataclass(frozen=True)
class ImplInfo:
    """One row of ``list_impls()``."""

    name: str
    aliases: tuple[str, ...]
    plugin: str
    distribution: str | None
    version: str | None
    platforms: tuple[str, ...]
    priority: int
    status: str  # "ok", "broken", "conflict", "disabled"
    reason: str = ""
    usable_here: bool = False
    description: str = ""
    kind: str = "dense"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Global, so that a fresh Registry never reuses a generation number a cache has seen.
_generations = itertools.count(1)


class Registry:
    """Providers by name. Filled by discovery (``jaxattn.plugins``) and ``register_impl``."""

    def __init__(self) -> None:
        self.providers: list[Provider] = []
        self.generation = next(_generations)  # changes on every change; caches key on it

    def add(self, provider: Provider, *, strict: bool) -> list[str]:
        """Add a provider; returns conflict messages (raised at once when ``strict``)."""
        conflicts = [self.conflict_message(provider, other) for other in self.conflicting(provider)]
        if conflicts and strict:
            raise PluginError(conflicts[0])
        self.providers.append(provider)
        self.generation = next(_generations)
        return conflicts

    def remove(self, provider: Provider) -> None:
        self.providers.remove(provider)
        self.generation = next(_generations)

    def conflicting(self, provider: Provider) -> Iterator[Provider]:
        """Providers sharing a name with ``provider`` at its priority on a platform it serves, or
        of another op kind (a name means one kind of call everywhere)."""
        for other in self.providers:
            if other is not provider and set(other.names) & set(provider.names) and (
                other.kind != provider.kind or (other.priority == provider.priority and other.overlaps(provider))
            ):
                yield other

    @staticmethod
    def conflict_message(a: Provider, b: Provider) -> str:
        shared = sorted(set(a.names) & set(b.names))
        if a.kind != b.kind:
            return (
                f"{', '.join(shared)} names a {a.kind} impl from {a.origin} and a {b.kind} impl from {b.origin}; "
                "a name means one kind of call: rename one, or disable one with JAXATTN_DISABLE_PLUGINS"
            )
        return (
            f"two providers of {', '.join(shared)} for overlapping platforms at equal priority {a.priority}: "
            f"{a.origin} ({'/'.join(a.platforms)}) and {b.origin} ({'/'.join(b.platforms)}); "
            "give one a different priority, or disable one with JAXATTN_DISABLE_PLUGINS"
        )

    def providers_of(self, name: str) -> list[Provider]:
        return [p for p in self.providers if name in p.names]

    def names(self) -> list[str]:
        return sorted({p.name for p in self.providers})

    def resolve(self, name: str, platform: str, vendor: str | None) -> Provider:
        """The provider serving ``name`` on this platform: highest priority, equal ones an error."""
        providers = self.providers_of(name)
        if not providers:
            raise ImplNotFoundError(name)
        here = [p for p in providers if p.runs_on(platform, vendor)]
        if not here:
            raise ImplNotFoundError(name)
        best = max(p.priority for p in here)
        top = [p for p in here if p.priority == best]
        if len(top) > 1:
            raise PluginError(self.conflict_message(top[0], top[1]))
        return top[0]
