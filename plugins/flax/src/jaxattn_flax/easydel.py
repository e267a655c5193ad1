"""EasyDeL's operator call convention, mapped onto jaxattn's call (docs/easydel.md).

EasyDeL's ``FlexibleAttentionModule`` calls its operator as ``impl(**input_dict)``, with keys
that changed across EasyDeL releases: ``q``/``k``/``v`` or ``query``/``key``/``value`` (or
``query_states``/...), ``mask`` (or ``attention_mask``), ``bias``, ``init_bias``, ``causal``,
``segment_ids``, ``sliding_window``, ``softmax_scale``, ``logits_soft_cap``, ``softmax_aux``,
``deterministic``, ``dropout_rng``, ``dropout_prob``, ``cache_metadata``, ``cache_view``,
``precision`` and kernel hints. ``EasyDeLOperator(impl)`` takes that call::

    op = EasyDeLOperator("auto", jaxattn.AttentionMetadata(runtime_softmax_dtype="float32"))
    out = op(**input_dict)            # an AttentionOutput, as EasyDeL's operators return

How each key maps (what EasyDeL's ``VanillaAttn`` does with it, the reference here):

* ``mask``: boolean or 0/1, any of the shapes VanillaAttn takes: ``(b, 1 or Hq, T, S)`` as
  they are, ``(b, Hkv, T, S)`` repeated to the query heads of each group (query head h reads
  mask head ``h // (Hq // Hkv)``, as its key/value head), ``(b, T, S)`` shared by the heads,
  ``(b, S)`` a key padding mask (key j visible to every query where ``mask[b, j]``). Another
  head count, which VanillaAttn silently reads as its first head, is refused.
* ``bias``: ``(b, 1, Hkv or Hq, T, S)``-headed as the mask; ``init_bias`` is called only when
  neither ``mask`` nor ``bias`` is given (VanillaAttn's rule). Given both a mask and a bias,
  jaxattn applies both (VanillaAttn reads only the bias; EasyDeL builds its bias from the
  mask, so the two agree).
* ``causal``: jaxattn's ``causal`` (bottom-right aligned; with the causal masks EasyDeL
  builds it hides nothing more).
* ``segment_ids`` ``(b, T)`` (packed sequences): ``q_segment_ids`` and ``kv_segment_ids``
  both (T == S; otherwise pass those two).
* ``cache_view``, ``cache_metadata``: EasyDeL's dense operators receive the cache's contents
  as ``key``/``value`` and its visibility in ``mask``, and read neither object; nor does this.
  A paged cache view (one with pages) is refused: paged caches go through
  ``jaxattn.ragged_paged_attention``.
* ``deterministic``, ``dropout_prob`` (else ``metadata.dropout_prob``), ``dropout_rng``:
  VanillaAttn's dropout shares one keep-mask across the batch and heads, which no jaxattn
  backend does, so a call that would drop (not deterministic, a probability > 0) is refused.
* ``precision``: the default matmul precision while the call is traced.
* ``prevent_cse``, ``policy``, ``fused_backward``, ``optimized``, ``vmem_limit_bytes``: kernel
  hints that change no number; jaxattn's backends choose their own. ``compute_dtype`` casts
  q, k and v; ``mask_value``, ``cum_seqlens_q`` / ``_k``, ``mask_info`` and
  ``normalize_output=False`` must be left at their defaults (refused otherwise).

Anything else is one ``InvalidInputError`` naming every unknown key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

import jaxattn
from jaxattn import AttentionImpl, AttentionMechanisms, AttentionMetadata, AttentionOutput, InvalidInputError

from .attention_fn import _matmul_precision

__all__ = ["EasyDeLOperator", "easydel_bias", "easydel_call", "easydel_mask"]

_QKV = (("q", "query", "query_states"), ("k", "key", "key_states"), ("v", "value", "value_states"))
_PASSED = ("sliding_window", "softmax_scale", "logits_soft_cap", "softmax_aux", "q_segment_ids", "kv_segment_ids")
_HINTS = ("prevent_cse", "policy", "fused_backward", "optimized", "vmem_limit_bytes")  # change no number
_MUST_BE_NONE = ("mask_value", "cum_seqlens_q", "cum_seqlens_k", "mask_info")
_KNOWN = {n for names in _QKV for n in names} | set(_PASSED) | set(_HINTS) | set(_MUST_BE_NONE) | {
    "mask", "attention_mask", "bias", "init_bias", "causal", "segment_ids", "cache_view", "cache_metadata",
    "deterministic", "dropout_rng", "dropout_prob", "precision", "compute_dtype", "normalize_output"}


class EasyDeLOperator:
    """A jaxattn impl called as EasyDeL's ``FlexibleAttentionModule`` calls its operators."""

    def __init__(self, impl: str | AttentionMechanisms | AttentionImpl = "auto",
                 metadata: AttentionMetadata | None = None) -> None:
        self.impl: AttentionImpl = impl if isinstance(impl, AttentionImpl) else _dense(impl, metadata)
        self.metadata = self.impl.get_impl_metadata()

    def __call__(self, **inputs: Any) -> AttentionOutput:
        return easydel_call(self.impl, **inputs)


def _dense(name: str | AttentionMechanisms, metadata: AttentionMetadata | None) -> AttentionImpl:
    impl = jaxattn.get_impl(name, metadata)
    if not isinstance(impl, AttentionImpl):
        raise InvalidInputError("impl", f"{impl.name()!r} is a paged impl; EasyDeL's dense operators take dense "
                                "key/value states", "call jaxattn.ragged_paged_attention for a paged cache")
    return impl


