"""The serving contract's paged decode, ``q (num_seqs, T, Hq, D)``, on the Pallas TPU
ragged paged-attention kernel.

Each sequence's T queries are one ragged sequence (``cu_q_lens = arange(num_seqs + 1) * T``,
every sequence real); query i of sequence s then sits at ``kv_lengths[s] - T + i``, which
is the contract's position, and everything else is :mod:`jaxattn_pallas.ragged.kernel`'s
translation (same fix-ups, same refusals, same block-size rules).

Why the ragged kernel for this function, and not ``jax.experimental.pallas.ops.tpu.paged_attention``
(read in jax 0.10.2 and 0.11.2, where the two kernels' sources are unchanged):

* layout: paged_attention wants K and V each as ``(Hkv, num_pages, page_size, D)``, so
  either of the contract's layouts costs a transpose of the whole cache on every call,
  twice the cache's bytes moved per decode step before attention reads a single used
  page. The ragged kernel reads the combined layout in place; the separate layout costs
  it one interleaving copy, no more than the transpose;
* precision: paged_attention casts every loaded K/V page to bfloat16
  (``_maybe_dequantize`` defaults to it), so a float32 cache is attended in float32 only
  if it is split into bfloat16 terms first (what :mod:`jaxattn_pallas.decode.kernel` does),
  at two to three times the kernel's work;
* features: paged_attention has no sliding window and no causal offset (one query per
  sequence; T > 1 would need one batch row per query, re-reading the pages T times),
  while the ragged kernel masks causally per sequence, takes a window and a soft cap,
  and reads each page once per block of queries;
* what paged_attention has for it: it runs in TPU interpret mode on CPU, which the ragged
  kernel does not in these jax versions (see :mod:`jaxattn_pallas.ragged.rules`). That is
  a testing convenience, not a property of the call; it does not buy back the transpose.

The registered backends follow from this (:mod:`jaxattn_pallas.ragged.impl`,
:mod:`jaxattn_pallas.decode.impl`): on a TPU "auto" runs ``ragged_page_attention_v3``
(this kernel) for decode steps too, while the name ``page_attention`` is
:mod:`jaxattn_pallas.decode.kernel` on paged_attention, the interpretable one, which the
conformance suite runs on CPU.
Supported and declined: as :func:`jaxattn_pallas.ragged.rules.paged_decode_reasons` says
(any T >= 0; T == 0 or num_seqs == 0 return an empty result).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.backend import InvalidInputError

from . import rules as ragged_rules
from .kernel import cache_facts, run_ragged

__all__ = ["paged_decode"]

_NAME = "pallas_paged_decode"


def paged_decode(
    q: jax.Array,
    k_pages: jax.Array | None,
    v_pages: jax.Array | None,
    page_table: jax.Array,
    kv_lengths: jax.Array,
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
    """Paged decode of ``q (num_seqs, T, Hq, D)``: query i of sequence s sits at
    ``kv_lengths[s] - T + i`` and sees keys ``0 <= j <= pos`` (and ``j >= pos - window_left``).

    The cache is ``k_pages``/``v_pages`` (separate layout) or ``kv_pages`` (combined, pass
    ``None, None`` for k/v); ``page_table (num_seqs, pages_per_seq)`` and ``kv_lengths
    (num_seqs,)`` are int32. Returns ``(num_seqs, T, Hq, Dv)`` in q's dtype; a query with
    no visible key gives zeros. ``sinks`` must be None (declined). Raises
    ``UnsupportedError`` listing every reason a call cannot run.
    """
    if q.ndim != 4:
        raise InvalidInputError("q", f"expected (num_seqs, T, Hq, D), got shape {q.shape}")
    num_seqs, t, num_q_heads, head_dim = q.shape
    layout, hkv, dv, page_size, _, kv_dtype = cache_facts(head_dim, k_pages, v_pages, kv_pages)
    if page_table.shape[0] != num_seqs:
        raise InvalidInputError("page_table", f"has {page_table.shape[0]} rows for {num_seqs} sequences")
    reasons = ragged_rules.paged_decode_reasons(
        q_len=t, q_dtype=jnp.dtype(q.dtype).name, kv_dtype=kv_dtype, num_q_heads=num_q_heads, num_kv_heads=hkv,
        head_dim=head_dim, v_head_dim=dv, layout=layout, page_size=page_size, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, window_left=window_left, has_sinks=sinks is not None,
        num_queries_per_block=num_queries_per_block, num_kv_pages_per_block=num_kv_pages_per_block,
        interpret=interpret,
    )
    out = run_ragged(
        q.reshape(num_seqs * t, num_q_heads, head_dim), k_pages, v_pages, kv_pages, page_table, kv_lengths,
        jnp.arange(num_seqs + 1, dtype=jnp.int32) * t, jnp.full((1,), num_seqs, jnp.int32),
        reasons=reasons, name=_NAME, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_left, interpret=interpret, num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block, vmem_limit_bytes=vmem_limit_bytes,
    )
    return out.reshape(num_seqs, t, num_q_heads, dv)
