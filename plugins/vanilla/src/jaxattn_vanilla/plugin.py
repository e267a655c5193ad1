"""Entry-point module of jaxattn-vanilla: registers ``vanilla``, ``blockwise`` and
``autoregressive_decodeattn`` (dense), and the paged reference, lazily (imports no jax)."""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["BLOCKWISE", "DECODE", "VANILLA", "VANILLA_PAGED", "jaxattn_register_impls"]

# Must match VanillaAttention's declarations; the registry checks it when the class loads.
VANILLA = ImplRef(
    "jaxattn_vanilla.vanilla.impl:VanillaAttention",
    names=("vanilla",),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="pure-JAX reference attention, every feature, O(T*S) memory",
)
# Must match BlockwiseAttention's declarations. Priority 10: above vanilla (same math in O(T)
# memory), below every kernel plugin (sdpa is 50), so "auto" takes it only where none runs.
BLOCKWISE = ImplRef(
    "jaxattn_vanilla.blockwise.impl:BlockwiseAttention",
    names=("blockwise",),
    platforms=("cpu", "gpu", "tpu"),
    priority=10,
    description="pure-JAX blockwise attention with a custom VJP, every feature but weights, O(T) memory",
)
# Must match DecodeAttention's declarations. Priority 60 (decode/impl.py says why): above sdpa
# (50) for the decode calls it accepts on a CPU, where it was measured faster; its
# priority_for() drops it to 5 on GPUs and TPUs. Kernel plugins' providers of this name (the
# Triton decode kernel, 100 on CUDA) shadow it on their platforms.
DECODE = ImplRef(
    "jaxattn_vanilla.decode.impl:DecodeAttention",
    names=("autoregressive_decodeattn",),
    platforms=("cpu", "gpu", "tpu"),
    priority=60,
    description="pure-JAX split-K decode over a dense KV cache (T <= 16), any platform",
)


# The paged mechanisms' reference (kind "paged"), on every platform at the lowest priority:
# kernel plugins provide the mechanism names for their platforms above it, and "auto" still
# sees it under its own name.
VANILLA_PAGED = ImplRef(
    "jaxattn_vanilla.paged.impl:PagedReference",
    names=("vanilla_paged", "ragged_page_attention_v3", "ragged_page_attention_v2", "page_attention"),
    platforms=("cpu", "gpu", "tpu"),
    priority=0,
    description="pure-JAX paged attention (gather the pages, then attend), every paged call",
    kind="paged",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [VANILLA, BLOCKWISE, DECODE, VANILLA_PAGED]
