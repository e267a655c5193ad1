"""A paged call's ``mask_mod`` as data the ragged kernel reads: packed visibility bits and key bounds.

A Triton kernel cannot run a traced JAX function, so ``mask_mod(seq, h, q_pos, kv_pos)`` (positions
within each sequence, docs/masks.md "Tree masks for speculative decoding") is evaluated in JAX, once
per call, at every query row of the ragged batch and every position of the page table's capacity,
by the core's ``jaxattn.masks.mask_bits`` (one word layout for every kernel: bit ``j % 32`` of word
``j // 32`` is key ``j``). This module adds what is paged: each row's sequence and position from
``cu_q_lens`` and ``kv_lengths`` (the mask_mod called with ``(n,1,1)``, ``(1,Hq,1)``, ``(n,1,1)``,
``(1,1,S)`` for a chunk of n rows, as the paged contract allows), ANDed with the rest of the row's
rule (causal, the length, the window), and per-token bounds. It returns:

* ``words (H, num_tokens, W)`` int32 (``W = ceil(capacity / 32)``; ``H`` is 1 when the mask_mod
  does not depend on ``h``, else Hq): ``num_tokens x capacity / 8`` bytes (times Hq), small for a
  speculative step;
* ``bounds (num_tokens, 4)`` int32 per query token, over all its heads, at word granularity:
  ``[lo, hi)`` holds every key some head sees, ``[full_lo, full_hi)`` is the first run of
  words every head sees in full (for a tree step: the cache before the drafts; with a window:
  the keys past its edge). The kernel narrows its key range to the union of its rows'
  ``[lo, hi)`` (tiles past it are never visited) and runs the intersection of their full runs
  as its hot loop, with no mask arithmetic; the tiles between read the bits.

Rows of no sequence (padding, past ``num_seqs``) see nothing. Memory is bounded: ``mask_bits``
evaluates steps of rows of about 2^24 booleans before packing them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["visibility_words"]

def visibility_words(
    mask_mod: Any, num_tokens: int, hq: int, kv_lengths: Array, cu_q_lens: Array, num_seqs: Array, capacity: int,
    window_left: int | None = None,
) -> tuple[Array, Array]:
    """``(words (H, num_tokens, W) int32, bounds (num_tokens, 4) int32)`` of a ragged paged call
    (see the module docstring); ``kv_lengths (max_seqs,)``, ``cu_q_lens (max_seqs + 1,)`` and
    ``num_seqs (1,)`` int32 as the kernel takes them."""
    from jaxattn import masks

    max_seqs = int(kv_lengths.shape[0])
    count = jnp.clip(num_seqs.reshape(-1)[0], 0, max_seqs)
    # Offsets past num_seqs are unread (zero-padded tails): flattened to the last real one.
    cu = jnp.where(jnp.arange(max_seqs + 1) <= count, cu_q_lens, cu_q_lens[count])
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused comparison, where the default search is a loop of small kernels on a GPU.
    seq = jnp.searchsorted(cu[1:], rows, side="right", method="compare_all")
    seq = jnp.clip(seq, 0, max_seqs - 1).astype(jnp.int32)
    valid = (rows < cu[count]) & (seq < count)
    length = jnp.clip(kv_lengths, 0, capacity)[seq]
    pos = length - (cu[seq + 1] - cu[seq]) + (rows - cu[seq])

    def on_rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # mask_bits' (1,1,1,1), (1,Hq,1,1), (1,1,n,1), (1,1,1,S): n rows of the batch, as the
        # paged contract calls a mask_mod, and the row's own rule; (1, H, n, S) back.
        r, kv = q_idx.reshape(-1), kv_idx.reshape(1, 1, -1)
        p = pos[r].reshape(-1, 1, 1)
        seen = jnp.asarray(mask_mod(seq[r].reshape(-1, 1, 1), h.reshape(1, -1, 1), p, kv), bool)
        seen = seen.reshape((1,) * (3 - seen.ndim) + seen.shape)
        rule = valid[r].reshape(-1, 1, 1) & (kv <= p) & (kv < length[r].reshape(-1, 1, 1))
        if window_left is not None:
            rule &= kv >= p - window_left
        heads = hq if seen.shape[1] == hq else 1
        both = jnp.broadcast_to(seen & rule, (r.shape[0], heads, kv.shape[-1]))
        return jnp.transpose(both, (1, 0, 2))[None]

    words = masks.mask_bits(on_rows, 1, hq, num_tokens, capacity)[0]
    return words, _bounds(words)


def _bounds(words: Array) -> Array:
    """``(num_tokens, 4)``: ``lo, hi, full_lo, full_hi`` in keys, at word granularity (module
    docstring). Plain min/max reductions over the words (no scan, no argmax): the first three read
    the words in one fused pass on a GPU, the run's end in a second, so that building them costs
    little beside the kernel."""
    width = words.shape[-1]
    some = jnp.any(words != 0, axis=0)  # (N, W): a key some head sees
    every = jnp.all(words == -1, axis=0)  # (N, W): all 32 keys seen by every head
    idx = jnp.arange(width, dtype=jnp.int32)[None]  # (1, W): rank promotion "raise" refuses (W,)
    lo = jnp.min(jnp.where(some, idx, width), axis=1)
    hi = jnp.max(jnp.where(some, idx + 1, 0), axis=1)
    full_lo = jnp.min(jnp.where(every, idx, width), axis=1)
    # The run ends at the first word past its start that is not full (or at the last word).
    full_hi = jnp.min(jnp.where(~every & (idx >= full_lo[:, None]), idx, width), axis=1)
    run = full_lo < width  # some word is full: [full_lo, full_hi) is non-empty
    lo, full_lo, full_hi = jnp.where(hi > 0, lo, 0), jnp.where(run, full_lo, 0), jnp.where(run, full_hi, 0)
    return jnp.stack([lo, hi, full_lo, full_hi], axis=1).astype(jnp.int32) * 32
