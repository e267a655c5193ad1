"""Checks of a paged (cached) call's arguments, and their normalisation.

Shapes and dtypes are always checked (``InvalidInputError`` naming the argument, the
constraint and a way out). Values (page indices in range, lengths that fit the page table,
``cu_q_lens`` starting at 0 and non-decreasing, ``num_seqs`` within the table) are checked
only when the arrays are concrete: under ``jax.jit`` they are tracers, and the contract fixes
what happens instead (docs/contract.md, "Serving attention": out-of-range page indices and
lengths are clamped, never read out of bounds).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError, InvalidTypeError, checked_keywords
from ._dtypes import dtype_name
from .call import PagedCall
from .metadata import DEFAULT_METADATA, AttentionMetadata, as_metadata
from .problem import PagedProblem
from .quantize import check_kv_scales
from .validation import _FLOAT_DTYPES, MAX_CHECKED, as_int, check_ints, check_sinks, positive, shape_of

__all__ = ["resolve_paged_call"]


def _pages(q: Any, k_pages: Any, v_pages: Any, kv_pages: Any) -> tuple[str, int, int, int, int, int]:
    """``(layout, num_pages, page_size, Hkv, D, Dv)`` of the cache, its shapes checked (dtypes:
    ``check_kv_scales``)."""
    if kv_pages is not None:
        if k_pages is not None or v_pages is not None:
            raise InvalidInputError("kv_pages", "give either kv_pages (combined layout) or k_pages and v_pages, "
                                    "not both")
        shape = shape_of(kv_pages, "kv_pages")
        if len(shape) != 4 or shape[2] % 2:
            raise InvalidInputError(
                "kv_pages", f"must have shape (num_pages, page_size, 2 * Hkv, D), K head h at 2h and V head h at "
                f"2h + 1, got {shape}", "or pass k_pages and v_pages separately")
        return "combined", shape[0], shape[1], shape[2] // 2, shape[3], shape[3]
    if k_pages is None or v_pages is None:
        raise InvalidInputError("k_pages/v_pages", "the paged KV cache is missing",
                                "pass k_pages and v_pages (num_pages, page_size, Hkv, D), or kv_pages")
    ks, vs = shape_of(k_pages, "k_pages"), shape_of(v_pages, "v_pages")
    for name, shape, last in (("k_pages", ks, "D"), ("v_pages", vs, "Dv")):
        if len(shape) != 4:
            raise InvalidInputError(name, f"must have rank 4 (num_pages, page_size, Hkv, {last}), got shape {shape}")
    if ks[:3] != vs[:3]:
        raise InvalidInputError("v_pages", f"shape {vs} does not match k_pages {ks} in (num_pages, page_size, Hkv)")
    return "separate", ks[0], ks[1], ks[2], ks[3], vs[3]


def _window(sliding_window: Any, longest: int | None = None) -> int | None:
    """The left window: keys a query sees before itself (causal masking cuts the right).

    ``longest``: the most positions a sequence holds; a wider window hides nothing and is
    clamped to it (the same attention, in int32 for every kernel: ``10**12`` means unbounded).
    """
    if sliding_window is None:
        return None
    left = sliding_window
    if isinstance(sliding_window, tuple | list):
        if len(sliding_window) != 2:
            raise InvalidInputError("sliding_window",
                                    f"expected an int or a (left, right) pair, got {sliding_window!r}")
        left = sliding_window[0]
    size = as_int(left)
    if size is None or size < 0:
        error = InvalidTypeError if size is None else InvalidInputError
        raise error("sliding_window", f"the left window must be an int >= 0, got {sliding_window!r}",
                    "None means no window")
    return size if longest is None else min(size, longest)


def _check_values(spec: PagedProblem, page_table: Any, kv_lengths: Any, cu_q_lens: Any, num_seqs: Any) -> int | None:
    """Value checks of the arrays that are concrete (see the module docstring for traced ones),
    run on every call; num_seqs's value, None when traced."""
    import numpy as np

    try:
        import jax

        abstract: tuple[type, ...] = (jax.core.Tracer, jax.ShapeDtypeStruct)  # no values to check (is_concrete)
    except ImportError:  # NumPy arrays on a host without jax
        abstract = ()
    n = spec.num_seqs
    count = None if isinstance(num_seqs, abstract) else int(np.asarray(num_seqs).reshape(-1)[0])
    if count is not None:
        if not 0 <= count <= n:
            raise InvalidInputError("num_seqs", f"is {count}, but the page table has {n} rows",
                                    f"num_seqs must be in 0..{n}")
        n = count
    if not isinstance(cu_q_lens, abstract):
        cu = np.asarray(cu_q_lens)
        if cu[0] != 0:
            raise InvalidInputError("cu_q_lens", f"must start at 0, got {int(cu[0])}")
        steps = np.diff(cu[: n + 1])
        if (steps < 0).any():
            i = int(np.flatnonzero(steps < 0)[0])
            raise InvalidInputError("cu_q_lens", f"must not decrease: cu_q_lens[{i + 1}] = {int(cu[i + 1])} < "
                                    f"cu_q_lens[{i}] = {int(cu[i])}", "cu_q_lens[s + 1] - cu_q_lens[s] is sequence "
                                    "s's query count")
        if cu[n] > spec.num_tokens:
            raise InvalidInputError("cu_q_lens", f"cu_q_lens[num_seqs] = {int(cu[n])} exceeds the {spec.num_tokens} "
                                    "query rows of q")
    if isinstance(kv_lengths, abstract):
        return count
    lengths = np.asarray(kv_lengths)[:n]
    capacity = spec.pages_per_seq * spec.page_size
    bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
    if bad.size:
        s = int(bad[0])
        raise InvalidInputError(
            "kv_lengths", f"kv_lengths[{s}] = {int(lengths[s])} is outside 0..{capacity}, what {spec.pages_per_seq} "
            f"pages of {spec.page_size} tokens hold", "grow the page table (pages_per_seq) or the page size")
    if isinstance(page_table, abstract):
        return count
    table = np.asarray(page_table)[:n]
    used = -(-lengths // spec.page_size)  # pages each sequence reads
    read = np.arange(spec.pages_per_seq)[None, :] < used[:, None]
    out = np.argwhere(read & ((table < 0) | (table >= spec.num_pages)))  # row-major: the first sequence's first
    if out.size:
        s, p = (int(i) for i in out[0])
        raise InvalidInputError(
            "page_table", f"page_table[{s}, {p}] = {int(table[s, p])} is outside 0..{spec.num_pages - 1} (sequence "
            f"{s} reads {int(used[s])} pages for {int(lengths[s])} tokens)", "entries past a sequence's last page "
            "are never read and may hold anything")
    return count


def _active_offsets(cu_q_lens: Any, num_seqs: Any, rows: int) -> Any:
    """``cu_q_lens`` with every entry past ``num_seqs`` set to ``cu_q_lens[num_seqs]``.

    Entries past num_seqs are unread (docs/contract.md): JAX's ragged TPU kernel, vLLM-TPU and
    ejkernel pass ``max_num_seqs + 1`` offsets zero-padded past the real ones. A kernel that finds
    a row's sequence by searching the whole array (``searchsorted``) would place every row in a
    padding "sequence" of zero length and return zeros; with the tail flattened to the last real
    offset, rows past it belong to no sequence, in every backend, eager or traced.
    """
    import jax.numpy as jnp

    live = jnp.arange(rows + 1, dtype=jnp.int32) <= num_seqs[0]
    last = cu_q_lens[jnp.minimum(num_seqs[0], rows)]
    return jnp.where(live, cu_q_lens, last)


#: Checks already passed, per paged call signature (shapes, dtypes, static options, metadata;
#: never values: arrays may be traced), as ``validation`` memoises a dense call's: the problem
#: (which holds the normalised window and soft cap) and the softmax scale.
_checked: dict[tuple[Any, ...], tuple[PagedProblem, float]] = {}


def _check(q: Any, k_pages: Any, v_pages: Any, kv_pages: Any, page_table: Any, kv_lengths: Any, cu_q_lens: Any,
           num_seqs: Any, queries_per_seq: Any, sliding_window: Any, softmax_scale: Any, logits_soft_cap: Any,
           softmax_aux: Any, k_scale: Any, v_scale: Any, mask_mod: bool, md: AttentionMetadata
           ) -> tuple[PagedProblem, float]:
    """Every check of a paged call that reads no values: the problem it describes, and its scale."""
    qs = shape_of(q, "q")
    if len(qs) != 3:
        raise InvalidInputError("q", f"must have rank 3 (num_tokens, Hq, D), got shape {qs}",
                                "paged_attention takes (B, T, Hq, D) and flattens it")
    if dtype_name(q.dtype) not in _FLOAT_DTYPES:
        raise InvalidInputError("q", f"dtype {dtype_name(q.dtype)} is not a floating dtype", "cast to bfloat16")
    num_tokens, hq, d = qs
    layout, num_pages, page_size, hkv, dk, dv = _pages(q, k_pages, v_pages, kv_pages)
    # The cache has q's dtype, or is quantized (K and V alike) with float32 scales (jaxattn.backend.quantize).
    caches = {"kv_pages": kv_pages} if layout == "combined" else {"k_pages": k_pages, "v_pages": v_pages}
    kv_dtype = check_kv_scales(q, caches, k_scale, v_scale, (num_pages, page_size, hkv),
                               "(num_pages, page_size, Hkv)")
    if dk != d:
        raise InvalidInputError("k_pages" if layout == "separate" else "kv_pages",
                                f"head dim {dk} differs from q's {d}", "q and the keys must share the head dim D")
    if d == 0 or dv == 0 or hq == 0:
        raise InvalidInputError("q/k_pages/v_pages", f"empty dims (Hq={hq}, D={d}, Dv={dv}): attention needs at "
                                "least one head and one feature", "give every head dim and Hq a size >= 1")
    if hkv == 0 or hq % hkv:
        raise InvalidInputError("q", f"Hq={hq} query heads is not a multiple of Hkv={hkv} cached key/value heads",
                                "GQA/MQA needs Hq % Hkv == 0")
    if num_pages == 0 or page_size == 0:
        raise InvalidInputError("k_pages" if layout == "separate" else "kv_pages",
                                f"the cache holds no tokens (num_pages={num_pages}, page_size={page_size})")
    table = shape_of(page_table, "page_table")
    if len(table) != 2:
        raise InvalidInputError("page_table", f"must have shape (num_seqs, pages_per_seq), got {table}")
    n, pages_per_seq = table
    check_ints(page_table, "page_table", table, f"{table} (num_seqs, pages_per_seq)")
    if queries_per_seq is not None and queries_per_seq * n != num_tokens:  # paged_attention: B sequences of T
        raise InvalidInputError("page_table", f"has {n} rows, but q has {num_tokens // queries_per_seq} sequences "
                                f"(B) of {queries_per_seq} queries", "give page_table and kv_lengths one row per "
                                "sequence of q")
    check_ints(kv_lengths, "kv_lengths", (n,), f"{(n,)} (one cached-token count per page-table row)")
    check_ints(cu_q_lens, "cu_q_lens", (n + 1,), f"{(n + 1,)} (query-row offsets of the page table's sequences)")
    if not hasattr(num_seqs, "shape") or shape_of(num_seqs, "num_seqs") not in ((), (1,)):
        raise InvalidInputError("num_seqs", f"must be an int32 array of shape (1,) or (), got {num_seqs!r}")
    if not dtype_name(num_seqs.dtype).startswith(("int", "uint")):
        raise InvalidInputError("num_seqs", f"must be an integer, got {dtype_name(num_seqs.dtype)}")
    check_sinks(softmax_aux, hq)
    scale = positive("softmax_scale", softmax_scale if softmax_scale is not None else md.softmax_scale)
    cap = positive("logits_soft_cap", logits_soft_cap if logits_soft_cap is not None else md.logits_soft_cap)
    left = _window(sliding_window, pages_per_seq * page_size)
    window = None if left is None else (left, 0)
    problem = PagedProblem(
        num_seqs=n, num_tokens=num_tokens, queries_per_seq=queries_per_seq, heads_q=hq, heads_kv=hkv, head_dim=d,
        head_dim_v=dv, dtype=dtype_name(md.runtime_dtype or q.dtype), page_size=page_size, num_pages=num_pages,
        pages_per_seq=pages_per_seq, kv_layout=layout, sliding_window=window, logits_soft_cap=cap,
        sinks=softmax_aux is not None, kv_dtype=kv_dtype, mask_mod=mask_mod,
    )
    return problem, scale if scale is not None else float(d) ** -0.5


@checked_keywords("a paged attention call")
def resolve_paged_call(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    *,
    kv_pages: Any = None,
    cu_q_lens: Any,
    num_seqs: Any,
    queries_per_seq: int | None = None,
    sliding_window: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    mask_mod: Any = None,
    metadata: AttentionMetadata | None = None,
    prepare: bool = False,
) -> PagedCall:
    """Validate a paged call in its ragged form and fill its defaults from ``metadata``: the one
    ``PagedCall`` it runs as. Arrays may be ``jax.ShapeDtypeStruct``s unless ``prepare`` is set,
    which also normalises them as a forward receives them: q and a float cache in
    ``metadata.runtime_dtype``, ``num_seqs`` int32 of shape (1,), the scales float32 at rank 3,
    NumPy arrays as JAX arrays. ``num_seqs``'s value, when known here, stays on the call as
    ``static_num_seqs``.

    The checks that read no values run once per call signature (``_check``); the values of the
    concrete arrays are checked on every call (``_check_values``)."""
    import numpy as np

    md = DEFAULT_METADATA if metadata is None else as_metadata(metadata)
    # The signature of the call: everything _check reads. Scalars carry their type (True == 1).
    try:
        key: tuple[Any, ...] | None = (
            q.shape, q.dtype, None if k_pages is None else (k_pages.shape, k_pages.dtype),
            None if v_pages is None else (v_pages.shape, v_pages.dtype), page_table.shape, page_table.dtype,
            None if kv_pages is None else (kv_pages.shape, kv_pages.dtype), kv_lengths.shape, kv_lengths.dtype,
            cu_q_lens.shape, cu_q_lens.dtype, num_seqs.shape, num_seqs.dtype, queries_per_seq.__class__,
            queries_per_seq, None if sliding_window is None else repr(sliding_window), softmax_scale.__class__,
            softmax_scale, logits_soft_cap.__class__, logits_soft_cap, mask_mod is None,
            None if softmax_aux is None else (softmax_aux.shape, softmax_aux.dtype),
            None if k_scale is None else (k_scale.shape, k_scale.dtype),
            None if v_scale is None else (v_scale.shape, v_scale.dtype), None if md is DEFAULT_METADATA else md,
        )
        checked = _checked.get(key)  # type: ignore[arg-type]
    except (AttributeError, TypeError):  # not arrays, or unhashable options: the checks say what is wrong
        key = checked = None
    if checked is None:
        checked = _check(q, k_pages, v_pages, kv_pages, page_table, kv_lengths, cu_q_lens, num_seqs,
                         queries_per_seq, sliding_window, softmax_scale, logits_soft_cap, softmax_aux, k_scale,
                         v_scale, mask_mod is not None, md)
        if key is not None:
            if len(_checked) >= MAX_CHECKED:
                _checked.clear()
            _checked[key] = checked
    problem, scale = checked
    if mask_mod is not None:  # traced once per function and shapes (jaxattn.masks)
        from ..masks import check_paged_mask_mod

        check_paged_mask_mod(mask_mod, problem.heads_q, problem.max_context)
    count = _check_values(problem, page_table, kv_lengths, cu_q_lens, num_seqs)
    if problem.kv_layout == "combined":
        k_pages, v_pages = kv_pages, None
    if prepare:
        import jax.numpy as jnp

        q, k_pages, v_pages, page_table, kv_lengths, cu_q_lens, num_seqs, softmax_aux = [
            jnp.asarray(x) if isinstance(x, np.ndarray) else x
            for x in (q, k_pages, v_pages, page_table, kv_lengths, cu_q_lens, num_seqs, softmax_aux)
        ]
        if md.runtime_dtype is not None:
            dtype = jnp.dtype(md.runtime_dtype)
            q = q.astype(dtype)
            if problem.kv_dtype is None:  # a quantized cache is read as it is
                k_pages = k_pages.astype(dtype)
                v_pages = None if v_pages is None else v_pages.astype(dtype)
        if num_seqs.shape != (1,) or num_seqs.dtype != np.int32:
            num_seqs = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
        if count != problem.num_seqs:  # rows past num_seqs: flattened (every row real: no op added)
            cu_q_lens = _active_offsets(cu_q_lens, num_seqs, problem.num_seqs)
        if problem.kv_dtype is not None:
            from .quantize import scale_rank3

            k_scale, v_scale = scale_rank3(k_scale), scale_rank3(v_scale)
    return PagedCall(
        problem=problem, metadata=md, q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table,
        kv_lengths=kv_lengths, cu_q_lens=cu_q_lens, num_seqs=num_seqs, kv_layout=problem.kv_layout,
        queries_per_seq=queries_per_seq, softmax_scale=scale, logits_soft_cap=problem.logits_soft_cap,
        sliding_window=problem.sliding_window,
        softmax_aux=softmax_aux, k_scale=k_scale, v_scale=v_scale, static_num_seqs=count, mask_mod=mask_mod,
    )
