"""Entry-point module of jaxattn-vanilla: registers ``vanilla`` and ``blockwise`` lazily (imports no jax)."""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["BLOCKWISE", "VANILLA", "jaxattn_register_impls"]

# Must match VanillaAttention's declarations; the registry checks it when the class loads.
VANILLA = ImplRef(
    "jaxattn_vanilla.impl:VanillaAttention",
    names=("vanilla",),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="pure-JAX reference attention, every feature, O(T*S) memory",
)
# Must match BlockwiseAttention's declarations. Priority 10: above vanilla (same math in O(T)
# memory), below every kernel plugin (sdpa is 50), so "auto" takes it only where none runs.
BLOCKWISE = ImplRef(
    "jaxattn_vanilla.blockwise_impl:BlockwiseAttention",
    names=("blockwise",),
    platforms=("cpu", "gpu", "tpu"),
    priority=10,
    description="pure-JAX blockwise attention with a custom VJP, every feature but weights, O(T) memory",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [VANILLA, BLOCKWISE]
