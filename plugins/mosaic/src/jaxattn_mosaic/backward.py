"""mosaic_flash's gradients: a forward's residuals (q, k, v, output, lse) handed to a flash backward.

A flash backward needs only ``q, k, v``, the output, the log-sum-exp and the cotangents, so a
differentiated ``mosaic_flash`` call runs its forward once and one backward:

* :func:`with_own_backward`: this package's Mosaic GPU backward (``backward_kernel``), which
  takes the lse's cotangent itself (it enters ``delta``), head dims 64 and 128, any T and S,
  bottom-right causal, a logits soft cap, a sliding window;
* :func:`with_cudnn_backward`: cuDNN's (``jaxattn_sdpa.residual.cudnn_backward`` binds it
  with any forward's pair), for head dim 256.

cuDNN's backward takes no cotangent of the lse. When a loss uses the lse (``d_lse != 0``,
decided at run time), its exact terms are added: with ``P`` the softmax and ``s`` the scale,
``d lse_i / d q_i = s * sum_j P_ij k_j`` and ``d lse_i / d k_j = s * P_ij q_i``. The first is
this forward with the keys as values (``P K``); the second is the ``dV`` a flash backward
computes, ``P^T dO``, at ``dO = d_lse * Q`` (summed over a GQA group as dV is). Both read the
same ``P`` (the same q, k and lse), so nothing is approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["differentiable", "with_cudnn_backward", "with_own_backward"]

Array = Any
Forward = Callable[[Array, Array, Array], tuple[Array, Array]]
#: ``backward(q, k, v, out, lse, d_out, d_lse) -> (dq, dk, dv)``.
Backward = Callable[[Array, Array, Array, Array, Array, Array, Array], tuple[Array, Array, Array]]


def _rows(x: Array) -> Array:
    """``(B, H, T)`` row values -> ``(B, T, H, 1)`` to scale ``(B, T, H, D)`` arrays."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def differentiable(forward: Any, backward: Any, aux: dict[str, Array] | None = None) -> Forward:
    """``forward(q, k, v, **aux) -> (out, lse)`` differentiated by ``backward(q, k, v, out, lse,
    d_out, d_lse, **aux) -> (dq, dk, dv, aux's cotangents)`` at its residuals. ``aux``: inputs of
    both passed as arguments (they may be traced: a closure would not be differentiated), a mask_mod's
    bits (integers: no cotangent) or ALiBi's slopes; the cotangents a dict of those that have one."""
    given = aux or {}

    @jax.custom_vjp
    def attend(q: Array, k: Array, v: Array, aux: dict[str, Array]) -> tuple[Array, Array]:
        return forward(q, k, v, **aux)  # type: ignore[no-any-return]

    def attend_fwd(q: Array, k: Array, v: Array, aux: dict[str, Array]) -> tuple[tuple[Array, Array], Any]:
        out, lse = forward(q, k, v, **aux)
        return (out, lse), (q, k, v, out, lse, aux)

    def attend_bwd(res: Any, cts: tuple[Array, Array]) -> tuple[Any, ...]:
        q, k, v, out, lse, aux = res
        dq, dk, dv, *rest = backward(q, k, v, out, lse, *cts, **aux)
        grads = rest[0] if rest else {}
        return dq, dk, dv, {name: grads[name] if name in grads else np.zeros(a.shape, jax.dtypes.float0)
                            for name, a in aux.items()}

    attend.defvjp(attend_fwd, attend_bwd)
    return lambda q, k, v: attend(q, k, v, given)


def with_own_backward(forward: Any, *, causal: bool, softmax_scale: float, soft_cap: float | None = None,
                      sliding_window: tuple[int, int] | None = None, aux: dict[str, Array] | None = None) -> Forward:
    """``forward`` made differentiable by this package's Mosaic GPU backward (head dims 64, 128);
    ``aux``: a mask_mod's ``bits`` and ALiBi's ``alibi_slopes``, as ``forward(q, k, v, **aux)`` takes them."""
    from jaxattn_mosaic.backward_kernel import mosaic_attention_backward

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array, d_lse: Array,
                 **aux: Array) -> tuple[Any, ...]:
        grads = mosaic_attention_backward(q, k, v, out, lse, d_out, d_lse, causal=causal,
                                          softmax_scale=softmax_scale, soft_cap=soft_cap,
                                          sliding_window=sliding_window, **aux)
        return (*grads[:3], {"alibi_slopes": grads[3]} if len(grads) > 3 else {})

    return differentiable(forward, backward, aux)


def with_cudnn_backward(forward: Forward, *, causal: bool, softmax_scale: float) -> Forward:
    """``forward(q, k, v) -> (out, lse)`` made differentiable by cuDNN's backward at its residuals.

    Full attention, or causal with T == S (cuDNN's causal is top-left), even T and S
    (``MosaicFlashAttention.not_supported_reasons`` declines the rest before this runs).
    """
    from jaxattn_sdpa.residual import cudnn_backward

    def flash(q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array) -> tuple[Array, Array, Array]:
        return cudnn_backward(q, k, v, out, lse, d_out, causal=causal, softmax_scale=softmax_scale)

    def backward(q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array,
                 d_lse: Array) -> tuple[Array, Array, Array]:
        dq, dk, dv = flash(q, k, v, out, lse, d_out)
        d_lse = d_lse.astype(jnp.float32)

        def lse_terms() -> tuple[Array, Array]:
            p_k, _ = forward(q, k, k)  # P K
            p_t = flash(q, k, k, jnp.zeros_like(q), lse, _rows(d_lse) * q.astype(jnp.float32))[2]  # P^T (d_lse Q)
            return (softmax_scale * _rows(d_lse) * p_k.astype(jnp.float32),
                    softmax_scale * p_t.astype(jnp.float32))

        def none() -> tuple[Array, Array]:
            return jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32)

        extra_q, extra_k = jax.lax.cond(jnp.any(d_lse != 0), lse_terms, none)
        return ((dq.astype(jnp.float32) + extra_q).astype(q.dtype), (dk.astype(jnp.float32) + extra_k).astype(k.dtype),
                dv)

    return differentiable(forward, backward)
