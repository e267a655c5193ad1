"""Tile sizes for the Pallas TPU splash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. Splash tiles query rows and
keys alike in multiples of 128 (the dkv kernel puts queries on lanes, so even query tiles
are lane multiples once segment ids are used), every tile divides its padded sequence, and
no tile is longer than its sequence. The planning (padding, default sizes up to 512,
explicit sizes) is shared with the flash plugin: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

import dataclasses

from jaxattn_pallas.common import DEFAULT_CAP, LANES, plan_axis

__all__ = ["LANES", "SplashPlan", "plan_splash"]

_KERNEL = "splash kernel"


@dataclasses.dataclass(frozen=True)
class SplashPlan:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int


def plan_splash(
    t: int,
    s: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    cap: int = DEFAULT_CAP,
) -> SplashPlan:
    """Tiles for ``t`` queries against ``s`` keys (explicit sizes win, clamped to the
    padded length). Raises ``ValueError`` for an explicit size the kernel cannot take."""
    if t <= 0 or s <= 0:
        raise ValueError(f"sequence lengths must be positive, got t={t} s={s}")
    q_len, bq, bq_bwd = plan_axis(t, LANES, block_q, block_q_bwd, cap=cap, names=("block_q", "block_q_bwd"),
                                  kernel=_KERNEL)
    kv_len, bk, bk_bwd = plan_axis(s, LANES, block_k, block_k_bwd, cap=cap, names=("block_k", "block_k_bwd"),
                                   kernel=_KERNEL)
    return SplashPlan(q_len=q_len, kv_len=kv_len, block_q=bq, block_kv=bk, block_q_bwd=bq_bwd, block_kv_bwd=bk_bwd)
