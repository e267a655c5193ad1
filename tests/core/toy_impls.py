"""Small in-process impls for the core's tests (plain jnp, independent of the plugins)."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxattn import AttentionCall, AttentionImpl, AttentionOutput, Feature


def dense_attention(q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, 2), jnp.repeat(v, group, 2)
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale
    t, n = q.shape[1], k.shape[1]
    if causal:
        keep = jnp.arange(n)[None, :] <= jnp.arange(t)[:, None] + n - t
        s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32)).astype(q.dtype)


class PlainImpl(AttentionImpl):
    """Everywhere; causal + GQA only."""

    features: ClassVar = frozenset({Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.GRAD})
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("plain", "plain_alias")

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        type(self).calls.append(f"native:{self.platform}")
        return AttentionOutput(dense_attention(call.q, call.k, call.v, call.causal, call.softmax_scale))

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        type(self).calls.append("cuda")
        return AttentionOutput(dense_attention(call.q, call.k, call.v, call.causal, call.softmax_scale))


class FancyImpl(PlainImpl):
    """Higher priority, but no GQA: auto takes it only for MHA."""

    features: ClassVar = frozenset({Feature.CAUSAL, Feature.CROSS})
    priority: ClassVar[int] = 10

    @classmethod
    def get_impl_name(cls) -> str:
        return "fancy"


class TpuOnlyImpl(PlainImpl):
    platforms: ClassVar = frozenset({"tpu"})
    priority: ClassVar[int] = 50

    @classmethod
    def get_impl_name(cls) -> str:
        return "tpu_only"


class CudaOnlyImpl(PlainImpl):
    platforms: ClassVar = frozenset({"cuda"})
    dtypes: ClassVar = frozenset({"bfloat16", "float16"})
    head_dims: ClassVar = frozenset({64, 128})
    priority: ClassVar[int] = 50

    @classmethod
    def get_impl_name(cls) -> str:
        return "cuda_only"


class FallbackImpl(PlainImpl):
    """Runs MHA itself and falls back on "plain" for GQA, like splash's seed behaviour."""

    priority: ClassVar[int] = 20
    fallback_impl: ClassVar[str | None] = "plain"

    @classmethod
    def get_impl_name(cls) -> str:
        return "falls_back"

    def fallback_reasons(self, problem: Any) -> list[str]:
        return ["GQA falls back"] if problem.heads_q != problem.heads_kv else []


class OddBackwardImpl(PlainImpl):
    """Fastest forward, but its backward refuses odd lengths (as cuDNN's does): declared, so
    that "auto" can route differentiated calls elsewhere and an explicit choice can refuse."""

    priority: ClassVar[int] = 30

    @classmethod
    def get_impl_name(cls) -> str:
        return "odd_bwd"

    def not_supported_reasons(self, problem: Any) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.needs_grad and (problem.seq_q % 2 or problem.seq_k % 2):
            reasons.append(f"the backward needs even T and S, got T={problem.seq_q}, S={problem.seq_k}")
        return reasons

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        type(self).calls.append("odd_bwd")
        causal, scale = call.causal, call.softmax_scale

        @jax.custom_vjp
        def attend(q: Any, k: Any, v: Any) -> Any:
            return dense_attention(q, k, v, causal, scale)

        def fwd(q: Any, k: Any, v: Any) -> tuple[Any, None]:
            if q.shape[1] % 2 or k.shape[1] % 2:  # what a kernel library does: a raw error
                raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, KV {k.shape[1]}.")
            return jax.vjp(lambda *a: dense_attention(*a, causal, scale), q, k, v)

        def bwd(pullback: Any, g: Any) -> Any:
            return pullback(g)

        attend.defvjp(fwd, bwd)
        return AttentionOutput(attend(call.q, call.k, call.v))
