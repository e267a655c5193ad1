"""Tiling for the splash kernel: every tiling is one the kernel accepts."""

from __future__ import annotations

import pytest

from jaxattn_splash.blocks import LANES, SplashTiling, splash_tiling


def _assert_valid(tiling: SplashTiling, t: int, s: int) -> None:
    assert tiling.q_len >= t and tiling.kv_len >= s
    for tile, length in ((tiling.block_q, tiling.q_len), (tiling.block_q_bwd, tiling.q_len),
                         (tiling.block_kv, tiling.kv_len), (tiling.block_kv_bwd, tiling.kv_len)):
        assert tile % LANES == 0 and length % tile == 0 and tile <= length


@pytest.mark.parametrize("t", [1, 100, 128, 600, 4000, 8192])
@pytest.mark.parametrize("s", [1, 129, 1000, 4100])
def test_default_tilings_are_valid(t: int, s: int) -> None:
    _assert_valid(splash_tiling(t, s), t, s)


def test_defaults_take_large_tiles_where_padding_is_small() -> None:
    assert splash_tiling(8192, 8192) == SplashTiling(8192, 8192, 512, 512, 512, 512)
    short = splash_tiling(100, 600)  # 512 or 256 would pad 600 keys by far more than 1/8
    assert (short.q_len, short.block_q, short.kv_len, short.block_kv) == (128, 128, 640, 128)


def test_explicit_sizes_win() -> None:
    tiling = splash_tiling(1000, 1000, block_q=256, block_k=384, block_q_bwd=128)
    assert (tiling.block_q, tiling.block_kv, tiling.block_q_bwd, tiling.block_kv_bwd) == (256, 384, 128, 384)
    assert (tiling.q_len, tiling.kv_len) == (1024, 1152)


@pytest.mark.parametrize("kwargs", [{"block_q": 64}, {"block_k": 200}, {"block_k_bwd": 0}])
def test_explicit_sizes_the_kernel_cannot_take(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        splash_tiling(512, 512, **kwargs)
