"""Entry-point module of jaxattn-triton: registers ``flash_attn2`` for CUDA lazily.

Discovery imports only this module, which imports neither jax, triton nor jax_triton:
the impl class is named by an ``ImplRef`` and loaded on first use.
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["FLASH_ATTN2", "jaxattn_register_impls"]

# Must match TritonFlashAttention's declarations; the registry checks it when the class loads.
FLASH_ATTN2 = ImplRef(
    "jaxattn_triton.impl:TritonFlashAttention",
    names=("flash_attn2", "triton_flash_attn2"),
    platforms=("cuda",),
    priority=90,
    description="FlashAttention-2 in Triton via jax-triton (CUDA GPUs, fp16/bf16)",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [FLASH_ATTN2]
