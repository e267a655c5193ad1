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

__all__ = ["WORD", "call_bits", "row_blocks", "rows_seen", "tile_lists", "unread_zeroed"]

#: Keys per word of the packed bits.
WORD = 32


def call_bits(mask_mod: Any, block_mask: Any, *, batch: int, heads: int, t_len: int, s_len: int, causal: bool,
              window: tuple[int | None, int | None]) -> Any:
    """The visibility the kernels apply, int32 ``(B|1, Hq|1, T, ceil(S / 32))``: ``mask_mod``
    ANDed with the bottom-right causal rule and the window's sides that cut (``window``, None:
    unbounded). A ``block_mask`` built with ``bits=True`` gives the mask_mod's own bits (it is not
    evaluated again)."""
    from jaxattn import masks

    diag = s_len - t_len
    left, right = window
    ahead = [r for r in (0 if causal else None, right) if r is not None]
    rules: list[Any] = []
    if ahead:
        rules.append(lambda b, h, qi, kv: kv <= qi + (diag + min(ahead)))
    if left is not None:
        rules.append(lambda b, h, qi, kv: kv >= qi + (diag - left))
    given = None if block_mask is None else block_mask.bits
    if given is not None and not rules:
        return jnp.asarray(given)
    rule = masks.and_(*rules) if given is not None else masks.and_(mask_mod, *rules)
    words = masks.mask_bits(rule, batch, heads, t_len, s_len)
    return jnp.asarray(words if given is None else given & words)


def tile_lists(bits: Any, s_len: int, *, rows: int, keys: int, by_keys: bool = False) -> Any:
    """The tiles a kernel visits, int32 ``(B|1, Hq|1, n, 2 + m)``: per tile of ``rows`` query rows
    (``by_keys``: of ``keys`` keys) the number of partial and of full blocks of the other side,
    then their indices, partial ones first, each run ascending (the rest zeros). A block past
    ``S`` is partial at most: a full block is read without masking."""
    from jaxattn import masks

    t_len = int(bits.shape[2])
    kind = masks.from_bits(bits, s_len, block_q=rows, block_kv=keys).kind
    # Tiles are the kernels' own, not capped at T or S as a BlockMask's are.
    nq, nk = -(-t_len // rows), -(-s_len // keys)
    kind = jnp.pad(kind, ((0, 0), (0, 0), (0, nq - kind.shape[2]), (0, nk - kind.shape[3])))
    tail = (jnp.arange(nk) == nk - 1).reshape(1, 1, 1, nk) & (s_len % keys != 0)  # rank 4: no promotion
    kind = jnp.where(tail & (kind == masks.FULL), masks.PARTIAL, kind)
    if by_keys:
        kind = jnp.swapaxes(kind, 2, 3)
    rank = jnp.where(kind == masks.PARTIAL, 0, jnp.where(kind == masks.FULL, 1, 2))
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack([jnp.sum(kind == masks.PARTIAL, -1), jnp.sum(kind == masks.FULL, -1)], -1)
    return jnp.concatenate([counts.astype(jnp.int32), order], -1)


def row_blocks(bits: Any, *, rows: int, t_pad: int, words: int) -> Any:
    """``bits`` ``(B|1, Hq|1, T, W)`` as ``(B|1, Hq|1, t_pad / rows, words, rows)``: block ``r``'s
    word ``w`` of its ``rows`` rows side by side, what a kernel copies beside a K/V block and
    loads as a vector per word. Zeros past T and past the words (padding sees nothing)."""
    lead0, lead1, t_len, w = (int(n) for n in bits.shape)
    padded = jnp.pad(bits, ((0, 0), (0, 0), (0, t_pad - t_len), (0, words - w)))
    return jnp.swapaxes(padded.reshape(lead0, lead1, t_pad // rows, rows, words), 3, 4)


def rows_seen(bits: Any) -> Any:
    """Whether each row sees any key, bool ``(B|1, Hq|1, T)``."""
    return jnp.any(bits != 0, axis=-1)


def unread_zeroed(k: Any, v: Any, bits: Any) -> tuple[Any, Any]:
    """``k`` and ``v`` ``(B, S, Hkv, D)`` with zeros at the keys no query of their sequence and KV
    head sees: a kernel loads whole blocks, and a partial one's P V would multiply an unseen V
    row (the contract lets it hold NaN) by 0; its gradients there are 0."""
    lead0, lead1, _, w = (int(n) for n in bits.shape)
    s_len, hkv = int(k.shape[1]), int(k.shape[2])
    groups = hkv if lead1 > 1 else 1
    grouped = bits.reshape(lead0, groups, lead1 // groups, -1, w)
    seen_words = lax.reduce(grouped, jnp.int32(0), lax.bitwise_or, (2, 3))  # (B|1, Hkv|1, W)
    shifts = jnp.arange(WORD, dtype=jnp.int32).reshape(1, 1, 1, WORD)
    seen = (lax.shift_right_logical(seen_words[..., None], shifts) & 1).reshape(lead0, groups, w * WORD)
    seen = jnp.swapaxes(seen[:, :, :s_len] != 0, 1, 2)[..., None]  # (B|1, S, Hkv|1, 1)
    zero = jnp.zeros((), k.dtype)
    return jnp.where(seen, k, zero), jnp.where(seen, v, zero)
