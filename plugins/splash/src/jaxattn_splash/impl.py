"""``SplashAttention``: ``splash`` (alias ``blocksparse``) on TPU, over Pallas splash attention.

Imports no Pallas TPU module at import time: ``kernel.py`` (which does) is imported inside
``forward_tpu``, so discovery, listing and ``explain`` stay cheap on every host.
"""

from __future__ import annotations

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem, DeviceInfo

from .blocks import LANES, splash_tiling
from .plugin import SPLASH

__all__ = ["SplashAttention"]

#: TPU generations where the Pallas flash kernel (flash_attn2) is preferred to splash.
_OLD_TPUS = frozenset({"v2", "v3"})


class SplashAttention(AttentionImpl, declaration=SPLASH):
    """Block-sparse flash attention on TPU (jax.experimental.pallas.ops.tpu.splash_attention)."""

    @classmethod
    def priority_for(cls, device: DeviceInfo) -> int:
        return 90 if device.tpu_generation in _OLD_TPUS else cls.priority

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        # The base class declines every feature missing from ``features`` (boolean mask,
        # bias, dropout, weights, lse), with a reason each.
        reasons = super().not_supported_reasons(problem)
        if self.metadata.softmax_dtype != "float32":
            reasons.append(
                "the splash kernel computes the softmax in float32; "
                f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured"
            )
        if problem.mask_mod and not problem.mask_mod_static and not problem.mask_mod_documents:
            reasons.append("splash builds its mask on the host with the kernel: the mask_mod must close over no "
                           "traced array (build it from concrete arrays, outside jax.jit) and not vary with b, or "
                           "be masks.document(ids) ANDed with such a mask_mod (the ids become splash's segment "
                           "ids) in a call without segment ids; blockwise runs any mask_mod")
        try:
            splash_tiling(problem.seq_q, problem.seq_k, **self.metadata.block_sizes)
        except ValueError as err:
            reasons.append(f"metadata: {err}")
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        if not problem.mask_mod:
            return []
        how = "its document() term as segment ids, the rest" if problem.mask_mod_documents else "mask_mod"
        return [f"{how} evaluated on the host into one splash NumpyMask per head, with the kernel (cached per "
                "function and shape); splash skips its empty tiles"]

    def fallback_reasons(self, problem: AttentionProblem) -> list[str]:
        """The seed's fallbacks to vanilla, kept (visible in explain and logged once)."""
        reasons = []
        if problem.seq_q == 1:
            reasons.append("a decode step (T == 1) would fill a 128-row query tile with one row")
        for label, dim in (("head dim", problem.head_dim), ("value head dim", problem.head_dim_v)):
            if dim % LANES:
                reasons.append(f"{label} {dim} is not a multiple of {LANES}, the TPU lane width splash tiles by")
        return reasons

    def forward_tpu(self, call: AttentionCall) -> AttentionOutput:
        from jaxattn import masks
        from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads

        from .kernel import splash_attention

        # A document() term runs as splash's segment ids (its ids may be traced), the rest as its mask.
        mask_mod, q_seg, kv_seg = masks.as_segment_ids(call)

        # A +inf sink: the kernel gets a finite one and the heads it absorbs are zeroed (jaxattn.backend.sinks).
        sinks, absorbed = split_absorbing_sinks(call.softmax_aux)
        out = splash_attention(
            call.q,
            call.k,
            call.v,
            causal=call.causal,
            sliding_window=call.sliding_window,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap,
            softmax_aux=sinks,
            block_sizes=self.metadata.block_sizes,
            interpret=self.metadata.interpret,
            mask_mod=mask_mod,
        )
        return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 2))
