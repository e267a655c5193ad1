"""Entry-point module of jaxattn-splash: declares ``splash`` / ``blocksparse`` for TPU.

Imports neither jax nor any Pallas module: the class (and the kernel behind it) load only
when ``splash`` is asked for on a TPU (or in interpret mode).
"""

from __future__ import annotations

from jaxattn.backend import Feature, ImplRef, hookimpl

__all__ = ["SPLASH", "jaxattn_register_impls"]

SPLASH = ImplRef(
    "jaxattn_splash.impl:SplashAttention",
    names=("splash", "blocksparse"),
    platforms=("tpu",),
    # The seed's choice by generation: splash on TPU v4 and later, the Pallas flash kernel
    # (priority 100) on v2/v3, where splash's block-sparse bookkeeping does not pay
    # (SplashAttention.priority_for gives 90 there).
    priority=110,
    description="Pallas TPU splash attention (block-sparse: causal, windows, static mask_mods, soft cap, sinks)",
    dtypes={"float32", "bfloat16"},
    # Head dims that are not multiples of 128 are accepted and handed to vanilla (see
    # SplashAttention.fallback_reasons); past 256 the tiles stop fitting the default VMEM budget.
    head_dims=(1, 256),
    features={
        Feature.CAUSAL, Feature.GQA, Feature.CROSS,
        Feature.DECODE,  # through the fallback
        Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SEGMENT_IDS, Feature.SOFT_CAP, Feature.SINKS,
        Feature.GRAD,
        Feature.MASK_MOD,  # static ones: host data for splash's mask objects (SplashAttention says why not)
    },
    fallback_impl="vanilla",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [SPLASH]
