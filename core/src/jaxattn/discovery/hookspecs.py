"""The plugin hooks. A plugin module marks functions with ``@jaxattn.hookimpl``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ..backend.impl import AttentionImpl
    from .commands import Commands
    from .registry import ImplRef

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("jaxattn")
hookimpl = pluggy.HookimplMarker("jaxattn")


@hookspec
def jaxattn_register_impls() -> Iterable[type[AttentionImpl] | ImplRef]:  # type: ignore[empty-body]
    """Return the ``AttentionImpl`` subclasses this plugin provides, or lazy ``ImplRef``s to them.

    Prefer ``ImplRef``: discovery and listing then import no kernel library.
    """


@hookspec
def jaxattn_register_commands(commands: Commands) -> None:
    """Add this plugin's commands of the ``jaxattn`` program: ``commands.add(Command(...))``.

    Called when the program starts, so keep it cheap (no jax); see ``jaxattn.discovery.commands``. A hook
    that raises costs only its own plugin's commands (the plugin is reported broken).
    """


@hookspec
def jaxattn_tuning_records() -> Any:
    """Return this plugin's measured records for "auto" (``jaxattn.selection.tuning.TuningRecords``), or None.

    Typed ``Any`` because discovery sits below selection. Asked once per registry state; the
    object answers per call kind and may re-read its store. A hook that raises costs only its
    own plugin (reported broken): auto keeps declared order.
    """


@hookspec
def jaxattn_tuning_priors() -> Any:
    """Return this plugin's shipped priors: an iterable of files (``importlib.resources``
    ``Traversable``s or paths) in the format ``jaxattn.selection.tuning.parse_priors`` checks.

    Each file holds what the plugin measured about its own impls on one device generation;
    "auto" ranks by them where the user has no tuning record for a call. Asked once per
    registry state, when "auto" first ranks a call; return package data, import no kernel
    library. A file that fails the check is ignored with a warning.
    """
