"""``jaxattn.pages_in_address_order``: which pages it reorders, and that attention does not change."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import InvalidInputError
from jaxattn.testing import oracle

HQ, HKV, D = 4, 2, 8


def _call(rng: np.random.Generator, page_size: int, kv_lens: list[int], q_lens: list[int],
          spare: int = 2) -> dict[str, Any]:
    """A ragged call over a randomly permuted pool; unused table entries hold garbage."""
    per_seq = -(-max(kv_lens) // page_size) + 1
    used = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(used) + spare
    order = rng.permutation(num_pages)
    table = rng.integers(-2, num_pages + 2, size=(len(kv_lens), per_seq)).astype(np.int32)
    nxt = 0
    for s, n in enumerate(used):
        table[s, :n] = order[nxt:nxt + n]
        nxt += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return {"q": rng.normal(size=(int(cu[-1]), HQ, D)), "k_pages": rng.normal(size=(num_pages, page_size, HKV, D)),
            "v_pages": rng.normal(size=(num_pages, page_size, HKV, D)), "page_table": table,
            "kv_lengths": np.asarray(kv_lens, np.int32), "cu_q_lens": cu,
            "num_seqs": np.asarray([len(kv_lens)], np.int32)}


def _oracle(call: dict[str, Any], table: np.ndarray, window: int | None) -> np.ndarray:
    return oracle.paged_attention(call["q"], call["k_pages"], call["v_pages"], table, call["kv_lengths"],
                                  call["cu_q_lens"], call["num_seqs"], sliding_window=window)


def test_decode_rows_sort_every_full_page_and_keep_the_last() -> None:
    table = np.array([[7, 3, 9, 1, 5], [4, 8, 2, 6, 0], [9, 9, 9, 9, 9]], np.int32)
    # Row 0: 14 tokens of pages of 4 -> pages 0-2 full (positions <= 11), page 3 holds the query (13).
    # Row 1: 16 tokens -> four full pages, but page 3 holds the query's own position (15): it stays,
    # as the contract says. Row 2: empty, nothing moves.
    got = jaxattn.pages_in_address_order(table, np.array([14, 16, 0]), 4)
    np.testing.assert_array_equal(got, [[3, 7, 9, 1, 5], [2, 4, 8, 6, 0], [9, 9, 9, 9, 9]])
    assert got.dtype == table.dtype and isinstance(got, np.ndarray)


def _brute_force(table: np.ndarray, lengths: np.ndarray, page_size: int, q_lens: np.ndarray,
                 window: int | None) -> np.ndarray:
    """The contract's reading-order rule, position by position: a page moves only if every
    position it holds is seen by every query of its row and is no query's own position."""
    out = table.copy()
    for s, (n, t) in enumerate(zip(lengths.tolist(), q_lens.tolist(), strict=True)):
        queries = range(n - t, n)

        def seen_by_all(x: int, queries: range = queries) -> bool:
            return all(x <= p and (window is None or x >= p - window) for p in queries)

        movable = [j for j in range(table.shape[1])
                   if all(seen_by_all(x) and x not in queries and x < n
                          for x in range(j * page_size, (j + 1) * page_size))]
        out[s, movable] = np.sort(table[s, movable])
    return out


@pytest.mark.parametrize("window", [None, 0, 2, 5, 9, 10**12])
@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_the_band_matches_a_brute_force_listing_at_page_boundaries(q_len: int, page_size: int,
                                                                   window: int | None) -> None:
    # Lengths k * page_size and k * page_size +- 1 for every k: the query's own position on a
    # page's last row, its first row, and one before the last.
    lengths = np.array(sorted({max(0, k * page_size + e) for k in range(6) for e in (-1, 0, 1)}), np.int32)
    q_lens = np.minimum(lengths, q_len).astype(np.int32)
    per_seq = -(-int(lengths.max()) // page_size) + 1
    table = np.random.default_rng(page_size * 10 + q_len).permutation(len(lengths) * per_seq).reshape(
        len(lengths), per_seq).astype(np.int32)
    got = jaxattn.pages_in_address_order(table, lengths, page_size, q_lens=q_lens, sliding_window=window)
    np.testing.assert_array_equal(got, _brute_force(table, lengths, page_size, q_lens, window))
    jitted = jax.jit(lambda t, n, q: jaxattn.pages_in_address_order(t, n, page_size, q_lens=q, sliding_window=window))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(q_lens))),
                                  got)


