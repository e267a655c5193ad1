"""Entry-point module of jaxattn-sdpa: registers ``sdpa`` and ``cudnn`` lazily (imports no jax).

``cuda_flash_attn2`` is an alias of ``cudnn``, not of ``sdpa``: the name promises a flash
kernel on CUDA (the seed used it for cuDNN's flash attention), and an explicit choice must
never turn silently into XLA's O(T*S)-memory path, which is what ``sdpa`` may do.
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["CUDNN", "SDPA", "jaxattn_register_impls"]

# Must match the classes' declarations; the registry checks it when a class loads.
SDPA = ImplRef(
    "jaxattn_sdpa.impl:SdpaAttention",
    names=("sdpa",),
    platforms=("cpu", "gpu", "tpu"),
    priority=50,
    description="jax.nn.dot_product_attention: cuDNN when it takes the call, XLA otherwise",
)
CUDNN = ImplRef(
    "jaxattn_sdpa.impl:CudnnAttention",
    names=("cudnn", "cuda_flash_attn2"),
    platforms=("cuda",),
    priority=100,
    description="cuDNN flash attention via jax.nn (needs an NVIDIA GPU with cuDNN, fp16/bf16)",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [SDPA, CUDNN]
