"""A paged decode step (one query per sequence) on JAX's TPU ``paged_attention`` kernel.

``jax.experimental.pallas.ops.tpu.paged_attention`` wants K and V as ``(Hkv, num_pages,
page_size, D)``, rounds every page it loads to bfloat16, has no softmax scale, no window and
no sinks. :mod:`jaxattn_pallas.decode.rules` lists its constraints and how this module
meets the contract on top of it; in short, per call:

* **copies**: the whole KV cache (every page of the pool, used or not) into the kernel's
  layout, transposed (separate layout) or de-interleaved (combined layout), split into
  bfloat16 terms for float32/float16 caches (exactness, see the rules module) and zero-padded
  to a multiple of 128 in the head dim; ``PagedKernelTiling.describe_copy`` says how many bytes.
  The kernel cannot read the contract's layouts in place, so there is no way around the copy:
  on a real TPU the ragged kernel (:mod:`jaxattn_pallas.ragged.kernel`), which reads the combined
  layout in place, is the faster choice, and jaxattn ranks it first;
* q (small): upcast to float32, scaled by ``softmax_scale`` and repeated once per term;
* the page table clamped into the pool and padded to whole compute blocks, the lengths
  clamped to the table and zeroed past ``num_seqs``; rows of length 0 are zeros;
* the pool's rows no sequence reads (past a length, pages listed past a last page, unused
  pages) zeroed in that copy (:func:`live_rows`): they may hold NaN, which the kernel's additive
  mask and its ``p @ v`` would carry into the output.

What it runs: it is the one Pallas TPU paged kernel that runs in TPU interpret mode on a CPU
in jax 0.10.2 / 0.11.2 (the ragged kernel does not), so the conformance suite checks it there.
The kernel is traced with ``jax_enable_x64`` off (it indexes in int32).

This module imports the Pallas TPU kernel at module level; import it only when a call is made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pa_kernel

from jaxattn.backend import InvalidInputError, UnsupportedError, traced_under, x64_off

from ..ragged.kernel import cache_facts
from .rules import PagedKernelTiling, paged_kernel_tiling

__all__ = ["live_rows", "paged_attention_decode", "tiling_for"]

_NAME = "pallas_paged_attention_decode"


def bf16_terms(x: jax.Array, terms: int) -> list[jax.Array]:
    """``terms`` bfloat16 arrays whose float32 sum is ``x`` (to ``x``'s own precision for the
    terms :data:`rules.TERMS` gives its dtype): each term rounds what the previous
    ones left, and that remainder is exact in float32. An infinite or NaN value stays in the
    first term, the others are 0 (no inf - inf); so does a float32 value past bfloat16's largest
    finite one (about 3.39e38), which becomes infinite."""
    rest = x.astype(jnp.float32)
    out = []
    for i in range(terms):
        term = rest.astype(jnp.bfloat16)
        out.append(term)
        if i + 1 < terms:
            wide = term.astype(jnp.float32)
            rest = jnp.where(jnp.isfinite(wide), rest - wide, jnp.zeros((), jnp.float32))
    return out


def _kernel_layout(pages: jax.Array, tiling: PagedKernelTiling) -> jax.Array:
    """``(num_pages, page_size, Hkv, d)`` -> ``(Hkv, num_pages, page_size, D')`` bfloat16: the copy."""
    pages = jnp.transpose(pages, (2, 0, 1, 3))
    parts = bf16_terms(pages, tiling.terms)
    width = tiling.head_dim - tiling.terms * pages.shape[-1]
    if width:
        parts.append(jnp.zeros((*pages.shape[:-1], width), jnp.bfloat16))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def live_rows(table: jax.Array, lengths: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """``(num_pages, page_size)`` bool: the pool's rows some sequence reads as one of its tokens.

    The kernel masks keys past a length by adding a large negative number to their logits and
    multiplies V by the resulting 0, so a NaN or Inf it loads (a row of a last page past the
    length, a page listed past the last one: the contract lets both hold anything) poisons the
    row. Every other row is zeroed, by a select, in the copy the kernel needs anyway; a page
    that one sequence reads and another lists past its length stays (its rows are real data).
    """
    pages_per_seq = table.shape[1]
    pos = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32).reshape(pages_per_seq, page_size)
    read = (pos[None] < lengths[:, None, None]).astype(jnp.int32)  # (B, pages_per_seq, page_size)
    return jnp.zeros((num_pages, page_size), jnp.int32).at[table].max(read) > 0


def tiling_for(q: jax.Array, k_pages: jax.Array | None, v_pages: jax.Array | None, page_table: jax.Array, *,
             kv_pages: jax.Array | None = None, pages_per_compute_block: int | None = None) -> PagedKernelTiling:
    """The tiling of a call with these arrays (shapes and dtypes only)."""
    _, hkv, dv, page_size, num_pages, _ = cache_facts(q.shape[-1], k_pages, v_pages, kv_pages)
    return paged_kernel_tiling(dtype=jnp.dtype(q.dtype).name, num_kv_heads=hkv, head_dim=q.shape[-1], v_head_dim=dv,
                             page_size=page_size, num_pages=num_pages, pages_per_seq=page_table.shape[1],
                             pages_per_compute_block=pages_per_compute_block)


def paged_attention_decode(
    q: jax.Array,
    k_pages: jax.Array | None,
    v_pages: jax.Array | None,
    page_table: jax.Array,
    kv_lengths: jax.Array,
    num_seqs: jax.Array | None = None,
    *,
    kv_pages: jax.Array | None = None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
) -> jax.Array:
    """One decode step: ``q (B, Hq, D)``, query s at position ``kv_lengths[s] - 1`` seeing keys
    ``0 .. kv_lengths[s] - 1`` of sequence s.

    The cache is ``k_pages (num_pages, page_size, Hkv, D)`` with ``v_pages (..., Dv)``, or
    ``kv_pages (num_pages, page_size, 2 * Hkv, D)`` (K head h at 2h, V head h at 2h + 1; pass
    ``None, None`` for k/v). ``page_table (B, pages_per_seq)`` and ``kv_lengths (B,)`` are
    integers; ``num_seqs`` (a scalar or shape (1,), default B) says how many rows are real.
    Returns ``(B, Hq, Dv)`` in q's dtype; rows past ``num_seqs`` and sequences of length 0 are
    zeros. Raises ``UnsupportedError`` for a dtype it does not take, ``InvalidInputError`` for
    malformed arguments.
    """
    if q.ndim != 3:
        raise InvalidInputError("q", f"expected (B, Hq, D), got shape {q.shape}")
    b, hq, d = q.shape
    _, hkv, dv, page_size, num_pages, kv_dtype = cache_facts(d, k_pages, v_pages, kv_pages)
    q_dtype = jnp.dtype(q.dtype).name
    if q_dtype != kv_dtype:
        raise InvalidInputError("q", f"dtype {q_dtype} differs from the cache's {kv_dtype}")
    if hq % hkv:
        raise InvalidInputError("q", f"{hq} query heads are not a multiple of {hkv} KV heads")
    if page_table.ndim != 2 or page_table.shape[0] != b or kv_lengths.shape != (b,):
        raise InvalidInputError("page_table", f"expected page_table ({b}, pages_per_seq) and kv_lengths ({b},), got "
                                f"{page_table.shape} and {kv_lengths.shape}")
    try:
        tiling = tiling_for(q, k_pages, v_pages, page_table, kv_pages=kv_pages,
                        pages_per_compute_block=pages_per_compute_block)
    except ValueError as err:
        raise UnsupportedError(_NAME, [str(err)]) from None
    pages_per_seq = page_table.shape[1]
    if b == 0 or pages_per_seq == 0 or num_pages == 0:
        return jnp.zeros((b, hq, dv), q.dtype)  # no key anywhere: every row is zeros

    # Indices first, in int32 and clamped (under jit nothing could check them): a bad entry
    # reads the wrong page, never out of bounds.
    n = b if num_seqs is None else jnp.reshape(num_seqs, ()).astype(jnp.int32)
    lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
    lengths = jnp.where(jnp.arange(b, dtype=jnp.int32) < n, lengths, 0)
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    table = jnp.pad(table, ((0, 0), (0, tiling.pages_per_seq - pages_per_seq)))

    if kv_pages is not None:
        k_pages, v_pages = kv_pages[:, :, 0::2], kv_pages[:, :, 1::2]
    assert k_pages is not None
    assert v_pages is not None
    live = live_rows(table, lengths, num_pages, page_size)[:, :, None, None]
    k = _kernel_layout(jnp.where(live, k_pages, jnp.zeros((), k_pages.dtype)), tiling)
    v = _kernel_layout(jnp.where(live, v_pages, jnp.zeros((), v_pages.dtype)), tiling)
    qk = q.astype(jnp.float32) * jnp.float32(softmax_scale)
    qk = jnp.concatenate([qk] * tiling.terms + [jnp.zeros((b, hq, tiling.head_dim - tiling.terms * d), jnp.float32)],
                         axis=-1)

    kernel = functools.partial(
        pa_kernel.paged_attention,
        pages_per_compute_block=tiling.pages_per_compute_block,
        attn_logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
    )
    # The kernel indexes in int32 (it breaks under jax_enable_x64); interpret mode runs it on a CPU.
    contexts = (x64_off, pltpu.force_tpu_interpret_mode) if interpret else (x64_off,)
    out = traced_under(kernel, *contexts)(qk, k, v, lengths, table)

    # q was launched as float32, so the kernel's output is float32: sum the terms' column
    # blocks (smallest first), then drop the padding.
    total = out[..., (tiling.terms - 1) * dv : tiling.terms * dv]
    for t in range(tiling.terms - 2, -1, -1):
        total = total + out[..., t * dv : (t + 1) * dv]
    return jnp.where(lengths[:, None, None] > 0, total, jnp.zeros((), total.dtype)).astype(q.dtype)
