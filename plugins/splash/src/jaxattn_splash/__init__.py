"""jaxattn-splash: ``splash`` / ``blocksparse`` on TPU, over Pallas splash attention.

The package root imports nothing heavy (the entry point ``jaxattn_splash.plugin`` is
imported during discovery); ``SplashAttention`` and ``splash_attention`` load on first
access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .impl import SplashAttention
    from .kernel import splash_attention

__all__ = ["SplashAttention", "__version__", "splash_attention"]
__version__ = "0.1.0"

_LAZY = {"SplashAttention": ".impl", "splash_attention": ".kernel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
