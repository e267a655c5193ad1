"""Forward by one backend, gradients by another: what "auto" runs when it must or when it pays.

A ``jax.custom_vjp`` whose primal is backend A's forward and whose forward rule is backend B's
``jax.vjp``. Without differentiation only A runs (A's forward is the fastest). Under
``jax.grad``/``jax.vjp`` JAX calls the forward rule instead of the primal, so B computes the
output *and* its residuals, and B's own backward consumes them: B never has to understand A's
residuals (log-sum-exp layouts, saved tiles), which no contract fixes. The cost of training is
then exactly B's forward+backward.

"auto" uses it in two cases: A's backward cannot run the call at all (a forward cannot know
whether a gradient follows, so the choice of the backward is a decision of its own), and the
tuning cache measured B's forward+backward faster (see
:func:`jaxattn.tuning.refiner.split_eligible` for when that is considered). With no B that
can differentiate the call, differentiating it raises ``UnsupportedError`` with every
candidate's reasons.

This is exact because both backends are exact attention (no approximation): the outputs of
an undifferentiated and a differentiated call differ only by the rounding of two kernels.
Every array argument travels: the bias and the sinks get B's cotangents, masks, segment ids
and the dropout key none. A ``custom_vjp`` has no forward-mode derivative, so
``jax.jvp``/``jax.linearize`` of such a call raise (pick an impl explicitly for those).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .errors import UnsupportedError
from .impl import AttentionImpl
from .output import AttentionOutput

__all__ = ["SplitGradImpl"]

_ARRAY_FEATURES = ("q_segment_ids", "kv_segment_ids", "softmax_aux", "dropout_rng")
# Array arguments whose cotangents the gradient backend computes (the rest are integers,
# booleans or keys: no cotangent).
_DIFFERENTIABLE = ("bias", "softmax_aux")


@functools.lru_cache(maxsize=256)
def _split_fn(forward: AttentionImpl, backward: AttentionImpl | None, refusal: tuple[str, ...], causal: bool,
              names: tuple[str, ...], static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """The split call for one configuration; ``names`` are the array arguments it receives."""
    import jax

    kwargs = dict(static)

    def run(impl: AttentionImpl, q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        return impl(q, k, v, causal=causal, **arrays, **kwargs).attention_outputs

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        return run(forward, q, k, v, arrays)

    def attend_fwd(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> tuple[Any, Any]:
        if backward is None:
            raise UnsupportedError("auto", list(refusal), gradient=True,
                                   hint="no installed impl can differentiate this call here")
        fixed = {n: a for n, a in arrays.items() if n not in _DIFFERENTIABLE}

        def differentiable(q: Any, k: Any, v: Any, diff: dict[str, Any]) -> Any:
            return run(backward, q, k, v, {**fixed, **diff})

        diff = {n: a for n, a in arrays.items() if n in _DIFFERENTIABLE}
        return jax.vjp(differentiable, q, k, v, diff)  # (output, B's pullback)

    def attend_bwd(pullback: Any, cotangent: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
        dq, dk, dv, ddiff = pullback(cotangent)
        return dq, dk, dv, {n: ddiff.get(n) for n in names}

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


class SplitGradImpl(AttentionImpl):
    """Runs ``forward`` for the output and ``backward`` (forward and backward) under differentiation.

    ``backward=None``: nothing can differentiate the call; differentiating it raises
    ``UnsupportedError`` with ``refusal`` (every candidate's reasons).
    """

    def __init__(self, forward: AttentionImpl, backward: AttentionImpl | None,
                 refusal: Sequence[str] = ()) -> None:
        super().__init__(forward.metadata, forward.device)
        self.forward, self.backward, self.refusal = forward, backward, tuple(refusal)

    @classmethod
    def get_impl_name(cls) -> str:
        return "auto"

    def __repr__(self) -> str:
        grad = self.backward.name() if self.backward is not None else None
        return f"<SplitGradImpl forward={self.forward.name()!r} grad={grad!r}>"

    def __call__(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                 init_bias: Callable[[], Any] | None = None, causal: bool = False,
                 **features: Any) -> AttentionOutput:
        if bias is None and init_bias is not None:
            bias = init_bias()
        given = {"mask": mask, "bias": bias, **{n: features.get(n) for n in _ARRAY_FEATURES}}
        arrays = {n: a for n, a in given.items() if a is not None}
        static = tuple(sorted((name, _hashable(value)) for name, value in features.items()
                              if name not in _ARRAY_FEATURES))
        attend = _split_fn(self.forward, self.backward, self.refusal, bool(causal), tuple(sorted(arrays)), static)
        return AttentionOutput(attend(q, k, v, arrays))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
