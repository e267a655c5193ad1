"""``RingAttention``: the ``ring`` impl, sequence-parallel attention over ``metadata.sequence_axis``.

The call arrives with global arrays (or, with ``metadata.mesh=None``, with local shards
inside the caller's own ``shard_map``). Batch, heads and sequence are split over their mesh
axes; on each device the ring (``ring.make_ring``) runs a per-block kernel chosen among the
registered impls that return their log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn.backend import (
    AttentionCall,
    AttentionImpl,
    AttentionOutput,
    AttentionProblem,
    AttentionSpecs,
    InvalidInputError,
    MeshAxes,
    UnsupportedError,
    axis_size,
    axis_tuple,
    check_batch_heads,
    describe_axes,
    kv_head_repeat,
    local_metadata,
    mesh_axes,
    resolve_call,
    shard_map,
    split_absorbing_sinks,
    zero_absorbed_heads,
)

from .blocks import BlockChoice, BlockKernel, Mode, RingTiling, block_problems, choose_kernel
from .comm import COMMS, Comm, choose_comm, describe, device_memory, gathered_bytes, requested_comm
from .layout import LAYOUTS, Layout, from_zigzag, to_zigzag
from .plugin import RING
from .ring import make_ring

__all__ = ["RingAttention"]

Array = Any


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What a call resolves to before any array moves."""

    mode: Mode
    layout: Layout
    local: AttentionProblem  # per-device sizes
    kernel: BlockChoice | None
    reasons: list[str]
    comm: Comm
    comm_why: str  # "asked", or how "auto" chose


