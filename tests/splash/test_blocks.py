"""Tile planning for the splash kernel: every plan is one the kernel accepts."""

from __future__ import annotations

import pytest

from jaxattn_splash.blocks import LANES, SplashPlan, plan_splash


def _assert_valid(plan: SplashPlan, t: int, s: int) -> None:
    assert plan.q_len >= t and plan.kv_len >= s
    for tile, length in ((plan.block_q, plan.q_len), (plan.block_q_bwd, plan.q_len),
                         (plan.block_kv, plan.kv_len), (plan.block_kv_bwd, plan.kv_len)):
        assert tile % LANES == 0 and length % tile == 0 and tile <= length


@pytest.mark.parametrize("t", [1, 100, 128, 600, 4000, 8192])
@pytest.mark.parametrize("s", [1, 129, 1000, 4100])
def test_default_plans_are_valid(t: int, s: int) -> None:
    _assert_valid(plan_splash(t, s), t, s)


def test_defaults_take_large_tiles_where_padding_is_small() -> None:
    assert plan_splash(8192, 8192) == SplashPlan(8192, 8192, 512, 512, 512, 512)
    short = plan_splash(100, 600)  # 512 or 256 would pad 600 keys by far more than 1/8
    assert (short.q_len, short.block_q, short.kv_len, short.block_kv) == (128, 128, 640, 128)


def test_explicit_sizes_win() -> None:
    plan = plan_splash(1000, 1000, block_q=256, block_k=384, block_q_bwd=128)
    assert (plan.block_q, plan.block_kv, plan.block_q_bwd, plan.block_kv_bwd) == (256, 384, 128, 384)
    assert (plan.q_len, plan.kv_len) == (1024, 1152)


@pytest.mark.parametrize("kwargs", [{"block_q": 64}, {"block_k": 200}, {"block_k_bwd": 0}])
def test_explicit_sizes_the_kernel_cannot_take(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        plan_splash(512, 512, **kwargs)
