"""What ``jaxattn.dot_product_attention`` needs of ``attention()``: top-left alignment, padding
lengths and ``return_lse`` (docs/contract.md), checked against jax.nn and a NumPy rule, and the
drop-in's own edges (rank 3, any scale, jax.nn's checks)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.capabilities import Feature
from jaxattn.backend.validation import top_left_rules


@pytest.fixture(autouse=True)
def _strict() -> Iterator[None]:
    with jax.numpy_rank_promotion("raise"), jax.default_matmul_precision("highest"):
        yield


def _inputs(b: int = 2, t: int = 6, s: int = 9, n: int = 4, k: int = 2, h: int = 8, seed: int = 0) -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[1], (b, s, k, h)),
            jax.random.normal(keys[2], (b, s, k, h)))


def _top_left(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> np.ndarray:
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    keep = np.ones((t, s), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    return keep


def _br(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> np.ndarray:
    i, j = np.arange(t)[:, None] + s - t, np.arange(s)[None, :]
    keep = np.ones((t, s), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    return keep


WINDOWS = (None, (0, 0), (2, 1), (0, 3), (4, 0), (1, 7), (12, 12))


def test_top_left_rules_say_the_same_as_bottom_right_rules() -> None:
    """Every (T, S, causal, window): the bottom-right rules (and band mask) ``top_left_rules``
    returns keep exactly the keys the top-left rule keeps."""
    for t, s, causal, window in itertools.product((1, 3, 6, 9), (1, 4, 6, 11), (False, True), WINDOWS):
        want = _top_left(t, s, causal, window)
        br_causal, br_window, band = top_left_rules(t, s, causal, window)
        got = _br(t, s, br_causal, br_window)
        if band is not None:
            _, lo, hi = band
            i, j = np.arange(t)[:, None], np.arange(s)[None, :]
            got = got & (True if lo is None else j >= i + lo) & (True if hi is None else j <= i + hi)
        np.testing.assert_array_equal(got, want, err_msg=f"T={t} S={s} causal={causal} window={window}")


@pytest.mark.parametrize("impl", ["vanilla", "blockwise", "sdpa"])
@pytest.mark.parametrize(("t", "s"), [(6, 9), (9, 6)])
def test_top_left_matches_jax_nn(impl: str, t: int, s: int) -> None:
    """``alignment="top_left"`` is jax.nn's causal and window, for T < S and T > S; rows that see
    nothing are zeros (jax.nn's differ on purpose)."""
    q, k, v = _inputs(t=t, s=s)
    for causal, window in [(True, None), (False, (2, 1)), (True, (3, 0)), (False, (0, 3))]:
        want = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window))
        got = np.asarray(jaxattn.attention(q, k, v, impl=impl, causal=causal, sliding_window=window,
                                           alignment="top_left"))
        seen = _top_left(t, s, causal, window).any(axis=1)  # (T,)
        np.testing.assert_allclose(got[:, seen], want[:, seen], atol=2e-6, rtol=2e-6)
        assert not got[:, ~seen].any(), "rows that see no key must be zeros"


