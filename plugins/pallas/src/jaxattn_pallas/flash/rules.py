"""Tile sizes for the Pallas TPU flash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. The kernel's constraints
(jax.experimental.pallas.ops.tpu.flash_attention, forward and both backward kernels):

* every key tile is a multiple of 128 lanes and divides the (padded) key length;
* every query tile divides the (padded) query length and is a multiple of the sublane
  count (8 rows of 32-bit values; 16 for 16-bit dtypes, which pack two rows per sublane);
* no tile is longer than its sequence.

The tiling itself (padding, default sizes up to 512, explicit sizes) is shared with the
splash plugin: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

import dataclasses

from ..common import DEFAULT_CAP, LANES, axis_tiling, sublanes_for

__all__ = ["LANES", "FlashTiling", "flash_tiling", "sublanes_for"]

_KERNEL = "Pallas TPU kernel"


@dataclasses.dataclass(frozen=True)
class FlashTiling:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int


def flash_tiling(
    rows: int,
    keys: int,
    *,
    itemsize: int,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    cap: int = DEFAULT_CAP,
) -> FlashTiling:
    """Tiles for ``rows`` query rows against ``keys`` keys (explicit sizes win, clamped to
    the padded length). Raises ``ValueError`` for an explicit size the kernel cannot take."""
    if rows <= 0 or keys <= 0:
        raise ValueError(f"sequence lengths must be positive, got rows={rows} keys={keys}")
    q_len, bq, bq_bwd = axis_tiling(rows, sublanes_for(itemsize), block_q, block_q_bwd, cap=cap,
                                  names=("block_q", "block_q_bwd"), kernel=_KERNEL)
    kv_len, bk, bk_bwd = axis_tiling(keys, LANES, block_k, block_k_bwd, cap=cap, names=("block_k", "block_k_bwd"),
                                   kernel=_KERNEL)
    return FlashTiling(q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd)
