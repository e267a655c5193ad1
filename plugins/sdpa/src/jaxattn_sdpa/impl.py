"""The ``sdpa`` and ``cudnn`` impls: jaxattn's contract over ``jax.nn.dot_product_attention``.

* ``cudnn`` (alias ``cuda_flash_attn2``) is cuDNN flash attention and nothing else: a call
  cuDNN cannot take is declined with every reason, never run some other way.
* ``sdpa`` is the best jax.nn path on this device: cuDNN when it takes the call (including
  its backward pass, since a forward cannot know whether a gradient follows), XLA otherwise.
  The choice is logged once per call signature (logger "jaxattn") and shown by ``notes``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem, Feature, UnsupportedError

from .cudnn import cudnn_reasons, cudnn_version
from .kernel import Implementation, sdpa_attention
from .plugin import CUDNN, SDPA

__all__ = ["CudnnAttention", "SdpaAttention"]

logger = logging.getLogger("jaxattn")

#: Why the features jax.nn lacks cannot be emulated exactly (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.SOFT_CAP: (
        "jax.nn.dot_product_attention has no logits soft cap, and c*tanh(x/c) depends on q.k, so no "
        "mask or bias expresses it exactly (impl='vanilla' runs it)"
    ),
    Feature.DROPOUT: (
        "jax.nn.dot_product_attention has no dropout (cuDNN's dropout is not exposed by jax.nn and "
        "would not use dropout_rng); impl='vanilla' runs it"
    ),
    Feature.VALUE_DIM: "jax.nn.dot_product_attention requires v to have k's shape (value head dim == head dim)",
}

_logged: set[tuple[Any, ...]] = set()


class _JaxNnAttention(AttentionImpl):
    """What both impls share: reasons, and the call into ``sdpa_attention``."""

    why_not = WHY_NOT

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if self.metadata.softmax_dtype != "float32":
            reasons.append(
                "jax.nn.dot_product_attention always computes the softmax in float32; "
                f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured"
            )
        return reasons

    def _attend(self, implementation: Implementation, call: AttentionCall) -> AttentionOutput:
        # The call declined these already; a direct forward_* call must not drop them either.
        if call.logits_soft_cap is not None:
            raise UnsupportedError(self.name(), [WHY_NOT[Feature.SOFT_CAP]])
        if call.dropout_prob:
            raise UnsupportedError(self.name(), [WHY_NOT[Feature.DROPOUT]])
        out = sdpa_attention(
            call.q, call.k, call.v, mask=call.mask, bias=call.bias, causal=call.causal,
            sliding_window=call.sliding_window, q_segment_ids=call.q_segment_ids,
            kv_segment_ids=call.kv_segment_ids, softmax_scale=call.softmax_scale, softmax_aux=call.softmax_aux,
            kv_lengths=call.kv_lengths, implementation=implementation,
        )
        return AttentionOutput(attention_outputs=out)


class CudnnAttention(_JaxNnAttention, declaration=CUDNN):
    """cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``."""

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        return reasons + cudnn_reasons(problem, self.device, cudnn_version())

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        return self._attend("cudnn", call)


class SdpaAttention(_JaxNnAttention, declaration=SDPA):
    """The best ``jax.nn.dot_product_attention`` path here: cuDNN if it takes the call, else XLA."""

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if self.compute_dtype(problem) == "float16" and self.platform in ("cpu", "tpu"):
            # jax.nn's XLA path pins the dot algorithm F16_F16_F32; its fallback for platforms
            # without it only catches eager errors, and under jit XLA rejects it at compile time.
            reasons.append(
                f"jax.nn's XLA path asks for the F16_F16_F32 dot algorithm, which XLA on {self.platform} "
                "rejects under jit; use bfloat16 or float32 (AttentionMetadata(runtime_dtype=...))"
            )
        return reasons

    def cudnn_declines(self, problem: AttentionProblem) -> list[str]:
        """Why this call goes to XLA rather than cuDNN here (empty: it goes to cuDNN).

        Judged as if a gradient followed: a forward cannot know, and cuDNN's backward has
        limits of its own that would otherwise fail (or mislead) only later.
        """
        if not (self.platform == "gpu" and self.vendor == "cuda"):
            return [f"cuDNN runs only on NVIDIA GPUs; this platform is {self.platform}"]
        reasons: list[str] = []
        dtype = self.compute_dtype(problem)
        # cuDNN's limits are what its backend declares (plugin.CUDNN).
        if dtype not in CudnnAttention.dtypes:
            reasons.append(f"cuDNN computes in float16/bfloat16 only, the inputs are {dtype}")
        lo, hi = CudnnAttention.head_dims
        reasons += [f"cuDNN takes a {label} of {lo}..{hi}, got {dim}"
                    for label, dim in (("head dim", problem.head_dim), ("value head dim", problem.head_dim_v))
                    if not lo <= dim <= hi]
        return reasons + cudnn_reasons(dataclasses.replace(problem, needs_grad=True), self.device,
                                       cudnn_version())

    def notes(self, problem: AttentionProblem) -> list[str]:
        """How this impl would run ``problem`` here (for ``explain``)."""
        why = self.cudnn_declines(problem)
        if not why:
            return ["runs through cuDNN (jax.nn implementation='cudnn')"]
        return ["runs through XLA (jax.nn implementation='xla'): " + "; ".join(why)]

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return self._attend("xla", call)

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        problem = call.problem
        why = self.cudnn_declines(problem)
        implementation: Implementation = "xla" if why else "cudnn"
        key = (problem.signature(), implementation)
        if key not in _logged:
            _logged.add(key)
            logger.info("jaxattn: sdpa runs %s through %s%s", problem.describe(),
                        "cuDNN" if not why else "XLA", f" ({'; '.join(why)})" if why else "")
        return self._attend(implementation, call)