@pytest.mark.parametrize("impl", ["vanilla", "blockwise", "sdpa"])
@pytest.mark.parametrize("with_segments", [False, True], ids=["lengths", "lengths+segment_ids"])
def test_padding_lengths(impl: str, with_segments: bool) -> None:
    """``q_padding_lengths`` / ``kv_padding_lengths`` are jax.nn's query / key lengths: padded
    queries give zeros and zero gradients; with segment ids of the caller's too, both apply."""
    q, k, v = _inputs(t=7, s=7)
    q_len, kv_len = jnp.array([7, 3], jnp.int32), jnp.array([5, 7], jnp.int32)
    ids = jnp.array([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], jnp.int32) if with_segments else None
    mask = None if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

    def run(q: Any) -> Any:
        return jaxattn.attention(q, k, v, impl=impl, q_segment_ids=ids, kv_segment_ids=ids,
                                 q_padding_lengths=q_len, kv_padding_lengths=kv_len)

    got = run(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
    assert not np.asarray(got)[1, 3:].any()
    dq = jax.grad(lambda q: jnp.sum(run(q)))(q)
    assert not np.asarray(dq)[1, 3:].any(), "padded queries get no gradient"


def test_padding_is_lowered_into_the_rules_backends_declare() -> None:
    """Padding needs segment ids (or a mask next to the caller's ids), top-left a window or a
    mask: a backend without them declines with its declared reasons."""
    q, k, v = _inputs(t=6, s=9)
    lengths = jnp.array([6, 2], jnp.int32)
    problem = jaxattn.explain(q, k, v, q_padding_lengths=lengths).problem
    assert Feature.SEGMENT_IDS in problem.required_features()
    ids = jnp.zeros((2, 6), jnp.int32)
    problem = jaxattn.explain(q, k, v, q_padding_lengths=lengths, q_segment_ids=ids,
                              kv_segment_ids=jnp.zeros((2, 9), jnp.int32)).problem
    assert problem.mask_shape == (2, 1, 6, 9)
    # T < S, causal top-left: j <= i is no bottom-right window (its right side would be -3).
    problem = jaxattn.explain(q, k, v, causal=True, alignment="top_left").problem
    assert problem.mask_shape == (1, 1, 6, 9) and not problem.causal
    decode = jaxattn.get_impl("autoregressive_decodeattn")
    assert any("boolean mask" in r for r in decode.supports(q, k, v, causal=True, alignment="top_left"))


def test_return_lse() -> None:
    """``return_lse=True``: (out, lse (B, Hq, T) float32, natural log, no gradient); auto picks a
    backend that returns it, and one that does not declines with the reason."""
    q, k, v = _inputs(t=6, s=9)
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 6, 9)) > 0.3).at[..., 0].set(True)
    out, lse = jaxattn.attention(q, k, v, mask=mask, return_lse=True)
    assert lse.shape == (2, 4, 6) and lse.dtype == jnp.float32
    want_out, want_lse = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse).transpose(0, 2, 1), atol=2e-6, rtol=2e-6)
    assert jaxattn.explain(q, k, v, mask=mask, return_lse=True).chosen in ("blockwise", "vanilla")
    with pytest.raises(jaxattn.UnsupportedError, match="log-sum-exp"):
        jaxattn.attention(q, k, v, impl="sdpa", return_lse=True)
    # differentiated through auto (forward and backward may be two backends): no gradient from the lse
    dq = jax.grad(lambda q: jnp.sum(jaxattn.attention(q, k, v, mask=mask, return_lse=True)[1]))(q)
    assert not np.asarray(dq).any()
    dq = jax.grad(lambda q: jnp.sum(jaxattn.attention(q, k, v, mask=mask, return_lse=True)[0]))(q)
    want = jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask)))(q)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_bad_options_are_named() -> None:
    q, k, v = _inputs(t=6, s=9)
    cases = [
        ({"alignment": "left"}, "alignment"),
        ({"alignment": "top_left", "kv_lengths": jnp.array([9, 4], jnp.int32)}, "kv_lengths"),
        ({"q_padding_lengths": jnp.array([7, 1], jnp.int32)}, "q_padding_lengths"),
        ({"kv_padding_lengths": jnp.array([1, 2, 3], jnp.int32)}, "kv_padding_lengths"),
        ({"kv_padding_lengths": jnp.array([1.0, 2.0])}, "kv_padding_lengths"),
        ({"return_lse": 1}, "return_lse"),
    ]
    for kwargs, name in cases:
        with pytest.raises(jaxattn.InvalidInputError) as info:
            jaxattn.attention(q, k, v, **kwargs)
        assert info.value.argument == name, (kwargs, info.value)


def test_drop_in_edges() -> None:
    """Rank 3, scales jaxattn itself does not take (0, negative, traced), the residual's layout
    and dtype, and jax.nn's checks as ValueErrors."""
    q, k, v = _inputs(t=6, s=9)
    q, k, v = q[0].astype(jnp.bfloat16), k[0].astype(jnp.bfloat16), v[0].astype(jnp.bfloat16)
    out, lse = jaxattn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    want_out, want_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert out.shape == want_out.shape == (6, 4, 8) and lse.shape == want_lse.shape == (6, 4)
    assert lse.dtype == want_lse.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float32), np.asarray(want_lse, np.float32), atol=2e-2, rtol=1e-2)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    for scale in (0.0, -0.5, 2.0):
        got = jaxattn.dot_product_attention(*f32, scale=scale, implementation="vanilla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.dot_product_attention(*f32, scale=scale)),
                                   atol=2e-6, rtol=2e-6)
    traced = jax.jit(lambda s: jaxattn.dot_product_attention(*f32, scale=s))(0.3)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(jax.nn.dot_product_attention(*f32, scale=0.3)),
                               atol=2e-6, rtol=2e-6)
    bad = [
        ((f32[0], f32[1], f32[2][..., :4]), {}),  # value's shape differs from key's
        ((f32[0], f32[1], f32[2]), {"mask": jnp.ones((1, 1, 6, 9), jnp.int32)}),
        ((f32[0][None], f32[1][None], f32[2][None]), {"key_value_seq_lengths": jnp.array([3], jnp.int16)}),
        ((q, f32[1], f32[2]), {}),  # query's dtype differs from key's
        ((f32[0][:, :3], f32[1], f32[2]), {}),  # 3 query heads over 2 key heads
    ]
    for args, kwargs in bad:
        with pytest.raises(ValueError):
            jaxattn.dot_product_attention(*args, **kwargs)
