"""The paged mechanisms in plain JAX, on every platform: ``vanilla_paged``, an adapter over
``paged_reference``.

Its name is its own, with the seed's mechanism names as aliases (``ragged_page_attention_v3``,
``ragged_page_attention_v2``, ``page_attention``): where a kernel plugin provides those names
for its platform at a higher priority, the names resolve to the kernel, and "auto" still sees
the reference under ``vanilla_paged`` for the calls every kernel declines (float32 on a GPU,
sinks on a TPU, ...). Where no kernel is installed, the mechanism names resolve to it.
"""

from __future__ import annotations

from jaxattn.backend import AttentionOutput, PagedAttentionImpl, PagedCall, PagedProblem

from ..plugin import VANILLA_PAGED

__all__ = ["PagedReference"]


class PagedReference(PagedAttentionImpl, declaration=VANILLA_PAGED):
    """Gathers each sequence's pages, then attends: every paged feature, every platform."""

    window_pair = True  # paged_reference takes the call's (left, 0)

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
