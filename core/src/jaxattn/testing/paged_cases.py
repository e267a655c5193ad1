"""The paged conformance matrix: calls over a paged KV cache, as data (NumPy only).

A ``PagedCase`` fixes the sequences (query and cached-token counts), the cache (page size,
layout, how pages are allocated) and the features; ``make_paged_inputs`` builds the arrays,
rounded to the dtype under test. The allocations are what a serving engine produces: pages in
order, permuted (a fragmented pool), shared between sequences (a common prompt prefix), with
unused table entries holding garbage, and lengths that are not multiples of the page size.

``PAGED_MOD_CASES`` are calls with a ``mask_mod(seq, h, q_pos, kv_pos)`` (positions within each
sequence, docs/contract.md "Tree masks"), named by a recipe of ``PAGED_MASK_MODS``: a speculative
step's draft tree in a ragged batch and in a uniform one, packed documents, a mask of the query
head. A recipe builds its function from the arrays ``make_paged_inputs`` adds for it (their names
and dtypes: ``MASK_MOD_ARRAYS``), so under ``jax.jit`` what it captures is traced, as in a serving
loop. The recipes import jax (and ``jaxattn.masks``) when they run; this module imports NumPy only.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from .cases import Level, round_to_dtype

__all__ = ["DEFAULT_PAGED_CASES", "FULL_PAGED_CASES", "MASK_MOD_ARRAYS", "PAGED_MASK_MODS", "PAGED_MOD_CASES",
           "PagedCase", "make_paged_inputs", "paged_cases_for", "paged_features", "paged_mask_mod", "poison_unread",
           "query_counts", "read_slots", "seen_slots"]

Allocation = Literal["sequential", "permuted", "shared_prefix"]


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One paged call. ``q_lens`` and ``kv_lens`` per sequence (page-table row); ``uniform`` calls
    go through the decode form (``paged_attention``: every sequence has ``q_lens[0]`` queries)."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    uniform: bool = False
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dv: int | None = None
    page_size: int = 4
    spare_pages: int = 3  # pool pages no sequence uses
    spare_table: int = 1  # page-table entries past the longest sequence (never read)
    allocation: Allocation = "sequential"
    layout: Literal["separate", "combined"] = "separate"
    active: int | None = None  # num_seqs: real sequences (None: every row)
    pad_tokens: int = 0  # query rows after the last real sequence's
    # What cu_q_lens holds past num_seqs (unread): None, the last real offset (jaxattn's own
    # form); 0, zero padding (JAX's ragged TPU test, vLLM-TPU, ejkernel: max_num_seqs + 1 offsets).
    offsets_tail: int | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False
    softmax_scale: float | None = None
    q_gain: float = 1.0
    seed: int = 0
    # The call's mask_mod: a key of PAGED_MASK_MODS (None: no mask_mod).
    mask_mod: str | None = None

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError(f"case {self.name}: q_lens and kv_lens need one entry per sequence")
        if self.uniform and len(set(self.q_lens)) != 1:
            raise ValueError(f"case {self.name}: a uniform case has one query count")
        if self.mask_mod is not None and self.mask_mod not in PAGED_MASK_MODS:
            raise ValueError(f"case {self.name}: no mask_mod recipe {self.mask_mod!r} (PAGED_MASK_MODS)")

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_seqs(self) -> int:
        return self.num_rows if self.active is None else self.active

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    @property
    def pages_per_seq(self) -> int:
        return -(-max(max(self.kv_lens), 1) // self.page_size) + self.spare_table

    def describe(self) -> str:
        form = f"decode T={self.q_lens[0]}" if self.uniform else f"ragged q_lens={self.q_lens}"
        feats = [f for f in ("sliding_window", "logits_soft_cap", "softmax_scale") if getattr(self, f) is not None]
        feats += ["sinks"] if self.sinks else []
        feats += [f"mask_mod={self.mask_mod}"] if self.mask_mod is not None else []
        return (f"{self.name}: {form} kv_lens={self.kv_lens} Hq={self.hq} Hkv={self.hkv} D={self.d} "
                f"Dv={self.value_dim} page={self.page_size} {self.allocation} {self.layout} "
                f"[{', '.join(feats) or 'plain'}]")


DEFAULT_PAGED_CASES: tuple[PagedCase, ...] = (
    PagedCase("decode", q_lens=(1, 1, 1, 1), kv_lens=(5, 16, 1, 11), uniform=True),
    PagedCase("decode_gqa_8to1_permuted", q_lens=(1, 1, 1), kv_lens=(9, 3, 14), uniform=True, hq=8, hkv=1,
              allocation="permuted"),
    PagedCase("decode_combined", q_lens=(1, 1), kv_lens=(7, 13), uniform=True, layout="combined"),
    PagedCase("decode_empty_sequence", q_lens=(1, 1, 1), kv_lens=(6, 0, 2), uniform=True),
    PagedCase("speculative", q_lens=(3, 3, 3), kv_lens=(3, 10, 7), uniform=True, hq=4, hkv=1),
    PagedCase("ragged_mixed", q_lens=(5, 1, 1, 3), kv_lens=(5, 9, 1, 12)),
    PagedCase("ragged_empty_and_padding", q_lens=(2, 0, 1, 4), kv_lens=(7, 5, 0, 6), active=3, pad_tokens=3),
    PagedCase("shared_prefix", q_lens=(2, 1, 1), kv_lens=(10, 9, 13), allocation="shared_prefix"),
    # 3 real sequences of 8 rows, cu_q_lens zero-padded past num_seqs (JAX's and vLLM-TPU's form).
    PagedCase("ragged_zero_padded_offsets", q_lens=(3, 2, 1, 0, 0, 0, 0, 0), kv_lens=(7, 9, 4, 0, 0, 0, 0, 0),
              active=3, pad_tokens=2, offsets_tail=0),
    PagedCase("window", q_lens=(4, 1), kv_lens=(11, 14), sliding_window=3),
    PagedCase("soft_cap", q_lens=(1, 3), kv_lens=(8, 6), logits_soft_cap=2.0, q_gain=4.0),
    PagedCase("sinks", q_lens=(2, 1, 1), kv_lens=(5, 1, 9), sinks=True, hq=4, hkv=2),
    PagedCase("softmax_scale", q_lens=(1, 1), kv_lens=(6, 10), uniform=True, softmax_scale=0.31),
    PagedCase("value_dim", q_lens=(2, 1), kv_lens=(7, 5), dv=8),
    # A fragmented pool under a window: pages_in_address_order moves a band in the middle of the
    # row (what the window still covers, before the first query), ends kept in place.
    PagedCase("ragged_window_permuted", q_lens=(3, 1, 2), kv_lens=(21, 18, 13), sliding_window=12,
              allocation="permuted", seed=3),
    PagedCase("combined_everything", q_lens=(3, 1, 2), kv_lens=(9, 15, 2), layout="combined",
              allocation="permuted", sliding_window=5, logits_soft_cap=3.0, sinks=True, q_gain=2.0, hq=8, hkv=2),
)

FULL_PAGED_CASES: tuple[PagedCase, ...] = (
    *DEFAULT_PAGED_CASES,
    PagedCase("decode_long", q_lens=(1,) * 5, kv_lens=(130, 77, 200, 1, 64), uniform=True, hq=8, hkv=2, d=64,
              page_size=16, allocation="permuted", seed=1),
    PagedCase("ragged_long_prefill", q_lens=(40, 1, 1, 17), kv_lens=(40, 90, 33, 57), hq=8, hkv=1, d=32,
              page_size=8, allocation="permuted", seed=2),
    PagedCase("page_size_1", q_lens=(1, 2), kv_lens=(5, 3), page_size=1),
    # One real sequence; the offsets past it hold garbage, larger than q's rows (unread too).
    PagedCase("ragged_garbage_offsets", q_lens=(4, 0, 0, 0), kv_lens=(6, 0, 0, 0), active=1, offsets_tail=999),
    PagedCase("mha_window_sinks_cap", q_lens=(2, 2), kv_lens=(12, 4), hq=2, hkv=2, sliding_window=0,
              logits_soft_cap=1.5, sinks=True, q_gain=3.0),
    PagedCase("shared_prefix_combined_decode", q_lens=(1, 1, 1), kv_lens=(12, 15, 9), uniform=True,
              allocation="shared_prefix", layout="combined"),
)


# -- mask_mods ---------------------------------------------------------------------------------

Arrays = Mapping[str, Any]

#: Draft tokens per sequence at most in the "tree" recipe: the last ones of its queries.
MAX_DRAFTS = 4


def _tree(a: Arrays) -> Any:
    # A verification step: a draft token sees the cache before its sequence's first draft
    # (tree_start) and its ancestors in the draft tree (tree_ancestors); the queries before
    # the drafts (kv_pos < first for every key they may see) are causal.
    import jax.numpy as jnp

    anc, start = jnp.asarray(a["tree_ancestors"]), jnp.asarray(a["tree_start"])
    last = anc.shape[-1] - 1

    def mask_mod(seq: Any, h: Any, q_pos: Any, kv_pos: Any) -> Any:
        first = start[seq]
        return (kv_pos < first) | anc[seq, jnp.clip(q_pos - first, 0, last), jnp.clip(kv_pos - first, 0, last)]

    return mask_mod


def _document(a: Arrays) -> Any:
    # Packed documents: jaxattn.masks' constructor, the ids over each sequence's positions (one
    # array for queries and keys, as positions within a sequence are both).
    from jaxattn import masks

    return masks.document(a["segment_ids"])


def _by_head(a: Arrays) -> Any:
    # Per query head: the sequence's first token and the keys at most head_reach[h] positions
    # before the query (a KV head's queries may all leave a key unseen that another's see).
    import jax.numpy as jnp

    reach = jnp.asarray(a["head_reach"])
    return lambda seq, h, q_pos, kv_pos: (kv_pos == 0) | (q_pos - kv_pos <= reach[h])


#: mask_mod recipes: a case's arrays (NumPy, or jax, traced under jit) -> its mask_mod.
PAGED_MASK_MODS: dict[str, Callable[[Arrays], Any]] = {"tree": _tree, "document": _document, "by_head": _by_head}

#: The arrays the recipes capture (added by ``make_paged_inputs``) and their dtypes.
MASK_MOD_ARRAYS: dict[str, str] = {"tree_ancestors": "bool", "tree_start": "int32", "segment_ids": "int32",
                                   "head_reach": "int32"}


def _tree_arrays(case: PagedCase) -> dict[str, np.ndarray]:
    """The last ``min(q_len - 1, MAX_DRAFTS)`` queries of each sequence are draft tokens after an
    accepted one (a decode step has none): a tree in which draft i's parent is draft i // 2 - 1
    (-1: the accepted token), so the first two are siblings, and so are the next two."""
    anc = np.zeros((case.num_rows, MAX_DRAFTS, MAX_DRAFTS), bool)
    drafts = np.clip(np.asarray(case.q_lens) - 1, 0, MAX_DRAFTS)
    for s, n in enumerate(drafts):
        for i in range(n):
            node = i
            while node >= 0:
                anc[s, i, node], node = True, node // 2 - 1
    return {"tree_ancestors": anc, "tree_start": (np.asarray(case.kv_lens) - drafts).astype(np.int32)}


def _document_arrays(case: PagedCase) -> dict[str, np.ndarray]:
    """Documents of 5 positions, sequence s's first one s shorter, over the table's capacity."""
    positions = np.arange(case.pages_per_seq * case.page_size)
    return {"segment_ids": ((positions[None] + np.arange(case.num_rows)[:, None]) // 5).astype(np.int32)}


def _by_head_arrays(case: PagedCase) -> dict[str, np.ndarray]:
    """The first KV head's queries reach 1, 4, 7... keys back, the others' 0, 1 or 2."""
    group = np.arange(case.hq) % (case.hq // case.hkv)
    return {"head_reach": np.where(np.arange(case.hq) < case.hq // case.hkv, 1 + 3 * group, group % 3).astype(np.int32)}


_MOD_INPUTS: dict[str, Callable[[PagedCase], dict[str, np.ndarray]]] = {
    "tree": _tree_arrays, "document": _document_arrays, "by_head": _by_head_arrays,
}

#: Calls with a mask_mod (``PagedConformanceSuite.test_mask_mod``), positions within each sequence.
#: One shape for all (12 query rows, 4 table rows of 5 pages, a pool of 14): eager runs, which
#: compile each operation on its own, share most of their compiles.
PAGED_MOD_CASES: tuple[PagedCase, ...] = (
    # A ragged step: a prefill chunk ending in 4 drafts, a decode step, an accepted token and 2
    # drafts; a padding row, cu_q_lens zero-padded past num_seqs, a fragmented pool.
    PagedCase("mm_tree", q_lens=(6, 1, 3, 0), kv_lens=(16, 9, 6, 0), active=3, pad_tokens=2, offsets_tail=0,
              allocation="permuted", spare_pages=5, mask_mod="tree"),
    # Speculative decoding in the uniform form: an accepted token and two sibling drafts each.
    PagedCase("mm_tree_uniform", q_lens=(3, 3, 3, 3), kv_lens=(3, 10, 7, 16), uniform=True, spare_pages=4,
              mask_mod="tree"),
    # Packed documents under a window. Sequence 0's queries see none of its first document, in
    # pages it shares with sequence 1: the keys sequence 1's queries see stay clean, the rest are NaN.
    PagedCase("mm_document_window", q_lens=(6, 2, 1, 3), kv_lens=(14, 9, 6, 12), allocation="shared_prefix",
              spare_pages=4, sliding_window=7, mask_mod="document"),
    # A mask of the query head (KV head 1's queries leave keys unseen that KV head 0's see), a
    # soft cap and sinks.
    PagedCase("mm_by_head", q_lens=(3, 1, 2, 6), kv_lens=(12, 15, 7, 6), allocation="permuted", logits_soft_cap=3.0,
              sinks=True, q_gain=2.0, mask_mod="by_head"),
)


def paged_mask_mod(case: PagedCase, arrays: Arrays) -> Any:
    """``case``'s mask_mod built from ``arrays`` (NumPy for the oracle, jax for the call), or None."""
    return None if case.mask_mod is None else PAGED_MASK_MODS[case.mask_mod](arrays)


