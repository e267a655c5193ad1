"""Entry-point module of jaxattn-ring: registers ``ring`` lazily (imports no jax)."""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["RING", "jaxattn_register_impls"]

# Must match RingAttention's declarations; the registry checks it when the class loads.
RING = ImplRef(
    "jaxattn_ring.impl:RingAttention",
    names=("ring",),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="sequence-parallel ring attention over metadata.sequence_axis, any per-block kernel with lse",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [RING]
