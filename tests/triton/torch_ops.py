"""The attention kernels' forward and backward on torch tensors: a test harness.

This is how the tests check the kernels' numerics without a GPU: with ``TRITON_INTERPRET=1``
set before triton is imported, the very ``@triton.jit`` kernels that JAX launches on a GPU run
on torch CPU tensors (one launch: ``jaxattn_triton.torch_launch``). On a CUDA device it launches
them natively. torch and triton are imported by the caller's use only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxattn_triton.flash import launch as L
from jaxattn_triton.spec import AttnSpec
from jaxattn_triton.torch_launch import run_launch

if TYPE_CHECKING:
    import torch


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

        # A mask_mod's bits, seen keys and tile lists, and masks.alibi's slopes (flash.ops): none here.
        self.no_mod = [dummy(torch.int32)] * 3 + [dummy(torch.float32)]

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
        [q.contiguous(), k.contiguous(), v.contiguous(), *extra.kernel_inputs(), extra.sinks, *extra.no_mod],
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
    delta, lse_b, dsink_rows, _ = run_launch(L.preprocess(spec), [out.contiguous(), dout, lse, dlse, extra.sinks])
    common = [q, k, v, *extra.kernel_inputs(), dout, lse_b, delta, *extra.no_mod]
    if tiles.dkdv_split:
        _, dv, _, _ = run_launch(L.dkdv(spec, tiles.dkdv, part=L.PART_DV), common)
        dk, _, dbias_full, dq_acc = run_launch(L.dkdv(spec, tiles.dkdv, tiles.dq_mode, L.PART_DK), common)
    else:
        dk, dv, dbias_full, dq_acc = run_launch(L.dkdv(spec, tiles.dkdv, tiles.dq_mode), common)
    if tiles.dq_mode == L.DQ_KERNEL:
        dq, _ = run_launch(L.dq(spec, tiles.dq), [*common, extra.no_mod[-1]])  # a dummy lse_term (no alibi)
    else:
        dq = (dq_acc * spec.softmax_scale).to(q.dtype)
    dbias = None
    if spec.bias_shape is not None:
        dims = [i for i, n in enumerate(spec.bias_shape) if n == 1]
        dbias = dbias_full.sum(dim=dims, keepdim=True) if dims else dbias_full
        dbias = dbias.to(extra.bias.dtype)
    dsinks = dsink_rows.sum(dim=(0, 2)) if spec.sinks else None
    return dq, dk, dv, dbias, dsinks
