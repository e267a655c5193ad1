"""Every backend on a mesh: its forward runs under ``shard_map`` over batch and heads.

An impl's plan (``Backend.plan``, with ``jaxattn.compose``) uses ``sharded_forward`` when
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

from ..output import AttentionOutput
from .axes import MeshAxes, describe_axes, kv_head_repeat, mesh_axes
from .compat import shard_map
from .specs import AttentionSpecs

if TYPE_CHECKING:
    from ..call import AttentionCall
    from ..impl import AttentionImpl
    from ..metadata import AttentionMetadata

__all__ = ["check_batch_heads", "local_metadata", "sharded_forward"]

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
