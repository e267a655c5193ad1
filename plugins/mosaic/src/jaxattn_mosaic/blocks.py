"""What the forward and backward Mosaic GPU kernels share: which key blocks a run of query rows
sees, and the producer warpgroup that streams K and V blocks through a ring of shared-memory
slots.

Like the kernel modules, it imports jax's Mosaic GPU dialect at its top: only they import it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["TRANSFORMS", "KeyBlocks", "cdiv", "check_inputs", "release_unread", "stream_kv"]

#: Shared-memory tiles of 64 columns (128 bytes of 16-bit values), as wgmma reads them.
TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_inputs(q: Any, k: Any, v: Any, head_dims: tuple[int, ...], who: str) -> None:
    """q ``(B, T, Hq, D)``, k and v ``(B, S, Hkv, D)`` of one 16-bit dtype, D in ``head_dims``."""
    hq, head_dim = q.shape[2:]
    hkv = k.shape[2]
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have one shape")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are no multiple of {hkv} key heads")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in (jnp.float16, jnp.bfloat16):
        raise ValueError(f"q, k, v must share float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim not in head_dims:
        raise ValueError(f"{who} takes head dims {', '.join(map(str, head_dims))}, got {head_dim}")


@dataclasses.dataclass(frozen=True)
class KeyBlocks:
    """``s_len`` keys in blocks of ``block``; with ``causal``, bottom-right: query row ``i``
    sees key ``j`` iff ``j <= i + offset`` (``offset = S - T``)."""

    s_len: int
    block: int
    causal: bool
    offset: int

    @property
    def count(self) -> int:
        """Blocks holding any key (padding past them is never read)."""
        return cdiv(self.s_len, self.block)

    def seen_before(self, row_end: Any) -> Any:
        """Blocks holding any key that rows < ``row_end`` (traced) may see."""
        if not self.causal:
            return row_end * 0 + self.count  # traced: a concrete array cannot enter the kernel
        last = jnp.minimum(row_end + self.offset, self.s_len)  # keys < last
        return jnp.clip(lax.div(last + (self.block - 1), jnp.int32(self.block)), 0, self.count)

    def keep(self, j: Any, row0: Any, shape: tuple[int, int]) -> Any:
        """Which keys of block ``j`` the ``shape[0]`` rows from ``row0`` see: a bool tile in
        wgmma's register layout (false past ``S`` and, causal, right of the diagonal)."""
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        keys = cols + j * self.block
        keep = keys < self.s_len
        if self.causal:
            keep = keep & (keys <= rows + (row0 + self.offset))
        return keep

    def whole_from(self, row_start: Any) -> Any:
        """Blocks every row >= ``row_start`` (traced) sees whole: no causal mask, no key tail."""
        full = self.s_len // self.block
        if not self.causal:
            return row_start * 0 + full
        first = row_start + self.offset + 1  # keys < first are seen by row row_start
        return jnp.clip(lax.div(jnp.maximum(first, 0), jnp.int32(self.block)), 0, full)


def stream_kv(k_ref: Any, v_ref: Any, smem: tuple[Any, Any], ready: tuple[Any, Any], free: tuple[Any, Any], *,
              b: Any, kv_head: Any, n_blocks: Any, block: int, stages: int) -> None:
    """The producer: key blocks ``0 .. n_blocks - 1`` of batch ``b``, head ``kv_head`` into slot
    ``j % stages`` of the K and V rings, each copy arriving on its slot's ``ready`` barrier and
    waiting, from the ring's second round, for its slot's ``free`` barrier."""
    (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free) = smem, ready, free

    def load(j: Any, slot: Any) -> None:
        idx = (b, pl.ds(j * block, block), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[idx], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[idx], v_smem.at[slot], v_ready.at[slot])

    # Static slices: the caller pads the keys to at least ``stages`` blocks.
    for i in range(stages):
        pl.when(i < n_blocks)(functools.partial(load, i, i))

    @pl.loop(0, jnp.maximum(n_blocks - stages, 0))
    def _refill(j: Any) -> None:
        slot = lax.rem(j, jnp.int32(stages))
        idx = (b, pl.ds((j + stages) * block, block), kv_head)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[idx], k_smem.at[slot], k_ready.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[idx], v_smem.at[slot], v_ready.at[slot])


def release_unread(j: Any, ready: tuple[Any, Any], free: tuple[Any, Any], *, stages: int, wait: bool = True) -> None:
    """Free key block ``j``'s K and V slots for a consumer that does not read the block (the
    other consumer of its CTA sees more keys).

    A slot's ``free`` barrier completes a phase on two arrivals, one per consumer. A consumer
    that runs ahead of the other would, by arriving for block ``j``, complete the phase of the
    slot's previous block ``j - stages`` in the other's place, and the producer would overwrite
    a block the other consumer still reads. Waiting for block ``j`` to land first orders the
    arrival: the producer loads ``j`` only once ``j - stages`` is free. ``wait=False`` is for
    schedules that already keep the consumers within a block of each other (the forward's
    ping-pong), where the wait would cost a barrier and change nothing.
    """
    slot = lax.rem(j, jnp.int32(stages))
    for ready_bar, free_bar in zip(ready, free, strict=True):
        if wait:
            plgpu.barrier_wait(ready_bar.at[slot])
        plgpu.barrier_arrive(free_bar.at[slot])
