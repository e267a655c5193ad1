"""cuDNN's flash-attention backward fed another forward's output and log-sum-exp.

A flash backward needs only ``q, k, v``, the output ``O``, the log-denominator ``L`` and the
output's cotangent: it recomputes ``P = exp(s * QK^T - L)``, takes ``D = rowsum(dO * O)`` and
returns ``dQ, dK, dV`` of ``dS = P * (dO V^T - D)``. cuDNN's backward is such a kernel, and
jax binds it with those residuals as operands; ``jax.nn`` exposes only the pair it computed
itself. Ring attention hands each block the ring's *global* ``O`` and ``L`` instead: then
``P`` is the block's share of the final softmax and the result is that block's exact
contribution to the gradients, with no block forward run again.

The binding is jax's private primitive (``jax/_src/cudnn/fused_attention_stablehlo.py``, the
same in jax 0.10 and 0.11); :func:`unavailable` says why it cannot be used where it is missing,
so callers decline instead of failing. Full and causal (T == S) attention only, no bias, mask
or lengths: what ring's blocks are. cuDNN takes no cotangent of ``L``; callers route calls
that have one elsewhere (jaxattn-ring runs the blockwise backward for them).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cudnn_backward", "unavailable"]

Array = Any


@functools.lru_cache(maxsize=1)
def _binding() -> tuple[Any, Any, Any, dict[str, Any]] | str:
    """``(primitive, MaskType, AttentionLayout, extra parameters)``, or why jax here has none.

    jax 0.12 gave the primitive a ``score_mod`` parameter (None: none), which its impl requires;
    jax 0.10-0.11 have none, and refuse one."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as err:
        return f"jax {jax.__version__} has no cuDNN attention module ({err})"
    names = ("_dot_product_attention_bwd_p_wrapper", "MaskType", "AttentionLayout", "_dot_product_attention_bwd_impl")
    parts: list[Any] = [getattr(fa, n, None) for n in names]
    if any(p is None for p in parts):
        return f"jax {jax.__version__} does not expose cuDNN's attention backward as jax 0.10-0.12 do"
    impl_params = inspect.signature(parts[3]).parameters
    extra: dict[str, Any] = {"score_mod": None} if "score_mod" in impl_params else {}
    return parts[0], parts[1], parts[2], extra


def unavailable() -> str | None:
    """Why :func:`cudnn_backward` cannot be bound with this jax (None: it can)."""
    found = _binding()
    return found if isinstance(found, str) else None


def cudnn_backward(q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array, *, causal: bool = False,
                   softmax_scale: float | None = None) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` (q's dtype) of attention at cotangent ``d_out``, from residuals ``out``
    ``(B, T, Hq, D)`` and ``lse`` ``(B, Hq, T)`` (the natural-log denominator of the scaled
    logits, finite) that need not come from this call's own forward.

    q ``(B, T, Hq, D)``, k/v ``(B, S, Hkv, D)`` in bfloat16 or float16; ``causal`` only with T == S.
    """
    found = _binding()
    if isinstance(found, str):
        raise NotImplementedError(found)
    primitive, mask_type, layout, extra = found
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"cudnn_backward: causal needs T == S, got T={q.shape[1]}, S={k.shape[1]}")
    scale = float(q.shape[-1]) ** -0.5 if softmax_scale is None else float(softmax_scale)
    unused = jnp.zeros(0, q.dtype)  # what jax passes for the bias, lengths, offsets and page tables it lacks
    dq, dk, dv = primitive.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused,
        lse.astype(jnp.float32), out.astype(q.dtype), d_out.astype(q.dtype),
        scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=mask_type.CAUSAL if causal else mask_type.NO_MASK, layout=layout.BTNH.value,
        sliding_window_length=None, **extra,
    )
    return dq, dk, dv
