"""The ``@triton.jit`` kernels (imported only when a kernel is launched)."""
