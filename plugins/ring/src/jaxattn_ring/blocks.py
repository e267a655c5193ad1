"""The per-block kernel, and the block of attention each ring step computes.

Any registered impl that returns its log-sum-exp (``Feature.LSE``) can be the per-block
kernel; it is called through its own ``__call__`` on local blocks, with flags only
(``causal`` on the diagonal block) where the layout allows, so kernels without mask
support serve causal and full attention; masks are built per block only for what flags
cannot express (a user mask, a sliding window, bottom-right causal with T != S).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxattn.api import get_impl
from jaxattn.capabilities import Feature
from jaxattn.errors import JaxattnError, PluginError
from jaxattn.impl import AttentionImpl
from jaxattn.lookup import available_here
from jaxattn.metadata import AttentionMetadata
from jaxattn.problem import AttentionProblem

from .layout import AxisName, Layout, key_columns, positions

__all__ = [
    "BlockKernel",
    "Mode",
    "RingPlan",
    "block",
    "block_problems",
    "choose_kernel",
    "lse_is_differentiable",
]

logger = logging.getLogger("jaxattn")

Mode = Literal["full", "causal", "masked"]
Array = Any


def acc_dtype(dtype: Any) -> Any:
    """Accumulation dtype of the merge: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """The static shape of one ring call (hashable: it keys jax's tracing caches)."""

    axis: AxisName
    n: int  # devices on the ring
    layout: Layout
    mode: Mode  # full: every block whole; causal: T == S, flags only; masked: per-block masks
    t_local: int
    s_local: int
    causal: bool
    window: tuple[int, int] | None
    offset: int  # S - T: bottom-right alignment of causal masks and windows

    @staticmethod
    def choose_mode(*, causal: bool, window: Any, mask: bool, t: int, s: int) -> Mode:
        if mask or window is not None or (causal and t != s):
            return "masked"
        return "causal" if causal else "full"


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """A registered impl called on one block; returns ``(output, lse)``, lse in the accumulation dtype."""

    impl: AttentionImpl
    softmax_scale: float
    logits_soft_cap: float | None

    def __call__(self, q: Array, k: Array, v: Array, *, causal: bool = False, mask: Array = None,
                 q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array]:
        out = self.impl(q, k, v, mask=mask, causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                        softmax_scale=self.softmax_scale, logits_soft_cap=self.logits_soft_cap)
        lse = out.softmax_lse
        want = (q.shape[0], q.shape[2], q.shape[1])
        if lse is None or tuple(lse.shape) != want:
            got = None if lse is None else tuple(lse.shape)
            raise PluginError(f"impl {self.impl.name()!r} declares Feature.LSE but returned softmax_lse {got}, "
                              f"expected shape (B, Hq, T) = {want}")
        return out.attention_outputs.astype(q.dtype), lse.astype(acc_dtype(q.dtype))


def _skip(q: Array, v: Array) -> tuple[Array, Array]:
    """The result of a block with nothing visible: zero output, lse -inf."""
    b, t, h, _ = q.shape
    return (jnp.zeros((b, t, h, v.shape[-1]), q.dtype),
            jnp.full((b, h, t), -jnp.inf, acc_dtype(q.dtype)))


def _rows(x: Array, lo: int, hi: int) -> Array:
    return None if x is None else x[:, lo:hi]


def _visibility(plan: RingPlan, index: Array, src: Array, mask: Array) -> Array:
    """Boolean ``(B|1, H|1, Tl, Sl)``: the positional rules for this block, and the user mask's columns."""
    q_pos = positions(plan.layout, index, plan.n, plan.t_local)[:, None] + plan.offset
    k_pos = positions(plan.layout, src, plan.n, plan.s_local)[None, :]
    visible = jnp.ones((plan.t_local, plan.s_local), bool)
    if plan.causal:
        visible &= k_pos <= q_pos
    if plan.window is not None:
        left, right = plan.window
        visible &= (k_pos >= q_pos - left) & (k_pos <= q_pos + right)
    visible = visible[None, None]
    if mask is not None:
        visible = visible & key_columns(mask, plan.layout, src, plan.n, plan.s_local)
    return visible


def block(plan: RingPlan, kernel: BlockKernel, q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array,
          mask: Array, *, index: Array, src: Array, first: bool) -> tuple[Array, Array]:
    """Attention of this device's queries to the keys of device ``src`` (``first``: its own keys).

    Returns ``(output (B, Tl, H, Dv), lse (B, H, Tl))`` normalised over this block only.
    """
    if plan.mode == "full":
        return kernel(q, k, v, q_ids=q_ids, kv_ids=kv_ids)
    if plan.mode == "masked":
        visible = _visibility(plan, index, src, mask)
        return jax.lax.cond(  # type: ignore[no-any-return]
            jnp.any(visible),
            lambda: kernel(q, k, v, mask=visible, q_ids=q_ids, kv_ids=kv_ids),
            lambda: _skip(q, v),
        )
    if first:  # own keys: causal on the local order is causal on global positions in both layouts
        return kernel(q, k, v, causal=True, q_ids=q_ids, kv_ids=kv_ids)
    if plan.layout == "contiguous":  # earlier devices' keys are all visible, later ones' none
        return jax.lax.cond(  # type: ignore[no-any-return]
            src < index, lambda: kernel(q, k, v, q_ids=q_ids, kv_ids=kv_ids), lambda: _skip(q, v))
    c_q, c_k = plan.t_local // 2, plan.s_local // 2

    def earlier() -> tuple[Array, Array]:
        # Device src < index: both query chunks see all of src's early chunk, none of its late one.
        return kernel(q, k[:, :c_k], v[:, :c_k], q_ids=q_ids, kv_ids=_rows(kv_ids, 0, c_k))

    def later() -> tuple[Array, Array]:
        # Device src > index: only the late query chunk sees src's keys, all of them.
        o, lse = kernel(q[:, c_q:], k, v, q_ids=_rows(q_ids, c_q, 2 * c_q), kv_ids=kv_ids)
        o0, lse0 = _skip(q[:, :c_q], v)
        return jnp.concatenate([o0, o], axis=1), jnp.concatenate([lse0, lse], axis=2)

    return jax.lax.cond(src < index, earlier, later)  # type: ignore[no-any-return]


