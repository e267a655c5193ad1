"""Entry-point module of jaxattn-triton: registers its backends for CUDA lazily.

* ``flash_attn2`` (dense): FlashAttention-2, forward and backward;
* ``autoregressive_decodeattn`` (dense): split-K decode over a dense KV cache (T <= 16);
* ``ragged_page_attention_v3`` / ``_v2`` and ``page_attention`` (kind "paged"): the split-K
  paged kernel, ragged batches and T queries per sequence.

Discovery imports only this module, which imports neither jax, triton nor jax_triton:
each class is named by an ``ImplRef`` and loaded on first use.
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["DECODE", "FLASH_ATTN2", "PAGE_ATTENTION", "RAGGED_PAGE_ATTENTION", "jaxattn_register_impls"]

# Must match TritonFlashAttention's declarations; the registry checks it when the class loads.
FLASH_ATTN2 = ImplRef(
    "jaxattn_triton.impl:TritonFlashAttention",
    names=("flash_attn2", "triton_flash_attn2"),
    platforms=("cuda",),
    priority=90,
    description="FlashAttention-2 in Triton via jax-triton (CUDA GPUs, fp16/bf16)",
)

# Must match TritonDecodeAttention's declarations. Priority 100: above flash_attn2 (90) for the
# decode-shaped calls it accepts (T <= 16), which it runs split-K over the cache.
DECODE = ImplRef(
    "jaxattn_triton.decode_impl:TritonDecodeAttention",
    names=("autoregressive_decodeattn",),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K decode over a dense KV cache (CUDA GPUs, fp16/bf16, T <= 16)",
    overrides=("autoregressive_decodeattn",),  # jaxattn-vanilla's pure-JAX decode, on CUDA
)

# The paged mechanisms (kind "paged"); each must match its class in jaxattn_triton.paged_impl.
# Above jaxattn-vanilla's pure-JAX references of the same names (0), which they shadow on CUDA
# (declared in overrides=, as taking another distribution's name must be).
RAGGED_PAGE_ATTENTION = ImplRef(
    "jaxattn_triton.paged_impl:TritonRaggedPagedAttention",
    names=("ragged_page_attention_v3", "ragged_page_attention_v2"),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K ragged paged attention (CUDA GPUs, fp16/bf16; mixed prefill+decode)",
    kind="paged",
    overrides=("ragged_page_attention_v3", "ragged_page_attention_v2"),
)
PAGE_ATTENTION = ImplRef(
    "jaxattn_triton.paged_impl:TritonPagedDecode",
    names=("page_attention",),
    platforms=("cuda",),
    priority=100,
    description="Triton split-K paged decode (CUDA GPUs, fp16/bf16; T queries per sequence)",
    kind="paged",
    overrides=("page_attention",),
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [FLASH_ATTN2, DECODE, RAGGED_PAGE_ATTENTION, PAGE_ATTENTION]