def paged_cases_for(level: Level) -> tuple[PagedCase, ...]:
    if level == "default":
        return DEFAULT_PAGED_CASES
    if level == "full":
        return FULL_PAGED_CASES
    raise ValueError(f"conformance level must be 'default' or 'full', got {level!r}")


def _page_table(case: PagedCase, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """``(page_table, num_pages)``: a pool big enough for every sequence plus spares."""
    rows, per_seq, ps = case.num_rows, case.pages_per_seq, case.page_size
    used = [-(-n // ps) for n in case.kv_lens]
    shared = min(used[:2]) - 1 if case.allocation == "shared_prefix" and rows >= 2 else 0
    shared = max(shared, 0)
    num_pages = sum(used) - shared + case.spare_pages
    order = rng.permutation(num_pages) if case.allocation == "permuted" else np.arange(num_pages)
    # Entries that are never read hold garbage, out-of-range values included.
    table = rng.integers(-3, num_pages + 3, size=(rows, per_seq)).astype(np.int32)
    nxt = 0
    for s, n in enumerate(used):
        first = 0
        if s == 1 and shared:  # sequence 1 reuses sequence 0's first pages (a common prefix)
            table[1, :shared] = table[0, :shared]
            first = shared
        for p in range(first, n):
            table[s, p] = order[nxt]
            nxt += 1
    return table, num_pages


def make_paged_inputs(case: PagedCase, dtype: str) -> dict[str, Any]:
    """Arrays of ``case`` (float64 NumPy rounded to ``dtype``, int32 indices): ``q``, ``k_pages`` and
    ``v_pages`` or ``kv_pages``, ``page_table``, ``kv_lengths``, ``cu_q_lens``, ``num_seqs``,
    ``softmax_aux`` with sinks, and the arrays its mask_mod recipe captures (``MASK_MOD_ARRAYS``)."""
    rng = np.random.default_rng([zlib.crc32(case.name.encode()), case.seed])
    table, num_pages = _page_table(case, rng)
    ps, hkv, d, dv = case.page_size, case.hkv, case.d, case.value_dim
    cu = np.zeros(case.num_rows + 1, np.int32)
    cu[1:] = np.cumsum(case.q_lens)
    num_tokens = int(cu[case.num_seqs]) + case.pad_tokens
    if case.active is not None:  # rows of inactive sequences: their offsets stay where the real ones end
        cu[case.num_seqs + 1:] = cu[case.num_seqs] if case.offsets_tail is None else case.offsets_tail
    out: dict[str, Any] = {
        "q": round_to_dtype(rng.normal(size=(num_tokens, case.hq, d)) * case.q_gain, dtype),
        "page_table": table,
        "kv_lengths": np.asarray(case.kv_lens, np.int32),
        "cu_q_lens": cu,
        "num_seqs": np.asarray([case.num_seqs], np.int32),
    }
    if case.layout == "combined":
        if dv != d:
            raise ValueError(f"case {case.name}: the combined layout needs Dv == D")
        out["kv_pages"] = round_to_dtype(rng.normal(size=(num_pages, ps, 2 * hkv, d)), dtype)
    else:
        out["k_pages"] = round_to_dtype(rng.normal(size=(num_pages, ps, hkv, d)), dtype)
        out["v_pages"] = round_to_dtype(rng.normal(size=(num_pages, ps, hkv, dv)), dtype)
    if case.sinks:
        out["softmax_aux"] = round_to_dtype(rng.normal(size=(case.hq,)), "float32")
    if case.mask_mod is not None:
        out.update(_MOD_INPUTS[case.mask_mod](case))
    return out


def query_counts(arrays: dict[str, Any]) -> np.ndarray:
    """Queries per page-table row of a ragged call's arrays: ``np.diff`` of the real offsets
    (``cu_q_lens[:num_seqs + 1]``), zeros for the rows past num_seqs (their offsets are unread)."""
    n = int(np.asarray(arrays["num_seqs"]).reshape(-1)[0])
    counts = np.zeros(len(arrays["kv_lengths"]), np.int32)
    counts[:n] = np.diff(np.asarray(arrays["cu_q_lens"])[: n + 1])
    return counts


def read_slots(table: np.ndarray, kv_lens: tuple[int, ...], num_pages: int, page_size: int) -> np.ndarray:
    """``(num_pages, page_size)``: True where some page-table row's position below its length lives."""
    read = np.zeros((num_pages, page_size), bool)
    for s, n in enumerate(kv_lens):
        for p in range(n):
            read[table[s, p // page_size], p % page_size] = True
    return read


def seen_slots(table: np.ndarray, visibility: list[np.ndarray], num_pages: int, page_size: int,
               kv_heads: int) -> np.ndarray:
    """``(num_pages, page_size, kv_heads)``: True where some query of a sequence listing the slot
    sees its key in that KV head; ``visibility`` is per sequence ``(Hq, q_len, kv_len)`` (the
    oracle's ``paged_visibility``), query head h reading KV head ``h // (Hq // kv_heads)``."""
    seen = np.zeros((num_pages, page_size, kv_heads), bool)
    for s, vis in enumerate(visibility):
        hq, t, n = vis.shape
        by_head: np.ndarray = np.any(vis.reshape(kv_heads, hq // kv_heads, t, n), axis=(1, 2))  # (kv_heads, n)
        for p in range(n):
            seen[table[s, p // page_size], p % page_size] |= by_head[:, p]
    return seen


def poison_unread(case: PagedCase, arrays: dict[str, Any], value: float,
                  seen: np.ndarray | None = None) -> dict[str, Any]:
    """``arrays`` with everything the contract calls unread set to ``value`` (NaN, +Inf...).

    Every pool slot no sequence reads (rows of a sequence's last page at or past its length,
    whole unused pages) holds ``value``, and every page-table entry past a sequence's last page
    names an unused, poisoned page (when the pool has one). Given ``seen`` (``seen_slots``: a
    mask_mod's call), so does every slot and KV head it leaves False: keys no query's KV head
    sees are not read either. The oracle's answer is unchanged.
    """
    out = dict(arrays)
    pool = arrays["kv_pages"] if "kv_pages" in arrays else arrays["k_pages"]
    num_pages, ps = pool.shape[:2]
    table = np.array(arrays["page_table"], copy=True)
    read = read_slots(table, case.kv_lens, num_pages, ps)
    unused = np.flatnonzero(~read.any(axis=1))
    if unused.size:
        for row, n in enumerate(case.kv_lens):
            first = -(-n // ps)
            table[row, first:] = unused[np.arange(table.shape[1] - first) % unused.size]
    out["page_table"] = table
    for name in ("k_pages", "v_pages", "kv_pages"):
        if name in arrays:
            poisoned = np.array(arrays[name], copy=True)
            poisoned[~read] = value
            if seen is not None:  # the combined layout holds KV head h's K at 2h and its V at 2h + 1
                poisoned[~(np.repeat(seen, 2, axis=2) if name == "kv_pages" else seen)] = value
            out[name] = poisoned
    return out


def paged_features(case: PagedCase) -> dict[str, Any]:
    """The static keyword arguments of ``case``'s call (only those it sets)."""
    feats: dict[str, Any] = {}
    for name in ("sliding_window", "logits_soft_cap", "softmax_scale"):
        if getattr(case, name) is not None:
            feats[name] = getattr(case, name)
    return feats
