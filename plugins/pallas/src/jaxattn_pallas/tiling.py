"""Tile planning for the Pallas TPU kernels (flash and splash plugins), in pure Python.

A sequence axis gets a padded length, a forward tile and a backward tile. The rules the TPU
kernels share: a tile is a multiple of its ``quantum`` (128 lanes for keys; for query rows
8 sublanes of 32-bit values, 16 for 16-bit dtypes, or 128 where a kernel puts queries on
lanes), it divides the padded length, and it is no longer than the sequence. Lengths that
fit none of these are padded (the caller masks the padding). The kernels' own default of
128 everywhere leaves TPUs dominated by per-grid-step overhead, so tiles grow up to ``cap``
(512 by default) where that costs little padding. No jax here: the rules are unit-tested on
their own, and importing this costs nothing.
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_CAP", "LANES", "MAX_PAD_FRACTION", "divisor_tile", "plan_axis", "round_up", "sublanes_for"]

LANES = 128
#: Largest default tile: 512x512 float32 logits (1 MiB) plus the q/k/v tiles, double buffered,
#: stay well inside the scoped VMEM of every TPU generation for head dims <= 256.
DEFAULT_CAP = 512
#: A larger tile is taken only when it pads the sequence by at most this fraction.
MAX_PAD_FRACTION = 1 / 8


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def sublanes_for(itemsize: int) -> int:
    """Rows per query tile quantum: 8 for 32-bit dtypes, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // itemsize)


def default_tile(n: int, quantum: int, cap: int) -> int:
    """One tile if the sequence fits under ``cap``, else the largest power-of-two multiple
    of 128 up to ``cap`` that pads ``n`` by at most :data:`MAX_PAD_FRACTION` (else 128)."""
    whole = round_up(n, quantum)
    if whole <= cap:
        return whole
    tile = cap
    while tile > LANES and round_up(n, tile) - n > n * MAX_PAD_FRACTION:
        tile //= 2
    return max(tile, LANES)


def divisor_tile(length: int, quantum: int, cap: int) -> int:
    """Largest multiple of ``quantum``, at most ``cap``, that divides ``length``."""
    return max((t for t in range(quantum, min(cap, length) + 1, quantum) if length % t == 0), default=quantum)


def plan_axis(n: int, quantum: int, fwd: int | None, bwd: int | None, *, cap: int = DEFAULT_CAP,
              names: tuple[str, str], kernel: str) -> tuple[int, int, int]:
    """``(padded length, forward tile, backward tile)`` of one sequence axis of ``n``.

    Explicit tiles win, clamped to the padded length (a tile longer than the sequence is not
    an error); one that is not a positive multiple of ``quantum`` raises ``ValueError``
    naming ``names`` (the forward and backward option) and ``kernel``. Without a backward
    tile, the backward takes the largest tile that divides the forward's padded length.
    """
    whole = round_up(n, quantum)
    for name, value in zip(names, (fwd, bwd), strict=True):
        if value is not None and (value <= 0 or value % quantum):
            raise ValueError(f"{name}={value} must be a positive multiple of {quantum} for the {kernel}")
    fwd = None if fwd is None else min(fwd, whole)
    bwd = None if bwd is None else min(bwd, whole)
    if fwd is None:
        fwd = default_tile(n, quantum, cap) if bwd is None else bwd
    if bwd is None:
        length = round_up(n, fwd)
        return length, fwd, divisor_tile(length, quantum, cap)
    return round_up(n, math.lcm(fwd, bwd)), fwd, bwd
