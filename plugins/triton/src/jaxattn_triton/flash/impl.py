"""``TritonFlashAttention``: ``flash_attn2`` on CUDA GPUs, the Triton kernels of this package.

This module imports neither triton nor jax_triton: ``ops`` (and through it the kernels)
is imported when the first call runs, so listing, ``explain`` and ``supports`` stay cheap.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, ClassVar

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem, DeviceInfo, Feature
from jaxattn_triton.plugin import FLASH_ATTN2

__all__ = ["TritonFlashAttention", "kernel_library_reasons", "kv_lengths_reasons"]

#: Why the features it lacks are declined (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.DROPOUT: (
        "flash_attn2 (Triton) has no dropout (no in-kernel random generator tied to "
        "dropout_rng); impl='vanilla' runs it"
    ),
    Feature.WEIGHTS: "flash attention never forms the (B, Hq, T, S) probabilities",
}

#: Why a score_mod other than ``masks.alibi`` is declined.
SCORE_MOD_ONLY_ALIBI = (
    "flash_attn2 (Triton) runs only the score_mod jaxattn.masks.alibi(slopes) (its term added in registers): a "
    "Triton kernel cannot execute a traced JAX function, and a score rewrites every logit (a mask_mod is "
    "evaluated in JAX into packed bits the kernels read; a score cannot be precomputed without the "
    "(B, Hq, T, S) array); blockwise or vanilla runs any score_mod"
)


class TritonFlashAttention(AttentionImpl, declaration=FLASH_ATTN2):
    """FlashAttention-2 forward and backward in Triton, launched from JAX through jax-triton."""

    why_not = WHY_NOT

    #: Run the kernels in the Triton interpreter through a host callback (tests only).
    interpret: ClassVar[bool] = False

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if self.metadata.softmax_dtype != "float32":
            reasons.append(
                "flash_attn2 (Triton) accumulates the softmax in float32; "
                f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured"
            )
        for name, value in self._overrides().items():
            if name.startswith("block") and (value < 16 or value & (value - 1)):
                reasons.append(f"metadata.{name}={value}: Triton tiles must be powers of two >= 16")
        reasons += kv_lengths_reasons(problem)
        if problem.score_mod and not problem.score_mod_alibi:
            reasons.append(SCORE_MOD_ONLY_ALIBI)
        if (problem.mask_mod or problem.score_mod) and problem.kv_lengths:
            reasons.append(MODS_WITHOUT_KV_LENGTHS)
        if not self.interpret:
            reasons += kernel_library_reasons(self.device)
        return reasons

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads
        from jaxattn_triton.flash.ops import flash_attention, make_spec
        from jaxattn_triton.tuning import tiles_for

        q, k, v, mask, bias, causal = call.q, call.k, call.v, call.mask, call.bias, call.causal
        # A +inf sink would be inf - inf in the kernels' online softmax: they get a finite one,
        # and the heads it absorbs are zeroed after (jaxattn.backend.sinks).
        sinks, absorbed = split_absorbing_sinks(call.softmax_aux)
        # The call declined these already; a direct forward_* call must not drop them either.
        if call.dropout_prob:
            raise NotImplementedError(WHY_NOT[Feature.DROPOUT])
        segments = call.q_segment_ids is not None
        kv_lengths = call.kv_lengths
        slopes = None
        if call.score_mod is not None:
            from jaxattn import masks

            slopes = masks.alibi_slopes(call)
            if slopes is None:  # declined by the call; a direct forward_* call must not drop it
                raise NotImplementedError(SCORE_MOD_ONLY_ALIBI)
        if call.mask_mod is not None or slopes is not None:
            if kv_lengths is not None:  # declined by the call; a direct forward_* call must not drop them
                raise NotImplementedError(MODS_WITHOUT_KV_LENGTHS)
            return self._forward_mods(call, sinks, absorbed, slopes)
        if kv_lengths is not None and not _split_k_decode(q, k, mask, bias, segments, kv_lengths):
            # The call declined it already; a direct forward_* call must not drop the lengths.
            raise NotImplementedError(KV_LENGTHS_ONLY_DECODE)
        spec = make_spec(
            q, k, v, mask=mask, bias=bias, causal=causal,
            sliding_window=call.sliding_window, segments=segments,
            softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap,
            sinks=sinks is not None,
        )  # fmt: skip
        if _split_k_decode(q, k, mask, bias, segments, kv_lengths):
            from jaxattn_triton.decode.ops import decode_with_flash_grad

            # Split-K over the keys (one program per query head would leave the GPU idle);
            # its gradient is the flash backward, on this forward's output and lse (with
            # kv_lengths, on the mask they make: flash tiles for that spec, overrides applied).
            out, lse = decode_with_flash_grad(
                q, k, v, kv_lengths, causal=causal, softmax_scale=call.softmax_scale,
                logits_soft_cap=call.logits_soft_cap, window=call.sliding_window,
                sinks=sinks, flash_overrides=self._overrides(), interpret=self.interpret,
            )  # fmt: skip
            return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 2), softmax_lse=lse)
        tiles = tiles_for(spec, interpret=self.interpret, overrides=self._overrides())
        out, lse = flash_attention(
            q, k, v, mask=mask, bias=bias, causal=causal,
            sliding_window=call.sliding_window,
            q_segment_ids=call.q_segment_ids,
            kv_segment_ids=call.kv_segment_ids,
            softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap,
            softmax_aux=sinks,
            tiles=tiles, interpret=self.interpret,
        )  # fmt: skip
        return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 2), softmax_lse=lse)

    def _forward_mods(self, call: AttentionCall, sinks: Any, absorbed: Any, slopes: Any) -> AttentionOutput:
        """The flash kernels with the mask_mod evaluated in JAX (``ops.mod_bits``: packed bits with
        the call's causal rule, window, segment ids and mask ANDed in; ``block_mask=`` lends its bits
        when built with ``bits=True``), each kernel skipping the tiles its lists leave out; and
        ``masks.alibi``'s ``slopes`` (or None), its term added to the scores in the kernels."""
        from jaxattn.backend import zero_absorbed_heads
        from jaxattn_triton.flash.ops import flash_attention

        out, lse = flash_attention(
            call.q, call.k, call.v, mask=call.mask, bias=call.bias, causal=call.causal,
            sliding_window=call.sliding_window, q_segment_ids=call.q_segment_ids,
            kv_segment_ids=call.kv_segment_ids, softmax_scale=call.softmax_scale,
            logits_soft_cap=call.logits_soft_cap, softmax_aux=sinks, mask_mod=call.mask_mod,
            block_mask=call.block_mask, alibi_slopes=slopes, interpret=self.interpret, overrides=self._overrides(),
        )  # fmt: skip
        return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 2), softmax_lse=lse)

    def notes(self, problem: AttentionProblem) -> list[str]:
        notes = []
        if problem.mask_mod:
            notes.append("mask_mod evaluated in JAX into packed bits (32 keys a word; a block_mask built with "
                         "bits=True lends its own), the call's causal rule, window, segment ids and mask ANDed "
                         "in; each kernel classifies its own tiles from them: empty tiles skipped, full ones "
                         "without mask arithmetic, partial ones read the bits")
        if problem.score_mod_alibi:
            notes.append("score_mod masks.alibi: slopes[h] * (kv_idx - q_idx) added to each score in registers, "
                         "forward and backward (the slopes' gradient summed per key tile)")
        return notes

    def backward_from_residuals(self, q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, d_lse: Any,
                                **features: Any) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` at cotangents ``(d_out, d_lse)`` from another forward's ``out`` and ``lse``:
        the backward kernels alone (ring attention hands them the whole ring's output and lse, so
        no block's forward runs again). Features: mask, causal, segment ids, scale, soft cap."""
        from jaxattn_triton.flash.ops import flash_attention_backward

        return flash_attention_backward(q, k, v, out, lse, d_out, d_lse, overrides=self._overrides(),
                                        interpret=self.interpret, **features)

    def _overrides(self) -> dict[str, int]:
        md = self.metadata
        names = ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps", "num_stages")
        return {n: v for n in names if (v := getattr(md, n)) is not None}


def _split_k_decode(q: Any, k: Any, mask: Any, bias: Any, segments: bool, kv_lengths: Any = None) -> bool:
    """T == 1 over more than one key (or over a cache with ``kv_lengths``), without a mask,
    bias or segment ids (which the split-K decode kernel does not take; the flash kernels
    run those)."""
    if int(q.shape[1]) != 1 or mask is not None or bias is not None or segments:
        return False
    return int(k.shape[1]) > 1 or kv_lengths is not None


MODS_WITHOUT_KV_LENGTHS = (
    "flash_attn2 (Triton) takes no kv_lengths with a mask_mod or score_mod: fold the lengths into a mask_mod "
    "(kv_idx < lengths[b])"
)

KV_LENGTHS_ONLY_DECODE = (
    "flash_attn2 (Triton) takes kv_lengths only on its split-K decode path (T == 1 without a mask, bias or "
    "segment ids): the flash kernels have no per-sequence key lengths. autoregressive_decodeattn runs "
    "kv_lengths calls of up to 16 queries (impl='auto' picks a backend that accepts the call), or express the "
    "lengths as a mask"
)


def kv_lengths_reasons(problem: AttentionProblem) -> list[str]:
    """Why flash_attn2 cannot take this call's ``kv_lengths`` (empty without them, or on the decode path)."""
    if not problem.kv_lengths:
        return []
    if problem.seq_q == 1 and problem.mask_shape is None and problem.bias_shape is None and not problem.segment_ids:
        return []
    return [KV_LENGTHS_ONLY_DECODE]


def kernel_library_reasons(device: DeviceInfo) -> list[str]:
    """Why this package's kernels cannot launch on ``device``: triton and jax-triton
    missing, or a GPU older than compute capability 8.0 (bf16 tensor cores)."""
    reasons = []
    for module, dist in (("triton", "triton"), ("jax_triton", "jax-triton>=0.3.1,<0.5")):
        if not _installed(module):
            reasons.append(f"the {module!r} package is not installed; pip install '{dist}' (or jaxattn-triton[gpu])")
    cc = device.compute_capability
    if cc is not None and _major(cc) < 8:
        reasons.append(f"needs an NVIDIA GPU of compute capability 8.0 or newer (bf16 tensor cores); this one is {cc}")
    return reasons


@functools.cache
def _installed(module: str) -> bool:
    # find_spec locates the package without importing it (no CUDA initialisation).
    return importlib.util.find_spec(module) is not None


def _major(capability: str) -> int:
    try:
        return int(str(capability).split(".")[0])
    except ValueError:
        return 0