def test_a_prefill_chunk_and_a_window_narrow_the_band() -> None:
    table = np.array([[7, 3, 9, 1, 5, 2]], np.int32)
    lengths = np.array([23])
    # 6 queries at positions 17..22: the first sees positions <= 17, so pages 0-3 are full.
    np.testing.assert_array_equal(jaxattn.pages_in_address_order(table, lengths, 4, q_lens=6),
                                  [[1, 3, 7, 9, 5, 2]])
    # A window of 12 keys: the last query (22) reaches back to 10, so pages 3.. only: page 3 alone.
    np.testing.assert_array_equal(
        jaxattn.pages_in_address_order(table, lengths, 4, q_lens=6, sliding_window=12), table)
    # One query (position 22) with a window of 14: positions 8..22, pages 2-4 (positions 8-19) move.
    np.testing.assert_array_equal(
        jaxattn.pages_in_address_order(table, lengths, 4, q_lens=1, sliding_window=(14, 0)), [[7, 3, 1, 5, 9, 2]])


@pytest.mark.parametrize("window", [None, 0, 3, 9, 40])
@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_attention_is_unchanged(page_size: int, window: int | None) -> None:
    rng = np.random.default_rng(page_size * 100 + (window or 0))
    kv_lens = [int(x) for x in rng.integers(0, 40, size=6)]
    q_lens = [min(n, int(x)) for n, x in zip(kv_lens, rng.integers(0, 6, size=6), strict=True)]
    call = _call(rng, page_size, kv_lens, q_lens)
    reordered = jaxattn.pages_in_address_order(call["page_table"], call["kv_lengths"], page_size,
                                               q_lens=np.diff(call["cu_q_lens"]), sliding_window=window)
    np.testing.assert_allclose(_oracle(call, reordered, window), _oracle(call, call["page_table"], window),
                               rtol=1e-12, atol=1e-12)
    # Each row keeps its pages (a permutation of the used entries); the rest is untouched.
    for s, n in enumerate(kv_lens):
        used = -(-n // page_size)
        assert sorted(reordered[s, :used]) == sorted(call["page_table"][s, :used])
        np.testing.assert_array_equal(reordered[s, used:], call["page_table"][s, used:])


def test_reordering_the_pages_around_the_queries_would_change_attention() -> None:
    """The property test above has teeth: sorting every used page (the query's own included) is wrong."""
    rng = np.random.default_rng(5)
    kv_lens, q_lens = [13, 22, 9], [3, 1, 2]
    call = _call(rng, 4, kv_lens, q_lens)
    wrong = call["page_table"].copy()
    for s, n in enumerate(kv_lens):
        wrong[s, : -(-n // 4)] = np.sort(wrong[s, : -(-n // 4)])
    assert not np.array_equal(wrong, call["page_table"])
    assert not np.allclose(_oracle(call, wrong, None), _oracle(call, call["page_table"], None))


def test_jax_arrays_give_the_same_table_under_jit() -> None:
    rng = np.random.default_rng(1)
    call = _call(rng, 4, [17, 30, 3, 12], [1, 1, 1, 1])
    want = jaxattn.pages_in_address_order(call["page_table"], call["kv_lengths"], 4, sliding_window=11)
    fn = jax.jit(lambda t, n: jaxattn.pages_in_address_order(t, n, 4, sliding_window=11))
    got = fn(jnp.asarray(call["page_table"]), jnp.asarray(call["kv_lengths"]))
    assert isinstance(got, jax.Array) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    assert not np.array_equal(want, call["page_table"])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_table": np.zeros((2, 3, 1), np.int32)}, "page_table"),
        ({"page_table": np.zeros((2, 3))}, "page_table"),
        ({"kv_lengths": np.zeros(3, np.int32)}, "kv_lengths"),
        ({"q_lens": np.ones(3, np.int32)}, "q_lens"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], argument: str) -> None:
    call = {"page_table": np.zeros((2, 3), np.int32), "kv_lengths": np.zeros(2, np.int32), "page_size": 4, **kwargs}
    with pytest.raises(InvalidInputError) as info:
        jaxattn.pages_in_address_order(call.pop("page_table"), call.pop("kv_lengths"), call.pop("page_size"), **call)
    assert info.value.argument == argument
