"""Entry-point module of jaxattn-pallas: declares ``flash_attn2`` and the paged mechanisms
(``ragged_page_attention_v3``/``_v2``, ``page_attention``) for TPU.

Imports neither jax nor any Pallas module: the classes (and the kernels behind them) load
only when a name is asked for on a TPU (or in interpret mode).
"""

from __future__ import annotations

from jaxattn.backend import Feature, ImplRef, hookimpl

from .ragged.rules import SUPPORTED_DTYPES

__all__ = ["PALLAS_FLASH", "PALLAS_PAGE_ATTENTION", "PALLAS_RAGGED_PAGE_ATTENTION", "jaxattn_register_impls"]

PALLAS_FLASH = ImplRef(
    "jaxattn_pallas.flash.impl:PallasFlashAttention",
    names=("flash_attn2",),
    platforms=("tpu",),
    # Above vanilla (0); below splash on TPU v4 and later (see jaxattn_splash), above it on v2/v3.
    priority=100,
    description="Pallas TPU flash attention (causal, mask, bias, GQA, segment ids, mask_mod)",
    # float16 has no fast path on TPUs; bfloat16 is their 16-bit type.
    dtypes={"float32", "bfloat16"},
    # Any head dim works (padded with zeros to the kernel's sizes); past 256 the padded
    # tiles stop fitting the default VMEM budget.
    head_dims=(1, 256),
    features={
        Feature.CAUSAL, Feature.MASK, Feature.BIAS, Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.VALUE_DIM,
        Feature.SEGMENT_IDS, Feature.GRAD, Feature.MASK_MOD,
    },
)

# The paged mechanisms (kind "paged"). On a TPU the ragged kernel (100) is the faster one for
# every call, decode steps included, so "auto" runs it first; page_attention (50, JAX's
# paged_attention kernel) serves that name, and "auto"'s decode steps in TPU interpret mode,
# where the ragged kernel cannot run (jax 0.10.2-0.12.1; its rules ask the interpreter). Both
# are above jaxattn-vanilla's references of the same names (0), which they take over on TPUs
# (declared in overrides=).
PALLAS_RAGGED_PAGE_ATTENTION = ImplRef(
    "jaxattn_pallas.ragged.impl:PallasRaggedPagedAttention",
    names=("ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention"),
    platforms=("tpu",),
    priority=100,
    description="Pallas TPU ragged paged attention (mixed prefill and decode, window, soft cap)",
    kind="paged",
    overrides=("ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention"),
    dtypes=SUPPORTED_DTYPES,
    features={
        Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.MULTI_TOKEN,
        Feature.RAGGED,
    },
)
PALLAS_PAGE_ATTENTION = ImplRef(
    "jaxattn_pallas.decode.impl:PallasPagedDecode",
    names=("page_attention",),
    platforms=("tpu",),
    priority=50,
    description="Pallas TPU paged decode (JAX's paged_attention kernel; runs in interpret mode)",
    kind="paged",
    overrides=("page_attention",),
    # float32 and float16 are split into bfloat16 terms for the kernel, exactly (decode/rules.py).
    dtypes={"float32", "bfloat16", "float16"},
    # One query per sequence, no window, no sinks: the kernel has none of them.
    features={Feature.GQA, Feature.VALUE_DIM, Feature.SOFT_CAP},
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [PALLAS_FLASH, PALLAS_RAGGED_PAGE_ATTENTION, PALLAS_PAGE_ATTENTION]
