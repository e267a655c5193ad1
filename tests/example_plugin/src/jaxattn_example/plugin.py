"""Registration module: the target of this distribution's ``jaxattn.plugins`` entry point.

It imports nothing heavy. The impl is declared here, once, as an ``ImplRef``: its names,
platforms, priority and capabilities. ``jaxattn list`` shows it without importing ``impl.py``,
whose class binds to this declaration; that module is imported the first time the impl is
asked for.
"""

from __future__ import annotations

from jaxattn.backend import Feature, ImplRef, hookimpl

__all__ = ["EXAMPLE", "jaxattn_register_impls"]

EXAMPLE = ImplRef(
    "jaxattn_example.impl:ExampleAttention",
    names=("example", "example_dense"),
    platforms=("cpu", "gpu", "tpu"),
    # A demonstration backend must never win "auto" over the real ones.
    priority=-100,
    description="example third-party backend: dense softmax attention in pure JAX",
    dtypes={"float32", "bfloat16", "float16"},
    head_dims=(1, 512),
    # Exactly what it runs; the core declines every other feature with a reason.
    features={
        Feature.CAUSAL, Feature.MASK, Feature.BIAS, Feature.GQA, Feature.CROSS,
        Feature.DECODE, Feature.VALUE_DIM, Feature.GRAD,
    },
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [EXAMPLE]
