"""The public entry points that run attention: ``get_impl``, ``attention``, ``paged_attention``,
``ragged_paged_attention`` (and ``explain_paged``).

This is where the layers meet: names are resolved by the selection layer (``lookup``,
``dispatch``), and what runs is composed here: every impl ``get_impl`` returns carries the
``COMPOSED`` composition (fallback and sharding, ``jaxattn.api.compose``), and "auto" gets this
module's ``get_impl`` to build its choices and ``SplitGradImpl`` to give a call's backward its
own backend. A call is validated once, here, into one call object (``jaxattn.backend.call``), which the
impl runs (``Backend.run``: its plan for the problem, then the forward).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend.base import Backend
from ..backend.device import DeviceInfo, detect_device
from ..backend.impl import AttentionImpl
from ..backend.metadata import DEFAULT_METADATA, AttentionMetadata, as_metadata
from ..backend.names import AttentionMechanisms, normalize_name
from ..backend.paged_impl import PagedAttentionImpl
from ..backend.paged_validation import resolve_paged_call
from ..backend.problem import Problem
from ..backend.validation import as_int, resolve_call, shape_of
from ..discovery.plugins import registry
from ..errors import InvalidInputError, PluginError, UnsupportedError, checked_keywords
from ..selection.dispatch import (
    AutoAttention,
    AutoPagedAttention,
    Explanation,
    accepting,
    call_impl_name,
    explain_problem,
)
from ..selection.lookup import new_impl
from .compose import COMPOSED
from .split import SplitGradImpl

__all__ = ["attention", "explain_paged", "get_impl", "paged_attention", "ragged_paged_attention"]


@functools.lru_cache(maxsize=256)
def _composed(name: str, metadata: AttentionMetadata, device: DeviceInfo, generation: int) -> Backend[Any]:
    impl = new_impl(name, metadata, device)
    impl.composition = COMPOSED
    return impl


@functools.lru_cache(maxsize=64)
def _auto(kind: str, metadata: AttentionMetadata, device: DeviceInfo, generation: int) -> Backend[Any]:
    # One instance per metadata and registry state: its plans are memoised per problem.
    if kind == "paged":
        return AutoPagedAttention(metadata, resolve=get_impl)
    return AutoAttention(metadata, resolve=get_impl, combine=SplitGradImpl)


def get_impl(name: str | AttentionMechanisms, metadata: AttentionMetadata | None = None, *,
             kind: str = "dense") -> Any:
    """The implementation called ``name`` (or an alias), bound to ``metadata`` and this device.

    A dense name gives an ``AttentionImpl``, a paged one (``page_attention``,
    ``ragged_page_attention_v3``...) a ``PagedAttentionImpl`` (typed ``Any``: the name decides).
    ``"auto"`` gives an impl that picks the best backend per call, of op ``kind`` ("dense" or
    "paged"). The impl falls back
    on its ``fallback_impl`` where it says so and runs under ``shard_map`` when the metadata
    carries a mesh.
    """
    key = normalize_name(name, "name")
    md = as_metadata(metadata)
    if not isinstance(kind, str) or kind not in ("dense", "paged"):
        raise InvalidInputError("kind", f"must be 'dense' or 'paged', got {kind!r}",
                                "kind picks what 'auto' chooses among; a named impl has its own")
    if key == AttentionMechanisms.AUTO.value:
        return _auto(kind, md, detect_device(), registry().generation)
    return _composed(key, md, detect_device(), registry().generation)


def _with_hint(err: UnsupportedError, problem: Problem, metadata: AttentionMetadata) -> UnsupportedError:
    """``err`` with the impls that would accept (or differentiate) the call named in its hint."""
    others = [n for n in accepting(problem, metadata) if n != err.impl_name]
    verb = "differentiate" if err.gradient else "accept"
    hint = (f"impls that {verb} this call here: {', '.join(others)} (or impl='auto')" if others
            else f"no installed impl can {verb} this call here")
    return UnsupportedError(err.impl_name, err.reasons, hint=hint, gradient=err.gradient)


@checked_keywords("attention()")
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    impl: str | AttentionMechanisms | AttentionImpl | None = None,
    mask: Any = None,
    bias: Any = None,
    init_bias: Callable[[], Any] | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    dropout_prob: float | None = None,
    dropout_rng: Any = None,
    kv_lengths: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    block_mask: Any = None,
    q_padding_lengths: Any = None,
    kv_padding_lengths: Any = None,
    alignment: str = "bottom_right",
    return_lse: bool = False,
    metadata: AttentionMetadata | None = None,
) -> Any:
    """Attention over BTHD tensors: ``(B, T, Hq, D) x (B, S, Hkv, D) -> (B, T, Hq, Dv)``.

    ``q_padding_lengths`` / ``kv_padding_lengths`` ``(B,)``: the queries / keys at and past
    them are padding (a padded query gives zeros, a padded key is seen by none).
    ``alignment="top_left"`` puts query i at key position i for ``causal`` and
    ``sliding_window`` (jax.nn's rule; the default ``"bottom_right"`` puts the queries last).
    ``return_lse=True`` returns ``(output, lse)``, ``lse (B, Hq, T)`` float32, the natural-log
    log-sum-exp of the scaled logits over the visible keys (``-inf`` for a row that sees none),
    without a gradient; only backends declaring ``Feature.LSE`` run such a call.

    ``kv_lengths (B,)`` makes k and v a dense KV cache of capacity S: keys at and past a
    sequence's length are invisible, and ``causal`` / ``sliding_window`` align the queries to
    the sequence's own last token (decoding with per-sequence lengths).

    k and v may be a quantized cache (int8, float8_e4m3fn, float8_e5m2; ``jaxattn.quantize_kv``)
    with float32 ``k_scale`` and ``v_scale`` broadcastable against ``(B, S, Hkv)``: the cache
    means ``values.astype(float32) * scale[..., None]``; the output is in q's dtype.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx) -> score``
    are masks and scores as JAX functions of raw positions, ``block_mask`` their tiles
    (``jaxattn.masks``, docs/masks.md).

    ``impl=None`` means: ``use_impl(...)`` scope, else ``$JAXATTN_IMPL``, else "auto". An
    explicitly chosen impl never falls back silently: it raises ``UnsupportedError`` with every
    reason and the names of the impls that would accept the call.
    """
    md = DEFAULT_METADATA if metadata is None else as_metadata(metadata)
    chosen = impl if isinstance(impl, AttentionImpl) else get_impl(call_impl_name(impl), md)
    if not isinstance(chosen, AttentionImpl):
        raise InvalidInputError("impl", f"{chosen.name()!r} is a {chosen.kind} impl; attention() runs dense ones",
                                "use paged_attention / ragged_paged_attention for paged impls")
    call = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                        sliding_window=sliding_window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
                        dropout_prob=dropout_prob, dropout_rng=dropout_rng, kv_lengths=kv_lengths, k_scale=k_scale,
                        v_scale=v_scale, mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask,
                        q_padding_lengths=q_padding_lengths, kv_padding_lengths=kv_padding_lengths,
                        alignment=alignment, return_lse=return_lse, metadata=chosen.metadata, prepare=True)
    try:
        out = chosen.run(call)
    except UnsupportedError as err:
        if isinstance(chosen, AutoAttention) or err.hint:
            raise
        problem = dataclasses.replace(call.problem, needs_grad=err.gradient)
        raise _with_hint(err, problem, md) from None
    if not return_lse:
        return out.attention_outputs
    if out.softmax_lse is None:
        raise PluginError(f"impl {chosen.name()!r} accepted return_lse=True (Feature.LSE) but returned no softmax_lse")
    import jax

    # Like jax.nn's residual, the lse carries no gradient (backends' VJPs take none for it).
    return out.attention_outputs, jax.lax.stop_gradient(out.softmax_lse)


def _paged_impl(impl: str | AttentionMechanisms | PagedAttentionImpl | None,
                metadata: AttentionMetadata) -> PagedAttentionImpl:
    if isinstance(impl, PagedAttentionImpl):
        return impl
    chosen = get_impl(call_impl_name(impl, "paged"), metadata, kind="paged")
    if not isinstance(chosen, PagedAttentionImpl):
        raise InvalidInputError("impl", f"{chosen.name()!r} is a {chosen.kind} impl, not a paged one",
                                "name a paged impl (page_attention, ragged_page_attention_v3) or 'auto'")
    return chosen


def _num_seqs(num_seqs: Any) -> Any:
    count = num_seqs if type(num_seqs) is int else None  # the common case, without a call
    if count is None:
        count = as_int(num_seqs) if not hasattr(num_seqs, "shape") else None
    if count is None:
        return num_seqs  # an array (checked with the call), or garbage that the check names
    if not 0 <= count <= np.iinfo(np.int32).max:
        raise InvalidInputError("num_seqs", f"is {count}, outside 0..2**31 - 1", "num_seqs counts page-table rows")
    return np.asarray([count], np.int32)


def _run_paged(chosen: PagedAttentionImpl, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any,
               features: dict[str, Any], metadata: AttentionMetadata) -> Any:
    call = chosen.validate(q, k_pages, v_pages, page_table, kv_lengths, prepare=True, **features)
    try:
        return chosen.run(call).attention_outputs
    except UnsupportedError as err:
        if isinstance(chosen, AutoPagedAttention) or err.hint:
            raise
        raise _with_hint(err, call.problem, metadata) from None


@checked_keywords("ragged_paged_attention()")
def ragged_paged_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    *,
    kv_pages: Any = None,
    impl: str | AttentionMechanisms | PagedAttentionImpl | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    mask_mod: Callable[..., Any] | None = None,
    metadata: AttentionMetadata | None = None,
) -> Any:
    """Attention of a ragged batch over a paged KV cache (vLLM-TPU style): ``(num_tokens, Hq, Dv)``.

    ``q (num_tokens, Hq, D)`` packs the queries of several sequences: sequence s owns rows
    ``cu_q_lens[s]:cu_q_lens[s + 1]`` (prefill chunks and decode steps mixed), only the first
    ``num_seqs`` (an int or an int32 array of shape (1,)) are real. The cache is ``k_pages``,
    ``v_pages`` ``(num_pages, page_size, Hkv, D|Dv)``, or ``kv_pages`` in JAX's combined TPU layout
    (pass None for k_pages and v_pages); ``page_table (max_num_seqs, pages_per_seq)`` maps a
    sequence's positions to pages and ``kv_lengths (max_num_seqs,)`` counts its cached tokens,
    the queried ones included. Queries are causal per sequence, aligned to its last token.

    The cache may be quantized (int8, float8_e4m3fn, float8_e5m2; ``jaxattn.quantize_kv``) with
    float32 ``k_scale`` and ``v_scale`` broadcastable against ``(num_pages, page_size, Hkv)``: it
    means ``values.astype(float32) * scale[..., None]``; scales past a sequence's length are unread.

    ``mask_mod(seq, h, q_pos, kv_pos) -> bool`` (positions within the sequence) narrows what each
    query sees, ANDed with the causal rule: a tree mask over a speculative step's draft tokens.
    """
    md = DEFAULT_METADATA if metadata is None else as_metadata(metadata)
    features = {"kv_pages": kv_pages, "cu_q_lens": cu_q_lens, "num_seqs": _num_seqs(num_seqs),
                "sliding_window": sliding_window, "softmax_scale": softmax_scale, "logits_soft_cap": logits_soft_cap,
                "softmax_aux": softmax_aux, "k_scale": k_scale, "v_scale": v_scale}
    if mask_mod is not None:
        features["mask_mod"] = mask_mod
    return _run_paged(_paged_impl(impl, md), q, k_pages, v_pages, page_table, kv_lengths, features, md)


@checked_keywords("paged_attention()")
def paged_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    *,
    kv_pages: Any = None,
    impl: str | AttentionMechanisms | PagedAttentionImpl | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    metadata: AttentionMetadata | None = None,
) -> Any:
    """A decode step over a paged KV cache: ``q (B, Hq, D)`` or ``(B, T, Hq, D)`` -> the same shape, Dv last.

    Every sequence (row of ``page_table``) has T queries, the last T tokens of its
    ``kv_lengths`` (T == 1: a decode step; a few: speculative decoding), causal. The cache
    (quantized or not: ``k_scale``, ``v_scale``) is as in ``ragged_paged_attention``.
    """
    md = DEFAULT_METADATA if metadata is None else as_metadata(metadata)
    shape = tuple(q.shape) if hasattr(q, "shape") else shape_of(q, "q")
    if len(shape) not in (3, 4):
        raise InvalidInputError("q", f"must have shape (B, Hq, D) or (B, T, Hq, D), got {shape}",
                                "ragged_paged_attention takes packed (num_tokens, Hq, D) queries")
    b, t = shape[0], (1 if len(shape) == 3 else shape[1])
    flat = q if len(shape) == 3 else q.reshape(b * t, *shape[-2:])
    features = {"kv_pages": kv_pages, "cu_q_lens": np.arange(b + 1, dtype=np.int32) * t,
                "num_seqs": np.asarray([b], np.int32), "queries_per_seq": t, "sliding_window": sliding_window,
                "softmax_scale": softmax_scale, "logits_soft_cap": logits_soft_cap, "softmax_aux": softmax_aux,
                "k_scale": k_scale, "v_scale": v_scale}
    out = _run_paged(_paged_impl(impl, md), flat, k_pages, v_pages, page_table, kv_lengths, features, md)
    return out.reshape(*shape[:-1], out.shape[-1])


def explain_paged(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    cu_q_lens: Any = None,
    num_seqs: Any = None,
    *,
    impl: str | AttentionMechanisms | None = None,
    metadata: AttentionMetadata | None = None,
    **features: Any,
) -> Explanation:
    """``explain`` for a paged call: ``paged_attention``'s arguments (q rank 3 or 4, no cu_q_lens),
    or ``ragged_paged_attention``'s (q rank 3 with cu_q_lens and num_seqs). Arrays may be
    ``jax.ShapeDtypeStruct``s."""
    md = as_metadata(metadata)
    shape = shape_of(q, "q")
    if cu_q_lens is None:
        b, t = shape[0], (1 if len(shape) == 3 else shape[1])
        q = _Struct((b * t, *shape[-2:]), q.dtype)
        cu_q_lens = np.arange(b + 1, dtype=np.int32) * t
        num_seqs, features["queries_per_seq"] = np.asarray([b], np.int32), t
    call = resolve_paged_call(q, k_pages, v_pages, page_table, kv_lengths, metadata=md,
                              **{**features, "cu_q_lens": cu_q_lens, "num_seqs": _num_seqs(num_seqs)})
    return explain_problem(call.problem, impl=impl, metadata=md)


class _Struct:
    """Shape and dtype only (what validation reads), without importing jax here."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype
