"""Providers of implementation names, per platform and priority, and name resolution."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from collections.abc import Iterator
from typing import Any

from ..backend.base import Backend
from ..backend.capabilities import platform_matches
from ..backend.declaration import DeclarationError, ImplRef, check_declaration
from ..backend.forms import ACCEPTED, forward_problems
from ..backend.names import FIRST_PARTY
from ..errors import ImplNotFoundError, PluginError

__all__ = ["PASS_THROUGH", "DeclarationError", "ImplInfo", "ImplRef", "Provider", "Registry", "reraise_interrupts"]

#: What no plugin failure may swallow: the user's interrupt and a generator's close. Everything
#: else a plugin raises while it is imported, registered or loaded (``SystemExit`` included)
#: marks that plugin broken and costs nothing else.
PASS_THROUGH: tuple[type[BaseException], ...] = (KeyboardInterrupt, GeneratorExit)


def reraise_interrupts(err: BaseException) -> None:
    """Re-raise ``err`` if it is (or groups) one of ``PASS_THROUGH``; return otherwise."""
    if isinstance(err, PASS_THROUGH):
        raise err
    if isinstance(err, BaseExceptionGroup) and err.subgroup(PASS_THROUGH) is not None:
        raise err


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
    #: Names it takes over from another distribution's provider (``ImplRef.overrides``).
    overrides: tuple[str, ...] = ()
    #: Registered by the program itself (``register_impl``): a deliberate choice, so it may
    #: shadow any provider at another priority without declaring it.
    explicit: bool = False
    error: BaseException | None = None
    _cls: type[Backend[Any]] | None = None

    @classmethod
    def from_source(cls, source: Any, plugin: str, distribution: str | None, version: str | None) -> Provider:
        if isinstance(source, ImplRef):
            return cls(source.names, source.platforms, source.priority, source, plugin, distribution, version,
                       source.description, source.kind, source.overrides)
        if isinstance(source, type) and issubclass(source, Backend):
            names, platforms = source.names(), tuple(sorted(source.platforms))
            check_declaration(source.__qualname__, names, platforms, source.kind)
            # A class bound to its declaration takes the names it declares over from there too.
            own = source.__dict__.get("declaration")
            overrides = tuple(n for n in own.overrides if n in names) if own is not None else ()
            provider = cls(names, platforms, source.priority, source, plugin, distribution, version,
                           source.description or (source.__doc__ or "").strip().split("\n")[0], source.kind,
                           overrides, _cls=source)
            provider.error = provider.refusal(source)
            return provider
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

    @property
    def first_party(self) -> bool:
        """Whether one of this project's distributions provides it (its names are built-in names)."""
        return self.distribution in FIRST_PARTY

    def locate(self) -> None:
        """Record a missing module of an ``ImplRef`` as this provider's error, without importing
        the module: ``importlib.util.find_spec`` imports only its parent packages, which for a
        plugin's own package discovery has imported already (so no kernel library loads)."""
        if not isinstance(self.source, ImplRef) or self._cls is not None or self.error is not None:
            return
        module = self.source.module
        try:
            found = module in sys.modules or importlib.util.find_spec(module) is not None
        except BaseException as err:  # a parent package missing, or failing (whatever it raises)
            reraise_interrupts(err)
            self.error = err
            return
        if not found:
            self.error = ModuleNotFoundError(f"No module named {module!r} (ImplRef {self.source.target!r})",
                                             name=module)

    def load(self) -> type[Backend[Any]]:
        """The impl class (imports its module on first use); re-raises a load failure."""
        if self._cls is not None and self.error is None:
            return self._cls
        if self.error is not None:
            raise PluginError(f"impl {self.name!r} from {self.origin} failed to load: "
                              f"{type(self.error).__name__}: {self.error}") from self.error
        assert isinstance(self.source, ImplRef)
        try:
            impl_cls: type[Backend[Any]] = self.source.load()  # checked by _disagreements
            disagreements = self._disagreements(impl_cls)
        except BaseException as err:  # third-party code: isolated, whatever it raises
            reraise_interrupts(err)
            self.error = err
            raise PluginError(f"impl {self.name!r} from {self.origin} failed to load: "
                              f"{type(err).__name__}: {err}") from err
        self.error = self.refusal(impl_cls) if not disagreements else None
        if self.error is not None:
            raise self.error
        if disagreements:
            self.error = DeclarationError(
                f"impl {self.name!r} from {self.origin}: its class {self.source.target!r} disagrees with its "
                f"declaration: {'; '.join(disagreements)}. Declare each value once, in the ImplRef, and bind the "
                "class to it (class Impl(AttentionImpl, declaration=REF)) without setting it again"
            )
            raise self.error
        self._cls = impl_cls
        return impl_cls

    def refusal(self, impl_cls: type[Backend[Any]]) -> DeclarationError | None:
        """The error that refuses a class whose forwards have neither accepted form (see
        ``jaxattn.backend.forms``), or None: found when the class is loaded, never in a call."""
        problems = forward_problems(impl_cls, Backend)
        if not problems:
            return None
        return DeclarationError(f"impl {self.name!r} from {self.origin} ({impl_cls.__module__}.{impl_cls.__qualname__}"
                                f"): {'; '.join(problems)}. A forward takes one of two forms: {ACCEPTED}")

    def _disagreements(self, impl_cls: Any) -> list[str]:
        """Where the class differs from what its ``ImplRef`` states: a class bound to the ref
        differs only where its body sets a declared value again; a plain class (one that binds
        to nothing) must match every value the ref states. Names: the same first name, and no
        name the class lacks (a plain class may have more aliases)."""
        ref = self.source
        assert isinstance(ref, ImplRef)
        if not (isinstance(impl_cls, type) and issubclass(impl_cls, Backend)):
            return [f"it is {impl_cls!r}, not an AttentionImpl or PagedAttentionImpl subclass"]
        out = []
        own = impl_cls.__dict__.get("declaration")
        if own is not None and own != ref:
            out.append(f"declaration: the class binds to the ImplRef of {own.target!r}, not to this one")
        names = impl_cls.names()
        if names[:1] != ref.names[:1] or not set(ref.names) <= set(names):
            out.append(f"names: the declaration says {ref.names}, the class says {names}")
        if ref.kind != impl_cls.kind:
            out.append(f"kind: the declaration says {ref.kind!r}, the class is a {impl_cls.kind!r} backend")
        for field, declared in ref.class_values().items():
            actual = getattr(impl_cls, field)
            if actual != declared:
                out.append(f"{field}: the declaration says {_shown(declared)}, the class says {_shown(actual)}")
        return out

    def runs_on(self, platform: str, vendor: str | None) -> bool:
        return platform_matches(self.platforms, platform, vendor)

    def shared_platforms(self, other: Provider) -> list[str]:
        """The platforms both could serve ("cpu", "tpu", "gpu/cuda", "gpu/rocm")."""
        return [f"{platform}/{vendor}" if vendor else platform
                for platform, vendor in (("cpu", None), ("tpu", None), ("gpu", "cuda"), ("gpu", "rocm"))
                if self.runs_on(platform, vendor) and other.runs_on(platform, vendor)]

    def overlaps(self, other: Provider) -> bool:
        """Whether the two could both serve some platform."""
        return bool(self.shared_platforms(other))


