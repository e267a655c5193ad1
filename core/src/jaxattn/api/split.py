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
:func:`jaxattn.selection.tuning.split_eligible` for when that is considered). With no B that
can differentiate the call, differentiating it raises ``UnsupportedError`` with every
candidate's reasons.

This is exact because both backends are exact attention (no approximation): the outputs of
an undifferentiated and a differentiated call differ only by the rounding of two kernels.
Every array argument travels: the bias and the sinks get B's cotangents, masks, segment ids
and the dropout key none. A ``custom_vjp`` has no forward-mode derivative, so
``jax.jvp``/``jax.linearize`` of such a call raise (pick an impl explicitly for those).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backend.base import Forward, Plan
from ..backend.call import AttentionCall
from ..backend.impl import AttentionImpl
from ..backend.output import AttentionOutput
from ..backend.problem import AttentionProblem
from ..errors import UnsupportedError

__all__ = ["SplitGradImpl", "split_forward"]

# Array arguments whose cotangents the gradient backend computes (the rest are integers,
# booleans or keys: no cotangent).
_DIFFERENTIABLE = ("bias", "softmax_aux")


def split_forward(forward: Plan, backward: Plan | None, refusal: Sequence[str]) -> Forward:
    """A forward that runs ``forward``'s plan for the output and, under differentiation,
    ``backward``'s (its forward and its backward); ``backward=None`` raises ``refusal``."""
    import jax

    refusal = list(refusal)

    def run(call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        arrays = {n: a for n, a in call.arrays().items() if n not in ("q", "k", "v")}
        # A call that asked for the log-sum-exp gets it from the backend that ran: (out, lse).
        with_lse = call.problem.needs_lse

        def results(out: AttentionOutput) -> Any:
            return (out.attention_outputs, out.softmax_lse) if with_lse else out.attention_outputs

        @jax.custom_vjp
        def attend(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
            return results(forward.forward(call.replace(q=q, k=k, v=v, **arrays)))

        def attend_fwd(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> tuple[Any, Any]:
            if backward is None:
                raise UnsupportedError("auto", refusal, gradient=True,
                                       hint="no installed impl can differentiate this call here")
            fixed = {n: a for n, a in arrays.items() if n not in _DIFFERENTIABLE}

            def differentiable(q: Any, k: Any, v: Any, diff: dict[str, Any]) -> Any:
                return results(backward.forward(call.replace(q=q, k=k, v=v, **fixed, **diff)))

            diff = {n: a for n, a in arrays.items() if n in _DIFFERENTIABLE}
            return jax.vjp(differentiable, q, k, v, diff)  # (output, B's pullback)

        def attend_bwd(pullback: Any, cotangent: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
            if with_lse:  # the lse carries no gradient (jaxattn.attention's return_lse)
                cotangent = (cotangent[0], jax.numpy.zeros_like(cotangent[1]))
            dq, dk, dv, ddiff = pullback(cotangent)
            return dq, dk, dv, {n: ddiff.get(n) for n in arrays}

        attend.defvjp(attend_fwd, attend_bwd)
        if with_lse:
            out, lse = attend(q, k, v, arrays)
            return AttentionOutput(out, softmax_lse=lse)
        return AttentionOutput(attend(q, k, v, arrays))

    return run


class SplitGradImpl(AttentionImpl):
    """Runs ``primal`` for the output and ``backward`` (forward and backward) under differentiation.

    ``backward=None``: nothing can differentiate the call; differentiating it raises
    ``UnsupportedError`` with ``refusal`` (every candidate's reasons). Its plan for a problem is
    the two impls' plans joined by ``split_forward``.
    """

    def __init__(self, forward: AttentionImpl, backward: AttentionImpl | None,
                 refusal: Sequence[str] = ()) -> None:
        super().__init__(forward.metadata, forward.device)
        self.primal, self.backward, self.refusal = forward, backward, tuple(refusal)

    @classmethod
    def get_impl_name(cls) -> str:
        return "auto"

    def __repr__(self) -> str:
        grad = self.backward.name() if self.backward is not None else None
        return f"<SplitGradImpl forward={self.primal.name()!r} grad={grad!r}>"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return self.primal.reasons_to_decline(problem)

    def plan(self, problem: AttentionProblem) -> Plan:
        first = self.primal.plan(problem)
        second = None if self.backward is None else self.backward.plan(problem)
        return Plan(split_forward(first, second, self.refusal), first.name, first.out_shape, first.out_dtype)
