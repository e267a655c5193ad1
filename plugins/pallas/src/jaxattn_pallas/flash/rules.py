"""Tile sizes for the Pallas TPU flash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. The kernel's constraints
(jax.experimental.pallas.ops.tpu.flash_attention, forward and both backward kernels):

* every key tile is a multiple of 128 lanes and divides the (padded) key length;
* every query tile divides the (padded) query length and is a multiple of the sublane
  count (8 rows of 32-bit values; 16 for 16-bit dtypes, which pack two rows per sublane);
* no tile is longer than its sequence.

The planning itself (padding, default sizes up to 512, explicit sizes) is shared with the
splash plugin: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

import dataclasses

from ..common import DEFAULT_CAP, LANES, plan_axis, sublanes_for

__all__ = ["LANES", "FlashPlan", "plan_flash", "sublanes_for"]

_KERNEL = "Pallas TPU kernel"


@dataclasses.dataclass(frozen=True)
class FlashPlan:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int


def plan_flash(
    rows: int,
    keys: int,
    *,
    itemsize: int,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    cap: int = DEFAULT_CAP,
) -> FlashPlan:
    """Tiles for ``rows`` query rows against ``keys`` keys (explicit sizes win, clamped to
    the padded length). Raises ``ValueError`` for an explicit size the kernel cannot take."""
    if rows <= 0 or keys <= 0:
        raise ValueError(f"sequence lengths must be positive, got rows={rows} keys={keys}")
    q_len, bq, bq_bwd = plan_axis(rows, sublanes_for(itemsize), block_q, block_q_bwd, cap=cap,
                                  names=("block_q", "block_q_bwd"), kernel=_KERNEL)
    kv_len, bk, bk_bwd = plan_axis(keys, LANES, block_k, block_k_bwd, cap=cap, names=("block_k", "block_k_bwd"),
                                   kernel=_KERNEL)
    return FlashPlan(q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd)
