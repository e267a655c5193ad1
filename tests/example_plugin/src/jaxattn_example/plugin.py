"""Registration module: the target of this distribution's ``jaxattn.plugins`` entry point.

It imports nothing heavy. The impl is handed over as a lazy ``ImplRef`` whose names and
platforms are declared here, so ``jaxattn list`` shows it without importing ``impl.py``; the
module is imported the first time the impl is asked for.
"""

from __future__ import annotations

from jaxattn import ImplRef, hookimpl

NAME = "example"
ALIAS = "example_dense"


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [
        ImplRef(
            "jaxattn_example.impl:ExampleAttention",
            names=(NAME, ALIAS),
            platforms=("cpu", "gpu", "tpu"),
            priority=-100,
            description="example third-party backend: dense softmax attention in pure JAX",
        )
    ]
