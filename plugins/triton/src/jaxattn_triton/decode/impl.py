"""``autoregressive_decodeattn`` on CUDA GPUs: decode over a dense KV cache, split-K.

The seed's decode mechanism: a few queries per sequence (T <= 16: a decode step, speculative
decoding) over a dense ``(B, S, Hkv, D)`` cache, optionally holding ``kv_lengths[b]`` valid
tokens per sequence. It runs ``decode.ops.dense_decode`` (the split-K kernel reading the
cache in its dense layout, no copy): the whole GQA group of a sequence's queries in
one program, the keys cut into enough splits to fill the GPU, merged in the same launch by
the split that finishes last.

A quantized cache (int8, float8_e4m3fn, float8_e5m2 with float32 ``k_scale``/``v_scale`` per
tensor, head or token; ``Feature.QUANTIZED_KV``) is read narrow and dequantized in registers,
forward only (no gradient flows into integer or float8 values).

Gradients are exact: the backward is FlashAttention-2's (this package's ``ops``), run on the
split-K forward's output and log-sum-exp; with ``kv_lengths`` it takes the visibility as a
``(B, 1, T, S)`` mask built from the lengths (``decode.ops.decode_with_flash_grad``).

Declined, with reasons: masks, biases and segment ids (the split-K kernel reads none;
flash_attn2 runs them), dropout, attention weights, T > 16 (flash_attn2 or cudnn run longer
queries), float32 (TF32 products), a softmax dtype other than float32.

This module imports neither triton nor jax_triton: ``decode.ops`` loads on the first call.
"""

from __future__ import annotations

from typing import ClassVar

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem, Feature
from jaxattn_triton.flash import impl as flash_impl
from jaxattn_triton.plugin import DECODE

__all__ = ["MAX_DECODE_QUERIES", "TritonDecodeAttention"]

#: Most queries per sequence. Up to 64 // group of them share one program (one read of each
#: K/V tile for the sequence); past 16 a call is a prefill chunk, which the flash kernels
#: (flash_attn2, cudnn) tile better.
MAX_DECODE_QUERIES = 16

_FLASH = "flash_attn2 runs it (impl='auto' picks a backend that accepts the call)"
#: Why the features it lacks are declined (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.MASK: f"the split-K decode kernel reads no mask; {_FLASH}",
    Feature.BIAS: f"the split-K decode kernel reads no bias; {_FLASH}",
    Feature.SEGMENT_IDS: f"the split-K decode kernel reads no segment ids; {_FLASH}",
    Feature.DROPOUT: "the split-K decode kernel has no dropout; impl='vanilla' runs it",
    Feature.WEIGHTS: "the split-K decode kernel never forms the (B, Hq, T, S) probabilities; impl='vanilla' "
    "returns them",
}

#: Metadata tile overrides the flash backward honours (the decode forward tiles itself).
_BACKWARD_OVERRIDES = ("block_q_bwd", "block_k_bwd", "num_warps", "num_stages")


class TritonDecodeAttention(AttentionImpl, declaration=DECODE):
    """Split-K decode over a dense KV cache (T <= 16), differentiable through the flash backward."""

    why_not = WHY_NOT

    #: Run the kernels in the Triton interpreter through a host callback (tests only).
    interpret: ClassVar[bool] = False

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if any(r.startswith("dtype float32 ") for r in reasons):
            reasons = [r for r in reasons if not r.startswith("dtype float32 ")]
            reasons.append("dtype float32 is not supported: the Triton decode kernel multiplies float32 in TF32 on "
                           "the tensor cores, which does not honour float32 precision; cast to bfloat16 or float16, "
                           "or impl='vanilla' / 'blockwise' runs float32 (impl='auto' picks one)")
        if problem.seq_q > MAX_DECODE_QUERIES:
            reasons.append(
                f"T={problem.seq_q} queries per sequence: autoregressive_decodeattn is the split-K decode kernel "
                f"(T <= {MAX_DECODE_QUERIES}: decode steps, speculative decoding); flash_attn2 or cudnn run "
                "longer queries (impl='auto' picks one)"
            )
        if self.metadata.softmax_dtype != "float32":
            reasons.append(f"the Triton decode kernel computes the softmax in float32; "
                           f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured")
        if problem.needs_grad and problem.kv_dtype is not None:
            reasons.append(f"gradients over a quantized ({problem.kv_dtype}) cache are not supported: the split-K "
                           "kernel reads it forward only (serving); differentiate a call over the dequantized cache "
                           "(jaxattn.dequantize_kv) instead")
        if problem.needs_grad:
            for name, value in self._overrides().items():
                if name.startswith("block") and (value < 16 or value & (value - 1)):
                    reasons.append(f"metadata.{name}={value}: the flash backward's Triton tiles must be powers of "
                                   "two >= 16")
        if not self.interpret:
            reasons += flash_impl.kernel_library_reasons(self.device)
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        lengths = "keys past kv_lengths skipped" if problem.kv_lengths else "the whole cache"
        if problem.kv_dtype is not None:
            return [f"split-K decode kernel over {lengths}, the {problem.kv_dtype} cache dequantized in registers "
                    "(k_scale, v_scale read in place; no full-size copy); forward only"]
        return [f"split-K decode kernel over {lengths}; gradients by the flash backward"]

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads
        from jaxattn_triton.decode.ops import decode_with_flash_grad, dense_decode

        q, k, v, causal = call.q, call.k, call.v, call.causal
        # A +inf sink: the kernel gets a finite one and the heads it absorbs are zeroed (jaxattn.backend.sinks).
        sinks, absorbed = split_absorbing_sinks(call.softmax_aux)
        # The call declined these already; a direct forward_* call must not drop them either.
        for feature, present in (
            (Feature.MASK, call.mask is not None), (Feature.BIAS, call.bias is not None),
            (Feature.SEGMENT_IDS, call.q_segment_ids is not None),
            (Feature.DROPOUT, bool(call.dropout_prob)),
        ):  # fmt: skip
            if present:
                raise NotImplementedError(WHY_NOT[feature])
        if int(q.shape[1]) > MAX_DECODE_QUERIES:
            raise NotImplementedError(f"autoregressive_decodeattn takes T <= {MAX_DECODE_QUERIES} queries")
        if call.k_scale is not None:
            # A quantized cache: the split-K forward alone (serving; no gradient into int8/fp8).
            got = dense_decode(
                q, k, v, call.kv_lengths, causal=causal, softmax_scale=call.softmax_scale,
                logits_soft_cap=call.logits_soft_cap, window=call.sliding_window,
                sinks=sinks, k_scale=call.k_scale, v_scale=call.v_scale,
                return_lse=True, interpret=self.interpret,
            )  # fmt: skip
            assert isinstance(got, tuple)
            return AttentionOutput(attention_outputs=zero_absorbed_heads(got[0], absorbed, 2), softmax_lse=got[1])
        out, lse = decode_with_flash_grad(
            q, k, v, call.kv_lengths, causal=causal, softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap, window=call.sliding_window,
            sinks=sinks, flash_overrides=self._overrides(), interpret=self.interpret,
        )  # fmt: skip
        return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 2), softmax_lse=lse)

    def _overrides(self) -> dict[str, int]:
        md = self.metadata
        return {n: v for n in _BACKWARD_OVERRIDES if (v := getattr(md, n)) is not None}
