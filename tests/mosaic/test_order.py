"""The persistent kernel's work, on a CPU: its tile order (``Config.q_group``: each tile
once, chunks of query tiles in turn, and every (batch, head) of a chunk before the next chunk),
the last round's split (``Config.split_tail``: how many pieces, and the merge of a tile's
pieces against the float64 oracle over all keys), and the schedule of a causal launch's tiles
(``Config.scheduled``: each tile once, the CTAs' work within 0.5% where the snake leaves 3%)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.testing import oracle
from jaxattn_mosaic.blocks import KeyBlocks
from jaxattn_mosaic.kernel import launch_order, merge_pieces, persistent_order, schedule_tiles, tail_split


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("batch", "heads", "n_q", "chunk"), [(1, 4, 8, 8), (2, 3, 6, 2), (3, 2, 5, 1), (2, 2, 4, 4)])
def test_the_order_visits_each_tile_once_chunk_by_chunk(batch: int, heads: int, n_q: int, chunk: int,
                                                         jit: bool) -> None:
    def order(t: jax.Array) -> tuple[jax.Array, ...]:
        return persistent_order(t, batch=batch, heads=heads, chunk=chunk)

    t = np.arange(batch * heads * n_q, dtype=np.int32)
    b, h, q = (np.asarray(x) for x in (jax.jit(order) if jit else order)(t))
    assert sorted(zip(b.tolist(), h.tolist(), q.tolist(), strict=True)) == [
        (i, j, k) for i in range(batch) for j in range(heads) for k in range(n_q)]
    # Chunk by chunk (query tiles 0..chunk-1 of every (batch, head) first), a (batch, head)'s
    # tiles of a chunk side by side, heads fastest within a batch.
    assert np.array_equal(q // chunk, t // (chunk * batch * heads))
    assert np.array_equal(q % chunk, t % chunk)
    assert np.array_equal(b * heads + h, (t // chunk) % (batch * heads))


@pytest.mark.parametrize("jit", [False, True])
def test_the_launch_order_runs_the_batch_fastest_then_a_heads_query_tiles(jit: bool) -> None:
    # A non-persistent launch's grid (heads, query tiles, batch), last axis fastest, as the
    # 1-D grid of a launch that cuts its last wave takes it.
    batch, heads, n_q = 3, 4, 5

    def order(t: jax.Array) -> tuple[jax.Array, ...]:
        return launch_order(t, batch=batch, heads=heads, n_q=n_q)

    t = np.arange(batch * heads * n_q, dtype=np.int32)
    b, h, q = (np.asarray(x) for x in (jax.jit(order) if jit else order)(t))
    want = [(bi, hi, qi) for hi in range(heads) for qi in range(n_q) for bi in range(batch)]
    assert list(zip(b.tolist(), h.tolist(), q.tolist(), strict=True)) == want


def _causal_costs(seq: int, rows: int = 128, block: int = 128) -> tuple[int, ...]:
    """Key blocks of a causal launch's query tiles (T = S = ``seq``), heaviest first."""
    n_q = seq // rows
    blocks = KeyBlocks(s_len=seq, block=block, causal=True, offset=0)
    return tuple(blocks.seen_before((n_q - i) * rows) for i in range(n_q))


def _snake_work(costs: tuple[int, ...], pairs: int, n_ctas: int) -> np.ndarray:
    """Each CTA's work (blocks, plus one a tile) under the snake of a head's tiles together."""
    n_q = len(costs)
    work = np.zeros(n_ctas)
    for t in range(pairs * n_q):
        r, c = divmod(t, n_ctas)
        work[c if r % 2 == 0 else n_ctas - 1 - c] += costs[t % n_q] + 1
    return work


