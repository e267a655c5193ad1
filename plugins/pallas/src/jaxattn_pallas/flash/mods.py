"""A call's ``mask_mod`` (``jaxattn.masks``) as what the Pallas TPU flash kernel takes.

The kernel runs a traced JAX function only through a dense mask: the mask_mod is evaluated over
the ``(B, Hq, T, S)`` grid into a boolean mask (broadcast over B and Hq where it does not use
them), ANDed with the call's own ``mask=``. A ``document()`` term becomes segment ids instead
(``masks.as_segment_ids``) when the call has none, its ids traced or not: packed documents then
cost ``O(T)`` and only the rest of the mask_mod (causal, say) is a dense mask.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lower_mask_mod"]


def lower_mask_mod(call: Any) -> tuple[Any, Any, Any]:
    """``(mask, q_segment_ids, kv_segment_ids)`` for the kernel from ``call`` (an
    ``AttentionCall`` with a mask_mod): the mask rank 4, broadcastable to ``(B, Hq, T, S)``."""
    import jax.numpy as jnp

    from jaxattn import masks

    rest, q_seg, kv_seg = masks.as_segment_ids(call)
    mask = call.mask
    if rest is not None:
        index = masks.indices(call.q.shape[0], call.q.shape[2], call.q.shape[1], call.k.shape[1])  # B, Hq, T, S
        seen = jnp.asarray(rest(*index), bool)
        seen = seen.reshape((1,) * (4 - seen.ndim) + seen.shape)
        mask = seen if mask is None else mask.astype(bool) & seen
    return mask, q_seg, kv_seg
