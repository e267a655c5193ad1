"""``DecodeAttention``: ``autoregressive_decodeattn`` in plain XLA, an adapter over ``decode_attention``.

The seed's decode mechanism on every platform: a few queries per sequence (T <= 16: a decode
step, speculative decoding) over a dense ``(B, S, Hkv, D)`` cache, optionally holding
``kv_lengths[b]`` valid tokens per sequence; split-K, the query heads of a KV head packed
together, K and V read in place (``jaxattn_vanilla.decode.kernel``). Gradients come from JAX's
autodiff of the same code, exactly.

Two kinds of call run ``blockwise``'s kernel instead (a tiled online softmax whose matrix
products XLA runs well; it takes the same features, ``kv_lengths`` included, and brings its
own exact backward), where that measured faster on a CPU (docs/decode.md):

* past ``MAX_STREAMED_ROWS`` query rows per KV head (T * G), where the products outweigh the
  read;
* on a CPU, a call with ``kv_lengths`` whose longest sequence fills at most half the cache,
  chosen at run time (``lax.cond``; both programs are compiled): blockwise's key loops stop
  at the longest sequence, where one pass over the cache reads all of it.

Declined, with reasons: masks, biases and segment ids (the decode path reads none),
dropout, attention weights, and T > 16 (a prefill: the dense paths tile it better).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem, DeviceInfo, Feature

from ..blockwise.kernel import DEFAULT_BLOCK_K, blockwise_attention
from ..plugin import DECODE
from .kernel import decode_attention, decode_tiling

__all__ = ["MAX_DECODE_QUERIES", "MAX_STREAMED_ROWS", "DecodeAttention"]

#: Most queries per sequence: decode steps and speculative decoding. Longer calls are a
#: prefill, for which the dense paths (sdpa, blockwise) are the better tiling.
MAX_DECODE_QUERIES = 16

_DENSE = "impl='blockwise' or 'vanilla' runs it (impl='auto' picks a backend that accepts the call)"
#: Why the features it lacks are declined (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.MASK: f"the split-K decode path reads no mask; {_DENSE}",
    Feature.BIAS: f"the split-K decode path reads no bias; {_DENSE}",
    Feature.SEGMENT_IDS: f"the split-K decode path reads no segment ids; {_DENSE}",
    Feature.DROPOUT: "the split-K decode path has no dropout; impl='vanilla' runs it",
    Feature.WEIGHTS: "the split-K decode path never forms the (B, Hq, T, S) probabilities; impl='vanilla' "
    "returns them",
    Feature.QUANTIZED_KV: "the split-K decode path reads float caches only; impl='vanilla' runs a quantized one "
    "(dequantized into a full-size copy)",
}

#: Most query rows per KV head (T * Hq / Hkv) the streaming split-K path takes; past it the
#: call runs blockwise's tiled kernel. On a CPU (B=8, Hq=32, Hkv=8, D=128, S=4096, float32)
#: 16 rows streamed ran even with blockwise (117 vs 121 ms), 32 rows 28% slower (284 vs 222).
MAX_STREAMED_ROWS = 16

#: Keys per split-K chunk off the CPU, where nothing was measured: the usual flash-decoding
#: granularity, so that B * Hkv * (S / 512) independent reductions fill a device.
ACCELERATOR_CHUNK = 512


class DecodeAttention(AttentionImpl, declaration=DECODE):
    """Split-K decode over a dense KV cache (T <= 16) in plain XLA, every platform."""

    why_not = WHY_NOT

    @classmethod
    def priority_for(cls, device: DeviceInfo) -> int:
        return cls.priority if device.platform == "cpu" else 5

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.seq_q > MAX_DECODE_QUERIES:
            reasons.append(
                f"T={problem.seq_q} queries per sequence: autoregressive_decodeattn is the split-K decode path "
                f"(T <= {MAX_DECODE_QUERIES}: decode steps, speculative decoding); a longer call is a prefill, "
                "which impl='sdpa', 'blockwise' or 'vanilla' run (impl='auto' picks one)"
            )
        return reasons

    def _cut(self, s: int) -> tuple[int, int | None]:
        """``(num_chunks, step keys)``: metadata.block_k (keys per chunk) and
        metadata.extra['decode_step_keys'] where set, else the platform's default."""
        md = self.metadata
        chunk = md.block_k or (s if self.platform == "cpu" else ACCELERATOR_CHUNK)
        step = md.extra.get("decode_step_keys")
        step_keys = s if step is None else min(int(step), s)
        return max(1, step_keys // max(1, min(chunk, step_keys))), None if step is None else int(step)

    def notes(self, problem: AttentionProblem) -> list[str]:
        rows = problem.seq_q * problem.group_size
        if rows > MAX_STREAMED_ROWS:
            return [f"{rows} query rows per KV head (> {MAX_STREAMED_ROWS}): blockwise's tiled kernel runs it"]
        chunks, step = self._cut(problem.seq_k)
        tiling = decode_tiling(problem.seq_k, chunks, step)
        cut = f"{tiling.num_chunks} chunk{'s' if tiling.num_chunks > 1 else ''} of {tiling.chunk} keys"
        steps = "" if tiling.steps == 1 else f" per step, {tiling.steps} steps (steps no query sees are skipped)"
        notes = [f"split-K over the cache: {cut}{steps}; the query heads of each KV head packed together"]
        if self._skips_by_tiles(problem.seq_k, problem.kv_lengths):
            notes.append("when the longest sequence fills at most half the cache: blockwise's tiles up to it "
                         "(chosen at run time)")
        return notes

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        # The call declined these already; a direct forward_* call must not drop them either.
        for feature, present in (
            (Feature.MASK, call.mask is not None), (Feature.BIAS, call.bias is not None),
            (Feature.SEGMENT_IDS, call.q_segment_ids is not None), (Feature.DROPOUT, bool(call.dropout_prob)),
        ):  # fmt: skip
            if present:
                raise NotImplementedError(WHY_NOT[feature])
        if int(q.shape[1]) > MAX_DECODE_QUERIES:
            raise NotImplementedError(f"autoregressive_decodeattn takes T <= {MAX_DECODE_QUERIES} queries")
        lengths = call.kv_lengths
        common: dict[str, Any] = {
            "kv_lengths": lengths, "causal": call.causal, "sliding_window": call.sliding_window,
            "softmax_scale": call.softmax_scale, "logits_soft_cap": call.logits_soft_cap,
            "softmax_aux": call.softmax_aux, "softmax_dtype": self.metadata.softmax_dtype,
        }

        def tiled() -> tuple[Any, Any]:
            res = blockwise_attention(q, k, v, block_k=self.metadata.block_k, **common)
            return res.output, res.lse

        if int(q.shape[1]) * (int(q.shape[2]) // int(k.shape[2])) > MAX_STREAMED_ROWS:
            out, lse = tiled()
            return AttentionOutput(attention_outputs=out, softmax_lse=lse)
        s = int(k.shape[1])
        chunks, step = self._cut(s)

        def streamed() -> tuple[Any, Any]:
            res = decode_attention(q, k, v, num_chunks=chunks, step=step, **common)
            return res.output, res.lse

        if self._skips_by_tiles(s, lengths is not None):
            # A cache at most half full: blockwise's loops stop at the longest sequence.
            lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s)
            out, lse = jax.lax.cond(2 * jnp.max(lengths) <= s, tiled, streamed)
        else:
            out, lse = streamed()
        return AttentionOutput(attention_outputs=out, softmax_lse=lse)

    def _skips_by_tiles(self, s: int, lengths: bool) -> bool:
        """Whether a call with kv_lengths chooses at run time between one pass over the cache and
        blockwise's tiles (on a CPU, without a step override, for caches of two tiles or more)."""
        return (lengths and self.platform == "cpu" and "decode_step_keys" not in self.metadata.extra
                and s >= 2 * (self.metadata.block_k or DEFAULT_BLOCK_K))