@pytest.mark.parametrize(("batch", "heads", "seq", "n_ctas"), [
    (4, 32, 4096, 132), (2, 16, 8192, 132), (1, 32, 8192, 132), (4, 8, 4096, 132), (2, 3, 1000 // 128 * 128, 5),
    (1, 2, 512, 7), (1, 1, 256, 2)])
def test_the_schedule_runs_each_tile_once_and_evens_the_ctas_work(batch: int, heads: int, seq: int,
                                                                    n_ctas: int) -> None:
    costs = _causal_costs(seq)
    n_q, pairs = len(costs), batch * heads
    schedule = schedule_tiles(costs, pairs=pairs, n_ctas=n_ctas)
    counts = schedule[:, 0]
    assert schedule.dtype == np.int32 and schedule.shape == (n_ctas, 1 + counts.max())
    tiles = [t for c in range(n_ctas) for t in schedule[c, 1 : 1 + counts[c]].tolist()]
    assert sorted(tiles) == list(range(pairs * n_q))
    assert not schedule[:, 1:][np.arange(schedule.shape[1] - 1)[None, :] >= counts[:, None]].any()  # zeros past a count
    work = np.array([sum(costs[t % n_q] + 1 for t in schedule[c, 1 : 1 + counts[c]]) for c in range(n_ctas)])
    assert work.sum() == sum(costs) * pairs + pairs * n_q
    if n_ctas == 132:  # the shapes the schedule is for: 4k-8k keys, 128-row tiles on an H100's SMs
        snake = _snake_work(costs, pairs, n_ctas)
        assert snake.max() / snake.mean() > 1.03  # what the schedule is for
        assert work.max() / work.mean() < 1.005


def test_the_schedule_keeps_list_schedulings_bound_at_any_shape() -> None:
    # Handing each tile to the least loaded CTA leaves no CTA more than one tile over the
    # mean: the busiest's last tile started when it was the least loaded (Graham's bound).
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch, heads, n_ctas = (int(x) for x in rng.integers(1, [4, 9, 140]))
        seq, rows = int(rng.integers(1, 40)) * 64, int(rng.choice([64, 128]))
        n_q = -(-seq // rows)
        blocks = KeyBlocks(s_len=seq, block=int(rng.choice([64, 128, 256])), causal=True,
                           offset=int(rng.integers(-seq // 2, seq // 2)))
        costs = tuple(blocks.seen_before((n_q - i) * rows) for i in range(n_q))
        n_ctas = min(n_ctas, batch * heads * n_q)
        schedule = schedule_tiles(costs, pairs=batch * heads, n_ctas=n_ctas)
        counts = schedule[:, 0]
        assert (counts >= 1).all() and counts.sum() == batch * heads * n_q
        work = [sum(costs[t % n_q] + 1 for t in schedule[c, 1 : 1 + counts[c]]) for c in range(n_ctas)]
        assert max(work) <= sum(work) / n_ctas + max(costs) + 1


def test_the_schedule_runs_a_ctas_tiles_heaviest_first_a_few_heads_at_a_time() -> None:
    costs = _causal_costs(4096)  # 32 query tiles: groups of round(132 / 32) = 4 heads
    n_q = len(costs)
    schedule = schedule_tiles(costs, pairs=128, n_ctas=132)
    for c in range(132):
        mine = schedule[c, 1 : 1 + schedule[c, 0]]
        groups = mine // n_q // 4
        assert np.all(np.diff(groups) >= 0)  # group by group
        within = mine % n_q
        assert np.all(np.diff(within)[np.diff(groups) == 0] > 0)  # heaviest first within one
    # The tiles every CTA starts with: the first group's 128, then the next group's heaviest 4,
    # so the CTAs at work at once read 8 heads' K/V, not 132.
    first = schedule[:, 1]
    assert sorted(set((first // n_q).tolist())) == list(range(8))


@pytest.mark.parametrize(("n_tiles", "n_ctas", "n_blocks", "pieces"), [
    (4096, 132, 32, 16),  # B4 S4k MHA, D = 128: 4 tiles left for a 32nd round, 2 blocks a piece
    (4096, 132, 16, 8),  # the same at D = 64 (256-key blocks)
    (2048, 132, 64, 5),  # B2 S8k: 68 tiles left, 340 pieces of 13 blocks in 3 rounds
    (2048, 132, 16, 3),  # B4 S2k: 68 left, 204 pieces of 6 blocks in 2 rounds
    (1024, 132, 8, 1),  # B8 S1k: 100 left of 8 blocks; pieces would not pay for themselves
    (32, 132, 64, 4),  # fewer tiles than CTAs: each cut 4 ways
    (12, 5, 5, 2),  # pieces of 3 and 2 blocks
    (1, 132, 9, 3),  # 4 pieces of 3 blocks would leave one empty: 3
    (264, 132, 32, 1),  # whole rounds: nothing to cut
    (1, 132, 1, 1),  # one key block: nothing to cut
])
def test_the_tail_split_fills_the_idle_ctas_with_pieces_of_at_least_two_blocks(
        n_tiles: int, n_ctas: int, n_blocks: int, pieces: int) -> None:
    assert tail_split(n_tiles, n_ctas, n_blocks) == pieces


def test_the_tail_split_leaves_no_piece_empty_and_pays_for_itself() -> None:
    for n_tiles in range(1, 40):
        for n_ctas in range(1, 20):
            for n_blocks in range(1, 24):
                pieces = tail_split(n_tiles, n_ctas, n_blocks)
                per = -(-n_blocks // pieces)
                assert (pieces - 1) * per < n_blocks  # the last piece has a block
                if pieces > 1:  # the rounds of pieces, a block more each, beat one whole tile
                    rounds = -(-(n_tiles % n_ctas) * pieces // n_ctas)
                    assert per >= 2 and rounds * (per + 1) <= n_blocks


@pytest.mark.parametrize("jit", [False, True])
def test_merged_pieces_are_the_attention_over_all_keys(jit: bool) -> None:
    # 2 batches x 3 heads x 4 query tiles of 8 rows over 40 keys; the order's last 5 tiles
    # come in 3 pieces of the keys (16, 16 and 8), each an attention of its own (the float64
    # oracle's, as the kernel would write it: float32, log2). Their rows start as NaN.
    batch, heads, n_q, rows, d, s_len, n_whole, pieces = 2, 3, 4, 8, 16, 40, 19, 3
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(batch, n, heads, d)) for n in (n_q * rows, s_len, s_len))
    ref = oracle.attention(q, k, v)
    b, h, qi = (np.asarray(x) for x in persistent_order(
        np.arange(n_whole, batch * heads * n_q, dtype=np.int32), batch=batch, heads=heads, chunk=n_q))
    out = np.asarray(ref.output, np.float32).copy()
    lse = (np.asarray(ref.lse) / np.log(2)).astype(np.float32)
    part_out, part_lse = [], []
    for bi, hi, ti in zip(b, h, qi, strict=True):
        sl = slice(ti * rows, (ti + 1) * rows)
        out[bi, sl, hi] = np.nan
        lse[bi, hi, sl] = np.nan
        for lo, end in ((0, 16), (16, 32), (32, 40)):
            part = oracle.attention(q[bi:bi + 1, sl], k[bi:bi + 1, lo:end], v[bi:bi + 1, lo:end])
            part_out.append(np.asarray(part.output)[0, :, hi])
            part_lse.append(np.asarray(part.lse)[0, hi] / np.log(2))

    def merge(*args: jax.Array) -> tuple[jax.Array, jax.Array]:
        return merge_pieces(*args, tiles=(b, h, qi), pieces=pieces)

    got_out, got_lse = (jax.jit(merge) if jit else merge)(
        *(jnp.asarray(x, jnp.float32) for x in (out, lse, part_out, part_lse)))
    np.testing.assert_allclose(np.asarray(got_out), ref.output, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lse) * np.log(2), ref.lse, rtol=0, atol=1e-5)
