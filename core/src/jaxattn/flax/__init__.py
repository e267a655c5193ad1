"""jaxattn for Flax NNX models (``pip install "jaxattn[flax]"``).

``FlexibleAttentionModule`` attends through jaxattn's registry ("auto" by default) and
handles training, prefill and decode calls with a KV cache (``KVCache``) passed in or held.
"""

from __future__ import annotations

try:
    import flax  # noqa: F401  # the absolute name: Flax itself, not this package
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("jaxattn.flax needs Flax: pip install 'jaxattn[flax]'") from err

from .cache import KVCache
from .module import FlexibleAttentionModule, Mode

__all__ = ["FlexibleAttentionModule", "KVCache", "Mode"]
