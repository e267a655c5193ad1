"""The paged mechanisms in plain JAX, on every platform: ``vanilla_paged``, an adapter over
``paged_reference``.

Its name is its own, with the seed's mechanism names as aliases (``ragged_page_attention_v3``,
``ragged_page_attention_v2``, ``page_attention``): where a kernel plugin provides those names
for its platform at a higher priority, the names resolve to the kernel, and "auto" still sees
the reference under ``vanilla_paged`` for the calls every kernel declines (float32 on a GPU,
sinks on a TPU, ...). Where no kernel is installed, the mechanism names resolve to it.
"""

from __future__ import annotations

from typing import ClassVar

from jaxattn.call import PagedCall
from jaxattn.capabilities import Feature
from jaxattn.output import AttentionOutput
from jaxattn.paged_impl import PagedAttentionImpl
from jaxattn.problem import PagedProblem

__all__ = ["PagedReference"]


class PagedReference(PagedAttentionImpl):
    """Gathers each sequence's pages, then attends: every paged feature, every platform."""

    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "gpu", "tpu"})
    # float64 too: the reference that checks a serving loop at full precision.
    dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16", "float32", "float64"})
    features: ClassVar[frozenset[Feature]] = frozenset({
        Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
        Feature.MULTI_TOKEN, Feature.RAGGED, Feature.QUANTIZED_KV,
    })
    # Lowest rank: "auto" runs it only where no paged kernel accepts the call.
    priority: ClassVar[int] = 0
    description: ClassVar[str] = "pure-JAX paged attention (gather the pages, then attend), every paged call"

    @classmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        # v2 and v3 differ in EasyDeL by kernel generation and cache layout; here the contract
        # fixes the call, so both name this op (docs/serving.md).
        return ("vanilla_paged", "ragged_page_attention_v3", "ragged_page_attention_v2", "page_attention")

    def notes(self, problem: PagedProblem) -> list[str]:
        if problem.kv_dtype is None:
            return []
        return [f"dequantizes the {problem.kv_dtype} pages each sequence reads into a full-size float32 copy, then "
                "attends (the reference)"]

    def forward_native(self, call: PagedCall) -> AttentionOutput:
        from .reference import paged_reference

        out = paged_reference(call.q, call.k_pages, call.v_pages, softmax_dtype=self.metadata.softmax_dtype,
                              **call.options())
        return AttentionOutput(attention_outputs=out)
