"""Attention over a paged KV cache in plain JAX: gather the pages, then attend.

The reference of the paged contract on every platform (docs/contract.md, "Serving
attention"), and what "auto" runs where no paged kernel is installed. Two paths:

* uniform calls (T queries per sequence: decode, speculative decoding) gather each sequence's
  pages into a dense ``(num_seqs, capacity, Hkv, D)`` cache and run ``vanilla_attention`` with
  ``kv_lengths``: causal and window aligned to each sequence's own length;
* ragged calls find each query row's sequence and position from ``cu_q_lens`` and attend to
  that sequence's gathered keys, in chunks of query rows (``lax.map``), so memory grows with
  the chunk times the capacity, not with all rows times it.

A quantized cache (int8/float8 values with ``k_scale``, ``v_scale``) is dequantized as it is
gathered, to float32 (float64 for a float64 q), with a select that zeroes every position at or
past a sequence's length: its values and scales are unread there and may be NaN. Then the
float path above attends over it (a full-size copy: this is the reference, not a fast path).

A ``mask_mod(seq, h, q_pos, kv_pos)`` (a tree mask over a speculative step's new tokens) runs
on the ragged path, evaluated per query row over the sequence's positions and ANDed with the
causal rule; values no query of the row's KV head sees are selected to zero (they may hold NaN).

Page-table entries are clamped into the pool (entries past a sequence's last page are never
read: their keys are masked) and lengths to the table's capacity, so a traced call never reads
out of bounds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from jaxattn.backend import dequantize_visible, split_absorbing_sinks, zero_absorbed_heads

from ..vanilla.reference import vanilla_attention

__all__ = ["paged_reference"]

# Query rows per step of the ragged path's loop.
_CHUNK = 64


def _split_layout(k_pages: Array, v_pages: Array | None) -> tuple[Array, Array]:
    if v_pages is None:  # combined: K head h at 2h, V head h at 2h + 1
        return k_pages[:, :, 0::2], k_pages[:, :, 1::2]
    return k_pages, v_pages


def _gather(pages: Array, table: Array) -> Array:
    """``(num_seqs, pages_per_seq * page_size, H, D)``: every sequence's tokens in position order."""
    n, per_seq = table.shape
    safe = jnp.clip(table, 0, pages.shape[0] - 1)
    return pages[safe].reshape(n, per_seq * pages.shape[1], *pages.shape[2:])


def _dequantized(values: Array, scale: Array, table: Array, lengths: Array, dtype: Any) -> Array:
    """``values`` gathered into ``(num_seqs, capacity, H, D)`` and dequantized in ``dtype``, zero
    at and past each sequence's length."""
    full = jnp.broadcast_to(scale, values.shape[:3])  # (num_pages, page_size, H) from any broadcastable scale
    out: Array = dequantize_visible(_gather(values, table), _gather(full, table), lengths, dtype)
    return out


def _ragged(q: Array, k_seq: Array, v_seq: Array, seq: Array, pos: Array, valid: Array, lengths: Array,
            *, scale: float, cap: float | None, window: int | None, aux: Array | None, sdtype: Any,
            mask_mod: Any = None) -> Array:
    """Rows of a ragged batch: row r attends to sequence ``seq[r]``'s keys up to position ``pos[r]``.

    Written for one row; ``lax.map`` vectorises it over chunks of rows.
    """
    _, hq, d = q.shape
    hkv, capacity = k_seq.shape[2], k_seq.shape[1]
    groups = hq // hkv
    j = jnp.arange(capacity)

    def one(row: tuple[Array, Array, Array, Array]) -> Array:
        qr, sr, pr, vr = row  # (Hq, D), the row's sequence, position, validity
        # Positions past the length (rows of the last page, pages past it) may hold NaN: the
        # logits' mask hides them from the softmax, a select keeps them out of P @ V (0 * NaN).
        live = j < lengths[sr]
        k, v = k_seq[sr], jnp.where(live[:, None, None], v_seq[sr], jnp.zeros((), v_seq.dtype))  # (S, Hkv, D|Dv)
        visible = vr & (j <= pr) & live
        if window is not None:
            visible &= j >= pr - window
        if mask_mod is not None:  # (seq, h, q_pos, kv_pos) as (1,1,1), (1,Hq,1), (1,1,1), (1,1,S)
            seen = mask_mod(sr.reshape(1, 1, 1), jnp.arange(hq, dtype=jnp.int32).reshape(1, hq, 1),
                            pr.astype(jnp.int32).reshape(1, 1, 1), j.astype(jnp.int32).reshape(1, 1, capacity))
            visible = visible[None, None, :] & jnp.broadcast_to(jnp.asarray(seen, bool), (1, hq, capacity))[0].reshape(
                hkv, groups, capacity)
            read = jnp.any(visible, axis=1).T[:, :, None]  # (S, Hkv, 1): keys the row's KV head reads
            v = jnp.where(read, v, jnp.zeros((), v.dtype))
            k = jnp.where(read, k, jnp.zeros((), k.dtype))
        logits = jnp.einsum("kgd,skd->kgs", qr.reshape(hkv, groups, d), k, preferred_element_type=sdtype)
        logits = logits * jnp.asarray(scale, sdtype)
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        # Hidden logits are the lowest finite value, not -inf (jax.debug_infs flags every -inf an
        # operation makes), and their exponents again after the shift: each weighs exactly 0.
        # The row's rule is made rank 3, as the logits (jax_numpy_rank_promotion="raise").
        lowest = jnp.asarray(jnp.finfo(logits.dtype).min, logits.dtype)
        visible = visible if visible.ndim == 3 else visible[None, None, :]
        # The select stands between the scale's product and the max's subtraction, so that no
        # compiler contracts them into one multiply-add (past ~2^32 its exact product overflows exp).
        masked = jnp.where(visible, logits, lowest)
        row_max = jnp.max(masked, axis=-1)  # (Hkv, G)
        if aux is not None:
            row_max = jnp.maximum(row_max, aux)
        shift = jnp.where(jnp.isfinite(row_max) & (row_max > lowest), row_max, 0)
        exp = jnp.exp(masked - shift[..., None])  # hidden: exp(lowest - shift) is 0
        key_sum = jnp.sum(exp, axis=-1)
        denom = key_sum if aux is None else key_sum + jnp.exp(aux - shift)
        probs = exp / jnp.where(key_sum > 0, denom, 1)[..., None]
        # Accumulate in float32, or in float64 for a float64 cache: an f64 x f64 -> f32 product is a mixed
        # GEMM that cuBLASLt refuses on a GPU ("GEMM is not supported by cublasLt"), and it drops precision.
        out = jnp.einsum("kgs,skd->kgd", probs.astype(v.dtype), v,
                         preferred_element_type=jnp.promote_types(jnp.float32, v.dtype))
        return out.reshape(hq, v.shape[-1])

    out: Array = jax.lax.map(one, (q, seq, pos, valid), batch_size=_CHUNK)
    return out


