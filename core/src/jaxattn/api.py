"""The public entry points that run attention: ``get_impl`` and ``attention``.

This is where the layers meet: names are resolved by the selection layer (``lookup``,
``dispatch``), and what runs is composed here: every impl ``get_impl`` returns carries the
``COMPOSED`` runner (hand-off and sharding, ``jaxattn.compose``), and "auto" gets this module's
``get_impl`` to build its choices and ``SplitGradImpl`` to give a call's backward its own backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .compose import COMPOSED
from .device import DeviceInfo, detect_device
from .dispatch import AutoAttention, accepting, current_impl_name
from .errors import UnsupportedError
from .impl import AttentionImpl
from .lookup import new_impl
from .metadata import DEFAULT_METADATA, AttentionMetadata
from .names import AttentionMechanisms, normalize_name
from .plugins import registry
from .split import SplitGradImpl
from .validation import resolve_call

__all__ = ["attention", "get_impl"]


@functools.lru_cache(maxsize=256)
def _composed(name: str, metadata: AttentionMetadata, device: DeviceInfo, generation: int) -> AttentionImpl:
    impl = new_impl(name, metadata, device)
    impl.runner = COMPOSED
    return impl


def get_impl(name: str | AttentionMechanisms, metadata: AttentionMetadata | None = None) -> AttentionImpl:
    """The implementation called ``name`` (or an alias), bound to ``metadata`` and this device.

    ``"auto"`` returns an impl that picks the best backend per call. The impl hands calls to
    its ``fallback_impl`` where it says so and runs under ``shard_map`` when the metadata
    carries a mesh.
    """
    key = normalize_name(name)
    md = metadata if metadata is not None else DEFAULT_METADATA
    if key == AttentionMechanisms.AUTO.value:
        return AutoAttention(md, resolve=get_impl, combine=SplitGradImpl)
    return _composed(key, md, detect_device(), registry().generation)


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
    metadata: AttentionMetadata | None = None,
) -> Any:
    """Attention over BTHD tensors: ``(B, T, Hq, D) x (B, S, Hkv, D) -> (B, T, Hq, Dv)``.

    ``impl=None`` means: ``use_impl(...)`` scope, else ``$JAXATTN_IMPL``, else "auto". An
    explicitly chosen impl never falls back silently: it raises ``UnsupportedError`` with every
    reason and the names of the impls that would accept the call.
    """
    md = metadata if metadata is not None else DEFAULT_METADATA
    chosen = impl if isinstance(impl, AttentionImpl) else get_impl(current_impl_name(impl), md)
    kwargs: dict[str, Any] = {
        "sliding_window": sliding_window, "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
        "softmax_scale": softmax_scale, "logits_soft_cap": logits_soft_cap, "softmax_aux": softmax_aux,
        "dropout_prob": dropout_prob, "dropout_rng": dropout_rng,
    }
    try:
        out = chosen(q, k, v, mask, bias, init_bias, causal, **kwargs)
    except UnsupportedError as err:
        if isinstance(chosen, AutoAttention) or err.hint:
            raise
        spec = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal, metadata=md,
                            **kwargs)
        problem = chosen.problem(q, k, v, mask, spec, softmax_aux, needs_grad=err.gradient)
        others = [n for n in accepting(problem, md) if n != err.impl_name]
        verb = "differentiate" if err.gradient else "accept"
        hint = (f"impls that {verb} this call here: {', '.join(others)} (or impl='auto')" if others
                else f"no installed impl can {verb} this call here")
        raise UnsupportedError(err.impl_name, err.reasons, hint=hint, gradient=err.gradient) from None
    return out.attention_outputs
