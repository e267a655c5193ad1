"""Tile sizes for the Pallas TPU splash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. Splash tiles query rows and
keys alike in multiples of 128 (the dkv kernel puts queries on lanes, so even query tiles
are lane multiples once segment ids are used), every tile divides its padded sequence, and
no tile is longer than its sequence. The tiling (padding, default sizes up to 512,
explicit sizes) is shared with the flash plugin: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

import dataclasses

from jaxattn_pallas.common import DEFAULT_CAP, LANES, axis_tiling

__all__ = ["LANES", "SplashTiling", "splash_tiling"]

_KERNEL = "splash kernel"


@dataclasses.dataclass(frozen=True)
class SplashTiling:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int


def splash_tiling(
    t: int,
    s: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    cap: int = DEFAULT_CAP,
) -> SplashTiling:
    """Tiles for ``t`` queries against ``s`` keys (explicit sizes win, clamped to the
    padded length). Raises ``ValueError`` for an explicit size the kernel cannot take."""
    if t <= 0 or s <= 0:
        raise ValueError(f"sequence lengths must be positive, got t={t} s={s}")
    q_len, bq, bq_bwd = axis_tiling(t, LANES, block_q, block_q_bwd, cap=cap, names=("block_q", "block_q_bwd"),
                                  kernel=_KERNEL)
    kv_len, bk, bk_bwd = axis_tiling(s, LANES, block_k, block_k_bwd, cap=cap, names=("block_k", "block_k_bwd"),
                                   kernel=_KERNEL)
    return SplashTiling(q_len=q_len, kv_len=kv_len, block_q=bq, block_kv=bk, block_q_bwd=bq_bwd, block_kv_bwd=bk_bwd)