def paged_reference(
    q: Array,
    k_pages: Array,
    v_pages: Array | None,
    *,
    page_table: Array,
    kv_lengths: Array,
    cu_q_lens: Array,
    num_seqs: Array,
    queries_per_seq: int | None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: tuple[int, int] | None = None,
    softmax_aux: Array | None = None,
    softmax_dtype: Any = jnp.float32,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    mask_mod: Any = None,
) -> Array:
    """``(num_tokens, Hq, Dv)`` in q's dtype: the paged call in its ragged form (see the module docstring).

    ``k_scale``, ``v_scale``: a quantized cache's scales (rank 3, broadcastable against
    ``(num_pages, page_size, Hkv)``), None for a float cache."""
    k_pages, v_pages = _split_layout(k_pages, v_pages)
    out_dtype = q.dtype
    n, capacity = page_table.shape[0], page_table.shape[1] * k_pages.shape[1]
    lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, capacity)
    if k_scale is None or v_scale is None:
        k_seq, v_seq = _gather(k_pages, page_table), _gather(v_pages, page_table)
    else:  # attend over the dequantized cache, q widened to match
        wide = jnp.promote_types(q.dtype, jnp.float32)
        k_seq = _dequantized(k_pages, k_scale, page_table, lengths, wide)
        v_seq = _dequantized(v_pages, v_scale, page_table, lengths, wide)
        q = q.astype(wide)
    count = num_seqs.reshape(-1)[0].astype(jnp.int32)
    sdtype = jnp.promote_types(jnp.dtype(softmax_dtype), q.dtype)
    num_tokens, hq, _ = q.shape
    if queries_per_seq is not None and mask_mod is None:
        t = queries_per_seq
        res = vanilla_attention(
            q.reshape(n, t, hq, -1), k_seq, v_seq, causal=True, kv_lengths=lengths,
            sliding_window=sliding_window, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, softmax_dtype=softmax_dtype,
        )
        out = res.output.reshape(num_tokens, hq, -1)
        real = jnp.repeat(jnp.arange(n) < count, t)
        return jnp.where(real[:, None, None], out, 0).astype(out_dtype)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, n - 1).astype(jnp.int32)
    valid = (rows < cu[count]) & (seq < count)
    q_len = cu[seq + 1] - cu[seq]
    pos = lengths[seq] - q_len + (rows - cu[seq])
    aux, absorbed = split_absorbing_sinks(softmax_aux)  # a +inf sink zeroes its head
    if aux is not None:
        hkv = k_seq.shape[2]
        aux = aux.astype(sdtype).reshape(hkv, hq // hkv)
    out = _ragged(q, k_seq, v_seq, seq, pos, valid, lengths, scale=softmax_scale, cap=logits_soft_cap,
                  window=None if sliding_window is None else sliding_window[0], aux=aux, sdtype=sdtype,
                  mask_mod=mask_mod)
    return zero_absorbed_heads(jnp.where(valid[:, None, None], out, 0), absorbed, 1).astype(out_dtype)
