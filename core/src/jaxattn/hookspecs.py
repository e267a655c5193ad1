"""The plugin hooks. A plugin module marks functions with ``@jaxattn.hookimpl``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .impl import AttentionImpl
    from .registry import ImplRef

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("jaxattn")
hookimpl = pluggy.HookimplMarker("jaxattn")


@hookspec
def jaxattn_register_impls() -> Iterable[type[AttentionImpl] | ImplRef]:  # type: ignore[empty-body]
    """Return the ``AttentionImpl`` subclasses this plugin provides, or lazy ``ImplRef``s to them.

    Prefer ``ImplRef``: discovery and listing then import no kernel library.
    """
