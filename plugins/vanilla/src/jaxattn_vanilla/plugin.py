"""Entry-point module of jaxattn-vanilla: declares ``vanilla``, ``blockwise`` and
``autoregressive_decodeattn`` (dense), and the paged reference ``vanilla_paged``, once each
(imports no jax); each class binds to its declaration."""

from __future__ import annotations

from typing import Any

from jaxattn.backend import ALL_FEATURES, Feature, ImplRef, hookimpl

__all__ = ["BLOCKWISE", "DECODE", "VANILLA", "VANILLA_PAGED", "jaxattn_register_impls", "jaxattn_tuning_priors"]

EVERYWHERE = ("cpu", "gpu", "tpu")
#: float64 too: pure JAX is the only way to check a model (or a serving loop) at full precision.
DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
ANY_HEAD_DIM = (1, 1 << 16)

VANILLA = ImplRef(
    "jaxattn_vanilla.vanilla.impl:VanillaAttention",
    names=("vanilla",),
    platforms=EVERYWHERE,
    # Lowest rank: "auto" picks it only when no specialised kernel accepts the call.
    priority=0,
    description="pure-JAX reference attention, every feature, O(T*S) memory",
    dtypes=DTYPES,
    head_dims=ANY_HEAD_DIM,
    features=ALL_FEATURES,
)
BLOCKWISE = ImplRef(
    "jaxattn_vanilla.blockwise.impl:BlockwiseAttention",
    names=("blockwise",),
    platforms=EVERYWHERE,
    # Above vanilla (same math in O(T) memory), below every kernel plugin (sdpa is 50), so
    # "auto" takes it only where none runs.
    priority=10,
    description="pure-JAX blockwise attention with a custom VJP, every feature but weights, O(T) memory",
    dtypes=DTYPES,
    head_dims=ANY_HEAD_DIM,
    # Every dense feature; the weights are exactly what it never forms. A quantized cache runs
    # on vanilla (which dequantizes a full-size copy) or a kernel that reads it.
    features=ALL_FEATURES - {Feature.WEIGHTS, Feature.QUANTIZED_KV},
)
DECODE = ImplRef(
    "jaxattn_vanilla.decode.impl:DecodeAttention",
    names=("autoregressive_decodeattn",),
    platforms=EVERYWHERE,
    # On a CPU "auto" should take the decode calls it accepts. Measured (plugins/vanilla/
    # benchmarks/decode_cpu.py; docs/decode.md has the commands and the whole table) at B=8,
    # Hq=32, Hkv=8, D=128, causal, kv_lengths, on the project's shared 2-core AMD EPYC host,
    # fastest of 9 runs, ms, this vs sdpa / blockwise / vanilla: T=1 float32 56 vs 155 / 82 /
    # 145 at S=4096 and 251 vs 647 / 265 / 570 at S=16384; T=1 bfloat16 105 vs 118 / 175 / 126
    # and 476 vs 525 / 718 / 487; T=4 117 vs 201 / 121 / 194; T=16 (blockwise's kernel) 184 vs
    # 296 / 193 / 289; a quarter-full S=16384 cache (blockwise's tiles) 114 vs 741 / 149 / 628.
    # It reads the cache in place where jax.nn's XLA path first copies K and V into another
    # layout. So 60: above sdpa (50), the path "auto" picked there before, below every kernel
    # plugin (cudnn and the Triton decode kernel are 100, and shadow this name on CUDA). Off
    # the CPU nothing was measured, so DecodeAttention.priority_for() puts it at 5, under
    # blockwise (10) and sdpa: there "auto" never prefers it to a generic path, and
    # impl="autoregressive_decodeattn" still runs it.
    priority=60,
    description="pure-JAX split-K decode over a dense KV cache (T <= 16), any platform",
    dtypes=DTYPES,
    head_dims=ANY_HEAD_DIM,
    features={
        Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.VALUE_DIM, Feature.SLIDING_WINDOW,
        Feature.SOFT_CAP, Feature.SINKS, Feature.KV_LENGTHS, Feature.GRAD, Feature.LSE,
    },
)

# The paged mechanisms' reference (kind "paged"), on every platform at the lowest priority:
# kernel plugins provide the mechanism names for their platforms above it, and "auto" still
# sees it under its own name. v2 and v3 differ in EasyDeL by kernel generation and cache
# layout; here the contract fixes the call, so both name this op (docs/serving.md), and so does
# EasyDeL's unversioned "ragged_page_attention".
VANILLA_PAGED = ImplRef(
    "jaxattn_vanilla.paged.impl:PagedReference",
    names=("vanilla_paged", "ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention",
           "page_attention"),
    platforms=EVERYWHERE,
    priority=0,
    description="pure-JAX paged attention (gather the pages, then attend), every paged call",
    kind="paged",
    dtypes=DTYPES,
    features={
        Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
        Feature.MULTI_TOKEN, Feature.RAGGED, Feature.QUANTIZED_KV,
        Feature.MASK_MOD,  # tree masks over a speculative step's new tokens (positions within the sequence)
    },
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [VANILLA, BLOCKWISE, DECODE, VANILLA_PAGED]


@hookimpl
def jaxattn_tuning_priors() -> list[Any]:
    """What this plugin measured about its own impls, per device generation: ``priors/*.json``
    (docs/tuning.md, "Shipped priors"); "auto" ranks by them where the user has no tuning record."""
    from jaxattn.backend import package_priors

    return package_priors(__package__ or __name__.rpartition(".")[0])
