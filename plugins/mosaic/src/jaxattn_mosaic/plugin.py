"""Entry-point module of jaxattn-mosaic: declares ``mosaic_flash`` (imports no jax).

``mosaic_flash`` is attention of our own in Pallas Mosaic GPU for sm_90 (H100/H200): a forward
for full and causal (bottom-right when T != S), GQA, head dims 64/128/256, bf16/fp16, any T and
S, a logits soft cap, a sliding window, a mask_mod (its packed bits and tile lists: ``mods``),
ALiBi as a score_mod (``masks.alibi``), with the log-sum-exp; a backward of its own for head
dims 64 and 128 (the same shapes, deterministic), and cuDNN's backward fed this forward's
output and lse where that measured faster or for head dim 256 (``impl.backward_choice``;
``metadata.extra["mosaic_backward"]``).

Priority 80 (below cudnn's 100 and flash_attn2's 90): measured on an H100 it is at or above
cuDNN for causal calls and slightly below for full ones (docs/bench.md), so "auto" picks it
only where tuning records measured it faster.
"""

from __future__ import annotations

from typing import Any

from jaxattn.backend import Feature, ImplRef, hookimpl

__all__ = ["MOSAIC_FLASH", "jaxattn_register_impls", "jaxattn_tuning_priors"]

MOSAIC_FLASH = ImplRef(
    "jaxattn_mosaic.impl:MosaicFlashAttention",
    names=("mosaic_flash",),
    platforms=("cuda",),
    priority=80,
    description="FA3-style forward and backward in Pallas Mosaic GPU (Hopper sm_90 only, fp16/bf16; no CPU)",
    dtypes={"bfloat16", "float16"},
    # Tiles of 64 columns of the head dim (128-byte swizzle); the shared memory holds up to 256.
    head_dims={64, 128, 256},
    features={Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.LSE, Feature.GRAD,
              Feature.SOFT_CAP, Feature.SLIDING_WINDOW, Feature.MASK_MOD, Feature.SCORE_MOD},
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [MOSAIC_FLASH]


@hookimpl
def jaxattn_tuning_priors() -> list[Any]:
    """What this plugin measured about its own impls, per device generation: ``priors/*.json``
    (docs/tuning.md, "Shipped priors"); "auto" ranks by them where the user has no tuning record."""
    from jaxattn.backend import package_priors

    return package_priors(__package__ or __name__.rpartition(".")[0])
