"""Tile sizes for the Pallas TPU flash-attention kernel, chosen from the shapes of a call.

Pure Python (no jax), so the rules are unit-tested on their own. The kernel's constraints
(jax.experimental.pallas.ops.tpu.flash_attention, forward and both backward kernels):

* every key tile is a multiple of 128 lanes and divides the (padded) key length;
* every query tile divides the (padded) query length and is a multiple of the sublane
  count (8 rows of 32-bit values; 16 for 16-bit dtypes, which pack two rows per sublane);
* no tile is longer than its sequence.

Lengths that fit none of these are padded (the caller masks the padding). The kernel's own
defaults are 128 everywhere, a known cause of poor TPU throughput: per-grid-step overhead
dominates at that size. Larger tiles (up to 512) are used when they cost little padding.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["LANES", "FlashPlan", "plan_flash", "sublanes_for"]

LANES = 128
#: Largest default tile: 512x512 float32 logits (1 MiB) plus the q/k/v/ab tiles, double
#: buffered, stay well inside the scoped VMEM of every TPU generation for head dims <= 256.
DEFAULT_CAP = 512
#: A larger tile is taken only when it pads the sequence by at most this fraction.
_MAX_PAD_FRACTION = 1 / 8


@dataclasses.dataclass(frozen=True)
class FlashPlan:
    """Padded lengths and the tiles of the forward and backward kernels."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int


def sublanes_for(itemsize: int) -> int:
    """Rows per query tile quantum: 8 for 32-bit dtypes, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // itemsize)


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _default_tile(n: int, quantum: int, cap: int) -> int:
    """The tile for a sequence of ``n``: one tile if it fits under ``cap``, else the largest
    power-of-two multiple of 128 that pads ``n`` by at most 1/8 (else 128)."""
    whole = _round_up(n, quantum)
    if whole <= cap:
        return whole
    tile = cap
    while tile > LANES:
        if _round_up(n, tile) - n <= n * _MAX_PAD_FRACTION:
            return tile
        tile //= 2
    return LANES


def _largest_divisor_tile(length: int, quantum: int, cap: int) -> int:
    """Largest multiple of ``quantum``, at most ``cap``, that divides ``length``."""
    best = quantum
    for tile in range(quantum, min(cap, length) + 1, quantum):
        if length % tile == 0:
            best = tile
    return best


def _check_override(name: str, value: int, quantum: int) -> None:
    if value <= 0 or value % quantum:
        raise ValueError(f"{name}={value} must be a positive multiple of {quantum} for the Pallas TPU kernel")


def _axis(
    n: int,
    quantum: int,
    fwd: int | None,
    bwd: int | None,
    cap: int,
    names: tuple[str, str],
) -> tuple[int, int, int]:
    """(padded length, forward tile, backward tile) of one sequence axis."""
    whole = _round_up(n, quantum)
    if fwd is not None:
        _check_override(names[0], fwd, quantum)
        fwd = min(fwd, whole)  # a tile longer than the sequence is clamped, not an error
    if bwd is not None:
        _check_override(names[1], bwd, quantum)
        bwd = min(bwd, whole)
    if fwd is None:
        fwd = _default_tile(n, quantum, cap) if bwd is None else bwd
    if bwd is None:
        length = _round_up(n, fwd)
        return length, fwd, _largest_divisor_tile(length, quantum, cap)
    length = _round_up(n, math.lcm(fwd, bwd))
    return length, fwd, bwd


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
    q_len, bq, bq_bwd = _axis(rows, sublanes_for(itemsize), block_q, block_q_bwd, cap, ("block_q", "block_q_bwd"))
    kv_len, bk, bk_bwd = _axis(keys, LANES, block_k, block_k_bwd, cap, ("block_k", "block_k_bwd"))
    return FlashPlan(q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd)
