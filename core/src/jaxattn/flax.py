"""Where the Flax NNX layer went: the jaxattn-flax distribution, package ``jaxattn_flax``.

The core imports no plugin (tests/architecture/test_layers.py), so this module re-exports
nothing: importing it raises an ``ImportError`` naming the new import and the extra.
"""

from __future__ import annotations

raise ImportError(
    "jaxattn.flax moved to the jaxattn-flax distribution: "
    "`from jaxattn_flax import FlexibleAttentionModule, KVCache` (pip install \"jaxattn[flax]\")"
)
