"""jaxattn for Flax NNX models (``pip install "jaxattn[flax]"``).

``FlexibleAttentionModule`` attends through jaxattn's registry ("auto" by default) and
handles training, prefill and decode calls with a KV cache (``KVCache``) passed in or held.
"""

from __future__ import annotations

from .cache import KVCache
from .module import FlexibleAttentionModule, Mode

__all__ = ["FlexibleAttentionModule", "KVCache", "Mode", "__version__"]
__version__ = "0.1.0"
