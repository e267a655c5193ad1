"""Finding implementations by name: providers here, instances, ``list_impls``, ``register_impl``.

Resolution only: the instances built here run their own kernel (they have no ``composition``);
``jaxattn.get_impl`` (``jaxattn.api.calls``) gives users instances composed with fallback and sharding.
"""

from __future__ import annotations

import functools
from typing import Any

from ..backend.base import Backend, resolve_platform
from ..backend.device import DeviceInfo, detect_device
from ..backend.metadata import DEFAULT_METADATA, AttentionMetadata
from ..backend.names import DISTRIBUTIONS, AttentionMechanisms, install_hint, normalize_name
from ..discovery.plugins import plugin_records, register_impl_class, registry
from ..discovery.registry import ImplInfo, Provider
from ..errors import ImplNotFoundError, PluginError

__all__ = ["available_here", "impl_for", "list_impls", "new_impl", "provider_here", "register_impl"]


def _where(platform: str, vendor: str | None) -> str:
    return f"{platform}/{vendor}" if platform == "gpu" and vendor else platform


def available_here(metadata: AttentionMetadata | None = None, device: DeviceInfo | None = None,
                   kind: str | None = None) -> list[Provider]:
    """Providers that serve this platform (best per name), in order of priority; of one op kind
    when ``kind`` is given."""
    md = metadata or DEFAULT_METADATA
    dev = device or detect_device()
    platform, vendor = resolve_platform(md, dev)
    reg = registry()
    best: dict[str, Provider] = {}
    for provider in reg.providers:
        if (provider.runs_on(platform, vendor) and provider.error is None and kind in (None, provider.kind)
                and not reg.rejected_by(provider)):
            current = best.get(provider.name)
            if current is None or provider.priority > current.priority:
                best[provider.name] = provider
    return sorted(best.values(), key=lambda p: (-p.priority, p.name))


def _not_found(name: str, platform: str, vendor: str | None, md: AttentionMetadata) -> ImplNotFoundError:
    reg = registry()
    here = ", ".join(p.name for p in available_here(md)) or "none (install jaxattn[cpu])"
    providers = reg.providers_of(name)
    if providers:
        elsewhere = "; ".join(
            f"{'/'.join(p.platforms)} ({p.origin}{': ' + p.description if p.description else ''})" for p in providers
        )
        hint = ""
        if any("tpu" in p.platforms for p in providers) and platform != "tpu":
            hint = " To run the TPU kernel here in interpret mode: AttentionMetadata(platform='tpu', interpret=True)."
        return ImplNotFoundError(
            f"impl {name!r} runs on {elsewhere}; this platform is {_where(platform, vendor)}. "
            f"Available here: {here}.{hint}"
        )
    for record in plugin_records():
        if name in (record.name, (record.distribution or "").lower()) and record.status == "broken":
            err = PluginError(f"plugin {record.name!r} ({record.distribution}) is installed but broken: "
                              f"{record.reason}")
            return err  # type: ignore[return-value]
    if distributions := DISTRIBUTIONS.get(name):
        return ImplNotFoundError(
            f"{name!r} is a known attention mechanism, but no installed plugin provides it. It comes with "
            f"{install_hint(distributions)}. Available here: {here}. `jaxattn list` shows what is installed."
        )
    known = sorted(set(reg.names()) | {m.value for m in AttentionMechanisms})
    return ImplNotFoundError(
        f"unknown attention impl {name!r}. Known names: {', '.join(known)}. Available here: {here}. "
        "`jaxattn list` shows every impl; backends come from plugins such as jaxattn[cpu], jaxattn[gpu], jaxattn[tpu]."
    )


def new_impl(name: str, metadata: AttentionMetadata, device: DeviceInfo) -> Backend[Any]:
    """A fresh instance of the provider of ``name`` here (its default runner: see ``jaxattn.api.calls``).

    Raises ``PluginError`` for a broken plugin of that name and ``ImplNotFoundError`` (saying
    what exists, where, and how to install it) when nothing here provides it.
    """
    broken = [r for r in plugin_records() if r.status == "broken" and name in (r.name, (r.distribution or "").lower())]
    reg = registry()
    if broken and not reg.providers_of(name):
        record = broken[0]
        raise PluginError(f"plugin {record.name!r} ({record.distribution}) failed to load: {record.reason}") \
            from record.error
    return provider_here(name, metadata, device).load()(metadata, device)


