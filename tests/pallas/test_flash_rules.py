"""Tile planning for the Pallas flash kernel: every plan is one the kernel accepts."""

from __future__ import annotations

import pytest

from jaxattn_pallas.flash.rules import LANES, FlashPlan, plan_flash, sublanes_for


def _assert_valid(plan: FlashPlan, rows: int, keys: int, itemsize: int) -> None:
    sub = sublanes_for(itemsize)
    assert plan.q_len >= rows and plan.kv_len >= keys
    for tile in (plan.block_q, plan.block_q_bwd):
        assert tile % sub == 0 and plan.q_len % tile == 0 and tile <= plan.q_len
    for tile in (plan.block_k, plan.block_k_bwd):
        assert tile % LANES == 0 and plan.kv_len % tile == 0 and tile <= plan.kv_len


@pytest.mark.parametrize("rows", [1, 7, 8, 100, 128, 513, 600, 1000, 4096, 4100])
@pytest.mark.parametrize("keys", [1, 127, 129, 640, 2048, 3000])
@pytest.mark.parametrize("itemsize", [4, 2])
def test_default_plans_are_valid(rows: int, keys: int, itemsize: int) -> None:
    _assert_valid(plan_flash(rows, keys, itemsize=itemsize), rows, keys, itemsize)


def test_short_sequences_take_one_tile() -> None:
    plan = plan_flash(1, 200, itemsize=2)  # a decode step
    assert (plan.q_len, plan.block_q) == (16, 16)  # bfloat16 packs 16 rows per sublane tile
    assert (plan.kv_len, plan.block_k) == (256, 256)
    assert plan_flash(100, 100, itemsize=4).block_q == 104


def test_long_sequences_take_large_tiles() -> None:
    plan = plan_flash(8192, 8192, itemsize=2)
    assert (plan.block_q, plan.block_k, plan.block_q_bwd, plan.block_k_bwd) == (512, 512, 512, 512)
    assert (plan.q_len, plan.kv_len) == (8192, 8192)


def test_large_tiles_only_where_padding_is_small() -> None:
    short = plan_flash(1000, 600, itemsize=4)  # 512 would pad 600 keys to 1024, 256 to 768
    assert (short.block_k, short.kv_len) == (128, 640)
    plan = plan_flash(4000, 4000, itemsize=4)
    assert plan.block_q == 512 and plan.q_len == 4096


def test_explicit_sizes_win_and_are_clamped() -> None:
    plan = plan_flash(1000, 1000, itemsize=4, block_q=256, block_k=384, block_q_bwd=128, block_k_bwd=128)
    assert (plan.block_q, plan.block_k, plan.block_q_bwd, plan.block_k_bwd) == (256, 384, 128, 128)
    assert plan.q_len == 1024 and plan.kv_len == 1152  # multiples of lcm(384, 128)
    clamped = plan_flash(10, 10, itemsize=4, block_q=512, block_k=512)
    assert (clamped.block_q, clamped.block_k) == (16, 128)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"block_k": 100}, "block_k=100"), ({"block_q": 12}, "block_q=12"), ({"block_k_bwd": 64}, "block_k_bwd=64")],
)
def test_explicit_sizes_the_kernel_cannot_take(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_flash(256, 256, itemsize=4, **kwargs)
