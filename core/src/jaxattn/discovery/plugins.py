"""Plugin discovery: entry points of group ``jaxattn.plugins``, loaded once, lazily, in isolation.

One pluggy ``PluginManager``. Each entry point names a module; a module that fails to import
or whose hook fails, whatever it raises (``SystemExit`` included; only ``KeyboardInterrupt``
and ``GeneratorExit`` pass), is recorded as broken (warned about once) and never breaks the
others, unless ``JAXATTN_STRICT_PLUGINS=1``. So is a provider whose name clashes
(``Registry.conflicting``) or whose ``ImplRef`` names a module that does not exist.
``problems()`` lists all of it. ``JAXATTN_PLUGINS`` / ``JAXATTN_DISABLE_PLUGINS`` are
comma-separated allow- and deny-lists of plugin (entry-point) names.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar, cast

import pluggy

from ..backend.environment import flag
from ..errors import PluginError
from . import hookspecs
from .registry import DeclarationError, ImplRef, Provider, Registry, reraise_interrupts

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginProblem",
    "PluginRecord",
    "PluginWarning",
    "call_each",
    "isolated_registry",
    "list_plugins",
    "plugin_manager",
    "plugin_records",
    "problems",
    "register_plugin",
    "registry",
    "reset",
]

ENTRY_POINT_GROUP = "jaxattn.plugins"
RUNTIME_PLUGIN = "<runtime>"
T = TypeVar("T")


class PluginWarning(UserWarning):
    """A plugin could not be loaded, or a plugin setting names something unknown."""


@dataclasses.dataclass
class PluginRecord:
    """One plugin as discovered: where it came from and whether it loaded."""

    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    status: str = "ok"  # "ok", "broken", "disabled"
    error: BaseException | None = None
    impl_names: list[str] = dataclasses.field(default_factory=list)
    conflicts: list[str] = dataclasses.field(default_factory=list)

    @property
    def reason(self) -> str:
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return "; ".join(self.conflicts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "distribution": self.distribution, "version": self.version,
            "module": self.module, "status": self.status, "reason": self.reason,
            "impls": list(self.impl_names), "conflicts": list(self.conflicts),
        }


class _State:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("jaxattn")
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.records: dict[str, PluginRecord] = {}
        self.discovered = False


_lock = threading.RLock()
_state = _State()
_warned: set[str] = set()


def _strict() -> bool:
    return flag("JAXATTN_STRICT_PLUGINS", default=False, meaning="make every plugin failure fatal")


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {n.strip().lower() for n in raw.split(",") if n.strip()}


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, PluginWarning, stacklevel=3)


def _fail(record: PluginRecord, err: BaseException) -> None:
    record.status, record.error = "broken", err
    if _strict():
        raise PluginError(f"plugin {record.name!r} ({record.distribution}) failed: {err}") from err
    _warn_once(
        f"broken:{record.name}",
        f"jaxattn plugin {record.name!r} from {record.distribution or 'an unknown distribution'} failed to load "
        f"({type(err).__name__}: {err}); other plugins still work. Run `jaxattn info` for details, "
        "set JAXATTN_DISABLE_PLUGINS to silence it, or JAXATTN_STRICT_PLUGINS=1 to make it fatal.",
    )


def _collect(record: PluginRecord, plugin: object, sources: Iterable[Any]) -> None:
    for source in sources:
        provider = Provider.from_source(source, record.name, record.distribution, record.version)
        provider.locate()  # a missing module is known now, without importing it
        # Clashes are reported once every plugin is in (_report_clashes): who pays for one
        # depends on both sides, never on which registered first.
        _state.registry.add(provider, strict=False)
        record.impl_names.append(provider.name)


def _report_clashes() -> None:
    """Warn once about each rejected provider (fatal under ``JAXATTN_STRICT_PLUGINS``)."""
    reg = _state.registry
    for provider in reg.providers:
        for message in reg.rejections(provider):
            record = _state.records.get(provider.plugin)
            if record is not None and message not in record.conflicts:
                record.conflicts.append(message)
            if _strict():
                raise PluginError(message)
            _warn_once(f"conflict:{message}", f"jaxattn: {message}")


def _register_module(record: PluginRecord, plugin: object, *, isolate: bool = True) -> None:
    """Register one plugin object with pluggy and collect its impls, isolating failures."""
    try:
        _state.pm.register(plugin, name=record.name)
        for hook in _state.pm.hook.jaxattn_register_impls.get_hookimpls():
            if hook.plugin is plugin:
                _collect(record, plugin, cast("Iterable[Any]", hook.function() or ()))
    except BaseException as err:  # third-party code: isolated, whatever it raises
        reraise_interrupts(err)
        for provider in [p for p in _state.registry.providers if p.plugin == record.name]:
            _state.registry.remove(provider)
        record.impl_names.clear()
        if _state.pm.is_registered(plugin):
            _state.pm.unregister(plugin)
        if not isolate:
            record.status, record.error = "broken", err
            raise
        _fail(record, err)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _discover() -> None:
    allow, deny = _env_names("JAXATTN_PLUGINS"), _env_names("JAXATTN_DISABLE_PLUGINS")
    eps = _entry_points()
    known = {ep.name.lower() for ep in eps}
    for var, names in (("JAXATTN_PLUGINS", allow), ("JAXATTN_DISABLE_PLUGINS", deny)):
        unknown = sorted((names or set()) - known)
        if unknown:
            message = f"{var} names unknown plugins {unknown}; installed plugins: {sorted(known) or 'none'}"
            if _strict():
                raise PluginError(message)
            _warn_once(f"env:{var}:{unknown}", message)
    for ep in eps:
        dist = getattr(ep, "dist", None)
        record = PluginRecord(
            name=ep.name.lower(), distribution=dist.name if dist else None,
            version=dist.version if dist else None, module=ep.value,
        )
        _state.records[record.name] = record
        if (allow is not None and record.name not in allow) or (deny is not None and record.name in deny):
            record.status = "disabled"
            continue
        try:
            module = ep.load()
        except BaseException as err:  # a broken plugin must not break the others, even sys.exit()
            reraise_interrupts(err)
            _fail(record, err)
            continue
        _register_module(record, module)
    _report_clashes()


def _ensure() -> _State:
    if not _state.discovered:
        with _lock:
            if not _state.discovered:
                _state.discovered = True
                try:
                    _discover()
                except BaseException:
                    _state.discovered = False
                    raise
    return _state


def registry() -> Registry:
    """The registry, after discovery (which runs once, on first use)."""
    return _ensure().registry


def plugin_manager() -> pluggy.PluginManager:
    return _ensure().pm


def plugin_records() -> list[PluginRecord]:
    """Every discovered plugin: distribution, version, status ("ok", "broken", "disabled") and cause."""
    return list(_ensure().records.values())


list_plugins = plugin_records


def register_plugin(plugin: object, name: str | None = None) -> PluginRecord:
    """Register an in-process plugin object (a module or instance with ``@hookimpl`` functions)."""
    state = _ensure()
    with _lock:
        record = PluginRecord(name=(name or getattr(plugin, "__name__", None) or repr(plugin)).lower(),
                              module=getattr(plugin, "__name__", None))
        state.records[record.name] = record
        _register_module(record, plugin, isolate=False)
        _report_clashes()
        return record


def register_impl_class(impl_cls: Any, *, replace: bool = False) -> Provider:
    """Register one ``AttentionImpl`` subclass at runtime (no packaging needed)."""
    state = _ensure()
    with _lock:
        provider = Provider.from_source(impl_cls, RUNTIME_PLUGIN, None, None)
        provider.explicit = True  # the program's own choice: it may shadow any name at another priority
        if provider.error is not None:  # a forward of neither form: refused now, not at the first call
            raise provider.error
        if replace:
            for other in list(state.registry.conflicting(provider)):
                state.registry.remove(other)
        state.registry.add(provider, strict=True)
        record = state.records.setdefault(RUNTIME_PLUGIN, PluginRecord(name=RUNTIME_PLUGIN))
        record.impl_names.append(provider.name)
        return provider


def call_each(hook_name: str, call: Callable[[Callable[..., Any]], T]) -> list[tuple[str, T]]:
    """``(plugin name, call(hook function))`` for each plugin implementing hook ``hook_name``, by name.

    Isolated as discovery isolates a plugin: one whose hook raises, whatever it raises, is
    recorded broken and warned about once (fatal under ``JAXATTN_STRICT_PLUGINS``), and the
    others' results are kept. The ``jaxattn`` program collects plugins' commands this way.
    """
    state = _ensure()
    results: list[tuple[str, T]] = []
    for hook in sorted(getattr(state.pm.hook, hook_name).get_hookimpls(), key=lambda h: h.plugin_name):
        try:
            results.append((hook.plugin_name, call(hook.function)))
        except BaseException as err:  # third-party code: isolated, whatever it raises
            reraise_interrupts(err)
            with _lock:
                record = state.records.setdefault(hook.plugin_name, PluginRecord(name=hook.plugin_name))
            _fail(record, err)
    return results


@dataclasses.dataclass(frozen=True)
class PluginProblem:
    """One plugin problem that would otherwise surface only when a call meets it.

    ``category`` is one of ``CATEGORIES``: "broken" (the plugin failed to import or register),
    "missing module" (an ``ImplRef``'s module does not exist), "load" (it exists but importing
    it failed), "declaration" (its class disagrees with its ``ImplRef``: it sets a declared
    value again, differently, or binds to another ``ImplRef``), "built-in name" (it
    provides a name of one of this project's distributions without declaring the takeover, or
    for another op kind) and "clash" (two other plugins' providers of one name).
    """

    category: str
    plugin: str
    distribution: str | None
    impl: str | None
    message: str

    def __str__(self) -> str:
        where = f"plugin {self.plugin!r} ({self.distribution or 'no distribution'})"
        return f"{self.category}: {where}{f', impl {self.impl!r}' if self.impl else ''}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CATEGORIES = ("broken", "missing module", "load", "declaration", "built-in name", "clash")


def problems(load: bool = False) -> list[PluginProblem]:
    """Every plugin problem discovery and the registry know of, in ``CATEGORIES`` order.

    Cheap by default: discovery finds missing modules without importing them. With
    ``load=True`` every ``ImplRef``'s module is imported first (a plugin's impl module, not the
    kernel libraries it imports when a kernel is built), so that classes that disagree with
    their declaration and modules that fail to import are found too: ``jaxattn info --strict``
    (and ``jaxattn list``, which fails on the disagreements).
    """
    state = _ensure()
    reg = state.registry
    if load:
        for provider in list(reg.providers):
            if provider.error is None:
                with suppress(PluginError):  # recorded as provider.error, reported below
                    provider.load()
    found = [PluginProblem("broken", r.name, r.distribution, None, r.reason)
             for r in state.records.values() if r.status == "broken"]
    for p in reg.providers:
        if p.error is not None:
            found.append(PluginProblem(_error_category(p), p.plugin, p.distribution, p.name,
                                       f"{type(p.error).__name__}: {p.error}"))
        for other in reg.rejected_by(p):
            category = "built-in name" if other.first_party and not p.first_party else "clash"
            found.append(PluginProblem(category, p.plugin, p.distribution, p.name, reg.conflict_message(p, other)))
    return sorted(found, key=lambda f: CATEGORIES.index(f.category))


def _error_category(provider: Provider) -> str:
    err = provider.error
    if isinstance(err, DeclarationError):
        return "declaration"
    if isinstance(err, ModuleNotFoundError) and isinstance(provider.source, ImplRef) and err.name:
        module = provider.source.module
        if module == err.name or module.startswith(err.name + "."):
            return "missing module"  # the module itself or one of its packages, not something it imports
    return "load"


def reset() -> None:
    """Forget discovery and runtime registrations (the next use discovers again)."""
    global _state
    with _lock:
        _state = _State()
        _warned.clear()


@contextmanager
def isolated_registry(discover: bool = True) -> Iterator[Registry]:
    """A scope with its own registry state, restored afterwards (for tests).

    With ``discover=False`` the scope starts empty: only what the test registers exists.
    """
    global _state
    with _lock:
        saved, saved_warned = _state, set(_warned)
        _state = _State()
        _warned.clear()
        if not discover:
            _state.discovered = True
    try:
        yield _state.registry if not discover else registry()
    finally:
        with _lock:
            _state = saved
            _warned.clear()
            _warned.update(saved_warned)
