"""How :mod:`jaxattn_pallas.decode.kernel` lays a decode call out for JAX's TPU paged_attention
kernel, in pure Python (no jax: the backend explains itself without tracing).

The kernel, ``jax.experimental.pallas.ops.tpu.paged_attention`` (same source in jax 0.10.2 and
0.11.2), as read from its source and run in TPU interpret mode:

* one query per sequence, ``q (batch, Hq, D)``; K and V each ``(Hkv, num_pages, page_size, D)``
  with one shape for both (so one head dim); Hq a multiple of Hkv (query head h reads KV head
  ``h // (Hq // Hkv)``, the contract's grouping); ``lengths (batch,)`` int32 and
  ``page_indices (batch, pages_per_sequence)`` int32;
* each loaded K/V page is cast to **bfloat16** before the products (``_maybe_dequantize``
  defaults to it) while q stays float32 (it is upcast in the kernel), and the softmax and the
  output accumulate in float32 when q is launched as float32;
* no softmax scale (the logits are ``q . k``), an optional ``attn_logits_soft_cap`` applied
  to them, keys ``j >= length`` masked: no sliding window, no sinks, no causal offset;
* ``pages_per_compute_block`` must divide ``pages_per_sequence``; a sequence's pages are read
  in blocks of that many, and the last block of a sequence may read table entries past its
  last page (they must be valid page indices);
* upstream runs it only on TPU v4 and newer, and its own TPU test
  (``tests/pallas/tpu_paged_attention_kernel_test.py``, read at jax-ml/jax commit 0f844335) is
  skipped with "This kernel has data races that need to be fixed". jaxattn ranks it below the
  ragged kernel on a TPU for that reason and for the copy below.

What the wrapper does about it (:class:`PagedKernelTiling` records it per call):

* **a copy of the whole cache on every call**: K and V are transposed into the kernel's
  ``(Hkv, num_pages, page_size, D')`` (from the separate layout, or de-interleaved from the
  combined one), every page, used or not, because the kernel reads the pool in that layout;
* **exact float32 and float16**: as the kernel rounds pages to bfloat16, a wider cache is split
  into bfloat16 terms along the head dim in that same copy, ``x = hi + mid + lo`` (three terms
  for float32's 24-bit significand, two for float16's 11; bfloat16 is one term), with q
  repeated once per term: ``q . k = q . hi + q . mid + q . lo`` and ``p @ v`` is the sum of
  the output's column blocks. The logits and the output then carry the input's precision at
  ``terms`` times the kernel's work;
* head dims (``terms * D`` for K, ``terms * Dv`` for V) are zero-padded to one multiple of 128
  (the TPU lane width; zeros change no logit and the extra output columns are dropped);
* ``softmax_scale`` is folded into q (in float32, before the kernel), the soft cap passed on;
* the page table is clamped into the pool and padded with page 0 to a multiple of
  ``pages_per_compute_block`` (a small int copy); lengths are clamped to what the table holds,
  and set to 0 for rows past ``num_seqs``; rows of length 0 are zeros;
* the pool's rows that no sequence reads (past a length, pages listed past a last page, unused
  pages) are zeroed in the same copy: the kernel adds its mask to the logits and multiplies V
  by the zero probabilities, so a NaN or Inf there would reach the output.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BLOCK_TOKENS", "LANES", "SUPPORTED_DTYPES", "TERMS", "PagedKernelTiling", "paged_kernel_tiling"]

LANES = 128
#: Tokens per compute block the wrapper aims for (upstream's test reads 512-token blocks).
BLOCK_TOKENS = 512
#: bfloat16 terms that carry a value of each dtype exactly (its significand bits / 8, rounded up).
TERMS = {"bfloat16": 1, "float16": 2, "float32": 3}
SUPPORTED_DTYPES = tuple(TERMS)
_ITEMSIZE_BF16 = 2


@dataclasses.dataclass(frozen=True)
class PagedKernelTiling:
    """What the kernel is given for one call."""

    terms: int  # bfloat16 terms per K/V value
    head_dim: int  # D' of q, K and V as the kernel sees them (a multiple of 128)
    pages_per_seq: int  # the page table's width, padded to a multiple of the block
    pages_per_compute_block: int
    cache_copy_bytes: int  # bytes of the K and V copies made per call

    def describe_copy(self, dtype: str, layout: str) -> str:
        source = ("de-interleaved from the combined layout" if layout == "combined"
                  else "transposed from the separate layout")
        split = "" if self.terms == 1 else f", each {dtype} value split into {self.terms} bfloat16 terms"
        return (f"copies the whole KV cache per call ({_mib(self.cache_copy_bytes)}): K and V {source} into the "
                f"kernel's (Hkv, num_pages, page_size, {self.head_dim}) bfloat16 layout{split}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def paged_kernel_tiling(
    *,
    dtype: str,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    num_pages: int,
    pages_per_seq: int,
    pages_per_compute_block: int | None = None,
) -> PagedKernelTiling:
    """The kernel's view of a call. Raises ``ValueError`` for a dtype the wrapper does not take
    or a non-positive ``pages_per_compute_block``.

    By default a compute block holds ``BLOCK_TOKENS // page_size`` pages (at least one, at most
    the table's width); an explicit block larger than the table is clamped to it.
    """
    if dtype not in TERMS:
        raise ValueError(f"dtype {dtype} is not supported (one of {', '.join(SUPPORTED_DTYPES)})")
    if pages_per_compute_block is not None and pages_per_compute_block <= 0:
        raise ValueError(f"pages_per_compute_block={pages_per_compute_block} must be positive")
    terms = TERMS[dtype]
    d = -(-terms * max(head_dim, v_head_dim) // LANES) * LANES
    width = max(pages_per_seq, 1)
    block = pages_per_compute_block or max(1, BLOCK_TOKENS // max(page_size, 1))
    block = min(block, width)
    return PagedKernelTiling(
        terms=terms,
        head_dim=d,
        pages_per_seq=-(-width // block) * block,
        pages_per_compute_block=block,
        cache_copy_bytes=2 * num_kv_heads * num_pages * page_size * d * _ITEMSIZE_BF16,
    )
