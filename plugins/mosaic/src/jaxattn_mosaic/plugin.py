"""Entry-point module of jaxattn-mosaic: declares ``mosaic_flash`` (imports no jax).

``mosaic_flash`` is a forward kernel of our own in Pallas Mosaic GPU for sm_90 (H100/H200):
full and causal (bottom-right when T != S), GQA, head dims 64/128/256, bf16/fp16, any T and S,
with the log-sum-exp. Its gradients are cuDNN's backward fed this forward's output and lse
(jaxattn-sdpa's binding; full, or causal with T == S, even lengths): no backward kernel of
its own yet.

Priority 80 (below cudnn's 100 and flash_attn2's 90): measured on an H100 it is at or above
cuDNN for causal calls and slightly below for full ones (docs/bench.md), so "auto" picks it
only where tuning records measured it faster.
"""

from __future__ import annotations

from jaxattn.capabilities import Feature
from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["MOSAIC_FLASH", "jaxattn_register_impls"]

MOSAIC_FLASH = ImplRef(
    "jaxattn_mosaic.impl:MosaicFlashAttention",
    names=("mosaic_flash",),
    platforms=("cuda",),
    priority=80,
    description="FA3-style forward in Pallas Mosaic GPU (Hopper sm_90 only, fp16/bf16; no CPU); cuDNN's backward",
    dtypes={"bfloat16", "float16"},
    # Tiles of 64 columns of the head dim (128-byte swizzle); the shared memory holds up to 256.
    head_dims={64, 128, 256},
    features={Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.LSE, Feature.GRAD},
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [MOSAIC_FLASH]
