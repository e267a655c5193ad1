"""The TPU tiler the flash and splash plugins share (pure Python)."""

from __future__ import annotations

import pytest

from jaxattn_pallas.common import DEFAULT_CAP, LANES, axis_tiling, divisor_tile, round_up, sublanes_for


def test_quanta() -> None:
    assert [sublanes_for(n) for n in (4, 2, 1)] == [8, 16, 32]
    assert round_up(129, LANES) == 256 and round_up(128, LANES) == 128


def test_default_tiles_grow_to_the_cap_when_padding_is_cheap() -> None:
    assert axis_tiling(300, 16, None, None, names=("a", "b"), kernel="k") == (304, 304, 304)  # one tile
    assert axis_tiling(4096, LANES, None, None, names=("a", "b"), kernel="k") == (4096, DEFAULT_CAP, DEFAULT_CAP)
    # 640 keys: 512 would pad to 1024 (60%), 256 to 768 (20%), so 128 and no padding
    assert axis_tiling(640, LANES, None, None, names=("a", "b"), kernel="k") == (640, 128, 128)


def test_explicit_tiles_win_are_clamped_and_checked() -> None:
    assert axis_tiling(256, LANES, 1024, None, names=("a", "b"), kernel="k") == (256, 256, 256)
    assert axis_tiling(1024, LANES, 256, 384, names=("a", "b"), kernel="k") == (1536, 256, 384)  # lcm padding
    with pytest.raises(ValueError, match="b=100 must be a positive multiple of 128 for the splash kernel"):
        axis_tiling(1024, LANES, None, 100, names=("a", "b"), kernel="splash kernel")


def test_divisor_tile() -> None:
    assert divisor_tile(1536, LANES, 512) == 512 and divisor_tile(640, LANES, 512) == 128
    assert divisor_tile(48, 16, 512) == 48
