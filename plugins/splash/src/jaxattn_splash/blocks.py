"""Tile sizes for the Pallas TPU splash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. Splash tiles query rows and
keys alike in multiples of 128 (the dkv kernel puts queries on lanes, so even query tiles
are lane multiples once segment ids are used), every tile divides its padded sequence, and
no tile is longer than its sequence. The kernel's own default is 128 everywhere, which
leaves TPUs dominated by per-step overhead; up to 512 is used when it costs little padding.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["LANES", "SplashPlan", "plan_splash"]

LANES = 128
DEFAULT_CAP = 512
#: A larger tile is taken only when it pads the sequence by at most this fraction.
_MAX_PAD_FRACTION = 1 / 8


@dataclasses.dataclass(frozen=True)
class SplashPlan:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _default_tile(n: int, cap: int) -> int:
    whole = _round_up(n, LANES)
    if whole <= cap:
        return whole
    tile = cap
    while tile > LANES and _round_up(n, tile) - n > n * _MAX_PAD_FRACTION:
        tile //= 2
    return max(tile, LANES)


def _divisor_tile(length: int, cap: int) -> int:
    """Largest multiple of 128, at most ``cap``, that divides ``length``."""
    return max(t for t in range(LANES, min(cap, length) + 1, LANES) if length % t == 0)


def _axis(n: int, fwd: int | None, bwd: int | None, cap: int, names: tuple[str, str]) -> tuple[int, int, int]:
    whole = _round_up(n, LANES)
    for name, value in zip(names, (fwd, bwd), strict=True):
        if value is not None and (value <= 0 or value % LANES):
            raise ValueError(f"{name}={value} must be a positive multiple of {LANES} for the splash kernel")
    fwd = None if fwd is None else min(fwd, whole)  # longer than the sequence: clamped
    bwd = None if bwd is None else min(bwd, whole)
    if fwd is None:
        fwd = _default_tile(n, cap) if bwd is None else bwd
    if bwd is None:
        length = _round_up(n, fwd)
        return length, fwd, _divisor_tile(length, cap)
    return _round_up(n, math.lcm(fwd, bwd)), fwd, bwd


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
    q_len, bq, bq_bwd = _axis(t, block_q, block_q_bwd, cap, ("block_q", "block_q_bwd"))
    kv_len, bk, bk_bwd = _axis(s, block_k, block_k_bwd, cap, ("block_k", "block_k_bwd"))
    return SplashPlan(q_len=q_len, kv_len=kv_len, block_q=bq, block_kv=bk, block_q_bwd=bq_bwd, block_kv_bwd=bk_bwd)