class RingAttention(AttentionImpl, declaration=RING):
    """Ring attention: each device holds a slice of the sequence; K/V travel around the ring."""

    # -- what can run ------------------------------------------------------------------------
    def _arrived_zigzag(self) -> bool:
        """Whether the caller's sequence axes come (and go) in zigzag order: ``extra["ring_inputs"]``."""
        order = str(self.metadata.extra.get("ring_inputs", "natural"))
        if order not in ("natural", "zigzag"):
            raise InvalidInputError("metadata.extra['ring_inputs']", f"{order!r} is not 'natural' or 'zigzag'")
        return order == "zigzag"

    def _requested_comm(self) -> str:
        requested = requested_comm(self.metadata.extra)
        if requested not in COMMS:
            raise InvalidInputError("metadata.extra['ring_comm']", f"{requested!r} is not one of {list(COMMS)}",
                                    "'ppermute' holds S/n keys per device; 'all_gather' holds all S")
        return requested

    def check_options(self) -> None:
        """The ring's options in ``metadata.extra`` (``ring_comm``, ``ring_layout``, ``ring_inputs``),
        checked whenever ring is asked about a call, mesh or not: a nonsense value is the caller's
        error (``InvalidInputError`` naming the option, which "auto" and ``explain`` raise), never a
        reason to decline."""
        self._requested_comm()
        self._layout(causal=True)  # ring_inputs and ring_layout (a causal default never conflicts)

    def _comm(self, local: AttentionProblem, n: int) -> tuple[Comm, str]:
        """How K/V travel (``extra["ring_comm"]``; "auto" by :func:`comm.choose_comm`) and why."""
        requested = self._requested_comm()
        memory = device_memory() if requested == "auto" and self.device.platform == "gpu" else None
        return choose_comm(requested, n, self.device, gathered_bytes(local, n), memory)

    def _layout(self, causal: bool) -> Layout:
        arrived = self._arrived_zigzag()
        layout = self.metadata.extra.get("ring_layout") or ("zigzag" if causal or arrived else "contiguous")
        if layout not in LAYOUTS:
            raise InvalidInputError("metadata.extra['ring_layout']", f"{layout!r} is not one of {list(LAYOUTS)}")
        if layout != "zigzag" and arrived:
            raise InvalidInputError(
                "metadata.extra['ring_layout']", f"{layout!r} with ring_inputs='zigzag': inputs in zigzag order run "
                "the zigzag layout", "drop ring_layout, or pass the inputs in natural order (ring_inputs='natural')")
        return layout  # type: ignore[return-value]  # checked against LAYOUTS above

    def _setup_here(self, problem: AttentionProblem) -> _Setup:
        """:meth:`_setup` for a problem of global sizes (local ones inside the caller's shard_map)."""
        axes = mesh_axes(self.metadata)
        return self._setup(problem, axes, axes.sequence_size if axes is not None else 1)

    def _setup(self, problem: AttentionProblem, axes: MeshAxes | None, n: int) -> _Setup:
        """Mode, layout, per-device problem and per-block kernel (or the reasons there is none)."""
        mode = RingTiling.choose_mode(causal=problem.causal, window=problem.sliding_window,
                                    mask=problem.mask_shape is not None, t=problem.seq_q, s=problem.seq_k)
        layout = self._layout(problem.causal)
        bs = hs = 1
        if axes is not None:
            bs, hs = axes.batch_size, axes.head_size
        hkv = problem.heads_kv * kv_head_repeat(problem.heads_q, problem.heads_kv, hs)
        local = dataclasses.replace(
            problem, batch=max(problem.batch // bs, 1), heads_q=max(problem.heads_q // hs, 1),
            heads_kv=max(hkv // hs, 1), seq_q=max(problem.seq_q // n, 1), seq_k=max(problem.seq_k // n, 1),
        )
        mask_dims = None
        if problem.mask_shape is not None:
            bm, hm = problem.mask_shape[:2]
            mask_dims = (local.batch if bm > 1 else 1, local.heads_q if hm > 1 else 1)
        problems = block_problems(mode, layout, local, mask_dims)
        requested = str(self.metadata.extra.get("ring_block_impl", "auto")).lower()
        kernel, reasons = choose_kernel(local_metadata(self.metadata), problems, requested)
        return _Setup(mode, layout, local, kernel, reasons, *self._comm(local, n))

    def check_call(self, problem: AttentionProblem) -> None:
        """T and S must split over the sequence axis (2n chunks in the zigzag layout): what the
        call raises, raised by ``explain`` too before it names ring."""
        axes = mesh_axes(self.metadata)
        if axes is not None and axes.sequence:
            self._check_sequence(problem, axes.sequence_size, self._layout(problem.causal), axes.sequence, True)

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        self.check_options()
        reasons = super().not_supported_reasons(problem)
        if self.metadata.sequence_axis is None:
            reasons.append("ring shards the sequence over a mesh axis: set AttentionMetadata(mesh=..., "
                           "sequence_axis=...) (mesh=None inside your own shard_map)")
            return reasons
        try:
            setup = self._setup_here(problem)
        except InvalidInputError as err:
            return [*reasons, str(err)]
        if setup.kernel is None:
            reasons.append("no per-block kernel that returns its lse accepts the blocks: "
                           + " | ".join(setup.reasons))
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        try:
            setup = self._setup_here(problem)
        except InvalidInputError:
            return []
        if setup.kernel is None:
            return []
        backward = ("backward from the ring's output and lse (no block forward again)"
                    if setup.kernel.kernel(1.0, None).residual_backward
                    else "backward through jax.vjp of each block (its forward runs again), or the blockwise "
                         "backward where the kernel's lse has no gradient")
        arrival = " (inputs and outputs in zigzag order: no relayout)" if self._arrived_zigzag() else ""
        comm = describe(setup.comm, setup.comm_why)
        return [f"{setup.layout} layout{arrival}; {comm}; per-block kernel {setup.kernel.name()}, {backward}"]

    def block_kernel(self, q: Array, k: Array, v: Array, mask: Array = None, causal: bool = False,
                     **features: Any) -> BlockChoice:
        """The per-block kernel ring would run for this call (arrays or ShapeDtypeStructs): its
        ``name()`` ("X", or "X+blockwise" for X's forward with the blockwise backward) and ``impl``."""
        problem = resolve_call(q, k, v, mask=mask, causal=causal, metadata=self.metadata, **features).problem
        setup = self._setup_here(problem)
        if setup.kernel is None:
            raise UnsupportedError(self.name(), setup.reasons)
        return setup.kernel

    # -- running -------------------------------------------------------------------------------
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        # bias and dropout are declined by not_supported_reasons (not in ``features``). A +inf sink
        # would be inf - inf in the blocks' log-sum-exp merge: a finite stand-in runs, and the
        # heads it absorbs are zeroed (jaxattn.backend.sinks).
        sinks, absorbed = split_absorbing_sinks(call.softmax_aux)
        res = self._ring(call.q, call.k, call.v, call.mask, call.causal, sliding_window=call.sliding_window,
                         q_segment_ids=call.q_segment_ids, kv_segment_ids=call.kv_segment_ids,
                         softmax_scale=call.softmax_scale, logits_soft_cap=call.logits_soft_cap, softmax_aux=sinks)
        return dataclasses.replace(res, attention_outputs=zero_absorbed_heads(res.attention_outputs, absorbed, 2))

    def _ring(self, q: Array, k: Array, v: Array, mask: Array, causal: bool, *,
              sliding_window: tuple[int, int] | None, q_segment_ids: Array, kv_segment_ids: Array,
              softmax_scale: float, logits_soft_cap: float | None, softmax_aux: Array) -> AttentionOutput:
        md = self.metadata
        seq = axis_tuple(md.sequence_axis)
        axis: str | tuple[str, ...] = seq[0] if len(seq) == 1 else seq
        axes = mesh_axes(md)
        if axes is not None:
            repeat = check_batch_heads(axes, q, k)
            if repeat > 1:  # documented replication, as for every impl on a mesh
                k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
            n = axes.sequence_size
        else:
            n = axis_size(axis)  # inside the caller's shard_map: q, k, v are local shards
        problem = AttentionProblem.from_inputs(
            q, k, v, mask=mask, causal=causal, sliding_window=sliding_window, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
        )
        if axes is None:  # global sizes, for the tiling's bottom-right offset
            problem = dataclasses.replace(problem, seq_q=problem.seq_q * n, seq_k=problem.seq_k * n)
        setup = self._setup(problem, axes, n)
        if setup.kernel is None:
            raise UnsupportedError(self.name(), setup.reasons)
        self._check_sequence(problem, n, setup.layout, seq, axes is not None)
        tiling = RingTiling(axis=axis, n=n, layout=setup.layout, mode=setup.mode, t_local=problem.seq_q // n,
                        s_local=problem.seq_k // n, causal=causal, window=sliding_window,
                        offset=problem.seq_k - problem.seq_q, arrived_zigzag=self._arrived_zigzag(),
                        comm=setup.comm)
        kernel = setup.kernel.kernel(softmax_scale, logits_soft_cap)
        args = (q, k, v, q_segment_ids, kv_segment_ids, mask, softmax_aux)
        if axes is None:
            out, lse = _per_device(tiling, make_ring(tiling, kernel), *args)
        else:
            specs = AttentionSpecs.from_axes(axes, shard_sequence=True)
            full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            in_specs = (specs.q, specs.kv, specs.kv, specs.q_ids, specs.kv_ids,
                        specs.broadcast(mask, full, shard_keys=False), specs.aux)
            out, lse = _sharded_ring(*args, tiling=tiling, kernel=kernel, mesh=md.mesh, in_specs=in_specs,
                                     out_specs=(specs.out, specs.lse))
        return AttentionOutput(attention_outputs=out, softmax_lse=lse)

    @staticmethod
    def _check_sequence(problem: AttentionProblem, n: int, layout: Layout, seq: tuple[str, ...], global_: bool) -> None:
        """T and S must split into n shards (2n chunks for zigzag); the error names axis and sizes."""
        parts = 2 * n if layout == "zigzag" else n
        for name, arg, size in (("query length T", "q", problem.seq_q), ("key length S", "k", problem.seq_k)):
            if size % parts:
                where = f"mesh axis {describe_axes(seq)} of size {n}"
                what = f"{parts} = 2 x {n} chunks ({layout} layout)" if layout == "zigzag" else f"{n} shards"
                raise InvalidInputError(
                    arg,
                    f"{name} {size}{'' if global_ else ' (all shards)'} does not split into {what} over {where} "
                    "(AttentionMetadata.sequence_axis)",
                    f"pad the sequence to a multiple of {parts} and mark the padding with segment ids or a mask",
                )


def _per_device(tiling: RingTiling, ring: Callable[..., tuple[Array, Array]], q: Array, k: Array, v: Array,
                q_ids: Array, kv_ids: Array, mask: Array, aux: Array) -> tuple[Array, Array]:
    """One device's ring on its shards (inside a ``shard_map``), natural order in and out."""
    # Two ppermutes of half a shard each way per array. Inputs that arrive in zigzag order
    # (ring_inputs) skip them; so do all-gathered K/V.
    axis, n = tiling.axis, tiling.n
    relayout = tiling.layout == "zigzag" and not tiling.arrived_zigzag
    if relayout:
        q, q_ids = (None if x is None else to_zigzag(x, 1, axis, n) for x in (q, q_ids))
        if not tiling.kv_natural:
            k, v, kv_ids = (None if x is None else to_zigzag(x, 1, axis, n) for x in (k, v, kv_ids))
        if mask is not None and mask.shape[2] > 1:
            mask = to_zigzag(mask, 2, axis, n)
    out, lse = ring(q, k, v, q_ids, kv_ids, mask, aux)
    if relayout:
        out, lse = from_zigzag(out, 1, axis, n), from_zigzag(lse, 2, axis, n)
    return out, lse


# Called eagerly (jax.grad included), a bare shard_map runs its body op by op: seconds for a toy
# ring, where one program runs in milliseconds. The static arguments key jit's cache (the kernel's
# impl by identity; get_impl caches instances), so eager calls of one tiling, kernel and specs trace
# once. Under the caller's jit it nests; inline=True would not, but runs an eager gradient op by op.
@functools.partial(jax.jit, static_argnames=("tiling", "kernel", "mesh", "in_specs", "out_specs"))
def _sharded_ring(q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array, mask: Array, aux: Array, *,
                  tiling: RingTiling, kernel: BlockKernel, mesh: Any, in_specs: tuple[Any, ...],
                  out_specs: tuple[Any, Any]) -> tuple[Array, Array]:
    body = functools.partial(_per_device, tiling, make_ring(tiling, kernel))
    out_lse: tuple[Array, Array] = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        q, k, v, q_ids, kv_ids, mask, aux)
    return out_lse
