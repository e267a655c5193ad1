"""Entry-point module of jaxattn-vanilla: registers ``vanilla`` lazily (imports no jax)."""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["VANILLA", "jaxattn_register_impls"]

# Must match VanillaAttention's declarations; the registry checks it when the class loads.
VANILLA = ImplRef(
    "jaxattn_vanilla.impl:VanillaAttention",
    names=("vanilla",),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="pure-JAX reference attention, every feature, O(T*S) memory",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [VANILLA]
