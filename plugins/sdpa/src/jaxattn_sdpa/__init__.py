"""jaxattn-sdpa: ``jax.nn.dot_product_attention`` as jaxattn backends.

* ``cudnn`` (alias ``cuda_flash_attn2``): cuDNN flash attention, NVIDIA GPUs only;
* ``sdpa``: the best jax.nn path on this device: cuDNN when it takes the call, XLA otherwise.

The package root stays import-light (the entry point ``jaxattn_sdpa.plugin`` is imported
during discovery); the impls and the kernel load on first access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .impl import CudnnAttention, SdpaAttention
    from .kernel import sdpa_attention

__all__ = ["CudnnAttention", "SdpaAttention", "__version__", "sdpa_attention"]
__version__ = "0.1.0"

_LAZY = {
    "CudnnAttention": ".impl",
    "SdpaAttention": ".impl",
    "sdpa_attention": ".kernel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
