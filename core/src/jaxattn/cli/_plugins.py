"""Plugin-level view of ``jaxattn.list_impls()`` for ``info`` and ``list``.

``list_impls`` has one row per implementation, plus one row per plugin that registered
nothing because it is broken or disabled; impls always declare platforms, so an empty
``platforms`` marks the plugin rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxattn import ImplInfo

__all__ = ["PluginSummary", "impl_label", "is_plugin_row", "summarize_plugins"]


def is_plugin_row(row: ImplInfo) -> bool:
    return not row.platforms


def impl_label(impl: dict[str, Any]) -> str:
    """``name (alias, ...)`` for tables; JSON keeps the fields."""
    return str(impl["name"]) + (f" ({', '.join(impl['aliases'])})" if impl["aliases"] else "")


@dataclasses.dataclass
class PluginSummary:
    name: str
    distribution: str | None
    version: str | None
    status: str = "ok"
    reason: str = ""
    #: One ``{"name", "aliases", "kind"}`` per impl it registered (fields, for ``--json``).
    impls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize_plugins(rows: Iterable[ImplInfo]) -> list[PluginSummary]:
    plugins: dict[str, PluginSummary] = {}
    for row in rows:
        summary = plugins.setdefault(row.plugin, PluginSummary(row.plugin, row.distribution, row.version))
        if is_plugin_row(row):
            summary.status, summary.reason = row.status, row.reason
            continue
        summary.impls.append({"name": row.name, "aliases": list(row.aliases), "kind": row.kind})
        # An impl that fails to load or collides makes its plugin need attention too.
        if row.status != "ok" and summary.status == "ok":
            summary.status, summary.reason = row.status, f"{row.name}: {row.reason}"
    return sorted(plugins.values(), key=lambda p: (p.status == "ok", p.name))