def _shown(value: Any) -> str:
    """A declared value as one reads it: sets sorted."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(repr(str(v)) if not isinstance(v, int) else str(v) for v in sorted(value, key=str)) + "}"
    return repr(value)


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
        self._rejected: dict[int, tuple[Provider, ...]] = {}
        self._rejected_at = -1

    def add(self, provider: Provider, *, strict: bool) -> list[str]:
        """Add a provider; returns clash messages (raised at once, adding nothing, when ``strict``)."""
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
        """Providers that clash with ``provider``. Two providers sharing a name clash when

        - they are of different op kinds (a name means one kind of call everywhere), or
        - they serve a common platform at equal priority (priorities are declared, never
          inferred from load order), or
        - they serve a common platform at different priorities, come from different
          distributions, and the higher one takes the name over without saying so: it lists
          the shared names in no ``ImplRef.overrides`` and is no ``register_impl`` of the
          program itself.
        """
        for other in self.providers:
            if other is not provider and _clash(provider, other):
                yield other

    def rejections(self, provider: Provider) -> tuple[str, ...]:
        """Why ``provider`` is not used (empty when it is): its clashes that cost it. A clash
        between a first-party provider (``names.FIRST_PARTY``) and another costs the other only;
        any other clash costs both. A rejected provider serves no name and auto never runs it."""
        return tuple(self.conflict_message(provider, other) for other in self.rejected_by(provider))

    def rejected_by(self, provider: Provider) -> tuple[Provider, ...]:
        """The providers whose clash with ``provider`` costs it (see ``rejections``)."""
        if self._rejected_at != self.generation:  # computed once per registry state
            self._rejected = {id(p): self._costly(p) for p in self.providers}
            self._rejected_at = self.generation
        cached = self._rejected.get(id(provider))
        return cached if cached is not None else self._costly(provider)

    def _costly(self, provider: Provider) -> tuple[Provider, ...]:
        return tuple(other for other in self.conflicting(provider)
                     if not provider.first_party or other.first_party)

    @staticmethod
    def conflict_message(a: Provider, b: Provider) -> str:
        """One sentence naming both distributions, which of them is not used, and the ways out."""
        shared = ", ".join(sorted(set(a.names) & set(b.names)))
        builtin = a if a.first_party and not b.first_party else b if b.first_party and not a.first_party else None
        other = None if builtin is None else (b if builtin is a else a)
        disable = "or disable one with JAXATTN_DISABLE_PLUGINS"
        if other is not None:
            disable = f"or disable plugin {other.plugin!r} with JAXATTN_DISABLE_PLUGINS"
        if a.kind != b.kind:
            if builtin is not None and other is not None:
                return (f"{shared} is a built-in {builtin.kind} name of {builtin.origin}; {other.origin}'s "
                        f"{other.kind} impl of that name is not used (a name means one kind of call): rename it, "
                        f"{disable}")
            return (f"{shared} names a {a.kind} impl from {a.origin} and a {b.kind} impl from {b.origin}; a name "
                    f"means one kind of call, so neither is used: rename one, {disable}")
        where = ", ".join(a.shared_platforms(b))
        if a.priority == b.priority:
            unused = f"{other.origin}'s is not used" if other is not None else "neither is used"
            return (f"two providers of {shared} for overlapping platforms ({where}) at equal priority {a.priority}: "
                    f"{a.origin} ({'/'.join(a.platforms)}) and {b.origin} ({'/'.join(b.platforms)}); {unused}: "
                    f"give one a different priority, {disable}")
        high, low = (a, b) if a.priority > b.priority else (b, a)
        declare = f"overrides=({', '.join(repr(n) for n in sorted(set(a.names) & set(b.names)))},)"
        if builtin is not None and other is not None:
            takeover = (f": to replace {builtin.origin}'s deliberately, add {declare} to {other.origin}'s ImplRef;"
                        " otherwise" if other is high else ";")
            return (f"{shared} is a built-in name of {builtin.origin} ({builtin.kind}, "
                    f"{'/'.join(builtin.platforms)}, priority {builtin.priority}); {other.origin}'s provider of it "
                    f"(priority {other.priority}) for {where} is not used{takeover} rename it, {disable}")
        return (f"{high.origin} and {low.origin} both provide {shared} for {where} (priorities {high.priority} and "
                f"{low.priority}), and {high.origin} does not declare the takeover, so neither is used: add "
                f"{declare} to {high.origin}'s ImplRef, rename one, {disable}")

    def takeovers(self, provider: Provider) -> list[Provider]:
        """The other distributions' providers ``provider`` deliberately shadows (declared overrides)."""
        return [other for other in self.providers
                if other is not provider and other.origin != provider.origin and other.kind == provider.kind
                and set(other.names) & set(provider.overrides) and other.priority < provider.priority
                and provider.overlaps(other)]

    def providers_of(self, name: str) -> list[Provider]:
        """The providers of ``name`` that are not rejected (see ``rejections``)."""
        return [p for p in self.providers if name in p.names and not self.rejected_by(p)]

    def names(self) -> list[str]:
        return sorted({p.name for p in self.providers})

    def resolve(self, name: str, platform: str, vendor: str | None) -> Provider:
        """The provider serving ``name`` on this platform: highest priority among those not
        rejected; when every one here is rejected, a ``PluginError`` saying why."""
        here = [p for p in self.providers if name in p.names and p.runs_on(platform, vendor)]
        if not here:
            raise ImplNotFoundError(name)
        live = [p for p in here if not self.rejected_by(p)]
        if not live:
            worst = max(here, key=lambda p: p.priority)
            raise PluginError(self.rejections(worst)[0])
        best = max(p.priority for p in live)
        top = [p for p in live if p.priority == best]
        if len(top) > 1:  # unreachable while equal priorities clash; kept as the last word
            raise PluginError(self.conflict_message(top[0], top[1]))
        return top[0]


def _clash(a: Provider, b: Provider) -> bool:
    """The rule of ``Registry.conflicting``, for one pair."""
    shared = set(a.names) & set(b.names)
    if not shared:
        return False
    if a.kind != b.kind:
        return True
    if not a.overlaps(b):
        return False
    if a.priority == b.priority:
        return True
    if a.origin == b.origin or a.explicit or b.explicit:
        return False
    high = a if a.priority > b.priority else b
    return not shared <= set(high.overrides)
