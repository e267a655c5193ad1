"""jaxattn-vanilla: the pure-JAX attention backend ``vanilla``, for every platform.

The package root stays import-light (the entry point ``jaxattn_vanilla.plugin`` is imported
during discovery); ``vanilla_attention`` and ``VanillaAttention`` load on first access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .vanilla.impl import VanillaAttention
    from .vanilla.reference import VanillaResult, vanilla_attention

__all__ = ["VanillaAttention", "VanillaResult", "__version__", "vanilla_attention"]
__version__ = "0.1.0"

_LAZY = {
    "VanillaAttention": ".vanilla.impl",
    "VanillaResult": ".vanilla.reference",
    "vanilla_attention": ".vanilla.reference",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
