"""jaxattn-ring: sequence-parallel ring attention, the impl ``ring``.

Each device of ``metadata.sequence_axis`` holds a slice of the sequence; K/V blocks travel
around the ring with ``jax.lax.ppermute`` and the partial results are merged with their
log-sum-exp. The package root stays import-light (the entry point ``jaxattn_ring.plugin``
is imported during discovery); the rest loads on first access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .impl import RingAttention
    from .layout import zigzag_permutation

__all__ = ["RingAttention", "__version__", "zigzag_permutation"]
__version__ = "0.1.0"

_LAZY = {"RingAttention": ".impl", "zigzag_permutation": ".layout"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
