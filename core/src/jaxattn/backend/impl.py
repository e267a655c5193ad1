"""``AttentionImpl``: the contract every dense attention backend implements.

Capabilities are class attributes (declared, not probed); ``not_supported_reasons`` returns
*every* reason a call cannot run; ``__call__`` validates the call once into an ``AttentionCall``
and runs it on the straight path (``Backend.run``: the plan decided once per problem, then the
``forward_<platform>`` method for the device, vLLM style). A forward receives the call object
and reads what it needs from it (the machinery every op kind shares is ``jaxattn.backend.Backend``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import Backend, Forward, Plan, resolve_platform
from .call import AttentionCall
from .metadata import AttentionMetadata, check_split
from .problem import AttentionProblem
from .validation import resolve_call

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["AttentionCall", "AttentionImpl", "Forward", "Plan", "resolve_platform", "sequence_reasons"]


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

    def check_call(self, problem: AttentionProblem) -> None:
        """A kernel run under ``shard_map`` over the metadata's batch and head axes needs B and Hq
        to split over them (``InvalidInputError`` naming the axis and both sizes)."""
        if self.metadata.mesh is not None and not self.sequence_parallel:
            check_split(self.metadata, "batch size B", "q", problem.batch, "batch_axis")
            check_split(self.metadata, "query heads Hq", "q", problem.heads_q, "head_axis")

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every reason this impl cannot run ``problem`` here; empty when it can.

        Subclasses extend it: ``reasons = super().not_supported_reasons(problem)``.
        """
        reasons = self.declared_reasons(problem) + sequence_reasons(self.name(), self.sequence_parallel, self.metadata)
        md = self.metadata
        if problem.kv_dtype is not None and md.mesh is not None and (md.batch_axis or md.head_axis):
            reasons.append("a quantized KV cache is not sharded for you (its scales have no mesh specs): call inside "
                           "your own shard_map with no mesh in the metadata, or dequantize first")
        if (problem.mask_mod or problem.score_mod) and md.mesh is not None and (md.batch_axis or md.head_axis):
            reasons.append("a mask_mod or score_mod is not sharded for you (under shard_map its b and h would be "
                           "shard-local): call inside your own shard_map with no mesh in the metadata")
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
        call = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                            metadata=self.metadata, **features)
        problem = dataclasses.replace(call.problem, needs_grad=True) if needs_grad else call.problem
        return self.reasons_to_decline(problem) + self.direct_reasons(problem)

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
        """Validate (once, into an ``AttentionCall``), check support (one error with every
        reason), then run on this device."""
        return self.run(resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                                     metadata=self.metadata, prepare=True, **features))

    def output_shape(self, problem: AttentionProblem) -> tuple[int, ...]:
        return (problem.batch, problem.seq_q, problem.heads_q, problem.head_dim_v)
