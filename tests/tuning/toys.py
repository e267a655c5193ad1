"""Toy impls for the tuning tests: exact attention in plain jnp, with call logs."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxattn import AttentionCall, AttentionImpl, AttentionOutput, Feature

EVERYTHING = frozenset({Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.GRAD, Feature.MASK})


def dense(q: Any, k: Any, v: Any, causal: bool, scale: float, mask: Any = None) -> Any:
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, 2), jnp.repeat(v, group, 2)
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale
    t, n = q.shape[1], k.shape[1]
    if causal:
        s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(t)[:, None] + n - t, s, -jnp.inf)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


class _Toy(AttentionImpl):
    features: ClassVar = EVERYTHING
    calls: ClassVar[list[str]]

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        type(self).calls.append(self.name())
        return AttentionOutput(dense(call.q, call.k, call.v, call.causal, call.softmax_scale, call.mask))


class Alpha(_Toy):
    """Highest declared priority."""

    priority: ClassVar[int] = 30
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "alpha"


class Beta(_Toy):
    priority: ClassVar[int] = 20
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "beta"


class NoGqa(_Toy):
    """Declines grouped-query calls; lowest priority."""

    features: ClassVar = EVERYTHING - {Feature.GQA}
    priority: ClassVar[int] = 10
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "nogqa"


class GpuOnly(_Toy):
    platforms: ClassVar = frozenset({"cuda"})
    priority: ClassVar[int] = 5
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "gpu_only"


class TpuOnly(_Toy):
    platforms: ClassVar = frozenset({"tpu"})
    priority: ClassVar[int] = 5
    calls: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "tpu_only"


ALL = (Alpha, Beta, NoGqa, GpuOnly, TpuOnly)


def reset_calls() -> None:
    for cls in ALL:
        cls.calls.clear()
