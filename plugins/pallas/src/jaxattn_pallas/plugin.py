"""Entry-point module of jaxattn-pallas: registers ``flash_attn2`` and the paged mechanisms
(``ragged_page_attention_v3``/``_v2``, ``page_attention``) for TPU lazily.

Imports neither jax nor any Pallas module: the classes (and the kernels behind them) load
only when a name is asked for on a TPU (or in interpret mode).
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["PALLAS_FLASH", "PALLAS_PAGE_ATTENTION", "PALLAS_RAGGED_PAGE_ATTENTION", "jaxattn_register_impls"]

# Must match PallasFlashAttention's declarations; the registry checks it when the class loads.
PALLAS_FLASH = ImplRef(
    "jaxattn_pallas.flash_impl:PallasFlashAttention",
    names=("flash_attn2",),
    platforms=("tpu",),
    priority=100,
    description="Pallas TPU flash attention (causal, mask, bias, GQA, segment ids)",
)

# The paged mechanisms (kind "paged"); each must match its class in jaxattn_pallas.ragged_impl or .paged_decode_impl.
# On a TPU the ragged kernel (100) is the faster one for every call, decode steps included, so
# "auto" runs it first; page_attention (50, JAX's paged_attention kernel) serves that name, and
# "auto"'s decode steps in TPU interpret mode, where the ragged kernel cannot run on
# jax <= 0.11.2. Both are above jaxattn-vanilla's references of the same names (0), which they
# take over on TPUs (declared in overrides=).
PALLAS_RAGGED_PAGE_ATTENTION = ImplRef(
    "jaxattn_pallas.ragged_impl:PallasRaggedPagedAttention",
    names=("ragged_page_attention_v3", "ragged_page_attention_v2"),
    platforms=("tpu",),
    priority=100,
    description="Pallas TPU ragged paged attention (mixed prefill and decode, window, soft cap)",
    kind="paged",
    overrides=("ragged_page_attention_v3", "ragged_page_attention_v2"),
)
PALLAS_PAGE_ATTENTION = ImplRef(
    "jaxattn_pallas.paged_decode_impl:PallasPagedDecode",
    names=("page_attention",),
    platforms=("tpu",),
    priority=50,
    description="Pallas TPU paged decode (JAX's paged_attention kernel; runs in interpret mode)",
    kind="paged",
    overrides=("page_attention",),
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [PALLAS_FLASH, PALLAS_RAGGED_PAGE_ATTENTION, PALLAS_PAGE_ATTENTION]
