"""``flash_attn2``: the Triton FlashAttention-2 kernels (``forward``, ``backward``, imported only when a
kernel is launched), their launch descriptions (``launch``), the JAX entry points behind
``jax.custom_vjp`` (``ops``) and the impl (``impl``)."""
