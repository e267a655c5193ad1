"""The per-block kernel, and the block of attention each ring step computes.

Any registered impl that returns its log-sum-exp (``Feature.LSE``) can be the per-block
kernel, and so can ``"cudnn"`` (cuDNN's forward and its own backward fed the ring's residuals:
``CudnnKernel``) and ``"X+blockwise"``: impl X's forward with the blockwise backward of
jaxattn-vanilla fed X's output and lse (``OwnBackwardKernel``: for X whose lse has no gradient,
cuDNN's). "auto" tries :data:`CANDIDATES` first, in their measured order, then every other impl
that returns its lse by priority. A kernel is called through its own ``__call__`` on local blocks, with flags only
(``causal`` on the diagonal block) where the layout allows, so kernels without mask
support serve causal and full attention; masks are built per block only for what flags
cannot express (a user mask, a sliding window, bottom-right causal with T != S).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxattn.backend import (
    AttentionImpl,
    AttentionMetadata,
    AttentionProblem,
    Feature,
    JaxattnError,
    PluginError,
    available_here,
    get_impl,
)

from .comm import Comm
from .layout import AxisName, Layout, key_columns, positions

__all__ = [
    "CANDIDATES",
    "BlockKernel",
    "CudnnKernel",
    "CudnnLseKernel",
    "Mode",
    "OwnBackwardKernel",
    "Residuals",
    "RingTiling",
    "block",
    "block_grads",
    "block_problems",
    "choose_kernel",
    "lse_is_differentiable",
]

logger = logging.getLogger("jaxattn")

Mode = Literal["full", "causal", "masked"]
Array = Any

#: The per-block kernels "auto" tries first, fastest first as measured by ``benchmarks/ring_bench.py
#: --block-kernels`` (ring forward+backward, causal, bf16): each returns ``(out, lse)`` and has a
#: backward for the ring. cuDNN's forward and its own backward fed the ring's residuals (``cudnn``);
#: Triton's ``flash_attn2`` (its backward subtracts the lse cotangent); jaxattn-mosaic's Hopper
#: forward and cuDNN's forward with the blockwise backward. On 4 H200s at 128k tokens ``cudnn``
#: blocks ran 1.21-1.22x faster than ``flash_attn2`` blocks on 2 and 4 GPUs, and those 2.8x faster
#: than ``cudnn+blockwise`` (docs/bench.md, "Multi-GPU"); ``mosaic_flash+blockwise`` shares the
#: blockwise backward and was not timed there.
CANDIDATES: tuple[str, ...] = ("cudnn", "flash_attn2", "mosaic_flash+blockwise", "cudnn+blockwise")

#: The backward an ``"X+blockwise"`` kernel takes X's forward to (jaxattn-vanilla's).
OWN_BACKWARD = "blockwise"


def acc_dtype(dtype: Any) -> Any:
    """Accumulation dtype of the merge: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class RingTiling:
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
    arrived_zigzag: bool = False  # the caller's sequence axes are in zigzag order already (ring_inputs)
    comm: Comm = "ppermute"

    @property
    def kv_natural(self) -> bool:
        """All-gathered K/V that arrived in natural order stay so (no relayout): the gathered array is in
        global order, and a device's block is cut from it by the layout's rows."""
        return self.comm == "all_gather" and self.layout == "zigzag" and not self.arrived_zigzag

    @staticmethod
    def choose_mode(*, causal: bool, window: Any, mask: bool, t: int, s: int) -> Mode:
        if mask or window is not None or (causal and t != s):
            return "masked"
        return "causal" if causal else "full"


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What ring's backward hands a block kernel's residual backward, for this device's query rows:
    the ring's final output, its log-denominator ``L`` (sink included; 0 where infinite), the
    output's cotangent, and the lse cotangent in terms of ``L`` (``exp(L - lse) * d lse``, ``d lse``
    the cotangent of the lse ring returns)."""

    out: Array  # (B, Tl, H, Dv)
    lse: Array  # (B, H, Tl)
    d_out: Array  # (B, Tl, H, Dv)
    d_lse: Array  # (B, H, Tl)

    def rows(self, lo: int, hi: int) -> Residuals:
        return Residuals(self.out[:, lo:hi], self.lse[:, :, lo:hi], self.d_out[:, lo:hi], self.d_lse[:, :, lo:hi])


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """A registered impl called on one block; returns ``(output, lse)``, lse in the accumulation dtype.

    Its backward: an impl with ``backward_from_residuals(q, k, v, out, lse, d_out, d_lse, *, causal,
    mask, q_segment_ids, kv_segment_ids, softmax_scale, logits_soft_cap) -> (dq, dk, dv)`` (a flash
    backward that takes any forward's output and lse) gets the ring's own output and
    log-denominator, so no block's forward runs again (``residual_backward``); ring differentiates
    any other through ``jax.vjp`` of the block, which recomputes its forward.
    """

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

    @property
    def residual_backward(self) -> bool:
        """Whether ring's backward can feed this kernel its residuals (no block forward again)."""
        return callable(getattr(self.impl, "backward_from_residuals", None))

    def backward(self, q: Array, k: Array, v: Array, res: Residuals, *, causal: bool = False, mask: Array = None,
                 q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array, Array]:
        """``(dq, dk, dv)`` of this block at the ring's residuals (``residual_backward`` kernels only)."""
        return self.impl.backward_from_residuals(  # type: ignore[attr-defined,no-any-return]
            q, k, v, res.out, res.lse, res.d_out, res.d_lse, causal=causal, mask=mask, q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, softmax_scale=self.softmax_scale, logits_soft_cap=self.logits_soft_cap)


@dataclasses.dataclass(frozen=True)
class OwnBackwardKernel(BlockKernel):
    """``impl``'s forward with the blockwise backward of jaxattn-vanilla, fed the forward's output
    and lse: a differentiable lse from a kernel whose own lse has none (cuDNN's)."""

    def __call__(self, q: Array, k: Array, v: Array, *, causal: bool = False, mask: Array = None,
                 q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array]:
        def forward(q: Array, k: Array, v: Array, mask: Array, q_ids: Array, kv_ids: Array) -> tuple[Array, Array]:
            return self.forward_block(q, k, v, causal=causal, mask=mask, q_ids=q_ids, kv_ids=kv_ids)

        def fwd(*args: Array) -> tuple[tuple[Array, Array], tuple[Array, ...]]:
            out, lse = forward(*args)
            return (out, lse), (*args, out, lse)

        def bwd(res: tuple[Array, ...], cts: tuple[Array, Array]) -> tuple[Array, ...]:
            q, k, v, mask, q_ids, kv_ids, out, lse = res
            dq, dk, dv = self.backward(q, k, v, Residuals(out, lse, *cts), causal=causal, mask=mask, q_ids=q_ids,
                                       kv_ids=kv_ids)
            return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None

        attend = jax.custom_vjp(forward)
        attend.defvjp(fwd, bwd)
        return attend(q, k, v, mask, q_ids, kv_ids)

    @property
    def residual_backward(self) -> bool:
        return True

    def backward(self, q: Array, k: Array, v: Array, res: Residuals, *, causal: bool = False, mask: Array = None,
                 q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array, Array]:
        """The blockwise backward at ``res`` (this block's own residuals, or the ring's)."""
        from jaxattn_vanilla.blockwise.kernel import blockwise_backward

        return blockwise_backward(q, k, v, res.out, res.lse, res.d_out, res.d_lse, mask=mask, causal=causal,
                                  q_segment_ids=q_ids, kv_segment_ids=kv_ids, softmax_scale=self.softmax_scale,
                                  logits_soft_cap=self.logits_soft_cap)

    def forward_block(self, q: Array, k: Array, v: Array, *, causal: bool = False, mask: Array = None,
                      q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array]:
        """The forward: ``impl``'s, through its ``__call__``."""
        return BlockKernel.__call__(self, q, k, v, causal=causal, mask=mask, q_ids=q_ids, kv_ids=kv_ids)


@dataclasses.dataclass(frozen=True)
class CudnnLseKernel(OwnBackwardKernel):
    """``cudnn+blockwise``: cuDNN's forward through ``jax.nn.dot_product_attention(implementation="cudnn",
    return_residual=True)``, whose log-sum-exp (the softmax statistics cuDNN keeps for its
    backward) has no gradient, with the blockwise backward. ``impl`` is the ``cudnn`` impl, which
    vouches for the platform, dtype and head dims; full and causal blocks only (``_block_reasons``).
    """

    #: jax.nn's implementation: "cudnn"; the CPU tests run the same code with "xla".
    implementation: Literal["xla", "cudnn"] = "cudnn"

    def forward_block(self, q: Array, k: Array, v: Array, *, causal: bool = False, mask: Array = None,
                      q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array]:
        self._full_or_causal(mask, q_ids, kv_ids)
        out, lse = jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                implementation=self.implementation,
                                                return_residual=True)
        return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2).astype(acc_dtype(q.dtype))  # (B, T, H) -> (B, H, T)

    def _full_or_causal(self, mask: Array, q_ids: Array, kv_ids: Array) -> None:
        """cuDNN's calls here take flags only: no mask, segment ids or soft cap (``_block_reasons``
        declines such blocks; this guards a direct call)."""
        if mask is not None or q_ids is not None or kv_ids is not None or self.logits_soft_cap is not None:
            raise PluginError(f"ring's {BlockChoice(self.impl, type(self) is CudnnLseKernel).name()} kernel "
                              "takes full and causal blocks only")


