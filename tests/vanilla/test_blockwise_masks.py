"""blockwise with a mask_mod: the block mask decides which tiles run (a block mask that calls a
visible tile empty changes the result, so skipping is real), a BlockMask's blocks are the blocks,
and explain says how it runs. The conformance suite (test_blockwise.py) checks the numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import masks

MD = jaxattn.AttentionMetadata(block_q=4, block_k=4)


def _qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(keys[0], (1, 12, 2, 8)), jax.random.normal(keys[1], (1, 12, 2, 8)),
            jax.random.normal(keys[2], (1, 12, 2, 8)))


def test_tiles_the_block_mask_calls_empty_are_skipped() -> None:
    q, k, v = _qkv()
    mod = masks.causal()
    honest = masks.block_mask(mod, 1, 1, 12, 12, block_q=4, block_kv=4)
    want = jaxattn.attention(q, k, v, impl="vanilla", mask_mod=mod)
    got = jaxattn.attention(q, k, v, impl="blockwise", metadata=MD, mask_mod=mod, block_mask=honest)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # Tile (2, 0) is visible; a block mask that calls it empty drops it: only the skip can do that.
    kind = np.asarray(honest.kind).copy()
    assert kind[0, 0, 2, 0] == masks.FULL
    kind[0, 0, 2, 0] = masks.EMPTY
    lying = masks.BlockMask(jnp.asarray(kind), honest.shape, 4, 4)
    dropped = jaxattn.attention(q, k, v, impl="blockwise", metadata=MD, mask_mod=mod, block_mask=lying)
    np.testing.assert_allclose(dropped[:, :8], want[:, :8], atol=1e-5)  # query blocks 0 and 1 keep their tiles
    assert not np.allclose(dropped[:, 8:], want[:, 8:], atol=1e-3)
    want_rows = jaxattn.attention(q[:, 8:], k[:, 4:], v[:, 4:], impl="vanilla", mask_mod=lambda b, h, i, j: i + 4 >= j)
    np.testing.assert_allclose(dropped[:, 8:], want_rows, atol=1e-5)


def test_a_block_masks_blocks_are_the_blocks_and_explain_says_so() -> None:
    q, k, v = _qkv()
    mod = masks.chunked_causal(6)
    bm = masks.block_mask(mod, 1, 1, 12, 12, block_q=6, block_kv=6)  # metadata says 4x4
    got = jaxattn.attention(q, k, v, impl="blockwise", metadata=MD, mask_mod=mod, block_mask=bm)
    np.testing.assert_allclose(got, jaxattn.attention(q, k, v, impl="vanilla", mask_mod=mod), atol=1e-5)
    text = str(jaxattn.explain(q, k, v, impl="blockwise", metadata=MD, mask_mod=mod, block_mask=bm))
    assert "mask_mod tiles 6x6: 2 empty, 2 partial, 0 full" in text
    assert "evaluated per tile" in text
