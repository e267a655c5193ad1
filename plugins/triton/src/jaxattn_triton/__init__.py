"""jaxattn-triton: FlashAttention-2 Triton kernels for jaxattn on CUDA GPUs (``flash_attn2``).

Importing the package imports no kernel library; ``jaxattn_triton.flash.ops.flash_attention`` is
the JAX entry point, ``jaxattn_triton.flash.impl.TritonFlashAttention`` the registered impl.
"""

__version__ = "0.1.0"
