"""The shapes, dtype and features of one call, without the arrays: what backends are asked about.

``AttentionProblem`` describes a dense call (``attention``), ``PagedProblem`` a call over a paged
KV cache (``paged_attention``, ``ragged_paged_attention``). Both are built from arrays or
``jax.ShapeDtypeStruct``s, so ``explain`` and the CLI can ask every backend about a call that
was never materialised, and both are hashable (choices are memoised per problem).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._dtypes import dtype_name
from .capabilities import Feature
from .quantize import QUANTIZED_KV_DTYPES

__all__ = ["AttentionProblem", "PagedProblem", "Problem"]


def _shape(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(d) for d in x.shape)


def _rank4(shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    return None if shape is None else (1,) * (4 - len(shape)) + shape


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Everything a backend needs to decide whether it can run a call."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool = False
    mask_shape: tuple[int, ...] | None = None  # rank 4, dims 1 or full
    bias_shape: tuple[int, ...] | None = None  # rank 4, dims 1 or full
    sliding_window: tuple[int, int] | None = None
    segment_ids: bool = False
    logits_soft_cap: float | None = None
    sinks: bool = False
    dropout_prob: float = 0.0
    needs_grad: bool = False
    kv_lengths: bool = False  # per-sequence key lengths (a dense KV cache of capacity S)
    kv_dtype: str | None = None  # the cache's storage dtype when quantized ("int8", "float8_e4m3fn"...), else None
    mask_mod: bool = False  # a mask_mod function (jaxattn.masks); the call carries it
    #: The mask_mod closes over no traced array and does not vary with b: a kernel that takes
    #: its mask as host data (splash) can evaluate it when it is built.
    mask_mod_static: bool = False
    #: The mask_mod is a ``document()`` of the call's (B, T) and (B, S) ids ANDed with a static rest,
    #: in a call without segment ids (``masks.as_segment_ids``): a kernel with segment ids runs it,
    #: its ids traced or not.
    mask_mod_documents: bool = False
    score_mod: bool = False  # a score_mod function
    #: The score_mod is ``masks.alibi(slopes)`` (``masks.alibi_slopes``): a kernel that cannot run
    #: a traced function adds its term itself.
    score_mod_alibi: bool = False
    #: A concrete ``block_mask``'s tiles: ``(block_q, block_kv, empty, partial, full)``; None
    #: without one, or when it is traced (``explain`` builds one to show it).
    block_sparsity: tuple[int, int, int, int, int] | None = None
    needs_lse: bool = False  # the caller asked for the log-sum-exp (``return_lse=True``)

    #: The op kind: which providers are asked (``AttentionImpl`` subclasses).
    kind = "dense"

    @classmethod
    def from_inputs(
        cls,
        q: Any,
        k: Any,
        v: Any,
        *,
        mask: Any = None,
        bias: Any = None,
        causal: bool = False,
        sliding_window: tuple[int, int] | None = None,
        q_segment_ids: Any = None,
        kv_segment_ids: Any = None,
        logits_soft_cap: float | None = None,
        softmax_aux: Any = None,
        dropout_prob: float = 0.0,
        needs_grad: bool = False,
        dtype: Any = None,
        kv_lengths: Any = None,
        needs_lse: bool = False,
    ) -> AttentionProblem:
        """Describe a call. Inputs are assumed validated (see ``jaxattn.backend.validation``)."""
        b, t, hq, d = _shape(q) or ()
        _, s, hkv, _ = _shape(k) or ()
        kv_dtype = None if k is None else dtype_name(k.dtype)
        return cls(
            batch=b,
            seq_q=t,
            seq_k=s,
            heads_q=hq,
            heads_kv=hkv,
            head_dim=d,
            head_dim_v=int(v.shape[-1]),
            dtype=dtype_name(dtype if dtype is not None else q.dtype),
            causal=bool(causal),
            mask_shape=_rank4(_shape(mask)),
            bias_shape=_rank4(_shape(bias)),
            sliding_window=None if sliding_window is None else (int(sliding_window[0]), int(sliding_window[1])),
            segment_ids=q_segment_ids is not None or kv_segment_ids is not None,
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            sinks=softmax_aux is not None,
            dropout_prob=float(dropout_prob),
            needs_grad=bool(needs_grad),
            kv_lengths=kv_lengths is not None,
            kv_dtype=kv_dtype if kv_dtype in QUANTIZED_KV_DTYPES else None,
            needs_lse=bool(needs_lse),
        )

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    def required_features(self) -> frozenset[Feature]:
        """The features this call cannot run without."""
        need: set[Feature] = set()
        flags = {
            Feature.CAUSAL: self.causal,
            Feature.MASK: self.mask_shape is not None,
            Feature.BIAS: self.bias_shape is not None,
            Feature.GQA: self.heads_q != self.heads_kv,
            Feature.CROSS: self.seq_q != self.seq_k,
            Feature.DECODE: self.seq_q == 1 and self.seq_k > 1,
            Feature.VALUE_DIM: self.head_dim_v != self.head_dim,
            Feature.SLIDING_WINDOW: self.sliding_window is not None,
            Feature.SEGMENT_IDS: self.segment_ids,
            Feature.SOFT_CAP: self.logits_soft_cap is not None,
            Feature.SINKS: self.sinks,
            Feature.DROPOUT: self.dropout_prob > 0,
            Feature.GRAD: self.needs_grad,
            Feature.KV_LENGTHS: self.kv_lengths,
            Feature.QUANTIZED_KV: self.kv_dtype is not None,
            Feature.MASK_MOD: self.mask_mod,
            Feature.SCORE_MOD: self.score_mod,
            Feature.LSE: self.needs_lse,
        }
        need.update(f for f, on in flags.items() if on)
        return frozenset(need)

    def signature(self) -> tuple[Any, ...]:
        """A hashable key of the call (used to log "auto"'s choice once per signature)."""
        return dataclasses.astuple(self)

    def describe(self) -> str:
        feats = ", ".join(sorted(str(f) for f in self.required_features())) or "plain"
        tiles = ""
        if self.block_sparsity is not None:
            bq, bk, empty, partial, full = self.block_sparsity
            tiles = f" (mask_mod tiles {bq}x{bk}: {empty} empty, {partial} partial, {full} full)"
        return (
            f"B={self.batch} T={self.seq_q} S={self.seq_k} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"D={self.head_dim} Dv={self.head_dim_v} {self.dtype} [{feats}]{tiles}"
        )


@dataclasses.dataclass(frozen=True)
class PagedProblem:
    """A call over a paged KV cache, in the ragged form every paged backend receives.

    ``num_tokens`` query rows of ``num_seqs`` sequences (the page table's rows);
    ``queries_per_seq`` is T when every sequence has T queries (``paged_attention``: T == 1 is a
    decode step), None for a ragged batch (``ragged_paged_attention``, per-sequence counts in
    ``cu_q_lens``). Queries are causal per sequence, aligned to its last cached token.
    """

    num_seqs: int
    num_tokens: int
    queries_per_seq: int | None
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    page_size: int
    num_pages: int
    pages_per_seq: int
    kv_layout: str = "separate"  # "separate" (k_pages, v_pages) or "combined" (kv_pages)
    #: ``(left, 0)``, the dense problem's type: left keys a query sees before itself (clamped to
    #: the longest context), right 0, queries being causal. The hooks of a backend declaring
    #: ``window_pair = False`` are asked about a copy holding the int left (``PagedAttentionImpl``).
    sliding_window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False
    needs_grad: bool = False
    kv_dtype: str | None = None  # the cache's storage dtype when quantized ("int8", "float8_e4m3fn"...), else None
    mask_mod: bool = False  # a mask_mod over positions within each sequence (tree masks); the call carries it

    kind = "paged"

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def max_context(self) -> int:
        """The most tokens a sequence's pages hold."""
        return self.pages_per_seq * self.page_size

    def required_features(self) -> frozenset[Feature]:
        flags = {
            Feature.GQA: self.heads_q != self.heads_kv,
            Feature.VALUE_DIM: self.head_dim_v != self.head_dim,
            Feature.SLIDING_WINDOW: self.sliding_window is not None,
            Feature.SOFT_CAP: self.logits_soft_cap is not None,
            Feature.SINKS: self.sinks,
            Feature.MULTI_TOKEN: self.queries_per_seq != 1,
            Feature.RAGGED: self.queries_per_seq is None,
            Feature.GRAD: self.needs_grad,
            Feature.QUANTIZED_KV: self.kv_dtype is not None,
            Feature.MASK_MOD: self.mask_mod,
        }
        return frozenset(f for f, on in flags.items() if on)

    def signature(self) -> tuple[Any, ...]:
        return dataclasses.astuple(self)

    def describe(self) -> str:
        feats = ", ".join(sorted(str(f) for f in self.required_features())) or "plain"
        queries = "ragged" if self.queries_per_seq is None else f"T={self.queries_per_seq}"
        return (
            f"paged: seqs={self.num_seqs} tokens={self.num_tokens} {queries} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"D={self.head_dim} Dv={self.head_dim_v} {self.dtype} pages={self.num_pages}x{self.page_size} "
            f"({self.pages_per_seq}/seq, {self.kv_layout}) [{feats}]"
        )


#: Either kind of problem.
Problem = AttentionProblem | PagedProblem