@dataclasses.dataclass(frozen=True)
class CudnnKernel(CudnnLseKernel):
    """``cudnn``: cuDNN's forward with its lse, and cuDNN's own backward fed the residuals
    (``jaxattn_sdpa.residual.cudnn_backward``), so both halves of a block run at cuDNN's speed.
    cuDNN's backward takes no lse cotangent: a call with one (a loss that uses ring's lse) takes
    the blockwise backward instead, chosen at run time (``lax.cond``), exact either way.
    """

    def backward(self, q: Array, k: Array, v: Array, res: Residuals, *, causal: bool = False, mask: Array = None,
                 q_ids: Array = None, kv_ids: Array = None) -> tuple[Array, Array, Array]:
        from jaxattn_sdpa.residual import cudnn_backward

        def cast(grads: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            return grads[0].astype(q.dtype), grads[1].astype(k.dtype), grads[2].astype(v.dtype)

        def cudnn() -> tuple[Array, Array, Array]:
            return cast(cudnn_backward(q, k, v, res.out, res.lse, res.d_out, causal=causal,
                                       softmax_scale=self.softmax_scale))

        def blockwise() -> tuple[Array, Array, Array]:
            return cast(super(CudnnKernel, self).backward(q, k, v, res, causal=causal))

        self._full_or_causal(mask, q_ids, kv_ids)
        return jax.lax.cond(jnp.any(res.d_lse != 0), blockwise, cudnn)  # type: ignore[no-any-return]


def _skip(q: Array, v: Array) -> tuple[Array, Array]:
    """The result of a block with nothing visible: zero output, lse -inf."""
    b, t, h, _ = q.shape
    return (jnp.zeros((b, t, h, v.shape[-1]), q.dtype),
            jnp.full((b, h, t), -jnp.inf, acc_dtype(q.dtype)))


def _rows(x: Array, lo: int, hi: int) -> Array:
    return None if x is None else x[:, lo:hi]


def _visibility(tiling: RingTiling, index: Array, src: Array, mask: Array) -> Array:
    """Boolean ``(B|1, H|1, Tl, Sl)``: the positional rules for this block, and the user mask's columns."""
    q_pos = positions(tiling.layout, index, tiling.n, tiling.t_local)[:, None] + tiling.offset
    k_pos = positions(tiling.layout, src, tiling.n, tiling.s_local)[None, :]
    visible = jnp.ones((tiling.t_local, tiling.s_local), bool)
    if tiling.causal:
        visible &= k_pos <= q_pos
    if tiling.window is not None:
        left, right = tiling.window
        visible &= (k_pos >= q_pos - left) & (k_pos <= q_pos + right)
    visible = visible[None, None]
    if mask is not None:
        # A mask that arrived in zigzag order holds device src's keys in one contiguous run of columns.
        order: Layout = "contiguous" if tiling.arrived_zigzag else tiling.layout
        visible = visible & key_columns(mask, order, src, tiling.n, tiling.s_local)
    return visible


@dataclasses.dataclass(frozen=True)
class _Region:
    """One block's inputs; subclasses compute a result on each region :func:`_dispatch` names
    (``whole``, ``skip``, ``key_prefix``, ``row_suffix``)."""

    kernel: BlockKernel
    q: Array
    k: Array
    v: Array
    q_ids: Array
    kv_ids: Array


class _Forward(_Region):
    """A block's ``(output, lse)`` through ``kernel``."""

    def whole(self, causal: bool = False, mask: Array = None) -> tuple[Array, Array]:
        return self.kernel(self.q, self.k, self.v, causal=causal, mask=mask, q_ids=self.q_ids, kv_ids=self.kv_ids)

    def skip(self) -> tuple[Array, Array]:
        return _skip(self.q, self.v)

    def key_prefix(self, c_k: int) -> tuple[Array, Array]:
        return self.kernel(self.q, self.k[:, :c_k], self.v[:, :c_k], q_ids=self.q_ids,
                           kv_ids=_rows(self.kv_ids, 0, c_k))

    def row_suffix(self, c_q: int) -> tuple[Array, Array]:
        t = self.q.shape[1]
        o, lse = self.kernel(self.q[:, c_q:], self.k, self.v, q_ids=_rows(self.q_ids, c_q, t), kv_ids=self.kv_ids)
        o0, lse0 = _skip(self.q[:, :c_q], self.v)
        return jnp.concatenate([o0, o], axis=1), jnp.concatenate([lse0, lse], axis=2)


@dataclasses.dataclass(frozen=True)
class _Backward(_Region):
    """A block's ``(dq, dk, dv)`` (accumulation dtype) from the ring's residuals ``res``."""

    res: Residuals

    def _grads(self, q: Array, k: Array, v: Array, res: Residuals, **kw: Any) -> tuple[Array, Array, Array]:
        acc = acc_dtype(self.q.dtype)
        dq, dk, dv = self.kernel.backward(q, k, v, res, **kw)
        return dq.astype(acc), dk.astype(acc), dv.astype(acc)

    def whole(self, causal: bool = False, mask: Array = None) -> tuple[Array, Array, Array]:
        return self._grads(self.q, self.k, self.v, self.res, causal=causal, mask=mask, q_ids=self.q_ids,
                           kv_ids=self.kv_ids)

    def skip(self) -> tuple[Array, Array, Array]:
        acc = acc_dtype(self.q.dtype)
        return jnp.zeros(self.q.shape, acc), jnp.zeros(self.k.shape, acc), jnp.zeros(self.v.shape, acc)

    def key_prefix(self, c_k: int) -> tuple[Array, Array, Array]:
        dq, dk, dv = self._grads(self.q, self.k[:, :c_k], self.v[:, :c_k], self.res, q_ids=self.q_ids,
                                 kv_ids=_rows(self.kv_ids, 0, c_k))
        pad = [(0, 0), (0, self.k.shape[1] - c_k), (0, 0), (0, 0)]
        return dq, jnp.pad(dk, pad), jnp.pad(dv, pad)

    def row_suffix(self, c_q: int) -> tuple[Array, Array, Array]:
        t = self.q.shape[1]
        dq, dk, dv = self._grads(self.q[:, c_q:], self.k, self.v, self.res.rows(c_q, t),
                                 q_ids=_rows(self.q_ids, c_q, t), kv_ids=self.kv_ids)
        return jnp.pad(dq, [(0, 0), (c_q, 0), (0, 0), (0, 0)]), dk, dv


def _dispatch(tiling: RingTiling, op: _Forward | _Backward, mask: Array, *, index: Array, src: Array,
              first: bool) -> Any:
    """The part of the block of device ``src``'s keys that this device's queries see, through ``op``.

    The layout decides it: whole (full attention, or its own keys under causal), none, the early
    half of src's keys (zigzag, src earlier on the ring), or the late half of the queries
    (zigzag, src later); per-block masks only where flags cannot say it (``tiling.mode == "masked"``).
    """
    if tiling.mode == "full":
        return op.whole()
    if tiling.mode == "masked":
        visible = _visibility(tiling, index, src, mask)
        return jax.lax.cond(jnp.any(visible), lambda: op.whole(mask=visible), op.skip)
    if first:  # own keys: causal on the local order is causal on global positions in both layouts
        return op.whole(causal=True)
    if tiling.layout == "contiguous":  # earlier devices' keys are all visible, later ones' none
        return jax.lax.cond(src < index, op.whole, op.skip)
    # Zigzag. Device src < index: both query chunks see all of src's early chunk, none of its late
    # one. Device src > index: only the late query chunk sees src's keys, all of them.
    c_q, c_k = tiling.t_local // 2, tiling.s_local // 2
    return jax.lax.cond(src < index, lambda: op.key_prefix(c_k), lambda: op.row_suffix(c_q))


def block(tiling: RingTiling, kernel: BlockKernel, q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array,
          mask: Array, *, index: Array, src: Array, first: bool) -> tuple[Array, Array]:
    """Attention of this device's queries to the keys of device ``src`` (``first``: its own keys).

    Returns ``(output (B, Tl, H, Dv), lse (B, H, Tl))`` normalised over this block only.
    """
    return _dispatch(tiling, _Forward(kernel, q, k, v, q_ids, kv_ids), mask,  # type: ignore[no-any-return]
                     index=index, src=src, first=first)


def block_grads(tiling: RingTiling, kernel: BlockKernel, q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array,
                mask: Array, res: Residuals, *, index: Array, src: Array, first: bool) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of the block :func:`block` computes, from the ring's residuals ``res``
    (``kernel.residual_backward``): the kernel's backward alone, no block forward."""
    return _dispatch(tiling, _Backward(kernel, q, k, v, q_ids, kv_ids, res), mask,  # type: ignore[no-any-return]
                     index=index, src=src, first=first)


def block_problems(ring_mode: Mode, layout: Layout, local: AttentionProblem,
                   mask_dims: tuple[int, int] | None) -> list[AttentionProblem]:
    """Every distinct call the per-block kernel gets, as problems (for choosing the kernel).

    ``local`` has the per-device sizes; ``mask_dims`` are the user mask's (B|1, H|1) there.
    """
    base = dataclasses.replace(local, causal=False, mask_shape=None, bias_shape=None, sliding_window=None,
                               sinks=False, dropout_prob=0.0)
    if ring_mode == "full":
        return [base]
    if ring_mode == "masked":
        bm, hm = mask_dims or (1, 1)
        return [dataclasses.replace(base, mask_shape=(bm, hm, local.seq_q, local.seq_k))]
    problems = [dataclasses.replace(base, causal=True), base]
    if layout == "zigzag":
        problems[1:] = [dataclasses.replace(base, seq_k=local.seq_k // 2),
                        dataclasses.replace(base, seq_q=local.seq_q // 2)]
    return problems


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """The per-block kernel chosen: an impl, and whether its backward is the blockwise one."""

    impl: AttentionImpl
    own_backward: bool = False

    def name(self) -> str:
        """``"X"``, or ``"X+blockwise"`` for X's forward with the blockwise backward."""
        return self.impl.name() + (f"+{OWN_BACKWARD}" if self.own_backward else "")

    def kernel(self, softmax_scale: float, logits_soft_cap: float | None) -> BlockKernel:
        kind: type[BlockKernel] = BlockKernel
        if self.impl.name() == "cudnn":  # its lse comes from jax.nn's return_residual
            kind = CudnnLseKernel if self.own_backward else CudnnKernel
        elif self.own_backward:
            kind = OwnBackwardKernel
        return kind(self.impl, softmax_scale, logits_soft_cap)


def _block_reasons(metadata: AttentionMetadata, name: str,
                   problems: list[AttentionProblem]) -> tuple[BlockChoice | None, list[str]]:
    """``name`` ("X" or "X+blockwise") as the per-block kernel, or every reason it cannot be."""
    forward_name, plus, backward_name = name.partition("+")
    if plus and backward_name != OWN_BACKWARD:
        return None, [f"block kernel {name}: only '{OWN_BACKWARD}' can be paired as a backward ('X+{OWN_BACKWARD}')"]
    impls: list[AttentionImpl] = []
    for part in (forward_name, backward_name) if plus else (forward_name,):
        try:
            impls.append(get_impl(part, metadata))
        except (JaxattnError, ImportError) as err:
            return None, [f"block kernel {name}: {err}"]
    cudnn = impls[0].name() == "cudnn"  # its lse comes from jax.nn's return_residual
    why: list[str] = []
    if impls[0].sequence_parallel:
        why.append("is sequence-parallel itself")
    if Feature.LSE not in impls[0].features and not cudnn:
        why.append("does not return its log-sum-exp (Feature.LSE)")
    if cudnn and not plus:
        from jaxattn_sdpa.residual import unavailable

        if (missing := unavailable()) is not None:
            why.append(f"cuDNN's backward cannot be fed the ring's residuals: {missing}; use 'cudnn+{OWN_BACKWARD}'")
    for impl in impls:
        for problem in problems:
            if plus and impl is impls[0]:  # the forward only: the blockwise backward differentiates it
                problem = dataclasses.replace(problem, needs_grad=False)
            elif cudnn and not plus:  # cuDNN's backward runs whenever ring is differentiated: judge its limits now
                problem = dataclasses.replace(problem, needs_grad=True)
            why += [f"{impl.name()}: {r}" if plus else r for r in impl.reasons_to_decline(problem) if r not in why]
            if cudnn and impl is impls[0] and (problem.mask_shape or problem.segment_ids or problem.logits_soft_cap):
                reason = ("cudnn: ring's cuDNN forward with lse takes full and causal blocks only (no mask, segment "
                          "ids or soft cap)")
                why += [reason] if reason not in why else []
    if why:
        return None, [f"block kernel {name}: {'; '.join(why)}"]
    return BlockChoice(impls[0], bool(plus)), []


def choose_kernel(metadata: AttentionMetadata, problems: list[AttentionProblem],
                  requested: str = "auto") -> tuple[BlockChoice | None, list[str]]:
    """The per-block kernel: ``requested`` ("X" or "X+blockwise"), or under "auto" the first of
    :data:`CANDIDATES` here that accepts every block problem, then the other impls that return
    their lse, highest priority first. Returns ``(choice, [])`` or ``(None, every reason)``.
    """
    if requested == "auto":
        here = [p.name for p in available_here(metadata, kind="dense") if p.name not in ("auto", "ring")]
        names = [*CANDIDATES, *(n for n in here if n not in CANDIDATES)]
    else:
        names = [requested]
    reasons: list[str] = []
    for name in names:
        choice, why = _block_reasons(metadata, name, problems)
        if choice is not None:
            return choice, []
        reasons += why
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
    key = (type(kernel), type(kernel.impl), kernel.impl.metadata, kernel.softmax_scale, kernel.logits_soft_cap,
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


def gradient_kernel(kernel: BlockKernel, q: Array, k: Array, v: Array) -> BlockKernel:
    """The kernel the ring's backward runs: ``kernel`` if it has a residual backward or its lse is
    differentiable, else its forward with the blockwise backward (``OwnBackwardKernel``), logged
    once; ``allow_fallback=False`` makes that an error."""
    if kernel.residual_backward or lse_is_differentiable(kernel, q, k, v):
        return kernel
    name = kernel.impl.name()
    if not kernel.impl.metadata.allow_fallback:
        raise PluginError(
            f"ring: the per-block kernel {name!r} returns a softmax_lse whose cotangent its VJP ignores, so ring "
            f"cannot differentiate through it; set metadata.extra['ring_block_impl']='{name}+{OWN_BACKWARD}' (its "
            "forward, the blockwise backward) or allow_fallback"
        )
    if name not in _logged_own_backward:
        _logged_own_backward.add(name)
        logger.info("jaxattn: ring differentiates %s's blocks with the %s backward: its softmax_lse is not "
                    "differentiable", name, OWN_BACKWARD)
    return OwnBackwardKernel(kernel.impl, kernel.softmax_scale, kernel.logits_soft_cap)


_logged_own_backward: set[str] = set()
