"""jaxattn-pallas: ``flash_attn2`` on TPU, over the Pallas TPU flash-attention kernel, and the
paged mechanisms (``ragged_page_attention_v3``/``_v2`` on the ragged paged-attention kernel,
``page_attention`` on JAX's paged_attention kernel).

The package root imports nothing heavy (the entry point ``jaxattn_pallas.plugin`` is
imported during discovery); the classes and kernel wrappers load on first access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .flash_impl import PallasFlashAttention
    from .flash_kernel import flash_attention
    from .paged_decode_impl import PallasPagedDecode
    from .paged_decode_kernel import paged_attention_decode
    from .ragged_impl import PallasRaggedPagedAttention

__all__ = ["PallasFlashAttention", "PallasPagedDecode", "PallasRaggedPagedAttention", "__version__",
           "flash_attention", "paged_attention_decode"]
__version__ = "0.1.0"

_LAZY = {
    "PallasFlashAttention": ".flash_impl",
    "flash_attention": ".flash_kernel",
    "PallasPagedDecode": ".paged_decode_impl",
    "paged_attention_decode": ".paged_decode_kernel",
    "PallasRaggedPagedAttention": ".ragged_impl",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
