"""Entry-point module of jaxattn-pallas: registers ``flash_attn2`` for TPU lazily.

Imports neither jax nor any Pallas module: the class (and the kernel behind it) load only
when ``flash_attn2`` is asked for on a TPU (or in interpret mode).
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["PALLAS_FLASH", "jaxattn_register_impls"]

# Must match PallasFlashAttention's declarations; the registry checks it when the class loads.
PALLAS_FLASH = ImplRef(
    "jaxattn_pallas.impl:PallasFlashAttention",
    names=("flash_attn2",),
    platforms=("tpu",),
    priority=100,
    description="Pallas TPU flash attention (causal, mask, bias, GQA, segment ids)",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [PALLAS_FLASH]
