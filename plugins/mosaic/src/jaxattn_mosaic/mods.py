"""A mask_mod as the Mosaic GPU kernels read it: packed bits and per-tile lists, built in plain JAX.

A Mosaic GPU kernel cannot run a traced JAX function that closes over arrays (document ids,
prefix lengths), so the call's mask_mod is evaluated once in JAX into its packed visibility
(``jaxattn.masks.mask_bits``, 32 keys a word) with the call's causal rule and window ANDed in.
Each kernel then walks, per tile, the list of the other side's blocks that hold a visible pair
(``tile_lists``: partial ones first, then full ones), so empty tiles are never loaded; full
tiles run without mask arithmetic and partial ones expand the bits in registers
(``blocks.bits_keep``), the words of a tile's rows copied beside its K and V block
(``row_blocks``).

Imports no Mosaic GPU: it is testable on any host (tests/mosaic/test_mods.py).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["WORD", "call_bits", "row_blocks", "tile_lists", "unread_zeroed"]

#: Keys per word of the packed bits.
WORD = 32


def call_bits(mask_mod: Any, block_mask: Any, *, batch: int, heads: int, t_len: int, s_len: int, causal: bool,
              window: tuple[int | None, int | None]) -> Any:
    """The visibility the kernels apply, int32 ``(B|1, Hq|1, T, ceil(S / 32))``
    (``jaxattn.masks.call_bits``): ``mask_mod`` ANDed with the bottom-right causal rule and the
    window's sides that cut (``window``, None: unbounded)."""
    from jaxattn import masks

    left, right = window
    ahead = [r for r in (0 if causal else None, right) if r is not None]
    return masks.call_bits(mask_mod, block_mask, batch, heads, t_len, s_len,
                           window=(left, min(ahead) if ahead else None))


def tile_lists(bits: Any, s_len: int, *, rows: int, keys: int, by_keys: bool = False) -> Any:
    """The tiles a kernel visits (``jaxattn.masks.tile_lists``), int32 ``(B|1, Hq|1, n, 2 + m)``
    for tiles of ``rows`` query rows and ``keys`` keys."""
    from jaxattn import masks

    return masks.tile_lists(bits, s_len, block_q=rows, block_kv=keys, by_keys=by_keys)


def row_blocks(bits: Any, *, rows: int, t_pad: int, words: int) -> Any:
    """``bits`` ``(B|1, Hq|1, T, W)`` as ``(B|1, Hq|1, t_pad / rows, words, rows)``: block ``r``'s
    word ``w`` of its ``rows`` rows side by side, what a kernel copies beside a K/V block and
    loads as a vector per word. Zeros past T and past the words (padding sees nothing)."""
    lead0, lead1, t_len, w = (int(n) for n in bits.shape)
    padded = jnp.pad(bits, ((0, 0), (0, 0), (0, t_pad - t_len), (0, words - w)))
    return jnp.swapaxes(padded.reshape(lead0, lead1, t_pad // rows, rows, words), 3, 4)


def unread_zeroed(k: Any, v: Any, bits: Any, mask_mod: Any = None) -> tuple[Any, Any]:
    """``k`` and ``v`` ``(B, S, Hkv, D)`` with zeros at the keys no query of their sequence and KV
    head sees: a kernel loads whole blocks, and a partial one's P V would multiply an unseen V
    row (the contract lets it hold NaN) by 0; its gradients there are 0. Unchanged, with no pass
    over them, where ``bits`` are ``mask_mod``'s (with the causal rule and a window, which keep the
    diagonal) and it keeps the diagonal of a square call (``masks.sees_diagonal``): every key is
    then seen."""
    from jaxattn import masks
    from jaxattn.backend import zero_unseen_keys

    if int(bits.shape[2]) == int(k.shape[1]) and masks.sees_diagonal(mask_mod):
        return k, v

    words = masks.seen_words(bits, int(k.shape[2]))  # (B|1, Hkv|1, W)
    shifts = jnp.arange(WORD, dtype=jnp.int32).reshape(1, 1, 1, WORD)
    seen = lax.shift_right_logical(words[..., None], shifts) & 1
    seen = seen.reshape(*words.shape[:2], 1, -1)[..., : int(k.shape[1])] != 0  # (B|1, Hkv|1, 1, S)
    return zero_unseen_keys(seen, k, v)
