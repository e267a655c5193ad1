"""Run one kernel launch on torch tensors, and move arrays between numpy and torch.

``flash.ops.flash_attention(..., interpret=True)`` and ``paged.ops`` in interpret mode go through
here: with ``TRITON_INTERPRET=1`` set before triton is imported, the very ``@triton.jit``
kernels that JAX launches on a GPU run on torch CPU tensors. On a CUDA device it launches them
natively (useful to debug a kernel outside XLA). torch is imported by the caller's use only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxattn_triton.flash import launch as L

__all__ = ["from_numpy", "run_launch", "to_numpy"]

if TYPE_CHECKING:
    import torch


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def run_launch(lz: L.Launch, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Allocate the launch's outputs on the inputs' device, run it, return the outputs."""
    import torch

    device = inputs[0].device
    # Zeros, not torch.empty, even where the launch asks for none: the one-element dummy outputs
    # a launch never writes would otherwise hold whatever the allocator left there, and a NaN
    # among those bits trips jax.debug_nans on the callback's outputs now and then.
    outs = [torch.zeros(shape, dtype=_torch_dtype(dtype), device=device) for shape, dtype in lz.outputs]
    lz.kernel[lz.grid](*inputs, *outs, **lz.constexprs, num_warps=lz.num_warps, num_stages=lz.num_stages)
    return outs


def from_numpy(x: np.ndarray) -> torch.Tensor:
    """A torch tensor of the same dtype; bfloat16 and float8 (ml_dtypes) go through their bits."""
    import torch

    if x.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(x, copy=True).view(np.int16)).view(torch.bfloat16)
    if x.dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        return torch.from_numpy(np.array(x, copy=True).view(np.uint8)).view(getattr(torch, x.dtype.name))
    return torch.from_numpy(np.array(x, copy=True))


def to_numpy(x: torch.Tensor) -> np.ndarray:
    import torch

    if x.dtype == torch.bfloat16:
        import ml_dtypes

        out: np.ndarray = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return out
    plain: np.ndarray = x.numpy()  # torch is untyped here: name the type for mypy
    return plain

