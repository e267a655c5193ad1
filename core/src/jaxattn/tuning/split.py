"""Forward by one backend, gradients by another: what "auto" runs when measurements say so.

A ``jax.custom_vjp`` whose primal is backend A's forward and whose forward rule is backend B's
``jax.vjp``. Without differentiation only A runs (A's forward is the fastest). Under
``jax.grad``/``jax.vjp`` JAX calls the forward rule instead of the primal, so B computes the
output *and* its residuals, and B's own backward consumes them: B never has to understand A's
residuals (log-sum-exp layouts, saved tiles), which no contract fixes. The cost of training is
then exactly B's forward+backward, the fastest measured.

This is exact because both backends are exact attention (no approximation): the outputs of
an undifferentiated and a differentiated call differ only by the rounding of two kernels.
Limits, which is why :func:`jaxattn.tuning.refiner.split_eligible` gates it: the only arrays
are q, k and v (no mask, bias, segment ids, sinks or dropout), and a ``custom_vjp`` has no
forward-mode derivative, so ``jax.jvp``/``jax.linearize`` of such a call raise (set
``JAXATTN_TUNING=0`` or pick an impl explicitly for those).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..impl import AttentionImpl
from ..output import AttentionOutput

__all__ = ["SplitGradImpl"]

_ARRAY_FEATURES = ("q_segment_ids", "kv_segment_ids", "softmax_aux", "dropout_rng")


@functools.lru_cache(maxsize=256)
def _split_fn(forward: AttentionImpl, backward: AttentionImpl, causal: bool,
              static: tuple[tuple[str, Any], ...]) -> Callable[[Any, Any, Any], Any]:
    import jax

    kwargs = dict(static)

    def run(impl: AttentionImpl, q: Any, k: Any, v: Any) -> Any:
        return impl(q, k, v, causal=causal, **kwargs).attention_outputs

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any) -> Any:
        return run(forward, q, k, v)

    def attend_fwd(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        return jax.vjp(functools.partial(run, backward), q, k, v)  # (output, B's pullback)

    def attend_bwd(pullback: Any, cotangent: Any) -> tuple[Any, Any, Any]:
        return pullback(cotangent)  # type: ignore[no-any-return]

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


class SplitGradImpl(AttentionImpl):
    """Runs ``forward`` for the output and ``backward`` (forward and backward) under differentiation."""

    def __init__(self, forward: AttentionImpl, backward: AttentionImpl) -> None:
        super().__init__(forward.metadata, forward.device)
        self.forward, self.backward = forward, backward

    @classmethod
    def get_impl_name(cls) -> str:
        return "auto"

    def __repr__(self) -> str:
        return f"<SplitGradImpl forward={self.forward.name()!r} grad={self.backward.name()!r}>"

    def __call__(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                 init_bias: Callable[[], Any] | None = None, causal: bool = False,
                 **features: Any) -> AttentionOutput:
        arrays = [mask, bias, init_bias, *(features.get(n) for n in _ARRAY_FEATURES)]
        if any(a is not None for a in arrays):
            # Not a call the split was chosen for; one backend runs it whole (the gradient one,
            # so that differentiating it stays fast).
            return self.backward(q, k, v, mask, bias, init_bias, causal, **features)
        static = tuple(sorted((name, _hashable(value)) for name, value in features.items()
                              if name not in _ARRAY_FEATURES))
        return AttentionOutput(_split_fn(self.forward, self.backward, bool(causal), static)(q, k, v))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
