"""Run the attention kernels on torch tensors.

This is how CI checks the kernels' numerics without a GPU: with ``TRITON_INTERPRET=1``
set before triton is imported, the very ``@triton.jit`` kernels that JAX launches on a
GPU run on torch CPU tensors. On a CUDA device it launches them natively (useful to
debug a kernel outside XLA). torch and triton are imported by the caller's use only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxattn_triton import launch as L
from jaxattn_triton.spec import AttnSpec

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
    outs = [
        (torch.zeros if i in lz.zeroed else torch.empty)(shape, dtype=_torch_dtype(dtype), device=device)
        for i, (shape, dtype) in enumerate(lz.outputs)
    ]
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


class TorchInputs:
    """The optional inputs of one call, as the kernels take them (dummies where absent)."""

    def __init__(
        self,
        like: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        q_segment_ids: torch.Tensor | None,
        kv_segment_ids: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> None:
        import torch

        def dummy(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((1,), dtype=dtype, device=like.device)

        self.mask = dummy(torch.int8) if mask is None else mask.to(torch.int8).contiguous()
        self.bias = dummy(torch.float32) if bias is None else bias.contiguous()
        self.qseg = dummy(torch.int32) if q_segment_ids is None else q_segment_ids.to(torch.int32).contiguous()
        self.kseg = dummy(torch.int32) if kv_segment_ids is None else kv_segment_ids.to(torch.int32).contiguous()
        self.sinks = dummy(torch.float32) if sinks is None else sinks.to(torch.float32).contiguous()

    def kernel_inputs(self) -> list[torch.Tensor]:
        return [self.mask, self.bias, self.qseg, self.kseg]


def forward(
    spec: AttnSpec,
    tiles: L.Tiles,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extra: TorchInputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out (B, T, Hq, Dv), lse (B, Hq, T) float32, natural log, sinks excluded)``."""
    out, lse = run_launch(
        L.forward(spec, tiles.fwd),
        [q.contiguous(), k.contiguous(), v.contiguous(), *extra.kernel_inputs(), extra.sinks],
    )
    return out, lse


def backward(
    spec: AttnSpec,
    tiles: L.Tiles,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extra: TorchInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum(out * dout) + sum(lse * dlse)``.

    Returns ``(dq, dk, dv, dbias reduced to the bias's shape or None, dsinks or None)``.
    """
    import torch

    q, k, v, dout = (x.contiguous() for x in (q, k, v, dout))
    dlse = torch.zeros_like(lse) if dlse is None else dlse.to(torch.float32).contiguous()
    delta, lse_b, dsink_rows = run_launch(L.preprocess(spec), [out.contiguous(), dout, lse, dlse, extra.sinks])
    common = [q, k, v, *extra.kernel_inputs(), dout, lse_b, delta]
    if tiles.dkdv_split:
        _, dv, _, _ = run_launch(L.dkdv(spec, tiles.dkdv, part=L.PART_DV), common)
        dk, _, dbias_full, dq_acc = run_launch(L.dkdv(spec, tiles.dkdv, tiles.dq_mode, L.PART_DK), common)
    else:
        dk, dv, dbias_full, dq_acc = run_launch(L.dkdv(spec, tiles.dkdv, tiles.dq_mode), common)
    if tiles.dq_mode == L.DQ_KERNEL:
        (dq,) = run_launch(L.dq(spec, tiles.dq), common)
    else:
        dq = (dq_acc * spec.softmax_scale).to(q.dtype)
    dbias = None
    if spec.bias_shape is not None:
        dims = [i for i, n in enumerate(spec.bias_shape) if n == 1]
        dbias = dbias_full.sum(dim=dims, keepdim=True) if dims else dbias_full
        dbias = dbias.to(extra.bias.dtype)
    dsinks = dsink_rows.sum(dim=(0, 2)) if spec.sinks else None
    return dq, dk, dv, dbias, dsinks
