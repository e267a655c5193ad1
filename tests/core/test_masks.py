"""jaxattn.masks: the constructors' rules, BlockMask (eager and under jit), the checks of mask_mod
and score_mod (one InvalidInputError naming the argument), declines, and explain's sparsity line."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import masks
from jaxattn.backend.validation import resolve_call
from jaxattn.testing import oracle

B, HQ, T, S = 2, 4, 10, 12


def grid(mod: masks.MaskMod, b: int = B, h: int = HQ, t: int = T, s: int = S) -> np.ndarray:
    return oracle.mask_mod_grid(mod, b, h, t, s)


def positions(t: int = T, s: int = S) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(t)[:, None], np.arange(s)[None, :]


def test_constructors_follow_their_rules() -> None:
    i, j = positions()
    np.testing.assert_array_equal(grid(masks.causal())[0, 0], i >= j)
    np.testing.assert_array_equal(grid(masks.sliding_window(3, 1))[1, 2], (j >= i - 3) & (j <= i + 1))
    np.testing.assert_array_equal(grid(masks.sliding_window(2))[0, 0], (j >= i - 2) & (j <= i))
    np.testing.assert_array_equal(grid(masks.chunked_causal(4))[0, 0], (i // 4 == j // 4) & (i >= j))
    lengths = np.array([3, 7], np.int32)
    got = grid(masks.prefix_lm(lengths))
    for b in range(B):
        np.testing.assert_array_equal(got[b, 1], (j < lengths[b]) | (i >= j))
    q_ids = np.array([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3], np.int32)
    kv_ids = np.array([[0] * 5 + [1] * 7, [0] * 2 + [1] * 10], np.int32)
    got = grid(masks.document(q_ids, kv_ids))
    for b in range(B):
        np.testing.assert_array_equal(got[b, 3], q_ids[b][:, None] == kv_ids[b][None, :])
    both = grid(masks.and_(masks.causal(), masks.sliding_window(2, 5)))
    np.testing.assert_array_equal(both[0, 0], (i >= j) & (j >= i - 2))
    either = grid(masks.or_(masks.sliding_window(0, 0), lambda b, h, q, kv: kv < h))
    for h in range(HQ):
        np.testing.assert_array_equal(either[0, h], (i == j) | (j < h))
    # One function per window: calls with it share their traces and checks.
    assert masks.sliding_window(3, 1) is masks.sliding_window(3, 1)
    assert masks.causal() is masks.causal()


@pytest.mark.parametrize("bad", [lambda: masks.sliding_window(-1), lambda: masks.chunked_causal(0),
                                 lambda: masks.and_(), lambda: masks.prefix_lm(np.zeros((2, 2), np.int32)),
                                 lambda: masks.document(np.zeros((3,), np.int32))])
def test_constructors_refuse_bad_arguments(bad: object) -> None:
    with pytest.raises(jaxattn.InvalidInputError):
        bad()  # type: ignore[operator]


def _expected_kind(mod: masks.MaskMod, b: int, h: int, t: int, s: int, bq: int, bk: int) -> np.ndarray:
    g = grid(mod, b, h, t, s)
    nq, nk = -(-t // bq), -(-s // bk)
    kind = np.zeros((b, h, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            tile = g[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            kind[:, :, i, j] = np.where(tile.all(axis=(2, 3)), 2, np.where(tile.any(axis=(2, 3)), 1, 0))
    return kind


def test_block_mask_classifies_tiles_eagerly_and_under_jit() -> None:
    ids = jnp.asarray([[0] * 5 + [1] * 5 + [2] * 3, [0] * 9 + [1] * 4], jnp.int32)  # T = S = 13: padded tiles
    mod = masks.and_(masks.causal(), masks.document(ids))
    want = _expected_kind(mod, 2, 1, 13, 13, 4, 4)
    bm = masks.block_mask(mod, 2, 1, 13, 13, block_q=4, block_kv=4)
    assert (bm.shape, bm.block_q, bm.block_kv) == ((2, 1, 13, 13), 4, 4)
    np.testing.assert_array_equal(np.asarray(bm.kind), want)
    assert bm.counts() == tuple(int((want == k).sum()) for k in (0, 1, 2))
    assert "empty" in repr(bm)

    @jax.jit
    def build(ids: jax.Array) -> masks.BlockMask:  # a traced capture; the BlockMask leaves jit as a pytree
        return masks.block_mask(masks.and_(masks.causal(), masks.document(ids)), 2, 1, 13, 13, block_q=4, block_kv=4)

    traced = build(ids)
    assert isinstance(traced, masks.BlockMask)
    np.testing.assert_array_equal(np.asarray(traced.kind), want)
    # A mask_mod of neither b nor h gives a BlockMask of (1, 1): it serves any batch and heads.
    assert masks.block_mask(masks.causal(), 3, 8, 16, 16, block_q=8, block_kv=8).kind.shape == (1, 1, 2, 2)


def test_mask_bits_pack_the_visibility_and_from_bits_classifies_any_tiling() -> None:
    b, h, t, s = 2, 3, 21, 75  # S not a multiple of 32: the last word's high bits are 0
    ids = jnp.asarray(np.arange(s)[None] // 20 + np.arange(b)[:, None], jnp.int32)
    mods = [masks.causal(), lambda b_, h_, q, kv: ((kv + b_ + h_) % 4 != 3) & (q + h_ >= kv),
            masks.and_(masks.causal(), masks.document(ids[:, :t], ids))]
    for mod in mods:
        dense = grid(mod, b, h, t, s)
        bits = np.asarray(masks.mask_bits(mod, b, h, t, s, block_q=8))
        assert bits.dtype == np.int32 and bits.shape[2:] == (t, 3)
        unpacked = (bits.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        unpacked = unpacked.reshape(*bits.shape[:3], 96)
        assert not unpacked[..., s:].any()
        np.testing.assert_array_equal(np.broadcast_to(unpacked[..., :s], dense.shape), dense)
        for bq, bk in ((4, 16), (8, 32), (16, 64), (5, 7), (128, 128)):
            bm = masks.block_mask(mod, b, h, t, s, block_q=bq, block_kv=bk, bits=True)
            np.testing.assert_array_equal(np.asarray(bm.bits), bits)
            got = masks.from_bits(bm.bits, s, block_q=bq, block_kv=bk)
            assert (got.block_q, got.block_kv, got.shape) == (bm.block_q, bm.block_kv, bm.shape)
            np.testing.assert_array_equal(np.asarray(got.kind), _expected_kind(mod, *bm.shape, bm.block_q,
                                                                               bm.block_kv))
    # Under jit, from a traced capture; the bits travel in the BlockMask (a pytree leaf).
    traced = jax.jit(lambda i: masks.block_mask(masks.document(i), b, 1, s, s, bits=True))(ids)
    np.testing.assert_array_equal(np.asarray(traced.bits), np.asarray(masks.mask_bits(masks.document(ids), b, 1, s, s)))
    with pytest.raises(jaxattn.InvalidInputError, match="bits"):
        masks.from_bits(jnp.zeros((1, 1, t, 2), jnp.int32), s)


def _unpacked(bits: object, s: int) -> np.ndarray:
    words = np.asarray(bits).view(np.uint32)
    return (((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(*words.shape[:-1], -1)[..., :s]) == 1


def _doc_ids(t: int) -> jax.Array:
    return jnp.asarray(np.searchsorted([40, 41, 100], np.arange(t), side="right")[None], jnp.int32)


@pytest.mark.parametrize("window", [(None, None), (None, 0), (30, 5), (17, None)])
@pytest.mark.parametrize(("t", "s"), [(150, 150), (77, 200), (200, 77)])
def test_call_bits_and_a_window_and_rules_bottom_right(t: int, s: int, window: tuple[int | None, int | None]) -> None:
    mask_mod = masks.or_(masks.chunked_causal(32), lambda b, h, qi, kv: (h == 1) & (kv % 3 == 0))
    odd = lambda b, h, qi, kv: (qi + b) % 2 == 1  # noqa: E731 (a rule beside the window)
    bits = masks.call_bits(mask_mod, None, 2, 2, t, s, window=window, rules=(odd,))
    qi, kv = np.arange(t)[:, None] + (s - t), np.arange(s)[None]
    want = grid(mask_mod, 2, 2, t, s) & grid(odd, 2, 2, t, s)
    if window[0] is not None:
        want = want & (kv >= qi - window[0])
    if window[1] is not None:
        want = want & (kv <= qi + window[1])
    np.testing.assert_array_equal(np.broadcast_to(_unpacked(bits, s), want.shape), want)
    # A block mask's bits stand for the mask_mod's: the same visibility, the rules ANDed in.
    given = masks.block_mask(mask_mod, 1, 2, t, s, bits=True)
    np.testing.assert_array_equal(np.asarray(masks.call_bits(None, given, 2, 2, t, s, window=window, rules=(odd,))),
                                  np.asarray(bits))
    np.testing.assert_array_equal(np.asarray(masks.call_bits(None, given, 1, 2, t, s)), np.asarray(given.bits))


@pytest.mark.parametrize("by_keys", [False, True])
@pytest.mark.parametrize(("t", "s", "rows", "keys"), [(300, 300, 128, 128), (333, 517, 128, 64), (64, 40, 128, 128)])
def test_tile_lists_name_each_tiles_partial_then_full_tiles(t: int, s: int, rows: int, keys: int,
                                                               by_keys: bool) -> None:
    mask_mod = masks.and_(masks.causal(), masks.document(_doc_ids(max(t, s))[:, :t], _doc_ids(max(t, s))[:, :s]))
    dense = grid(mask_mod, 1, 1, t, s)[0, 0]
    bits = masks.call_bits(mask_mod, None, 1, 1, t, s)
    lists = np.asarray(masks.tile_lists(bits, s, block_q=rows, block_kv=keys, by_keys=by_keys))[0, 0]
    nq, nk = -(-t // rows), -(-s // keys)
    assert lists.shape == ((nk, 2 + nq) if by_keys else (nq, 2 + nk))
    for tile, row in enumerate(lists):
        n_partial, n_full = row[:2]
        listed = row[2:2 + n_partial + n_full]
        for pos, other in enumerate(listed):
            qt, kt = (other, tile) if by_keys else (tile, other)
            block = dense[qt * rows:(qt + 1) * rows, kt * keys:(kt + 1) * keys]
            assert block.any()
            # Full: every pair of the kernel's whole tile is visible (a tail tile never is).
            full = block.all() and block.shape == (rows, keys)
            assert (pos >= n_partial) == full, (tile, pos, other)
        assert list(listed[:n_partial]) == sorted(listed[:n_partial])
        assert list(listed[n_partial:]) == sorted(listed[n_partial:])
        others = nq if by_keys else nk
        unlisted = set(range(others)) - set(listed.tolist())
        for other in unlisted:  # empty
            qt, kt = (other, tile) if by_keys else (tile, other)
            assert not dense[qt * rows:(qt + 1) * rows, kt * keys:(kt + 1) * keys].any()


def test_seen_words_are_the_keys_some_query_of_the_kv_head_sees() -> None:
    b, hq, hkv, t, s = 2, 4, 2, 20, 70
    mod = masks.or_(lambda b_, h, qi, kv: (h == 1) & (kv < 10) & (qi > 0),
                    lambda b_, h, qi, kv: (h >= 2) & (kv >= 60) & (b_ == 1))
    seen = masks.seen_words(masks.mask_bits(mod, b, hq, t, s), hkv)
    want = grid(mod, b, hq, t, s).reshape(b, hkv, hq // hkv, t, s).any(axis=(2, 3))
    np.testing.assert_array_equal(_unpacked(seen, s), want)
    assert masks.seen_words(masks.mask_bits(masks.causal(), b, hq, t, s), hkv).shape == (1, 1, 3)


def test_sees_diagonal_holds_for_what_keeps_the_diagonal_and_nothing_else() -> None:
    ids = jnp.asarray([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3], jnp.int32)
    other = jnp.asarray([[0] * 5 + [1] * 5, [1] * 10], jnp.int32)
    window = masks.sliding_window(2, 1)
    np_ids = np.asarray(ids)  # one numpy array given twice is one array too
    known = [masks.causal(), window, masks.sliding_window(0), masks.chunked_causal(3),
             masks.prefix_lm(np.array([3, 0], np.int32)), masks.document(ids), masks.document(ids, ids),
             masks.document(np_ids, np_ids),
             masks.and_(masks.causal(), masks.document(ids)), masks.and_(window, masks.chunked_causal(4)),
             masks.or_(lambda b, h, q, kv: kv < h, masks.causal())]
    unknown = [lambda b, h, q, kv: q >= kv, masks.document(ids, other),
               masks.document(np.asarray(ids), np.asarray(ids)),  # two arrays, equal: not assumed
               masks.and_(masks.causal(), lambda b, h, q, kv: kv > 0), masks.or_(lambda b, h, q, kv: kv < h),
               masks.and_(masks.causal(), masks.document(ids, other)), None, 3]
    n = ids.shape[1]
    for mod in known:  # the claim, checked densely: every (i, i) kept, in every sequence and head
        assert masks.sees_diagonal(mod)
        diag = grid(mod, 2, HQ, n, n)[..., np.arange(n), np.arange(n)]
        assert diag.all(), mod
    assert not any(masks.sees_diagonal(mod) for mod in unknown)
    # The one that is not claimed does drop a diagonal pair.
    assert not grid(masks.and_(masks.causal(), lambda b, h, q, kv: kv > 0), 1, 1, n, n)[0, 0, 0, 0]


@pytest.mark.parametrize("budget", [1, 200, 3000])
def test_block_mask_and_bits_do_not_depend_on_the_rows_a_step(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """A small step budget splits the rows into several steps (one tile's rows at the least, a
    ragged last step): the kinds and bits are those of one step over every row."""
    b, h, t, s = 2, 3, 45, 70
    ids = jnp.asarray(np.arange(s)[None] // 16 + np.arange(b)[:, None], jnp.int32)
    mod = masks.and_(lambda b_, h_, q, kv: (kv + h_) % 5 != 1, masks.causal(), masks.document(ids[:, :t], ids))
    dense = grid(mod, b, h, t, s)
    monkeypatch.setattr(masks, "_STEP_ELEMENTS", budget)
    for bq, bk in ((4, 16), (8, 8), (7, 32)):
        bm = masks.block_mask(mod, b, h, t, s, block_q=bq, block_kv=bk, bits=True)
        np.testing.assert_array_equal(np.asarray(bm.kind), _expected_kind(mod, b, h, t, s, bq, bk))
        unpacked = (np.asarray(bm.bits).view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        np.testing.assert_array_equal(unpacked.reshape(b, h, t, 96)[..., :s], dense)
    def docs(i: jax.Array) -> masks.MaskMod:
        return masks.and_(masks.causal(), masks.document(i[:, :t], i))

    one_step = np.asarray(masks.mask_bits(docs(ids), b, 1, t, s, block_q=t))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda i: masks.mask_bits(docs(i), b, 1, t, s))(ids)), one_step)
    assert masks._rows_at_once(mod, b, h, t, 96, 4) % 4 == 0  # whole tiles a step


def _qkv(t: int = T, s: int = S) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, t, HQ, 8))
    k = jax.random.normal(keys[1], (B, s, 2, 8))
    v = jax.random.normal(keys[2], (B, s, 2, 8))
    return q, k, v


@pytest.mark.parametrize(("name", "fn", "needle"), [
    ("mask_mod", lambda b, h, q: q > 0, "failed when traced: TypeError"),
    ("mask_mod", lambda b, h, q, kv: q - kv, "must return booleans"),
    ("mask_mod", lambda b, h, q, kv: jnp.ones((3, 3), bool), "must return booleans broadcastable"),
    ("mask_mod", 3, "must be a function"),
    ("score_mod", lambda s, b, h, q: s, "failed when traced: TypeError"),
    ("score_mod", lambda s, b, h, q, kv: s > 0, "must return a floating score"),
    ("score_mod", lambda s, b, h, q, kv: s[..., :1], "must return a floating score of the logits' shape"),
])
def test_bad_functions_get_one_error_naming_the_argument(name: str, fn: object, needle: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(jaxattn.InvalidInputError) as info:
        jaxattn.attention(q, k, v, impl="vanilla", **{name: fn})
    assert info.value.argument == name
    assert needle in str(info.value)


def test_block_mask_checks() -> None:
    q, k, v = _qkv()
    bm = masks.block_mask(masks.causal(), 1, 1, T, S)
    with pytest.raises(jaxattn.InvalidInputError, match=r"block_mask.*has none"):
        jaxattn.attention(q, k, v, impl="vanilla", block_mask=bm)
    wrong = masks.block_mask(masks.causal(), 1, 1, T + 1, S)
    with pytest.raises(jaxattn.InvalidInputError, match=r"block_mask.*was built for"):
        jaxattn.attention(q, k, v, impl="vanilla", mask_mod=masks.causal(), block_mask=wrong)
    with pytest.raises(jaxattn.InvalidTypeError, match="block_mask"):
        jaxattn.attention(q, k, v, impl="vanilla", mask_mod=masks.causal(), block_mask=np.ones((1, 1, 1, 1)))


def test_functions_are_traced_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv()
    traced = []

    def mod(b: jax.Array, h: jax.Array, qi: jax.Array, kv: jax.Array) -> jax.Array:
        traced.append(1)
        return qi >= kv

    calls = jax.make_jaxpr
    checks = []
    monkeypatch.setattr(jax, "make_jaxpr", lambda *a, **kw: checks.append(1) or calls(*a, **kw))
    for _ in range(3):
        jaxattn.attention(q, k, v, impl="vanilla", mask_mod=mod)
    assert len(checks) == 1


def test_a_mask_mod_is_static_without_traced_captures_or_b() -> None:
    q, k, v = _qkv()
    ids = jnp.zeros((B, S), jnp.int32)
    problem = jaxattn.explain(q, k, v, mask_mod=masks.causal()).problem
    assert problem.mask_mod and problem.mask_mod_static  # type: ignore[union-attr]
    assert not jaxattn.explain(q, k, v, mask_mod=masks.document(ids[:, :T], ids)).problem.mask_mod_static  # of b

    @jax.jit
    def traced(lengths: jax.Array) -> bool:
        found = jaxattn.explain(q, k, v, mask_mod=lambda b, h, i, j: j < lengths[0]).problem
        return found.mask_mod_static  # type: ignore[union-attr]

    assert jaxattn.explain(q, k, v, mask_mod=lambda b, h, i, j: j < ids[0, 0] + 3).problem.mask_mod_static
    assert not traced(jnp.asarray([3]))


def test_a_document_term_is_found_for_kernels_with_segment_ids() -> None:
    # document(), alone or ANDed with static mask_mods, is flagged (mask_mod_documents) and
    # as_segment_ids hands a kernel its ids and the rest, the ids traced or not; anything else
    # (or_, two documents, a non-static rest, ids of another shape, a call with its own ids) is not.
    q, k, v = _qkv(t=S)
    ids = jnp.asarray(np.repeat(np.arange(B * 2), S // 2).reshape(B, S), jnp.int32)
    other = masks.document(ids + 1)
    lengths = jnp.asarray([3, 5])

    def flags(mod: object, **kw: object) -> bool:
        return jaxattn.explain(q, k, v, mask_mod=mod, **kw).problem.mask_mod_documents  # type: ignore[union-attr]

    for mod in (masks.document(ids), masks.and_(masks.causal(), masks.document(ids)),
                masks.and_(masks.sliding_window(2), masks.document(ids), masks.causal())):  # fmt: skip
        assert flags(mod), mod
    for mod in (masks.or_(masks.causal(), masks.document(ids)), masks.and_(masks.document(ids), other),
                masks.and_(masks.prefix_lm(lengths), masks.document(ids)), masks.document(ids[:, :4], ids[:, :4]),
                lambda b, h, i, j: ids[b, i] == ids[b, j]):  # fmt: skip
        assert not flags(mod), mod
    assert not flags(masks.document(ids), q_segment_ids=ids, kv_segment_ids=ids)

    @jax.jit
    def split(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        mod = masks.and_(masks.causal(), masks.document(ids))
        call = resolve_call(q, k, v, mask_mod=mod)
        rest, q_seg, kv_seg = masks.as_segment_ids(call)
        assert rest is masks.causal() and call.problem.mask_mod_documents
        return q_seg, kv_seg

    q_seg, kv_seg = split(ids)
    np.testing.assert_array_equal(q_seg, ids)
    np.testing.assert_array_equal(kv_seg, ids)


def test_alibi_is_a_score_mod_recognised_by_kernels_and_its_slopes_checked() -> None:
    # The function is ALiBi at raw positions; the problem flags it (score_mod_alibi) and
    # alibi_slopes hands a kernel the slopes, traced or not; a lambda of the same values is not
    # flagged; slopes of another head count are refused (jnp indexing would clamp them).
    q, k, v = _qkv(t=S)
    hq = q.shape[2]
    slopes = jnp.asarray(np.linspace(-1.0, -0.1, hq), jnp.float32)
    score = jnp.zeros((1, hq, 3, 4))
    got = masks.alibi(slopes)(score, *masks.indices(1, hq, 3, 4))
    want = np.asarray(slopes)[None, :, None, None] * (np.arange(4)[None, :] - np.arange(3)[:, None])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert jaxattn.explain(q, k, v, score_mod=masks.alibi(slopes)).problem.score_mod_alibi  # type: ignore[union-attr]
    lam = lambda s, b, h, i, j: s + slopes[h] * (j - i)  # noqa: E731
    assert not jaxattn.explain(q, k, v, score_mod=lam).problem.score_mod_alibi  # type: ignore[union-attr]

    @jax.jit
    def handed(sl: jax.Array) -> jax.Array:
        call = resolve_call(q, k, v, score_mod=masks.alibi(sl))
        return masks.alibi_slopes(call)

    np.testing.assert_array_equal(handed(slopes), slopes)
    assert masks.alibi_slopes(resolve_call(q, k, v, score_mod=lam)) is None
    with pytest.raises(jaxattn.InvalidInputError, match=rf"score_mod.*shape \(3,\).*Hq = {hq}"):
        jaxattn.attention(q, k, v, impl="vanilla", score_mod=masks.alibi(slopes[:3]))
    for bad in (jnp.zeros((hq, 2)), jnp.arange(hq)):
        with pytest.raises(jaxattn.InvalidInputError, match="slopes"):
            masks.alibi(bad)


def test_backends_without_the_feature_decline_with_the_reason() -> None:
    q, k, v = _qkv(t=1)
    reasons = jaxattn.get_impl("autoregressive_decodeattn").supports(q, k, v, mask_mod=masks.causal())
    assert any("mask_mod" in r for r in reasons)
    with pytest.raises(jaxattn.UnsupportedError, match="score_mod"):
        jaxattn.attention(q, k, v, impl="autoregressive_decodeattn", score_mod=lambda s, b, h, qi, kv: s)


def test_explain_shows_the_block_sparsity() -> None:
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(t=S))
    text = str(jaxattn.explain(q, k, v, mask_mod=masks.causal()))
    assert "mask_mod tiles" in text and "empty" in text and "partial" in text and "full" in text
    bm = masks.block_mask(masks.chunked_causal(4), 1, 1, S, S, block_q=4, block_kv=4)
    text = str(jaxattn.explain(q, k, v, mask_mod=masks.chunked_causal(4), block_mask=bm))
    assert "mask_mod tiles 4x4: 6 empty, 3 partial, 0 full" in text


def test_importing_masks_imports_no_jax() -> None:
    code = "import jaxattn.masks, sys; from jaxattn import masks; masks.causal(); assert 'jax.numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
