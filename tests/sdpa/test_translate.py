"""The static translations of ``jaxattn_sdpa.translate``, against brute force over small grids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxattn_sdpa.translate import Band, band_row_valid, kv_band_restricts, padding_lengths, structural_band


def _contract_visible(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> np.ndarray:
    """The contract, spelled out: bottom-right causal and window on a (T, S) grid."""
    i = np.arange(t)[:, None] + (s - t)
    j = np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    return vis


def _band_visible(band: Band | None, t: int, s: int) -> np.ndarray:
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if band is not None and band.lo is not None:
        vis &= j >= i + band.lo
    if band is not None and band.hi is not None:
        vis &= j <= i + band.hi
    return vis


def _jax_nn_window_visible(t: int, s: int, left: int, right: int) -> np.ndarray:
    """jax.nn's documented local_window_size rule (top-left): i - left <= j <= i + right."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    return (j >= i - left) & (j <= i + right)


sizes = st.integers(1, 9)
windows = st.none() | st.tuples(st.integers(0, 10), st.integers(0, 10))


@settings(max_examples=400, deadline=None)
@given(t=sizes, s=sizes, causal=st.booleans(), window=windows)
def test_band_is_the_contract(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> None:
    band = structural_band(t, s, causal, window)
    want = _contract_visible(t, s, causal, window)
    np.testing.assert_array_equal(_band_visible(band, t, s), want)
    if band is None:
        assert want.all()
        return
    # Every bounded side excludes something (no mask is ever built for nothing) ...
    if band.lo is not None:
        assert not _band_visible(Band(band.lo, None), t, s).all()
    if band.hi is not None:
        assert not _band_visible(Band(None, band.hi), t, s).all()
    # ... and jax.nn's local_window_size reads the band back exactly.
    np.testing.assert_array_equal(_jax_nn_window_visible(t, s, *band.local_window_size(t, s)), want)
    assert band.is_top_left_causal == (band.lo is None and band.hi == 0)


@pytest.mark.parametrize(("t", "s", "causal", "window", "expected"), [
    (1, 9, True, None, None),  # decode sees every key: nothing to mask
    (5, 5, True, None, Band(None, 0)),  # T == S causal is jax.nn's is_causal
    (3, 7, True, None, Band(None, 4)),  # bottom-right: the diagonal moves right by S - T
    (7, 4, True, None, Band(None, -3)),  # T > S: the first T - S queries see nothing
    (6, 10, False, (2, 1), Band(2, 5)),
    (4, 4, False, (9, 9), None),  # a window wider than the grid excludes nothing
])
def test_band_examples(t: int, s: int, causal: bool, window: tuple[int, int] | None, expected: Band | None) -> None:
    assert structural_band(t, s, causal, window) == expected


@settings(max_examples=300, deadline=None)
@given(t=sizes, s=sizes, causal=st.booleans(), window=windows,
       kv_len=st.none() | st.lists(st.integers(0, 9), min_size=1, max_size=3))
def test_row_valid_matches_brute_force(t: int, s: int, causal: bool, window: tuple[int, int] | None,
                                       kv_len: list[int] | None) -> None:
    band = structural_band(t, s, causal, window)
    vis = _contract_visible(t, s, causal, window)
    if kv_len is None:
        np.testing.assert_array_equal(band_row_valid(band, t, s), vis.any(axis=-1))
        return
    lengths = np.minimum(np.asarray(kv_len, np.int32), s)
    padded = vis[None] & (np.arange(s)[None, None, :] < lengths[:, None, None])
    np.testing.assert_array_equal(band_row_valid(band, t, s, lengths), padded.any(axis=-1))


def _per_length_visible(t: int, s: int, length: int, causal: bool, window: tuple[int, int] | None) -> np.ndarray:
    """docs/contract.md, kv_lengths: keys j < L, query i at position L - T + i."""
    i = np.arange(t)[:, None] + (length - t)
    j = np.arange(s)[None, :]
    vis = np.broadcast_to(j < length, (t, s)).copy()
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    return vis


@settings(max_examples=400, deadline=None)
@given(t=sizes, s=sizes, causal=st.booleans(), window=windows)
def test_kv_band_restricts_exactly_when_some_length_is_cut(t: int, s: int, causal: bool,
                                                           window: tuple[int, int] | None) -> None:
    """False: for every length 0..S the rule is ``j < L`` alone; True: for some length it is not."""
    cut = any(
        not np.array_equal(_per_length_visible(t, s, n, causal, window), _per_length_visible(t, s, n, False, None))
        for n in range(s + 1)
    )
    assert kv_band_restricts(t, s, causal, window) == cut


def _brute_lengths(q: np.ndarray, kv: np.ndarray) -> tuple[list[int], list[int]] | None:
    """The unique (Lq, Lk >= 1) per row whose padding rule equals the segment rule, if any."""
    q_len, kv_len = [], []
    for qb, kb in zip(q, kv, strict=True):
        same = qb[:, None] == kb[None, :]
        fits = [(lq, lk) for lq in range(1, qb.size + 1) for lk in range(1, kb.size + 1)
                if np.array_equal(same, (np.arange(qb.size)[:, None] < lq) & (np.arange(kb.size)[None, :] < lk))]
        if not fits:
            return None
        assert len(fits) == 1
        q_len.append(fits[0][0])
        kv_len.append(fits[0][1])
    return q_len, kv_len


@st.composite
def segment_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    b, t, s = draw(st.integers(1, 3)), draw(st.integers(1, 7)), draw(st.integers(1, 7))
    ids = st.integers(0, 3)
    if draw(st.booleans()):  # a padding pattern: prefix of one id, then distinct pad ids
        q = np.full((b, t), 0, np.int32)
        kv = np.full((b, s), 0, np.int32)
        for row in range(b):
            q[row, draw(st.integers(1, t)):] = draw(st.sampled_from([1, 2]))
            kv[row, draw(st.integers(1, s)):] = draw(st.sampled_from([3, 4]))
        return q, kv
    q = np.asarray(draw(st.lists(st.lists(ids, min_size=t, max_size=t), min_size=b, max_size=b)), np.int32)
    kv = np.asarray(draw(st.lists(st.lists(ids, min_size=s, max_size=s), min_size=b, max_size=b)), np.int32)
    return q, kv


@settings(max_examples=500, deadline=None)
@given(pair=segment_pairs())
def test_padding_lengths_exactly_when_segments_are_padding(pair: tuple[np.ndarray, np.ndarray]) -> None:
    q, kv = pair
    got = padding_lengths(q, kv)
    want = _brute_lengths(q, kv)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert got[0].tolist() == want[0] and got[1].tolist() == want[1]
        assert got[0].dtype == np.int32 and got[1].dtype == np.int32


def test_padding_lengths_examples() -> None:
    q = np.array([[5, 5, 5, 9], [1, 1, 1, 1]])
    kv = np.array([[5, 5, 7, 7, 7], [1, 1, 1, 1, 1]])
    q_len, kv_len = padding_lengths(q, kv) or (None, None)
    assert q_len is not None and kv_len is not None
    assert q_len.tolist() == [3, 4] and kv_len.tolist() == [2, 5]
    # Packed sequences (two real segments) are not padding.
    assert padding_lengths(np.array([[0, 0, 1, 1]]), np.array([[0, 0, 1, 1]])) is None
    # Padded queries that match padded keys attend to them: not padding either.
    assert padding_lengths(np.array([[0, 0, 9]]), np.array([[0, 9, 9]])) is None
    # A row without real keys is left to the mask path.
    assert padding_lengths(np.array([[0, 0]]), np.array([[1, 1]])) is None
