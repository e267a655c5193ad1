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
    from .decode.impl import PallasPagedDecode
    from .decode.kernel import paged_attention_decode
    from .flash.impl import PallasFlashAttention
    from .flash.kernel import flash_attention
    from .ragged.impl import PallasRaggedPagedAttention

__all__ = ["PallasFlashAttention", "PallasPagedDecode", "PallasRaggedPagedAttention", "__version__",
           "flash_attention", "paged_attention_decode"]
__version__ = "0.1.0"

_LAZY = {
    "PallasFlashAttention": ".flash.impl",
    "flash_attention": ".flash.kernel",
    "PallasPagedDecode": ".decode.impl",
    "paged_attention_decode": ".decode.kernel",
    "PallasRaggedPagedAttention": ".ragged.impl",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
