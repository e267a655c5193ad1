"""``PallasFlashAttention``: ``flash_attn2`` on TPU, over the Pallas TPU flash-attention kernel.

Imports no Pallas TPU module at import time: ``kernel.py`` (which does) is imported inside
``forward_tpu``, so discovery, listing and ``explain`` stay cheap on every host.
"""

from __future__ import annotations

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem

from ..plugin import PALLAS_FLASH
from .rules import flash_tiling

__all__ = ["PallasFlashAttention"]

# Bytes per element of the compute dtypes: the query tile quantum depends on it.
_ITEMSIZE = {"float32": 4, "bfloat16": 2}


class PallasFlashAttention(AttentionImpl, declaration=PALLAS_FLASH):
    """Flash attention on TPU (jax.experimental.pallas.ops.tpu.flash_attention)."""

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        # The base class declines every feature missing from ``features`` (sliding window,
        # soft cap, sinks, dropout, weights, lse), with a reason each.
        reasons = super().not_supported_reasons(problem)
        if self.metadata.softmax_dtype != "float32":
            reasons.append(
                "the Pallas TPU flash kernel computes the softmax in float32; "
                f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured"
            )
        try:
            flash_tiling(
                problem.seq_q,
                problem.seq_k,
                itemsize=_ITEMSIZE.get(self.compute_dtype(problem), 4),
                **self.metadata.block_sizes,
            )
        except ValueError as err:
            reasons.append(f"metadata: {err}")
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        if not problem.mask_mod:
            return []
        how = "its document() term as segment ids, the rest" if problem.mask_mod_documents else "the mask_mod"
        return [f"{how} evaluated into a dense (B, Hq, T, S) boolean mask for the kernel (T x S memory, no tile "
                "skipped past causal's; splash skips empty tiles)"]

    def forward_tpu(self, call: AttentionCall) -> AttentionOutput:
        from .kernel import flash_attention
        from .mods import lower_mask_mod

        mask, q_seg, kv_seg = call.mask, call.q_segment_ids, call.kv_segment_ids
        if call.mask_mod is not None:
            mask, q_seg, kv_seg = lower_mask_mod(call)
        out = flash_attention(
            call.q,
            call.k,
            call.v,
            mask=mask,
            bias=call.bias,
            causal=call.causal,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            softmax_scale=call.softmax_scale,
            block_sizes=self.metadata.block_sizes,
            interpret=self.metadata.interpret,
            zero_unseen=call.mask_mod is not None,
        )
        return AttentionOutput(attention_outputs=out)
