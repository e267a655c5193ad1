"""Every backend on a mesh: its forward runs under ``shard_map`` over batch and heads.

``AttentionImpl._run`` calls ``sharded_forward`` when ``metadata.mesh`` is set (and the impl
is not sequence-parallel itself, as ring is). The kernel then sees local shards
``(B / batch devices, T, Hq / head devices, D)`` and a copy of the impl bound to metadata
without the mesh, so nothing it calls is sharded twice.
"""

from __future__ import annotations

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


def sharded_forward(impl: AttentionImpl, forward_name: str) -> Callable[..., AttentionOutput]:
    """``impl``'s ``forward_name`` method, run under ``shard_map`` over the batch and head axes.

    Returns ``impl``'s bound forward unchanged when the metadata names neither axis (nothing
    to split), or carries no mesh (the call already runs on local shards inside the
    caller's own ``shard_map``).
    """
    md = impl.metadata
    axes = mesh_axes(md)
    if axes is None or not (axes.batch or axes.heads):
        return getattr(impl, forward_name)  # type: ignore[no-any-return]
    mesh = md.mesh
    local = type(impl)(local_metadata(md), impl.device)
    kernel: Callable[..., AttentionOutput] = getattr(local, forward_name)

    def forward(q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None, init_bias: Any = None,
                causal: bool = False, *, q_segment_ids: Any = None, kv_segment_ids: Any = None,
                softmax_aux: Any = None, dropout_rng: Any = None, kv_lengths: Any = None,
                **static: Any) -> AttentionOutput:
        repeat = check_batch_heads(axes, q, k)
        if repeat > 1:  # documented replication: see kv_head_repeat
            k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
        specs = AttentionSpecs.from_axes(axes)
        full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        shard_axes = axes.batch + axes.heads

        def body(q: Any, k: Any, v: Any, mask: Any, bias: Any, q_ids: Any, kv_ids: Any, aux: Any,
                 rng: Any, lengths: Any) -> AttentionOutput:
            if rng is not None:
                # One key for every shard would repeat the same keep-mask on each of them.
                rng = jax.random.fold_in(rng, jax.lax.axis_index(shard_axes))
            extra = {} if lengths is None else {"kv_lengths": lengths}
            out = kernel(q, k, v, mask=mask, bias=bias, init_bias=None, causal=causal, q_segment_ids=q_ids,
                         kv_segment_ids=kv_ids, softmax_aux=aux, dropout_rng=rng, **extra, **static)
            return out if isinstance(out, AttentionOutput) else AttentionOutput(out)

        in_specs = (specs.q, specs.kv, specs.kv, specs.broadcast(mask, full), specs.broadcast(bias, full),
                    specs.q_ids, specs.kv_ids, specs.aux, P(), specs.lengths)
        out_specs = AttentionOutput(specs.out, specs.weights, specs.lse)
        run = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        return run(q, k, v, mask, bias, q_segment_ids, kv_segment_ids, softmax_aux,  # type: ignore[no-any-return]
                   dropout_rng, kv_lengths)

    return forward
