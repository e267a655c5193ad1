"""Entry-point module of jaxattn-sdpa: declares ``sdpa`` and ``cudnn`` (imports no jax).

``cuda_flash_attn2`` is an alias of ``cudnn``, not of ``sdpa``: the name promises a flash
kernel on CUDA (the seed used it for cuDNN's flash attention), and an explicit choice must
never turn silently into XLA's O(T*S)-memory path, which is what ``sdpa`` may do.
"""

from __future__ import annotations

from typing import Any

from jaxattn.backend import Feature, ImplRef, hookimpl

__all__ = ["CUDNN", "JAX_NN_FEATURES", "SDPA", "jaxattn_register_impls", "jaxattn_tuning_priors"]

#: What jax.nn runs exactly, on both paths (sinks through an extra key, kv_lengths through
#: key_value_seq_lengths or a per-sequence mask: see kernel.py).
JAX_NN_FEATURES = frozenset({
    Feature.CAUSAL, Feature.MASK, Feature.BIAS, Feature.GQA, Feature.CROSS, Feature.DECODE,
    Feature.SLIDING_WINDOW, Feature.SEGMENT_IDS, Feature.SINKS, Feature.GRAD, Feature.KV_LENGTHS,
})

SDPA = ImplRef(
    "jaxattn_sdpa.impl:SdpaAttention",
    names=("sdpa",),
    platforms=("cpu", "gpu", "tpu"),
    priority=50,
    description="jax.nn.dot_product_attention: cuDNN when it takes the call, XLA otherwise",
    # float64 is left out: jax.nn would run its softmax in float32, silently.
    dtypes={"float32", "bfloat16", "float16"},
    head_dims=(1, 1 << 16),
    features=JAX_NN_FEATURES,
)
CUDNN = ImplRef(
    "jaxattn_sdpa.impl:CudnnAttention",
    names=("cudnn", "cuda_flash_attn2"),
    platforms=("cuda",),
    priority=100,
    description="cuDNN flash attention via jax.nn (needs an NVIDIA GPU with cuDNN, fp16/bf16)",
    # cuDNN computes in these only (fp8 needs scaling factors that jax.nn does not take).
    dtypes={"bfloat16", "float16"},
    # Head dims cuDNN takes on sm_90+ (jax checks <= 256 there, <= 128 before; cudnn_reasons
    # checks the GPU at hand).
    head_dims=(8, 256),
    features=JAX_NN_FEATURES,
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [SDPA, CUDNN]


@hookimpl
def jaxattn_tuning_priors() -> list[Any]:
    """What this plugin measured about its own impls, per device generation: ``priors/*.json``
    (docs/tuning.md, "Shipped priors"); "auto" ranks by them where the user has no tuning record."""
    from jaxattn.backend import package_priors

    return package_priors(__package__ or __name__.rpartition(".")[0])
