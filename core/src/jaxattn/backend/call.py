"""The call objects: one validated, normalised call, what every ``forward_*`` method receives.

``jaxattn.attention`` (or calling an impl) validates and normalises its arguments once
(``jaxattn.backend.validation.resolve_call``) into an ``AttentionCall``; the paged entry points build a
``PagedCall`` (``jaxattn.backend.paged_validation.resolve_paged_call``). A call carries

* ``problem``: the hashable description of its shapes, dtype and features (``AttentionProblem``
  or ``PagedProblem``), which selection, decline reasons and memoisation use;
* the arrays, as JAX arrays, and every option in its normalised form (see each field);
* ``metadata``: the ``AttentionMetadata`` the call runs under.

A backend's forward reads what it needs from it: ``call.q``, ``call.mask``, ``call.softmax_scale``...
This module is the one place that lists a call's arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .metadata import AttentionMetadata
from .problem import AttentionProblem, PagedProblem

__all__ = ["AttentionCall", "PagedCall"]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionCall:
    """One dense attention call, validated and normalised (docs/contract.md says what it computes).

    Compared by identity: it holds arrays.

    Arrays are JAX arrays (NumPy inputs converted), q, k and v in ``metadata.runtime_dtype`` when
    it is set (a quantized cache stays as it is). ``None`` means the call does not use the feature,
    and only backends that declare a feature receive calls that use it.
    """

    problem: AttentionProblem
    metadata: AttentionMetadata
    q: Any  # (B, T, Hq, D)
    k: Any  # (B, S, Hkv, D)
    v: Any  # (B, S, Hkv, Dv)
    mask: Any = None  # boolean, rank 4 (B|1, Hq|1, T|1, S|1), True = attend
    bias: Any = None  # floating, rank 4 like mask (``init_bias`` already called)
    causal: bool = False
    sliding_window: tuple[int, int] | None = None  # (left, right), each side clamped to max(T, S)
    q_segment_ids: Any = None  # (B, T) ints; given exactly when kv_segment_ids is
    kv_segment_ids: Any = None  # (B, S) ints
    softmax_scale: float = 1.0  # resolved: the call's, the metadata's, or D ** -0.5
    logits_soft_cap: float | None = None
    softmax_aux: Any = None  # (Hq,) sink logits
    dropout_prob: float = 0.0
    dropout_rng: Any = None  # one PRNG key, given when dropout_prob > 0
    kv_lengths: Any = None  # (B,) ints: k and v are a cache holding that many tokens per sequence
    k_scale: Any = None  # float32 rank 3: a quantized cache's scales (Feature.QUANTIZED_KV)
    v_scale: Any = None
    #: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx) -> score``
    #: (``jaxattn.masks``; checked once per signature), and a ``jaxattn.masks.BlockMask`` of the
    #: mask_mod's tiles (its shape and blocks checked; a pytree that travels like the arrays).
    mask_mod: Any = None
    score_mod: Any = None
    block_mask: Any = None

    #: The fields that hold arrays (what travels through ``jax.custom_vjp`` and ``shard_map``).
    ARRAYS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "mask", "bias", "q_segment_ids", "kv_segment_ids",
                                         "softmax_aux", "dropout_rng", "kv_lengths", "k_scale", "v_scale",
                                         "block_mask")

    @property
    def kv_dtype(self) -> str | None:
        """A quantized cache's storage dtype ("int8", "float8_e4m3fn"...), None for a float cache."""
        return self.problem.kv_dtype

    def arrays(self) -> dict[str, Any]:
        """The array fields the call uses, by name."""
        return {name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> AttentionCall:
        """A copy with ``changes`` (arrays inside a transformation, a local problem under ``shard_map``)."""
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """The options past q, k, v, mask, bias and causal, as keyword arguments of a functional
        kernel (``vanilla_attention(q, k, v, mask=..., bias=..., causal=..., **call.options())``):
        ``kv_lengths`` and the scales only when the call has them."""
        out = {
            "sliding_window": self.sliding_window, "q_segment_ids": self.q_segment_ids,
            "kv_segment_ids": self.kv_segment_ids, "softmax_scale": self.softmax_scale,
            "logits_soft_cap": self.logits_soft_cap, "softmax_aux": self.softmax_aux,
            "dropout_prob": self.dropout_prob, "dropout_rng": self.dropout_rng,
        }
        if self.kv_lengths is not None:
            out["kv_lengths"] = self.kv_lengths
        if self.k_scale is not None:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        for name in ("mask_mod", "score_mod", "block_mask"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PagedCall:
    """One call over a paged KV cache, in the ragged form (``jaxattn.backend.paged_impl`` describes it).

    ``k_pages``/``v_pages`` are ``(num_pages, page_size, Hkv, D|Dv)`` with ``kv_layout="separate"``;
    with ``kv_layout="combined"`` ``k_pages`` is JAX's TPU layout ``(num_pages, page_size, 2*Hkv, D)``
    and ``v_pages`` is None.
    """

    problem: PagedProblem
    metadata: AttentionMetadata
    q: Any  # (num_tokens, Hq, D)
    k_pages: Any
    v_pages: Any
    page_table: Any  # (num_seqs, pages_per_seq) ints
    kv_lengths: Any  # (num_seqs,) ints, the queried tokens included
    cu_q_lens: Any  # (num_seqs + 1,) ints
    num_seqs: Any  # int32 (1,)
    kv_layout: str = "separate"
    queries_per_seq: int | None = None  # T when every sequence has T queries, None for a ragged batch
    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    #: ``(left, 0)``, the dense call's type (``problem.sliding_window``): left keys a query sees
    #: before itself (clamped to the longest context); right is 0, queries being causal. A backend
    #: declaring ``window_pair = False`` receives the int left instead, here and on the problem
    #: (``PagedAttentionImpl.window_pair``).
    sliding_window: tuple[int, int] | None = None
    softmax_aux: Any = None
    k_scale: Any = None  # float32 rank 3 for a quantized cache
    v_scale: Any = None
    #: num_seqs's value when the caller gave it concretely (``paged_attention`` always does),
    #: None when traced. A plain int, so it stays known where the arrays become tracers (the
    #: custom VJP that refuses gradients, shard_map, the caller's jit). When it equals the table's
    #: rows (``problem.num_seqs``), no kernel needs to mask rows past num_seqs.
    static_num_seqs: int | None = None
    #: ``mask_mod(seq, h, q_pos, kv_pos) -> bool`` over positions within each sequence (a tree mask
    #: over a speculative step's new tokens), ANDed with the causal rule; checked once per signature.
    mask_mod: Any = None

    ARRAYS: ClassVar[tuple[str, ...]] = ("q", "k_pages", "v_pages", "page_table", "kv_lengths", "cu_q_lens",
                                         "num_seqs", "softmax_aux", "k_scale", "v_scale")

    @property
    def kv_dtype(self) -> str | None:
        return self.problem.kv_dtype

    def arrays(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> PagedCall:
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """Everything past q, k_pages and v_pages as keyword arguments (the scales only when quantized)."""
        out = {
            "page_table": self.page_table, "kv_lengths": self.kv_lengths, "cu_q_lens": self.cu_q_lens,
            "num_seqs": self.num_seqs, "queries_per_seq": self.queries_per_seq,
            "softmax_scale": self.softmax_scale, "logits_soft_cap": self.logits_soft_cap,
            "sliding_window": self.sliding_window, "softmax_aux": self.softmax_aux,
        }
        if self.k_scale is not None:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        if self.mask_mod is not None:
            out["mask_mod"] = self.mask_mod
        return out
