"""The serving contract's ragged paged attention on the Pallas TPU ragged kernel.

``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (its constraints are listed in
:mod:`jaxattn_pallas.ragged.rules`) is given the contract's arrays, translated exactly:

* KV cache: the combined layout ``(num_pages, page_size, 2 * Hkv, D)`` is the kernel's own
  and is passed as is when its head dim is a multiple of 128 and ``2 * Hkv`` tiles the
  dtype's layout. The separate layout is interleaved into it: a copy of the whole cache
  (every page, used or not) on every call. Head dims off a multiple of 128 and KV head
  counts that do not tile are zero-padded as part of that conversion, and for the
  combined layout they make a whole-cache copy of their own.
  ``ragged_rules.ragged_tiling(...).cache_copy`` says which calls copy, and
  ``ragged_reasons(allow_cache_copy=False)`` refuses them;
* query heads: per KV head group, padded with zero heads where the kernel would otherwise
  leave its tiled path (q is small; the cache is not touched); dummy heads' outputs and
  padded value columns are dropped;
* ``window_left = w`` (the query sees itself and w keys before it) is the kernel's
  ``sliding_window = w + 1``; ``logits_soft_cap`` is its ``soft_cap``; ``softmax_scale``
  its ``sm_scale``;
* outside the kernel, without reading the cache: a real sequence with ``kv_len == 0`` is
  given length 1 (the kernel's prefetch chain would otherwise hand the next sequence this
  one's pages) and ``num_seqs == 0`` becomes 1 (its first prefetch is unconditional); the
  page table is clamped into range, since such a sequence's entry 0 (which the kernel
  reads for every page slot of a block past the sequence's last page) may be junk; rows
  past ``cu_q_lens[num_seqs]`` and rows that see no key (``kv_len - q_len + i < 0`` under
  the caller's lengths) are set to zero, as the kernel leaves them uninitialised or
  averages masked keys there. Query rows are padded to a whole number of query blocks;
* cache contents no query reads (rows past a length, pages past a last page) may be NaN: the
  kernel itself selects K and V rows past each length to zero before its products;
* block sizes are chosen here (:func:`ragged_rules.ragged_tiling`) or given by the caller:
  the kernel's own tuned table raises off TPU and on TPU v2/v3.

Declined (``ragged_rules.ragged_reasons`` lists them): attention sinks, float16 and other
dtypes, q and cache of different dtypes, and TPU interpret mode where the interpreter
cannot run this kernel.

This module imports the Pallas TPU kernel at module level; import it only when a call is
made (never at plugin registration).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel

from jaxattn.backend import InvalidInputError, UnsupportedError

from . import rules as ragged_rules
from .rules import Layout, RaggedTiling

__all__ = ["ragged_paged_attention"]

_NAME = "pallas_ragged_paged_attention"


def _pad(x: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """Zero-pad the end of each axis by ``widths`` (no copy when nothing is padded)."""
    if not any(widths):
        return x
    return jnp.pad(x, [(0, w) for w in widths])


def cache_facts(
    head_dim: int, k_pages: jax.Array | None, v_pages: jax.Array | None, kv_pages: jax.Array | None
) -> tuple[Layout, int, int, int, int, str]:
    """``(layout, Hkv, Dv, page_size, num_pages, cache dtype)`` of the one cache given.
    Raises ``InvalidInputError`` for a missing, doubled or malformed cache."""
    if kv_pages is not None:
        if k_pages is not None or v_pages is not None:
            raise InvalidInputError("kv_pages", "give either kv_pages or k_pages and v_pages, not both")
        if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
            raise InvalidInputError("kv_pages", f"expected (num_pages, page_size, 2*Hkv, D), got {kv_pages.shape}")
        if kv_pages.shape[3] != head_dim:
            raise InvalidInputError("kv_pages", f"head dim {kv_pages.shape[3]} differs from q's {head_dim}")
        num_pages, page_size, combined, _ = kv_pages.shape
        return "combined", combined // 2, head_dim, page_size, num_pages, jnp.dtype(kv_pages.dtype).name
    if k_pages is None or v_pages is None:
        raise InvalidInputError("k_pages", "give k_pages and v_pages (separate layout) or kv_pages (combined)")
    if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise InvalidInputError(
            "k_pages", f"expected (num_pages, page_size, Hkv, D) and (..., Dv), got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.shape[3] != head_dim:
        raise InvalidInputError("k_pages", f"head dim {k_pages.shape[3]} differs from q's {head_dim}")
    if k_pages.dtype != v_pages.dtype:
        raise InvalidInputError("v_pages", f"dtype {v_pages.dtype} differs from k_pages' {k_pages.dtype}")
    num_pages, page_size, hkv, _ = k_pages.shape
    return "separate", hkv, v_pages.shape[3], page_size, num_pages, jnp.dtype(k_pages.dtype).name


def _combined_cache(tiling: RaggedTiling, k_pages: jax.Array | None, v_pages: jax.Array | None,
                    kv_pages: jax.Array | None) -> jax.Array:
    if kv_pages is not None:
        _, _, combined, d = kv_pages.shape
        # Extra heads go after the real ones: K head h stays at 2h, V head h at 2h + 1.
        return _pad(kv_pages, (0, 0, 2 * tiling.num_kv_heads - combined, tiling.head_dim - d))
    assert k_pages is not None
    assert v_pages is not None
    num_pages, page_size, hkv, d = k_pages.shape
    k = _pad(k_pages, (0, 0, tiling.num_kv_heads - hkv, tiling.head_dim - d))
    v = _pad(v_pages, (0, 0, tiling.num_kv_heads - hkv, tiling.head_dim - v_pages.shape[3]))
    return jnp.stack([k, v], axis=3).reshape(num_pages, page_size, 2 * tiling.num_kv_heads, tiling.head_dim)


def _visible_rows(cu_q_lens: jax.Array, kv_lengths: jax.Array, n_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """(num_tokens,) bool: the row belongs to a real sequence and sees at least one key.

    Row i of sequence s sits at kv_lengths[s] - q_len_s + i and, being causal and never
    past kv_lengths[s] - 1, sees a key exactly when that position is >= 0 (a window
    always keeps the query's own position).
    """
    end = cu_q_lens[n_seqs]
    # Bounds past the real sequences are pinned to `end`, so that whatever the caller left
    # there the search below sees a sorted array.
    bounds = jnp.where(jnp.arange(cu_q_lens.shape[0]) <= n_seqs, cu_q_lens, end)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(bounds, rows, side="right") - 1, 0, kv_lengths.shape[0] - 1)
    start = bounds[seq]
    pos = kv_lengths[seq] - (bounds[seq + 1] - start) + (rows - start)
    return (rows < end) & (pos >= 0)


def run_ragged(
    q: jax.Array,
    k_pages: jax.Array | None,
    v_pages: jax.Array | None,
    kv_pages: jax.Array | None,
    page_table: jax.Array,
    kv_lengths: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    reasons: list[str],
    name: str,
    softmax_scale: float,
    logits_soft_cap: float | None,
    window_left: int | None,
    interpret: bool,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
    vmem_limit_bytes: int | None,
) -> jax.Array:
    """The kernel call behind both public wrappers; ``reasons`` are the caller's static
    refusals (raised as ``UnsupportedError`` under ``name``)."""
    if reasons:
        raise UnsupportedError(name, reasons)
    num_tokens, num_q_heads, head_dim = q.shape
    layout, num_kv_heads, v_head_dim, page_size, num_pages, kv_dtype = cache_facts(head_dim, k_pages, v_pages, kv_pages)
    max_num_seqs, pages_per_seq = page_table.shape
    if kv_lengths.shape != (max_num_seqs,) or cu_q_lens.shape != (max_num_seqs + 1,):
        raise InvalidInputError(
            "kv_lengths", f"expected kv_lengths ({max_num_seqs},) and cu_q_lens ({max_num_seqs + 1},) for a page "
            f"table of {max_num_seqs} rows, got {kv_lengths.shape} and {cu_q_lens.shape}"
        )
    if jnp.size(num_seqs) != 1:
        raise InvalidInputError("num_seqs", f"expected a scalar or shape (1,), got shape {jnp.shape(num_seqs)}")
    out_shape = (num_tokens, num_q_heads, v_head_dim)
    if num_tokens == 0 or max_num_seqs == 0 or pages_per_seq == 0 or num_pages == 0:
        # Nothing to compute, or no key anywhere: every row is zeros by the contract.
        return jnp.zeros(out_shape, q.dtype)

    tiling = ragged_rules.ragged_tiling(
        q_dtype=jnp.dtype(q.dtype).name, kv_dtype=kv_dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, layout=layout, page_size=page_size, pages_per_seq=pages_per_seq,
        num_tokens=num_tokens, window_left=window_left, num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
    )
    group = num_q_heads // num_kv_heads
    qk = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qk = _pad(qk, (tiling.num_tokens - num_tokens, tiling.num_kv_heads - num_kv_heads, tiling.q_per_kv - group,
                   tiling.head_dim - head_dim))
    qk = qk.reshape(tiling.num_tokens, tiling.num_q_heads, tiling.head_dim)
    kv = _combined_cache(tiling, k_pages, v_pages, kv_pages)

    lengths = kv_lengths.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    n_seqs = jnp.clip(jnp.reshape(num_seqs, ()).astype(jnp.int32), 0, max_num_seqs)
    kernel_seqs = jnp.maximum(n_seqs, 1)
    kernel_lengths = jnp.where(jnp.arange(max_num_seqs) < kernel_seqs, jnp.maximum(lengths, 1), lengths)
    table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)

    kernel = functools.partial(
        rpa_kernel.ragged_paged_attention,
        sm_scale=float(softmax_scale),
        sliding_window=tiling.sliding_window,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        num_kv_pages_per_block=tiling.num_kv_pages_per_block,
        num_queries_per_block=tiling.num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    args: tuple[Any, ...] = (qk, kv, kernel_lengths, table, cu, kernel_seqs.reshape(1))
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            out = kernel(*args)
    else:
        out = kernel(*args)

    out = out.reshape(tiling.num_tokens, tiling.num_kv_heads, tiling.q_per_kv, tiling.head_dim)
    out = out[:num_tokens, :num_kv_heads, :group, :v_head_dim].reshape(out_shape)
    visible = _visible_rows(cu, lengths, n_seqs, num_tokens)
    return jnp.where(visible[:, None, None], out, jnp.zeros((), out.dtype))


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array | None,
    v_pages: jax.Array | None,
    page_table: jax.Array,
    kv_lengths: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    kv_pages: jax.Array | None = None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """Ragged paged attention of ``q (num_tokens, Hq, D)`` over a paged KV cache.

    The cache is ``k_pages (num_pages, page_size, Hkv, D)`` with ``v_pages (..., Dv)``, or
    ``kv_pages (num_pages, page_size, 2 * Hkv, D)`` (then pass ``None, None`` for k/v).
    ``page_table (max_num_seqs, pages_per_seq)``, ``kv_lengths (max_num_seqs,)``,
    ``cu_q_lens (max_num_seqs + 1,)``, ``num_seqs`` a scalar or ``(1,)``: int32 arrays as
    in the serving contract. Returns ``(num_tokens, Hq, Dv)`` in q's dtype. ``sinks`` must
    be None (declined). Raises ``UnsupportedError`` with every reason a call cannot run
    (:func:`ragged_rules.ragged_reasons`), ``InvalidInputError`` for malformed arguments.
    """
    if q.ndim != 3:
        raise InvalidInputError("q", f"expected (num_tokens, Hq, D), got shape {q.shape}")
    layout, hkv, dv, page_size, _, kv_dtype = cache_facts(q.shape[-1], k_pages, v_pages, kv_pages)
    reasons = ragged_rules.ragged_reasons(
        q_dtype=jnp.dtype(q.dtype).name, kv_dtype=kv_dtype, num_q_heads=q.shape[1], num_kv_heads=hkv,
        head_dim=q.shape[-1], v_head_dim=dv, layout=layout, page_size=page_size, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, window_left=window_left, has_sinks=sinks is not None,
        num_queries_per_block=num_queries_per_block, num_kv_pages_per_block=num_kv_pages_per_block,
        interpret=interpret,
    )
    return run_ragged(
        q, k_pages, v_pages, kv_pages, page_table, kv_lengths, cu_q_lens, num_seqs, reasons=reasons, name=_NAME,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, window_left=window_left, interpret=interpret,
        num_queries_per_block=num_queries_per_block, num_kv_pages_per_block=num_kv_pages_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
