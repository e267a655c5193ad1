"""The paged mechanisms in plain JAX, on every platform: ``ragged_page_attention_v3`` (alias
``ragged_page_attention_v2``) and ``page_attention``, adapters over ``paged_reference``."""

from __future__ import annotations

from typing import Any, ClassVar

from jaxattn.capabilities import Feature
from jaxattn.output import AttentionOutput
from jaxattn.paged_impl import PagedAttentionImpl

__all__ = ["PagedDecodeReference", "RaggedPagedReference"]

_FEATURES = frozenset({Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                       Feature.MULTI_TOKEN, Feature.RAGGED})


class RaggedPagedReference(PagedAttentionImpl):
    """Gathers each sequence's pages, then attends: every paged feature, every platform."""

    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "gpu", "tpu"})
    # float64 too: the reference that checks a serving loop at full precision.
    dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16", "float32", "float64"})
    features: ClassVar[frozenset[Feature]] = _FEATURES
    # Lowest rank: "auto" runs it only where no paged kernel accepts the call.
    priority: ClassVar[int] = 0
    description: ClassVar[str] = "pure-JAX paged attention (gather the pages, then attend), ragged batches"

    @classmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        # v2 and v3 differ in EasyDeL by kernel generation and cache layout; here the contract
        # fixes the call, so both name this op (docs/serving.md).
        return ("ragged_page_attention_v3", "ragged_page_attention_v2")

    def forward_native(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        from .paged import paged_reference

        features.pop("kv_layout")
        out = paged_reference(q, k_pages, v_pages, softmax_dtype=self.metadata.softmax_dtype, **features)
        return AttentionOutput(attention_outputs=out)


class PagedDecodeReference(RaggedPagedReference):
    """``page_attention``: T queries per sequence (decode, speculative decoding), every platform."""

    features: ClassVar[frozenset[Feature]] = _FEATURES - {Feature.RAGGED}
    description: ClassVar[str] = "pure-JAX paged decode (gather the pages, then attend), T queries per sequence"

    @classmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        return "page_attention"
