"""A paged call's ``mask_mod`` as data the ragged kernel reads: packed visibility bits and key bounds.

A Triton kernel cannot run a traced JAX function, so ``mask_mod(seq, h, q_pos, kv_pos)`` (positions
within each sequence, docs/masks.md "Tree masks for speculative decoding") is evaluated here, in
JAX, once per call, at every query row of the ragged batch and every position of the page table's
capacity, exactly as the paged reference calls it (one row at a time: ``(1,1,1)``, ``(1,Hq,1)``,
``(1,1,1)``, ``(1,1,S)``; here vectorised over rows). Its result, ANDed with the rest of the row's
rule (causal, the length, the window), becomes:

* ``words (num_tokens, H, W)`` int32: bit ``j % 32`` of word ``j // 32`` is whether the row sees
  key ``j`` (``W = ceil(capacity / 32)``; ``H`` is 1 when the mask_mod does not depend on ``h``,
  else Hq): ``num_tokens x capacity / 8`` bytes (times Hq), small for a speculative step;
* ``bounds (num_tokens, 4)`` int32 per query token, over all its heads, at word granularity:
  ``[lo, hi)`` holds every key some head sees, ``[full_lo, full_hi)`` is the longest run of
  words every head sees in full. The kernel narrows its key range to the union of its rows'
  ``[lo, hi)`` (tiles past it are never visited) and runs the intersection of their full runs
  as its hot loop, with no mask arithmetic; the tiles between read the bits.

Rows of no sequence (padding, past ``num_seqs``) see nothing. Memory is bounded: rows are
evaluated in chunks of at most ``_CHUNK_ELEMENTS`` booleans before packing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["WORD", "mask_heads", "visibility_words"]

#: Keys per packed word.
WORD = 32
#: Booleans evaluated at once (rows x heads x keys) before they are packed into words.
_CHUNK_ELEMENTS = 1 << 24


def mask_heads(mask_mod: Any, hq: int, capacity: int) -> int:
    """1 when ``mask_mod``'s result does not vary with ``h`` (its head axis broadcasts), else ``hq``."""
    i = jax.ShapeDtypeStruct((1, 1, 1), jnp.int32)
    out = jax.eval_shape(mask_mod, i, jax.ShapeDtypeStruct((1, hq, 1), jnp.int32), i,
                         jax.ShapeDtypeStruct((1, 1, capacity), jnp.int32))
    shape = tuple(getattr(out, "shape", ()))
    return hq if len(shape) >= 2 and shape[-2] == hq and hq > 1 else 1


def visibility_words(
    mask_mod: Any, num_tokens: int, hq: int, kv_lengths: Array, cu_q_lens: Array, num_seqs: Array, capacity: int,
    window_left: int | None = None,
) -> tuple[Array, Array]:
    """``(words (num_tokens, H, W) int32, bounds (num_tokens, 4) int32)`` of a ragged paged call
    (see the module docstring); ``kv_lengths (max_seqs,)``, ``cu_q_lens (max_seqs + 1,)`` and
    ``num_seqs (1,)`` int32 as the kernel takes them."""
    heads = mask_heads(mask_mod, hq, capacity)
    max_seqs = int(kv_lengths.shape[0])
    width = -(-capacity // WORD)
    count = jnp.clip(num_seqs.reshape(-1)[0], 0, max_seqs)
    # Offsets past num_seqs are unread (zero-padded tails): flattened to the last real one.
    cu = jnp.where(jnp.arange(max_seqs + 1) <= count, cu_q_lens, cu_q_lens[count])
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    valid = (rows < cu[count]) & (seq < count)
    lengths = jnp.clip(kv_lengths, 0, capacity)
    length = lengths[seq]
    pos = length - (cu[seq + 1] - cu[seq]) + (rows - cu[seq])
    j = jnp.arange(width * WORD, dtype=jnp.int32)
    h = jnp.arange(hq, dtype=jnp.int32).reshape(1, hq, 1)
    kv = jnp.arange(capacity, dtype=jnp.int32).reshape(1, 1, capacity)
    shifts = jnp.arange(WORD, dtype=jnp.uint32)

    def one(row: tuple[Array, Array, Array, Array]) -> Array:
        sr, pr, lr, vr = row
        seen = jnp.asarray(mask_mod(sr.reshape(1, 1, 1), h, pr.reshape(1, 1, 1), kv), bool)
        seen = jnp.broadcast_to(seen, (1, hq, capacity))[0, :heads]  # (H, capacity)
        seen = jnp.pad(seen, ((0, 0), (0, width * WORD - capacity)))
        rule = vr & (j <= pr) & (j < lr)
        if window_left is not None:
            rule &= j >= pr - window_left
        bits = (seen & rule[None, :]).reshape(heads, width, WORD).astype(jnp.uint32) << shifts
        return jax.lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # (H, W)

    chunk = max(1, _CHUNK_ELEMENTS // (heads * width * WORD))
    xs = (seq, pos, length, valid)
    words = jax.vmap(one)(xs) if chunk >= num_tokens else jax.lax.map(one, xs, batch_size=chunk)
    return words, _bounds(words)


def _bounds(words: Array) -> Array:
    """``(num_tokens, 4)``: ``lo, hi, full_lo, full_hi`` in keys, at word granularity (module docstring)."""
    width = words.shape[-1]
    some = jnp.any(words != 0, axis=1)  # (N, W): a key some head sees
    every = jnp.all(words == -1, axis=1)  # (N, W): all 32 keys seen by every head
    idx = jnp.arange(width, dtype=jnp.int32)
    seen = jnp.any(some, axis=1)
    lo = jnp.where(seen, jnp.argmax(some, axis=1), 0).astype(jnp.int32)
    hi = jnp.where(seen, width - jnp.argmax(some[:, ::-1], axis=1), 0).astype(jnp.int32)
    # The run of full words ending at each word, and the longest one.
    run = idx - jax.lax.cummax(jnp.where(every, -1, idx), axis=1)
    end = jnp.argmax(run, axis=1).astype(jnp.int32)
    longest = jnp.take_along_axis(run, end[:, None], axis=1)[:, 0]
    full_lo = jnp.where(longest > 0, end - longest + 1, 0)
    full_hi = jnp.where(longest > 0, end + 1, 0)
    return jnp.stack([lo, hi, full_lo, full_hi], axis=1).astype(jnp.int32) * WORD
