"""``jaxattn_mosaic.blocks.KeyBlocks`` (which key blocks a run of query rows sees; both Mosaic GPU
kernels loop over its counts) against brute force over every row and key, on a CPU: the kernels
themselves only run on a Hopper GPU, this arithmetic runs anywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn_mosaic.blocks import KeyBlocks


def _block_sight(kb: KeyBlocks, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(any, all)`` of shape ``(rows, blocks)``: whether the row sees some / every key of the
    block (keys past ``s_len`` are seen by none)."""
    blocks = -(-kb.s_len // kb.block) + 1
    key = np.arange(blocks * kb.block)[None, :]
    row = np.arange(rows)[:, None]
    sees = np.broadcast_to((key < kb.s_len) & ((row + kb.offset >= key) if kb.causal else True), (rows, key.size))
    sees = sees.reshape(rows, blocks, kb.block)
    return sees.any(-1), sees.all(-1)


@pytest.mark.parametrize(("t_len", "s_len", "block"), [(128, 128, 64), (333, 517, 64), (640, 384, 128),
                                                       (1, 77, 64), (517, 129, 64), (256, 1000, 192)])
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


def test_key_blocks_arithmetic_is_traceable() -> None:
    import jax

    kb = KeyBlocks(s_len=517, block=64, causal=True, offset=184)
    got = jax.jit(lambda r: (kb.seen_before(r), kb.whole_from(r)))(jnp.int32(100))
    assert np.asarray(got).tolist() == [int(kb.seen_before(jnp.int32(100))), int(kb.whole_from(jnp.int32(100)))]
