"""``VanillaAttention``: the ``vanilla`` impl, an adapter over ``vanilla_attention``."""

from __future__ import annotations

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem

from ..plugin import VANILLA
from .reference import vanilla_attention

__all__ = ["VanillaAttention"]


class VanillaAttention(AttentionImpl, declaration=VANILLA):
    """Pure-JAX attention: every feature, every platform; the reference and the fallback."""

    def notes(self, problem: AttentionProblem) -> list[str]:
        if problem.kv_dtype is None:
            return []
        return [f"dequantizes the {problem.kv_dtype} cache into a full-size float32 copy, then attends (the reference)"]

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        out_dtype = q.dtype
        if call.k_scale is not None:  # a quantized cache: attend over its dequantized copy
            import jax.numpy as jnp

            from jaxattn.backend import dequantize_visible

            wide = jnp.promote_types(q.dtype, jnp.float32)
            q = q.astype(wide)
            k = dequantize_visible(k, call.k_scale, call.kv_lengths, wide)
            v = dequantize_visible(v, call.v_scale, call.kv_lengths, wide)
        res = vanilla_attention(
            q, k, v, mask=call.mask, bias=call.bias, causal=call.causal, sliding_window=call.sliding_window,
            q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids, softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap, softmax_aux=call.softmax_aux, dropout_prob=call.dropout_prob,
            dropout_rng=call.dropout_rng, kv_lengths=call.kv_lengths, mask_mod=call.mask_mod, score_mod=call.score_mod,
            softmax_dtype=self.metadata.softmax_dtype,
        )
        return AttentionOutput(attention_outputs=res.output.astype(out_dtype), attention_weights=res.weights,
                               softmax_lse=res.lse)
