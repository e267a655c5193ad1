"""The persistent kernel's tile order (``Config.q_group``), on a CPU: each tile once, chunks of
query tiles in turn, and every (batch, head) of a chunk before the next chunk."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxattn_mosaic.kernel import persistent_order


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