def block_problems(plan_mode: Mode, layout: Layout, local: AttentionProblem,
                   mask_dims: tuple[int, int] | None) -> list[AttentionProblem]:
    """Every distinct call the per-block kernel gets, as problems (for choosing the kernel).

    ``local`` has the per-device sizes; ``mask_dims`` are the user mask's (B|1, H|1) there.
    """
    base = dataclasses.replace(local, causal=False, mask_shape=None, bias_shape=None, sliding_window=None,
                               sinks=False, dropout_prob=0.0)
    if plan_mode == "full":
        return [base]
    if plan_mode == "masked":
        bm, hm = mask_dims or (1, 1)
        return [dataclasses.replace(base, mask_shape=(bm, hm, local.seq_q, local.seq_k))]
    problems = [dataclasses.replace(base, causal=True), base]
    if layout == "zigzag":
        problems[1:] = [dataclasses.replace(base, seq_k=local.seq_k // 2),
                        dataclasses.replace(base, seq_q=local.seq_q // 2)]
    return problems


def choose_kernel(metadata: AttentionMetadata, problems: list[AttentionProblem],
                  requested: str = "auto") -> tuple[AttentionImpl | None, list[str]]:
    """The per-block impl: ``requested``, or under "auto" the highest-priority impl here that
    returns its lse and accepts every block problem. Returns ``(impl, [])`` or ``(None, reasons)``.
    """
    if requested == "auto":
        names = [p.name for p in available_here(metadata, kind="dense") if p.name not in ("auto", "ring")]
    else:
        names = [requested]
    reasons: list[str] = []
    for name in names:
        try:
            impl = get_impl(name, metadata)
        except (JaxattnError, ImportError) as err:
            reasons.append(f"block kernel {name}: {err}")
            continue
        why: list[str] = []
        if impl.sequence_parallel:
            why.append("is sequence-parallel itself")
        if Feature.LSE not in impl.features:
            why.append("does not return its log-sum-exp (Feature.LSE)")
        for problem in problems:
            why += [r for r in impl.reasons_to_decline(problem) if r not in why]
        if not why:
            return impl, []
        reasons.append(f"block kernel {name}: {'; '.join(why)}")
    return None, reasons


def _depends_on_last_input(jaxpr: Any) -> bool:
    """Whether any output of ``jaxpr`` is computed from its last input (conservative dataflow)."""
    reached = {id(jaxpr.invars[-1])}
    for eqn in jaxpr.eqns:
        if any(id(x) in reached for x in eqn.invars):
            reached.update(id(x) for x in eqn.outvars)
    return any(id(x) in reached for x in jaxpr.outvars)


_lse_grad_cache: dict[tuple[Any, ...], bool] = {}


def lse_is_differentiable(kernel: BlockKernel, q: Array, k: Array, v: Array) -> bool:
    """Whether ``kernel``'s VJP uses the cotangent of its lse (ring's gradient needs it).

    Some kernels treat the lse as a by-product (cuDNN through ``return_residual`` drops its
    cotangent). This traces the kernel's pullback on abstract values, without running it,
    and checks that the lse cotangent reaches the gradients.
    """
    key = (type(kernel.impl), kernel.impl.metadata, kernel.softmax_scale, kernel.logits_soft_cap,
           *((tuple(x.shape), str(x.dtype)) for x in (q, k, v)))
    if key not in _lse_grad_cache:
        def pullback(q: Array, k: Array, v: Array, ct: Array) -> Any:
            _, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v)[1], q, k, v)
            return vjp(ct)

        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
        lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), acc_dtype(q.dtype))
        closed = jax.make_jaxpr(pullback)(*abstract, lse)
        _lse_grad_cache[key] = _depends_on_last_input(closed.jaxpr)
    return _lse_grad_cache[key]


def gradient_kernel(kernel: BlockKernel, q: Array, k: Array, v: Array,
                    fallback: Callable[[], BlockKernel]) -> BlockKernel:
    """The kernel the ring's backward differentiates: ``kernel`` if its lse is differentiable,
    else ``fallback()`` (vanilla), visibly; ``allow_fallback=False`` makes that an error."""
    if lse_is_differentiable(kernel, q, k, v):
        return kernel
    name = kernel.impl.name()
    if not kernel.impl.metadata.allow_fallback:
        raise PluginError(
            f"ring: the per-block kernel {name!r} returns a softmax_lse whose cotangent its VJP ignores, so ring "
            "cannot differentiate through it; set metadata.extra['ring_block_impl']='vanilla' or allow_fallback"
        )
    logger.info("jaxattn: ring differentiates its blocks with vanilla: %s's softmax_lse is not differentiable", name)
    return fallback()
