"""``jaxattn_mosaic.blocks.KeyBlocks`` (which key blocks a run of query rows sees; both Mosaic GPU
kernels loop over its counts) against brute force over every row and key, on a CPU: the kernels
themselves only run on a Hopper GPU, this arithmetic runs anywhere. And a model of the K/V ring's
barrier protocol (``release_unread``), run over random interleavings."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn_mosaic.blocks import KeyBlocks


def _block_sight(kb: KeyBlocks, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(any, all)`` of shape ``(rows, blocks)``: whether the row sees some / every key of the
    block (keys past ``s_len`` are seen by none), from jaxattn's definition of the mask."""
    blocks = -(-kb.s_len // kb.block) + 1
    key = np.arange(blocks * kb.block)[None, :]
    pos = np.arange(rows)[:, None] + kb.offset
    sees = key < kb.s_len
    if kb.causal:
        sees = sees & (key <= pos)
    if kb.right is not None:
        sees = sees & (key <= pos + kb.right)
    if kb.left is not None:
        sees = sees & (key >= pos - kb.left)
    sees = np.broadcast_to(sees, (rows, key.size)).reshape(rows, blocks, kb.block)
    return sees.any(-1), sees.all(-1)


SIGHTS = [(128, 128, 64), (333, 517, 64), (640, 384, 128), (1, 77, 64), (517, 129, 64), (256, 1000, 192)]


@pytest.mark.parametrize(("t_len", "s_len", "block"), SIGHTS)
@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_against_brute_force(t_len: int, s_len: int, block: int, causal: bool) -> None:
    kb = KeyBlocks(s_len=s_len, block=block, causal=causal, offset=s_len - t_len)
    assert kb.count == -(-s_len // block)
    t_pad = -(-t_len // 64) * 64 + 64
    some, every = _block_sight(kb, t_pad)
    full = s_len // block  # blocks wholly below s_len
    for end in range(1, t_pad + 1):
        # Blocks the kernel visits for a run of rows ending at ``end``: exactly up to the last
        # block holding a key one of them sees (a prefix: causal keys are a prefix of each row's).
        seen = np.flatnonzero(some[max(end - 64, 0):end].any(0))
        n = int(kb.seen_before(jnp.int32(end)))
        assert n == (seen[-1] + 1 if seen.size else 0), (end, n, seen)
    for start in range(t_pad):
        # Blocks before whole_from(start) need no mask: every row >= start sees all their keys;
        # and no longer such prefix exists.
        whole = int(kb.whole_from(jnp.int32(start)))
        unmasked = every[start:].all(0)
        assert unmasked[:whole].all(), (start, whole)
        assert whole == full or not unmasked[whole], (start, whole)


@pytest.mark.parametrize(("t_len", "s_len", "block"), SIGHTS)
@pytest.mark.parametrize(("left", "right", "causal"), [(0, 0, False), (5, None, False), (70, 3, False),
                                                       (200, 130, False), (None, 64, False), (64, None, True),
                                                       (1, 500, True), (127, 0, True)])
def test_a_windows_key_blocks_against_brute_force(t_len: int, s_len: int, block: int, left: int | None,
                                                  right: int | None, causal: bool) -> None:
    # A run of 64 rows visits blocks first_seen(row0) .. seen_before(row0 + 64) - 1: every block
    # holding a key one of them sees, starting at the first such block where it sees any; the
    # spans leave unmasked only blocks every row of the run sees whole. Host ints and traced
    # int32 agree.
    kb = KeyBlocks(s_len=s_len, block=block, causal=causal, offset=s_len - t_len, left=left, right=right)
    t_pad = -(-t_len // 64) * 64 + 64
    some, every = _block_sight(kb, t_pad)
    for row0 in range(0, t_pad - 63, 7):
        seen = np.flatnonzero(some[row0:row0 + 64].any(0))
        lo, n = kb.first_seen(row0), kb.seen_before(row0 + 64)
        assert (lo, n) == (int(kb.first_seen(jnp.int32(row0))), int(kb.seen_before(jnp.int32(row0 + 64))))
        if seen.size:
            assert (lo, n) == (seen[0], seen[-1] + 1), (row0, lo, n, seen)
        assert kb.first_seen(row0 - 64 if row0 >= 64 else 0) <= lo  # a CTA's band holds its consumers'
        start = jnp.minimum(jnp.int32(lo), n)
        spans = [(int(a), int(b), masked) for a, b, masked in kb.spans(jnp.int32(row0), 64, start, jnp.int32(n))]
        assert spans[0][0] == min(lo, n) and spans[-1][1] == n
        assert all(a <= b for a, b, _ in spans) and all(x[1] == y[0] for x, y in itertools.pairwise(spans))
        for a, b, masked in spans:
            assert masked or every[row0:row0 + 64, a:b].all(), (row0, spans)


@pytest.mark.parametrize(("t_len", "s_len", "block"), SIGHTS)
@pytest.mark.parametrize(("left", "right", "causal"), [(None, None, False), (None, None, True), (0, 0, False),
                                                       (70, 3, False), (None, 64, False), (64, None, True),
                                                       (1, 500, True), (300, None, False)])
def test_the_query_blocks_that_see_a_run_of_keys_against_brute_force(t_len: int, s_len: int, block: int,
                                                                      left: int | None, right: int | None,
                                                                      causal: bool) -> None:
    # The dK/dV kernel's view: a tile of 128 keys visits query blocks first .. end - 1 of 64
    # rows, exactly those holding a row that sees one of its keys (keys past S count as seen by
    # the rows that would see them: their gradients are dropped); unmasked spans only where
    # every row sees every key of the tile.
    kb = KeyBlocks(s_len=s_len, block=block, causal=causal, offset=s_len - t_len, left=left, right=right)
    n_q = -(-t_len // 64)
    keys = np.arange(-(-s_len // 128) * 128)[None, :]
    pos = np.arange(n_q * 64)[:, None] + kb.offset
    sees = np.ones((n_q * 64, keys.size), bool)
    if kb.ahead is not None:
        sees &= keys <= pos + kb.ahead
    if left is not None:
        sees &= keys >= pos - left
    for key0 in range(0, keys.size, 128):
        tile = sees[:, key0:key0 + 128].reshape(n_q, 64, 128)
        seen = np.flatnonzero(tile.any((1, 2)))
        first, end, spans = kb.row_spans(jnp.int32(key0), 128, 64, n_q)
        first, end = int(first), int(end)
        if seen.size:
            assert (first, end) == (seen[0], seen[-1] + 1), (key0, first, end, seen)
        else:
            assert first == end
        runs = [(int(a), int(b), masked) for a, b, masked in spans]
        assert runs[0][0] == first and runs[-1][1] == end
        assert all(a <= b for a, b, _ in runs) and all(x[1] == y[0] for x, y in itertools.pairwise(runs))
        for a, b, masked in runs:
            assert masked or tile[a:b].all(), (key0, runs)


def test_key_blocks_arithmetic_is_traceable() -> None:
    import jax

    kb = KeyBlocks(s_len=517, block=64, causal=True, offset=184)
    got = jax.jit(lambda r: (kb.seen_before(r), kb.whole_from(r)))(jnp.int32(100))
    assert np.asarray(got).tolist() == [int(kb.seen_before(jnp.int32(100))), int(kb.whole_from(jnp.int32(100)))]


# The ring's barrier protocol, as a model: a producer fills ``stages`` slots with key blocks; two
# consumers read blocks 0 .. n_c - 1 and release the rest (``release_unread``), tile after tile
# (a persistent kernel's; the ring's count runs on across tiles). Each slot's "free" barrier
# completes a phase on two arrivals (an mbarrier), or, as a hardware named barrier
# (``NamedBarriers``), on three: the producer's wait counts too. "ready" completes on the
# producer's load, and a consumer waits on it as on an mbarrier: for the phase after the one its
# own last wait saw (a parity bit), so a skipped wait leaves it a phase behind. Every
# interleaving of these steps must leave a block in its slot for as long as a consumer reads it.


def _ring_run(tiles: list[tuple[int, int]], stages: int, wait_before_release: bool, rng: np.random.Generator,
              named: bool = False) -> str:
    """One random interleaving; returns "" or what went wrong."""
    content = [-1] * stages
    ready = [0] * stages  # completed phases
    free_done, free_count = [0] * stages, [0] * stages
    arrivals = 3 if named else 2

    def arrive_free(slot: int) -> None:
        free_count[slot] += 1
        if free_count[slot] == arrivals:
            free_count[slot], free_done[slot] = 0, free_done[slot] + 1

    def producer() -> Iterator[None]:
        g = 0
        for tile in tiles:
            for _ in range(max(tile)):
                slot = g % stages
                if named and g >= stages:
                    arrive_free(slot)  # bar.sync: the producer's own arrival, then its wait
                while free_done[slot] < g // stages:  # the slot's previous block released by both
                    yield
                content[slot] = g
                ready[slot] += 1
                g += 1
                yield

    def consumer(c: int) -> Iterator[None]:
        g, parity = 0, [0] * stages
        for tile in tiles:
            n = tile[c]
            for j in range(max(tile)):
                slot = g % stages
                if j < n or wait_before_release:
                    while ready[slot] % 2 == parity[slot]:  # the phase after the last one seen
                        yield
                    parity[slot] ^= 1
                if j < n:
                    for _ in range(3):  # a read spans several steps
                        if content[slot] != g:
                            return  # the failure is reported by the caller through ``seen``
                        seen[0] += 1
                        yield
                arrive_free(slot)
                g += 1
                yield

    seen = [0]
    procs = [producer(), consumer(0), consumer(1)]
    alive = list(range(3))
    for _ in range(100_000):
        if not alive:
            break
        p = alive[int(rng.integers(len(alive)))]
        try:
            next(procs[p])
        except StopIteration:
            alive.remove(p)
    else:
        return "deadlock"
    return "" if seen[0] == 3 * sum(map(sum, tiles)) else "a block was overwritten while being read"


@pytest.mark.parametrize("named", [False, True], ids=["mbarriers", "named-barriers"])
@pytest.mark.parametrize("n_blocks", [(3, 4), (0, 6), (5, 7), (6, 6)])
def test_releasing_unread_blocks_waits_for_them(n_blocks: tuple[int, int], named: bool) -> None:
    rng = np.random.default_rng(0)
    assert all(_ring_run([n_blocks], 2, True, rng, named) == "" for _ in range(300))
    if n_blocks[0] < n_blocks[1]:
        # Releasing without the wait (the race fixed in both kernels) goes wrong in some
        # interleavings: the model can tell the two apart.
        assert any(_ring_run([n_blocks], 2, False, rng, named) for _ in range(300))


@pytest.mark.parametrize("named", [False, True], ids=["mbarriers", "named-barriers"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_persistent_ring_runs_on_across_tiles(stages: int, named: bool) -> None:
    # Causal tiles of a persistent CTA: the consumers see different counts in some, none in one.
    tiles = [(3, 4), (0, 2), (5, 5), (1, 3), (2, 2)]
    rng = np.random.default_rng(2)
    assert all(_ring_run(tiles, stages, True, rng, named) == "" for _ in range(200))
    # Without the waits on released blocks a consumer's phase bits fall behind, and a later
    # tile reads a slot before its block lands: the persistent kernel always waits.
    assert any(_ring_run(tiles, stages, False, rng, named) for _ in range(200))


# The forward's ping-pong by turns (``Config.pass_turns``), as a model: consumer w issues block
# j's Q K^T, passes the turn (arrives on the other's turn barrier), and waits for its own turn
# before block j's P V; consumer 1 first waits for a turn, consumer 0 passes one more at the
# end, and a consumer with fewer blocks drains (pass, then take) through the other's. Over a
# persistent CTA's tiles the turns run on: the first take and the last pass are the CTA's, not
# each tile's. A turn barrier is an mbarrier of one arrival, its waiter holding a parity bit,
# or a named barrier whose phase counts its waiter's arrival too.


Issues = list[tuple[str, int, int, int]]


def _turns_run(tiles: list[tuple[int, int]], named: bool, rng: np.random.Generator,
               per_tile: bool = False) -> tuple[str, Issues]:
    """One random interleaving: ``("", issues)`` or what went wrong; ``issues``: (gemm, consumer,
    tile, block). ``per_tile``: the first take and the last pass at every tile (the bug)."""
    done, count = [0, 0], [0, 0]  # completed phases, arrivals in the open phase
    parity = [0, 0]  # mbarriers: the phase bit each waiter expects to flip next
    issues: Issues = []

    def arrive(bar: int) -> None:
        count[bar] += 1
        if count[bar] == (2 if named else 1):
            count[bar], done[bar] = 0, done[bar] + 1

    def take(w: int) -> Iterator[None]:
        if named:
            joined = done[w]
            arrive(w)
            while done[w] <= joined:
                yield
        else:
            while done[w] % 2 == parity[w]:
                yield
            parity[w] ^= 1

    def consumer(w: int) -> Iterator[None]:
        for i, tile in enumerate(tiles):
            if w == 1 and (i == 0 or per_tile):
                yield from take(1)
            for j in range(max(tile)):
                if j < tile[w]:
                    issues.append(("qk", w, i, j))
                yield
                arrive(1 - w)  # pass
                yield
                yield from take(w)
                if j < tile[w]:
                    issues.append(("pv", w, i, j))
                yield
            if w == 0 and (i == len(tiles) - 1 or per_tile):
                arrive(1)
            for _ in range(int(rng.integers(4))):  # the epilogue and the next tile's Q
                yield

    procs = [consumer(0), consumer(1)]
    alive = [0, 1]
    for _ in range(100_000):
        if not alive:
            return "", issues
        p = alive[int(rng.integers(len(alive)))]
        try:
            next(procs[p])
        except StopIteration:
            alive.remove(p)
    return "deadlock", issues


def _check_turns(tiles: list[tuple[int, int]], issues: Issues) -> None:
    at = {e: i for i, e in enumerate(issues)}
    assert len(at) == 2 * sum(map(sum, tiles))
    for i, (n0, n1) in enumerate(tiles):
        for j in range(min(n0, n1)):
            # Consumer 0's P V waits for consumer 1's Q K^T of the same block, which follows
            # consumer 0's...
            assert at[("qk", 0, i, j)] < at[("qk", 1, i, j)] < at[("pv", 0, i, j)]
        for j in range(n1):
            # ... and consumer 1's P V for consumer 0's next Q K^T: one's softmax under the
            # other's GEMMs.
            if j + 1 < n0:
                assert at[("qk", 0, i, j + 1)] < at[("pv", 1, i, j)]


@pytest.mark.parametrize("named", [False, True], ids=["mbarriers", "named-barriers"])
@pytest.mark.parametrize("n_blocks", [(4, 4), (3, 5), (0, 3), (0, 0), (1, 1)])
def test_turns_keep_the_ping_pong_order(n_blocks: tuple[int, int], named: bool) -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        why, issues = _turns_run([n_blocks], named, rng)
        assert why == ""
        _check_turns([n_blocks], issues)


@pytest.mark.parametrize("named", [False, True], ids=["mbarriers", "named-barriers"])
def test_turns_run_on_across_a_persistent_ctas_tiles(named: bool) -> None:
    tiles = [(4, 4), (3, 5), (0, 2), (1, 1), (2, 3)]
    rng = np.random.default_rng(3)
    for _ in range(200):
        why, issues = _turns_run(tiles, named, rng)
        assert why == ""
        _check_turns(tiles, issues)
    # A first take and a last pass at every tile (what hung on the GPU): consumer 0 can pass
    # twice before consumer 1 takes, and some interleaving deadlocks.
    assert any(_turns_run(tiles, named, rng, per_tile=True)[0] for _ in range(200))
