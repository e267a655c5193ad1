"""``AttentionImpl``: the contract every dense attention backend implements.

Capabilities are class attributes (declared, not probed); ``not_supported_reasons`` returns
*every* reason a call cannot run; ``__call__`` validates, checks, then routes to the
``forward_<platform>`` method for the device, vLLM style (the machinery every op kind shares
is ``jaxattn.backend.Backend``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .backend import DIRECT, Backend, Call, Forward, Runner, resolve_platform
from .metadata import AttentionMetadata
from .problem import AttentionProblem
from .validation import CallSpec, resolve_call

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["DIRECT", "AttentionImpl", "Call", "Forward", "Runner", "resolve_platform", "sequence_reasons"]


def sequence_reasons(impl_name: str, sequence_parallel: bool, metadata: AttentionMetadata) -> list[str]:
    """Why an impl cannot honour ``metadata.sequence_axis`` (empty when it can or none is set)."""
    if metadata.sequence_axis is None or sequence_parallel:
        return []
    return [
        f"metadata.sequence_axis={metadata.sequence_axis!r} shards the sequence, but {impl_name} runs whole "
        "sequences on each device (shard_map over batch and heads only); use impl='ring' (which runs a "
        "per-block kernel such as vanilla), or leave sequence_axis unset"
    ]


class AttentionImpl(Backend[AttentionProblem]):
    """Base class of dense attention backends. Subclass it, declare capabilities, override forwards."""

    kind = "dense"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every reason this impl cannot run ``problem`` here; empty when it can.

        Subclasses extend it: ``reasons = super().not_supported_reasons(problem)``.
        """
        reasons = self.declared_reasons(problem) + sequence_reasons(self.name(), self.sequence_parallel, self.metadata)
        md = self.metadata
        if problem.kv_dtype is not None and md.mesh is not None and (md.batch_axis or md.head_axis):
            reasons.append("a quantized KV cache is not sharded for you (its scales have no mesh specs): call inside "
                           "your own shard_map with no mesh in the metadata, or dequantize first")
        return reasons

    def supports(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        bias: Any = None,
        init_bias: Callable[[], Any] | None = None,
        causal: bool = False,
        *,
        needs_grad: bool = False,
        **features: Any,
    ) -> list[str]:
        """Every reason this impl cannot run the call (arrays or ShapeDtypeStructs); [] if it can."""
        spec = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                            metadata=self.metadata, **features)
        problem = self.problem(q, k, v, mask, spec, features.get("softmax_aux"), needs_grad)
        return self.reasons_to_decline(problem) + self.runner.reasons(self, problem)

    def problem(
        self, q: Any, k: Any, v: Any, mask: Any, spec: CallSpec, softmax_aux: Any = None, needs_grad: bool = False
    ) -> AttentionProblem:
        return AttentionProblem.from_inputs(
            q, k, v, mask=mask, bias=spec.bias, causal=spec.causal, sliding_window=spec.sliding_window,
            q_segment_ids=spec.q_segment_ids, kv_segment_ids=spec.kv_segment_ids,
            logits_soft_cap=spec.logits_soft_cap, softmax_aux=softmax_aux, dropout_prob=spec.dropout_prob,
            needs_grad=needs_grad, dtype=self.metadata.runtime_dtype or q.dtype, kv_lengths=spec.kv_lengths,
        )

    # -- running ----------------------------------------------------------------------------
    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        bias: Any = None,
        init_bias: Callable[[], Any] | None = None,
        causal: bool = False,
        **features: Any,
    ) -> AttentionOutput:
        """Validate, check support (one error with every reason), then run on this device."""
        softmax_aux = features.pop("softmax_aux", None)
        dropout_rng = features.pop("dropout_rng", None)
        spec = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                            softmax_aux=softmax_aux, dropout_rng=dropout_rng, metadata=self.metadata, **features)
        problem = self.problem(q, k, v, mask, spec, softmax_aux)
        self.decline(problem)
        return self.runner.run(self, problem, self.prepare(q, k, v, mask, spec, softmax_aux, dropout_rng))

    def prepare(self, q: Any, k: Any, v: Any, mask: Any, spec: CallSpec, softmax_aux: Any,
                dropout_rng: Any) -> Call:
        """The normalised call: inputs in ``metadata.runtime_dtype``, mask and bias at rank 4.

        ``kv_lengths`` is passed only when the call has them (only impls that declare
        ``Feature.KV_LENGTHS`` get such calls); so are ``k_scale`` and ``v_scale``, rank 3, for a
        quantized cache (``Feature.QUANTIZED_KV``; the narrow cache is passed as it is).
        """
        import jax.numpy as jnp

        if self.metadata.runtime_dtype is not None:
            dtype = jnp.dtype(self.metadata.runtime_dtype)
            q = q.astype(dtype)
            if spec.kv_dtype is None:
                k, v = k.astype(dtype), v.astype(dtype)
        mask = None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
        bias = spec.bias
        bias = None if bias is None else jnp.reshape(bias, (1,) * (4 - bias.ndim) + tuple(bias.shape))
        kwargs = {
            "mask": mask, "bias": bias, "init_bias": None, "causal": spec.causal,
            "sliding_window": spec.sliding_window, "q_segment_ids": spec.q_segment_ids,
            "kv_segment_ids": spec.kv_segment_ids, "softmax_scale": spec.softmax_scale,
            "logits_soft_cap": spec.logits_soft_cap, "softmax_aux": softmax_aux,
            "dropout_prob": spec.dropout_prob, "dropout_rng": dropout_rng,
        }
        if spec.kv_lengths is not None:
            kwargs["kv_lengths"] = spec.kv_lengths
        if spec.kv_dtype is not None:
            from .quantize import scale_rank3

            kwargs["k_scale"], kwargs["v_scale"] = scale_rank3(spec.k_scale), scale_rank3(spec.v_scale)
        return Call((q, k, v), kwargs)

    def output_shape(self, call: Call) -> tuple[int, ...]:
        q, _, v = call.args
        b, t, hq, _ = q.shape
        return (b, t, hq, v.shape[-1])

    # -- per-platform forwards (override the ones you have) ---------------------------------
    def forward_native(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                       init_bias: Callable[[], Any] | None = None, causal: bool = False,
                       **features: Any) -> AttentionOutput:
        """Portable path; the default target of every other forward."""
        raise NotImplementedError(
            f"impl {self.name()!r} has no forward for platform {self.platform!r} and no forward_native"
        )

    def forward_cpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_tpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_gpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_cuda(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                     init_bias: Callable[[], Any] | None = None, causal: bool = False,
                     **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_rocm(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                     init_bias: Callable[[], Any] | None = None, causal: bool = False,
                     **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k, v, mask, bias, init_bias, causal, **features)