def easydel_call(impl: AttentionImpl, **inputs: Any) -> AttentionOutput:
    """Run ``impl`` on an EasyDeL ``input_dict`` (the module docstring maps every key)."""
    unknown = sorted(set(inputs) - _KNOWN)
    if unknown:
        raise InvalidInputError(", ".join(unknown), "not a key of EasyDeL's operator call",
                                f"the keys jaxattn maps are {', '.join(sorted(_KNOWN))}")
    q, k, v = (_one(inputs, names) for names in _QKV)
    for name in _MUST_BE_NONE:
        if inputs.get(name) is not None:
            raise InvalidInputError(name, "has no jaxattn meaning that gives EasyDeL's numbers",
                                    "leave it None: pass the mask as mask=, packed sequences as segment_ids=")
    if inputs.get("normalize_output", True) is not True:
        raise InvalidInputError("normalize_output", "jaxattn's outputs are always normalised by the softmax sum",
                                "leave it True")
    _check_cache_view(inputs.get("cache_view"))
    compute = inputs.get("compute_dtype")
    if compute is not None:
        q, k, v = (jnp.asarray(x).astype(compute) for x in (q, k, v))
    hq, hkv = q.shape[2], k.shape[2]
    mask = inputs.get("mask", inputs.get("attention_mask"))
    if "mask" in inputs and "attention_mask" in inputs:
        raise InvalidInputError("attention_mask", "given together with mask", "pass one of them")
    mask = None if mask is None else easydel_mask(mask, hq, hkv)
    bias = None if inputs.get("bias") is None else easydel_bias(inputs["bias"], hq, hkv)
    init_bias: Callable[[], Any] | None = inputs.get("init_bias")
    if mask is not None:
        init_bias = None  # VanillaAttn calls init_bias only when neither a mask nor a bias is given
    features: dict[str, Any] = {n: inputs[n] for n in _PASSED if inputs.get(n) is not None}
    segment_ids = inputs.get("segment_ids")
    if segment_ids is not None:
        if q.shape[1] != k.shape[1]:
            raise InvalidInputError("segment_ids", f"one set of ids needs T == S, got T={q.shape[1]}, S={k.shape[1]}",
                                    "pass q_segment_ids and kv_segment_ids")
        features.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    rate = inputs.get("dropout_prob")
    rate = impl.get_impl_metadata().dropout_prob if rate is None else rate
    if not inputs.get("deterministic", True) and rate > 0:
        raise InvalidInputError("deterministic", "EasyDeL's VanillaAttn drops with one keep-mask shared by every "
                                "batch row and head; jaxattn's backends keep each probability independently",
                                "pass deterministic=True, or call jaxattn.attention(..., dropout_prob=p, "
                                "dropout_rng=key) for independent dropout")
    features["dropout_prob"] = 0.0  # not dropping: the metadata's probability must not apply either
    causal = bool(inputs.get("causal", False))
    with _matmul_precision(inputs.get("precision")):
        return impl(q, k, v, mask, bias, init_bias, causal, **features)


def _one(inputs: dict[str, Any], names: tuple[str, ...]) -> Any:
    given = [n for n in names if inputs.get(n) is not None]
    if len(given) != 1:
        raise InvalidInputError(names[0], f"give exactly one of {', '.join(names)}, got "
                                f"{', '.join(given) or 'none'}")
    return inputs[given[0]]


def _check_cache_view(view: Any) -> None:
    if view is not None and any(hasattr(view, a) for a in ("kv_pages", "key_pages", "page_table", "block_tables")):
        raise InvalidInputError("cache_view", f"{type(view).__name__} is a paged cache; EasyDeL's dense operators "
                                "take the cache's contents as key/value", "call jaxattn.ragged_paged_attention "
                                "(impl='ragged_page_attention') with its pages, page table and lengths")


def easydel_mask(mask: Any, heads_q: int, heads_kv: int) -> Any:
    """An EasyDeL mask as jaxattn's ``(b, 1 or Hq, T, S)`` boolean mask (see the module docstring)."""
    mask = jnp.asarray(mask)
    mask = mask if mask.dtype == jnp.bool_ else mask.astype(jnp.bool_)
    if mask.ndim == 2:  # (b, S): which keys exist, for every query
        return mask[:, None, None, :]
    if mask.ndim == 3:  # (b, T, S): one mask for every head
        return mask[:, None]
    if mask.ndim == 4:
        return _heads("mask", mask, heads_q, heads_kv)
    raise InvalidInputError("mask", f"EasyDeL's masks are (b, S), (b, T, S) or (b, H, T, S), got {mask.shape}")


def easydel_bias(bias: Any, heads_q: int, heads_kv: int) -> Any:
    """An EasyDeL bias ``(b, 1 or Hkv or Hq, T, S)`` as jaxattn's (one per query head)."""
    bias = jnp.asarray(bias)
    if bias.ndim != 4:
        raise InvalidInputError("bias", f"EasyDeL's biases are (b, H, T, S), got {bias.shape}")
    return _heads("bias", bias, heads_q, heads_kv)


def _heads(name: str, x: Any, heads_q: int, heads_kv: int) -> Any:
    h = x.shape[1]
    if h in (1, heads_q):
        return x
    if h == heads_kv:  # per key/value head: query head i belongs to kv head i // (Hq // Hkv)
        return jnp.repeat(x, heads_q // heads_kv, axis=1)
    raise InvalidInputError(name, f"{h} heads is neither 1, the {heads_kv} key/value heads nor the {heads_q} "
                            "query heads", f"give {name} 1, Hkv or Hq heads")
