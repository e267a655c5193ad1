"""``jaxattn_mosaic.mods``: a mask_mod as the Mosaic GPU kernels read it (plain JAX, any host),
against dense evaluations of the mask_mod."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import masks
from jaxattn_mosaic import mods


def _dense(mask_mod: Any, b: int, h: int, t: int, s: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(mask_mod(*masks.indices(b, h, t, s))), (b, h, t, s))


def _unpacked(bits: Any, s: int) -> np.ndarray:
    words = np.asarray(bits).view(np.uint32)
    return (((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(*words.shape[:-1], -1)[..., :s]) == 1


@pytest.mark.parametrize(("causal", "window"), [(False, (None, None)), (True, (None, None)), (False, (30, 5)),
                                                (True, (17, None))])
@pytest.mark.parametrize(("t", "s"), [(150, 150), (77, 200), (200, 77)])
def test_call_bits_and_the_call_rules_bottom_right(t: int, s: int, causal: bool, window: Any) -> None:
    mask_mod = masks.or_(masks.chunked_causal(32), lambda b, h, qi, kv: (h == 1) & (kv % 3 == 0))
    bits = mods.call_bits(mask_mod, None, batch=1, heads=2, t_len=t, s_len=s, causal=causal, window=window)
    qi, kv = np.arange(t)[:, None] + (s - t), np.arange(s)[None]
    want = _dense(mask_mod, 1, 2, t, s) & (kv <= qi if causal else True)
    if window[0] is not None:
        want = want & (kv >= qi - window[0])
    if window[1] is not None:
        want = want & (kv <= qi + window[1])
    assert np.array_equal(_unpacked(bits, s), want)
    # A block mask's bits stand for the mask_mod's: the same visibility, the rules ANDed in.
    given = masks.block_mask(mask_mod, 1, 2, t, s, bits=True)
    assert np.array_equal(np.asarray(mods.call_bits(None, given, batch=1, heads=2, t_len=t, s_len=s, causal=causal,
                                                    window=window)), np.asarray(bits))


def test_row_blocks_put_a_blocks_rows_side_by_side_per_word() -> None:
    bits = jnp.asarray(np.random.default_rng(0).integers(-2**31, 2**31, size=(2, 1, 100, 3)), jnp.int32)
    blocked = np.asarray(mods.row_blocks(bits, rows=64, t_pad=128, words=4))
    assert blocked.shape == (2, 1, 2, 4, 64)
    padded = np.zeros((2, 1, 128, 4), np.int32)
    padded[:, :, :100, :3] = np.asarray(bits)
    for r in range(2):
        for w in range(4):
            assert np.array_equal(blocked[:, :, r, w], padded[:, :, r * 64:(r + 1) * 64, w])


def test_unread_keys_are_zeroed() -> None:
    # Heads 0, 1 share KV head 0, heads 2, 3 KV head 1; keys seen by no query of a KV head's group.
    t, s = 20, 70
    mask_mod = masks.or_(lambda b, h, qi, kv: (h < 2) & (kv < 10) & (qi > 0),
                         lambda b, h, qi, kv: (h >= 2) & (kv >= 60) & (b == 1))
    bits = mods.call_bits(mask_mod, None, batch=2, heads=4, t_len=t, s_len=s, causal=False, window=(None, None))
    k = jnp.full((2, s, 2, 8), jnp.nan, jnp.float32)
    zk, zv = mods.unread_zeroed(k, k + 1, bits)
    seen = _dense(mask_mod, 2, 4, t, s).reshape(2, 2, 2, t, s).any(axis=(2, 3))  # (B, Hkv, S)
    for a in (np.asarray(zk), np.asarray(zv)):
        assert np.array_equal(np.isnan(a).all(-1), np.swapaxes(seen, 1, 2))
        assert np.all(a[~np.isnan(a)] == 0)


def test_unread_keys_need_no_pass_where_a_square_calls_mask_mod_keeps_its_diagonal() -> None:
    t = 24
    ids = jnp.asarray([[0] * 10 + [1] * 14], jnp.int32)
    k, v = jnp.ones((1, t, 2, 8)), jnp.ones((1, t, 2, 8))
    kept = masks.and_(masks.causal(), masks.document(ids))
    bits = mods.call_bits(kept, None, batch=1, heads=4, t_len=t, s_len=t, causal=True, window=(3, None))
    assert mods.unread_zeroed(k, v, bits, kept) == (k, v)  # the same arrays: every key is seen
    # Not known to keep it (a user's function; a call that is not square): the pass runs.
    user = lambda b, h, qi, kv: ids[b, qi] == ids[b, kv]  # noqa: E731
    for mod, s in ((user, t), (kept, t + 8)):
        k2, v2 = jnp.ones((1, s, 2, 8)), jnp.ones((1, s, 2, 8))
        bits = mods.call_bits(mod, None, batch=1, heads=4, t_len=t, s_len=s, causal=True, window=(None, None))
        zk, zv = mods.unread_zeroed(k2, v2, bits, mod)
        assert zk is not k2 and zv is not v2
