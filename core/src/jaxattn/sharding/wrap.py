"""Every backend on a mesh: its forward runs under ``shard_map`` over batch and heads.

A paged backend shards its KV heads only (``sharded_paged_forward``): each device holds its
heads' pages ``(num_pages, page_size, Hkv / n, D)`` (the combined layout's ``2 * Hkv`` slots
split the same way, whole heads per device) and its query heads ``Hq / n`` (query head ``h``
reads KV head ``h // (Hq / Hkv)``, which the contiguous split keeps on one device), the sinks
and per-head scales with them; the page table, lengths and ``cu_q_lens`` are replicated, and
nothing is communicated but the output's head shards. ``PagedAttentionImpl`` declines the
batch and sequence axes and a head count that does not split.

An impl's plan (``Backend.plan``, with ``jaxattn.api.compose``) uses ``sharded_forward`` when
``metadata.mesh`` is set (and the impl is not sequence-parallel itself, as ring is). The kernel
then sees a call of local shards ``(B / batch devices, T, Hq / head devices, D)`` and is a
copy of the impl bound to metadata without the mesh, so nothing it calls is sharded twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..backend.output import AttentionOutput
from .axes import MeshAxes, describe_axes, kv_head_repeat, mesh_axes
from .compat import shard_map
from .specs import AttentionSpecs

if TYPE_CHECKING:
    from ..backend.call import AttentionCall, PagedCall
    from ..backend.impl import AttentionImpl
    from ..backend.metadata import AttentionMetadata
    from ..backend.paged_impl import PagedAttentionImpl

__all__ = ["check_batch_heads", "local_metadata", "sharded_forward", "sharded_paged_forward"]

logger = logging.getLogger("jaxattn")
_logged: set[tuple[str, int, int, int]] = set()


def local_metadata(metadata: AttentionMetadata) -> AttentionMetadata:
    """The metadata a kernel sees inside ``shard_map``: the same, without mesh and axes."""
    return metadata.replace(mesh=None, batch_axis=None, head_axis=None, sequence_axis=None)


def check_batch_heads(axes: MeshAxes, q: Any, k: Any) -> int:
    """Check that batch and heads split over their axes; return the K/V head repeat factor.

    Raises ``InvalidInputError`` naming the dimension, the axis and both sizes.
    """
    b, _, hq, _ = q.shape
    hkv = k.shape[2]
    axes.check_divides("batch size B", "q", b, axes.batch, "batch_axis")
    axes.check_divides("query heads Hq", "q", hq, axes.heads, "head_axis")
    repeat = kv_head_repeat(hq, hkv, axes.head_size)
    key = (describe_axes(axes.heads), hq, hkv, axes.head_size)
    if repeat > 1 and key not in _logged:
        _logged.add(key)
        logger.info(
            "jaxattn: Hkv=%d K/V heads do not split over mesh axis %s of size %d; each K/V head is repeated %d "
            "times (%d heads) so every head shard holds whole query groups", hkv, key[0], axes.head_size, repeat,
            hkv * repeat,
        )
    return repeat


def sharded_forward(impl: AttentionImpl) -> Callable[[AttentionCall], AttentionOutput]:
    """``impl``'s routed forward, run under ``shard_map`` over the batch and head axes.

    Returns ``impl``'s routed forward unchanged when the metadata names neither axis (nothing
    to split), or carries no mesh (the call already runs on local shards inside the
    caller's own ``shard_map``). Inside, the kernel receives the call with local shards, the
    local problem and the metadata without the mesh.
    """
    md = impl.metadata
    axes = mesh_axes(md)
    if axes is None or not (axes.batch or axes.heads):
        return impl.route()
    mesh = md.mesh
    local_md = local_metadata(md)
    kernel = type(impl)(local_md, impl.device).route()
    shard_axes = axes.batch + axes.heads

    def forward(call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        repeat = check_batch_heads(axes, q, k)
        if repeat > 1:  # documented replication: see kv_head_repeat
            k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
        specs = AttentionSpecs.from_axes(axes)
        full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        problem = call.problem
        local_problem = dataclasses.replace(
            problem, batch=problem.batch // axes.batch_size, heads_q=problem.heads_q // axes.head_size,
            heads_kv=max(problem.heads_kv * repeat // axes.head_size, 1))

        def body(q: Any, k: Any, v: Any, mask: Any, bias: Any, q_ids: Any, kv_ids: Any, aux: Any,
                 rng: Any, lengths: Any) -> AttentionOutput:
            if rng is not None:
                # One key for every shard would repeat the same keep-mask on each of them.
                rng = jax.random.fold_in(rng, jax.lax.axis_index(shard_axes))
            out = kernel(call.replace(problem=local_problem, metadata=local_md, q=q, k=k, v=v, mask=mask, bias=bias,
                                      q_segment_ids=q_ids, kv_segment_ids=kv_ids, softmax_aux=aux, dropout_rng=rng,
                                      kv_lengths=lengths))
            return out if isinstance(out, AttentionOutput) else AttentionOutput(out)

        in_specs = (specs.q, specs.kv, specs.kv, specs.broadcast(call.mask, full), specs.broadcast(call.bias, full),
                    specs.q_ids, specs.kv_ids, specs.aux, P(), specs.lengths)
        out_specs = AttentionOutput(specs.out, specs.weights, specs.lse)
        run = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        return run(q, k, v, call.mask, call.bias, call.q_segment_ids,  # type: ignore[no-any-return]
                   call.kv_segment_ids, call.softmax_aux, call.dropout_rng, call.kv_lengths)

    forward.__name__ = getattr(kernel, "__name__", "forward")
    return forward


#: The head dim of each array of a ``PagedCall`` that has one (the rest are replicated).
_PAGED_HEAD_DIM = {"q": 1, "k_pages": 2, "v_pages": 2, "softmax_aux": 0, "k_scale": 2, "v_scale": 2}


def sharded_paged_forward(impl: PagedAttentionImpl) -> Callable[[PagedCall], AttentionOutput]:
    """A paged ``impl``'s routed forward under ``shard_map`` over the KV heads (unchanged without a head axis)."""
    md, axes = impl.metadata, mesh_axes(impl.metadata)
    if axes is None or not axes.heads:
        return impl.route()
    local_md, heads, n = local_metadata(md), axes.spec_entry(axes.heads), axes.head_size
    kernel = type(impl)(local_md, impl.device).route()

    def spec(name: str, x: Any) -> P:  # a size-1 (broadcast) scale axis is replicated
        dim = _PAGED_HEAD_DIM.get(name)
        return P() if dim is None or x.shape[dim] == 1 else P(*(heads if i == dim else None for i in range(x.ndim)))

    def forward(call: PagedCall) -> AttentionOutput:
        pb, arrays = call.problem, call.arrays()
        local = dataclasses.replace(pb, heads_q=pb.heads_q // n, heads_kv=pb.heads_kv // n)

        def body(*xs: Any) -> AttentionOutput:
            out = kernel(call.replace(problem=local, metadata=local_md, **dict(zip(arrays, xs, strict=True))))
            return AttentionOutput(out.attention_outputs)

        run = shard_map(body, mesh=md.mesh, in_specs=tuple(spec(k, x) for k, x in arrays.items()),
                        out_specs=AttentionOutput(P(None, heads, None)))
        return run(*arrays.values())  # type: ignore[no-any-return]

    return forward
