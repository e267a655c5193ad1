"""Entry-point module of jaxattn-ring: declares ``ring`` (imports no jax)."""

from __future__ import annotations

from jaxattn.backend import Feature, ImplRef, hookimpl

__all__ = ["RING", "jaxattn_register_impls"]

RING = ImplRef(
    "jaxattn_ring.impl:RingAttention",
    names=("ring",),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="sequence-parallel ring attention over metadata.sequence_axis, any per-block kernel with lse",
    # What the per-block kernel accepts decides in the end; ring itself adds no dtype limit.
    dtypes={"float16", "bfloat16", "float32", "float64"},
    features={
        Feature.CAUSAL, Feature.MASK, Feature.GQA, Feature.CROSS, Feature.VALUE_DIM, Feature.SLIDING_WINDOW,
        Feature.SEGMENT_IDS, Feature.SOFT_CAP, Feature.SINKS, Feature.GRAD, Feature.LSE,
    },
    # It shards the sequence itself: nothing wraps its forward in shard_map.
    sequence_parallel=True,
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [RING]
