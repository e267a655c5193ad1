"""jaxattn for Flax NNX models (``pip install "jaxattn[flax]"``).

``FlexibleAttentionModule`` attends through jaxattn's registry ("auto" by default) and
handles training, prefill and decode calls with a KV cache (``KVCache``) passed in or held.
``dot_product_attention`` has Flax's ``attention_fn`` signature, for ``nnx.MultiHeadAttention``
and linen's ``MultiHeadDotProductAttention``.
"""

from __future__ import annotations

from .attention_fn import dot_product_attention
from .cache import KVCache
from .module import FlexibleAttentionModule, Mode

__all__ = ["FlexibleAttentionModule", "KVCache", "Mode", "__version__", "dot_product_attention"]
__version__ = "0.1.0"
