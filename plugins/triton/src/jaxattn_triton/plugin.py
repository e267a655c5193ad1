"""Entry-point module of jaxattn-triton: declares its backends for CUDA.

* ``flash_attn2`` (dense): FlashAttention-2, forward and backward;
* ``autoregressive_decodeattn`` (dense): split-K decode over a dense KV cache (T <= 16);
* ``ragged_page_attention_v3`` / ``_v2`` and ``page_attention`` (kind "paged"): the split-K
  paged kernel, ragged batches and T queries per sequence.

Discovery imports only this module (and the launchers' limits), which imports neither jax,
triton nor jax_triton: each class is named by its ``ImplRef``, binds to it, and is loaded on
first use.
"""

from __future__ import annotations

from typing import Any

from jaxattn.backend import Feature, ImplRef, hookimpl

from .paged.launch import MAX_HEAD_DIM

__all__ = ["DECODE", "FLASH_ATTN2", "PAGE_ATTENTION", "RAGGED_PAGE_ATTENTION", "jaxattn_register_impls",
           "jaxattn_tuning_priors"]

#: The Triton kernels compute in these (float32 would be TF32 on the tensor cores).
DTYPES = frozenset({"bfloat16", "float16"})

FLASH_ATTN2 = ImplRef(
    "jaxattn_triton.flash.impl:TritonFlashAttention",
    names=("flash_attn2", "triton_flash_attn2"),
    platforms=("cuda",),
    # Below cudnn (100), which measured faster on H200 for the calls both accept; above
    # sdpa (50): "auto" picks this kernel for what cuDNN cannot do (soft cap, Dv != D).
    priority=90,
    description="FlashAttention-2 in Triton via jax-triton (CUDA GPUs, fp16/bf16)",
    dtypes=DTYPES,
    # 64/128/256 run unpadded; other sizes are padded in-kernel to the next power of two.
    head_dims=(1, 256),
    features={
        Feature.CAUSAL, Feature.DECODE, Feature.MASK, Feature.BIAS, Feature.GQA, Feature.CROSS, Feature.VALUE_DIM,
        Feature.SLIDING_WINDOW, Feature.SEGMENT_IDS, Feature.SOFT_CAP, Feature.SINKS, Feature.GRAD, Feature.LSE,
        Feature.KV_LENGTHS,  # on the split-K decode path only (see impl.kv_lengths_reasons)
        Feature.MASK_MOD,  # evaluated in JAX into packed bits and tile lists (flash.ops.mod_bits)
        Feature.SCORE_MOD,  # masks.alibi only, its term added in registers (impl.SCORE_MOD_ONLY_ALIBI)
    },
)

# Priority 100: above flash_attn2 (90) for the decode-shaped calls it accepts (T <= 16),
# which it runs split-K over the cache.
DECODE = ImplRef(
    "jaxattn_triton.decode.impl:TritonDecodeAttention",
    names=("autoregressive_decodeattn",),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K decode over a dense KV cache (CUDA GPUs, fp16/bf16, T <= 16)",
    overrides=("autoregressive_decodeattn",),  # jaxattn-vanilla's pure-JAX decode, on CUDA
    dtypes=DTYPES,
    # 64/128/256 run unpadded; other sizes are masked to the next power of two (>= 16).
    head_dims=(1, MAX_HEAD_DIM),
    features={
        Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.VALUE_DIM, Feature.SLIDING_WINDOW,
        Feature.SOFT_CAP, Feature.SINKS, Feature.KV_LENGTHS, Feature.GRAD, Feature.LSE, Feature.QUANTIZED_KV,
    },
)

# The paged mechanisms (kind "paged"): above jaxattn-vanilla's pure-JAX references of the same
# names (0), which they shadow on CUDA (declared in overrides=, as taking another
# distribution's name must be). v2 and v3 differ in EasyDeL by kernel generation and cache
# layout; the contract fixes the call, so both name one op (docs/contract.md).
PAGED_FEATURES = frozenset({
    Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS, Feature.MULTI_TOKEN,
    Feature.RAGGED, Feature.QUANTIZED_KV,
})
RAGGED_PAGE_ATTENTION = ImplRef(
    "jaxattn_triton.paged.impl:TritonRaggedPagedAttention",
    names=("ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention"),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K ragged paged attention (CUDA GPUs, fp16/bf16; mixed prefill+decode)",
    kind="paged",
    overrides=("ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention"),
    dtypes=DTYPES,
    head_dims=(1, MAX_HEAD_DIM),
    # mask_mod: evaluated in JAX into packed visibility bits per query token (paged.visibility).
    features=PAGED_FEATURES | {Feature.MASK_MOD},
)
PAGE_ATTENTION = ImplRef(
    "jaxattn_triton.paged.impl:TritonPagedDecode",
    names=("page_attention",),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K paged decode (CUDA GPUs, fp16/bf16; T queries per sequence)",
    kind="paged",
    overrides=("page_attention",),
    dtypes=DTYPES,
    head_dims=(1, MAX_HEAD_DIM),
    features=PAGED_FEATURES - {Feature.RAGGED},
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [FLASH_ATTN2, DECODE, RAGGED_PAGE_ATTENTION, PAGE_ATTENTION]


@hookimpl
def jaxattn_tuning_priors() -> list[Any]:
    """What this plugin measured about its own impls, per device generation: ``priors/*.json``
    (docs/tuning.md, "Shipped priors"); "auto" ranks by them where the user has no tuning record."""
    from jaxattn.backend import package_priors

    return package_priors(__package__ or __name__.rpartition(".")[0])