def provider_here(name: str, metadata: AttentionMetadata, device: DeviceInfo | None = None) -> Provider:
    """The provider that serves ``name`` on this platform (the highest priority among those that
    run here): what ``get_impl`` builds and ``explain`` reports for an explicit name.

    Raises ``ImplNotFoundError`` saying what exists, where, and how to install it.
    """
    platform, vendor = resolve_platform(metadata, device or detect_device())
    try:
        return registry().resolve(name, platform, vendor)
    except ImplNotFoundError:
        raise _not_found(name, platform, vendor, metadata) from None


@functools.lru_cache(maxsize=256)
def _cached(name: str, metadata: AttentionMetadata, device: DeviceInfo, generation: int) -> Backend[Any]:
    return new_impl(name, metadata, device)


def impl_for(name: str | AttentionMechanisms, metadata: AttentionMetadata | None = None) -> Backend[Any]:
    """The provider of ``name`` here, bound to ``metadata``: one shared instance, for asking what
    it can run (selection and explanation). Calls go through ``jaxattn.get_impl``'s instances."""
    md = metadata if metadata is not None else DEFAULT_METADATA
    return _cached(normalize_name(name), md, detect_device(), registry().generation)


def register_impl(impl_cls: type[Backend[Any]], *, replace: bool = False) -> type[Backend[Any]]:
    """Register an ``AttentionImpl`` or ``PagedAttentionImpl`` subclass at runtime; usable as a class decorator.

    An equal-priority provider of the same name on an overlapping platform is an error
    unless ``replace=True``, which removes it.
    """
    register_impl_class(impl_cls, replace=replace)
    return impl_cls


def list_impls(metadata: AttentionMetadata | None = None) -> list[ImplInfo]:
    """Every implementation and plugin: names, origin, version, platforms, status, usable here."""
    md = metadata or DEFAULT_METADATA
    reg = registry()
    dev = detect_device()
    platform, vendor = resolve_platform(md, dev)
    here = {id(p) for p in available_here(md, dev)}
    rows: list[ImplInfo] = []
    for p in sorted(reg.providers, key=lambda p: (p.name, -p.priority)):
        rejections = reg.rejections(p)
        status, reason = "ok", ""
        if p.error is not None:
            status, reason = "broken", f"{type(p.error).__name__}: {p.error}"
        elif rejections:
            status, reason = "conflict", "; ".join(rejections)
        elif not p.runs_on(platform, vendor):
            reason = f"runs on {'/'.join(p.platforms)}, not {_where(platform, vendor)}"
        elif id(p) not in here:
            reason = "a higher-priority provider of this name serves this platform"
        takeovers = reg.takeovers(p) if status == "ok" else []
        if takeovers:  # a declared override is no problem, but a listing says so
            taken = ", ".join(f"{o.origin}'s {o.name} on {', '.join(p.shared_platforms(o))}" for o in takeovers)
            reason = "; ".join(filter(None, [reason, f"overrides {taken} (declared)"]))
        rows.append(ImplInfo(
            name=p.name, aliases=p.names[1:], plugin=p.plugin, distribution=p.distribution, version=p.version,
            platforms=p.platforms, priority=p.priority, status=status, reason=reason,
            usable_here=status == "ok" and id(p) in here, description=p.description, kind=p.kind,
        ))
    rows += [
        ImplInfo(
            name=record.name, aliases=(), plugin=record.name, distribution=record.distribution,
            version=record.version, platforms=(), priority=0, status=record.status,
            reason=record.reason if record.status == "broken" else "disabled by JAXATTN_PLUGINS/_DISABLE_PLUGINS",
        )
        for record in plugin_records()
        if record.status in ("broken", "disabled")
    ]
    return rows
