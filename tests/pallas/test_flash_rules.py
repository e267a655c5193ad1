"""Tiling for the Pallas flash kernel: every tiling is one the kernel accepts."""

from __future__ import annotations

import pytest

from jaxattn_pallas.flash.rules import LANES, FlashTiling, flash_tiling, sublanes_for


def _assert_valid(tiling: FlashTiling, rows: int, keys: int, itemsize: int) -> None:
    sub = sublanes_for(itemsize)
    assert tiling.q_len >= rows and tiling.kv_len >= keys
    for tile in (tiling.block_q, tiling.block_q_bwd):
        assert tile % sub == 0 and tiling.q_len % tile == 0 and tile <= tiling.q_len
    for tile in (tiling.block_k, tiling.block_k_bwd):
        assert tile % LANES == 0 and tiling.kv_len % tile == 0 and tile <= tiling.kv_len


@pytest.mark.parametrize("rows", [1, 7, 8, 100, 128, 513, 600, 1000, 4096, 4100])
@pytest.mark.parametrize("keys", [1, 127, 129, 640, 2048, 3000])
@pytest.mark.parametrize("itemsize", [4, 2])
def test_default_tilings_are_valid(rows: int, keys: int, itemsize: int) -> None:
    _assert_valid(flash_tiling(rows, keys, itemsize=itemsize), rows, keys, itemsize)


def test_short_sequences_take_one_tile() -> None:
    tiling = flash_tiling(1, 200, itemsize=2)  # a decode step
    assert (tiling.q_len, tiling.block_q) == (16, 16)  # bfloat16 packs 16 rows per sublane tile
    assert (tiling.kv_len, tiling.block_k) == (256, 256)
    assert flash_tiling(100, 100, itemsize=4).block_q == 104


def test_long_sequences_take_large_tiles() -> None:
    tiling = flash_tiling(8192, 8192, itemsize=2)
    assert (tiling.block_q, tiling.block_k, tiling.block_q_bwd, tiling.block_k_bwd) == (512, 512, 512, 512)
    assert (tiling.q_len, tiling.kv_len) == (8192, 8192)


def test_large_tiles_only_where_padding_is_small() -> None:
    short = flash_tiling(1000, 600, itemsize=4)  # 512 would pad 600 keys to 1024, 256 to 768
    assert (short.block_k, short.kv_len) == (128, 640)
    tiling = flash_tiling(4000, 4000, itemsize=4)
    assert tiling.block_q == 512 and tiling.q_len == 4096


def test_explicit_sizes_win_and_are_clamped() -> None:
    tiling = flash_tiling(1000, 1000, itemsize=4, block_q=256, block_k=384, block_q_bwd=128, block_k_bwd=128)
    assert (tiling.block_q, tiling.block_k, tiling.block_q_bwd, tiling.block_k_bwd) == (256, 384, 128, 128)
    assert tiling.q_len == 1024 and tiling.kv_len == 1152  # multiples of lcm(384, 128)
    clamped = flash_tiling(10, 10, itemsize=4, block_q=512, block_k=512)
    assert (clamped.block_q, clamped.block_k) == (16, 128)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"block_k": 100}, "block_k=100"), ({"block_q": 12}, "block_q=12"), ({"block_k_bwd": 64}, "block_k_bwd=64")],
)
def test_explicit_sizes_the_kernel_cannot_take(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flash_tiling(256, 256, itemsize=4, **kwargs)
