"""jaxattn-pallas: ``flash_attn2`` on TPU, over the Pallas TPU flash-attention kernel.

The package root imports nothing heavy (the entry point ``jaxattn_pallas.plugin`` is
imported during discovery); ``PallasFlashAttention`` and ``flash_attention`` load on first
access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .impl import PallasFlashAttention
    from .kernel import flash_attention

__all__ = ["PallasFlashAttention", "__version__", "flash_attention"]
__version__ = "0.1.0"

_LAZY = {"PallasFlashAttention": ".impl", "flash_attention": ".kernel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
