"""The ring: K/V blocks travel around the sequence axis, partial results merge by log-sum-exp.

Runs per device, inside ``shard_map`` (or the caller's own), on shards in the tiling's layout.
Step 0 attends to the device's own keys; each of the ``n - 1`` further steps attends to
the K/V block (with its segment ids) that arrived from the previous device through
``ppermute``, while the next transfer is already under way. Each block's ``(o_b, lse_b)``
merges into the running result:
``lse = logaddexp(lse, lse_b)``, ``o = o * exp(lse_old - lse) + o_b * exp(lse_b - lse)``.
Attention sinks join once, at the end, as one more term of the denominator.

``comm="all_gather"`` (``extra["ring_comm"]``, or its "auto": ``comm.py``) computes the same
blocks in the same order, but K/V reach every device in one all-gather (NCCL's collective, not
``n - 1`` neighbour transfers) and the backward's dK/dV go home in one reduce-scatter of float32
sums. Every device then holds all S keys during the call (the residuals stay O(T/n): the
backward gathers again). K/V that arrive in natural order are not relayouted: a device's
zigzag block is cut from the gathered global order.

Gradients: a ``custom_vjp`` whose backward runs the ring again. It keeps only the inputs,
the output and the lse (O(T/n) per device, like flash attention). With ``L`` the global
log-denominator (sink included) and ``D = rowsum(dO * O)``, each block's gradients are a flash
backward's at the *global* statistics: ``P_b = exp(S_b - L)``, ``dS_b = P_b * (dO V_b^T - D)``.
A kernel with a residual backward (``BlockKernel.residual_backward``: Triton's ``flash_attn2``,
``blockwise``, ``cudnn``, every ``X+blockwise``) is handed the ring's output and ``L`` and runs only its
backward. Any other is differentiated through ``jax.vjp`` of the block, which recomputes its
forward, and fed the exact cotangents of the merge: with ``w_b = exp(lse_b - L)``,

    d o_b   = w_b * dO
    d lse_b = w_b * (rowsum(dO * o_b) - D) + exp(lse_b - lse) * d lse

which needs a kernel whose lse is differentiable (else its forward runs with the blockwise
backward, a residual one: ``blocks.gradient_kernel`` decides). In both, dK/dV accumulators travel with their K/V and
arrive home after ``n`` passes. Autodiff
through the forward loop would also be exact, but it would keep every step's K/V block
and kernel residuals alive (the whole K/V on every device), which is what ring attention
exists to avoid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .blocks import BlockKernel, Residuals, RingTiling, acc_dtype, block, block_grads, gradient_kernel
from .layout import device_rows, put_device_rows

__all__ = ["make_ring"]

Array = Any


def _permute(tree: Any, tiling: RingTiling) -> Any:
    """Pass every array of ``tree`` to the next device on the ring."""
    perm = [(d, (d + 1) % tiling.n) for d in range(tiling.n)]
    return jax.tree_util.tree_map(lambda x: jax.lax.ppermute(x, tiling.axis, perm), tree)


def _gather(tree: Any, tiling: RingTiling) -> Any:
    """Every device's K/V (and key segment ids) along the sequence axis, in one collective."""
    return jax.tree_util.tree_map(lambda x: jax.lax.all_gather(x, tiling.axis, axis=1, tiled=True), tree)


def _gathered_order(tiling: RingTiling) -> Any:
    """How device ``src``'s keys lie in the gathered arrays: in one run of rows (shards gathered in
    device order), or the layout's chunks of the global order (K/V that stayed natural)."""
    return tiling.layout if tiling.kv_natural else "contiguous"


def _take(full: Any, src: Array, tiling: RingTiling) -> Any:
    """Device ``src``'s block (in the tiling's layout) out of the gathered K/V."""
    order = _gathered_order(tiling)
    return jax.tree_util.tree_map(lambda x: device_rows(x, order, src, tiling.n, tiling.s_local, 1), full)


def _bthd(x: Array) -> Array:
    """``(B, H, T)`` row statistics -> ``(B, T, H, 1)`` to scale outputs."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _finite_or_zero(x: Array) -> Array:
    return jnp.where(jnp.isfinite(x), x, 0)


def _merge(o: Array, lse: Array, o_b: Array, lse_b: Array) -> tuple[Array, Array]:
    new = jnp.logaddexp(lse, lse_b)  # -inf only where both are: such rows stay zero
    safe = _finite_or_zero(new)
    o = o * _bthd(jnp.exp(lse - safe)) + o_b.astype(o.dtype) * _bthd(jnp.exp(lse_b - safe))
    return o, new


def _denominator(lse: Array, aux: Array) -> Array:
    """``L``: log of the softmax denominator, the sink (one logit per head) included."""
    if aux is None:
        return lse
    return jnp.logaddexp(lse, aux.astype(lse.dtype)[None, :, None])


def _finish(q: Array, k: Array, v: Array, aux: Array, delta: Array, big_l_safe: Array, acc: Any, dq: Array,
            dk: Array, dv: Array) -> tuple[Array, ...]:
    """The backward's cotangents in the inputs' dtypes, the sinks' own included."""
    d_aux = None
    if aux is not None:
        # O = sum_b exp(lse_b - L) o_b and dL/daux = p_sink, so dO/daux = -p_sink * O.
        p_sink = jnp.exp(aux.astype(acc)[None, :, None] - big_l_safe)
        d_aux = (-(p_sink * delta).sum(axis=(0, 2))).astype(aux.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, d_aux


def _run_block(tiling: RingTiling, kern: BlockKernel, q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array,
               mask: Array, src: Array, first: bool) -> tuple[Array, Array]:
    """``(o_b, lse_b)``: this device's queries against the K/V block that came from device ``src``."""
    index = jax.lax.axis_index(tiling.axis)
    return block(tiling, kern, q, k, v, q_ids, kv_ids, mask, index=index, src=src, first=first)


def _ring_forward(tiling: RingTiling, kernel: BlockKernel, q: Array, k: Array, v: Array, q_ids: Array,
                  kv_ids: Array, mask: Array, aux: Array) -> tuple[tuple[Array, Array], tuple[Array, ...]]:
    """The ring's forward: ``((output, lse), residuals)``, every block merged, the sink last."""
    index = jax.lax.axis_index(tiling.axis)

    def attend(kv: tuple[Array, Array, Array], s: Any, first: bool) -> tuple[Array, Array]:
        k_blk, v_blk, ids_blk = kv
        return _run_block(tiling, kernel, q, k_blk, v_blk, q_ids, ids_blk, mask, (index - s) % tiling.n, first)

    def step(carry: Any, s: Array) -> tuple[Any, None]:
        o, lse, kv = carry
        # The next block's transfer does not depend on this block's attention: XLA runs
        # the two at once (an asynchronous collective-permute).
        nxt = _permute(kv, tiling)
        o, lse = _merge(o, lse, *attend(kv, s, False))
        return (o, lse, nxt), None

    def gathered_step(carry: Any, s: Array) -> tuple[Any, None]:
        o, lse = carry
        return _merge(o, lse, *attend(_take(full, (index - s) % tiling.n, tiling), s, False)), None

    kv = (k, v, kv_ids)
    if tiling.comm == "all_gather":
        full = _gather(kv, tiling)
        o_b, lse = attend(_take(full, index, tiling), 0, True)
        o = o_b.astype(acc_dtype(q.dtype))
        (o, lse), _ = jax.lax.scan(gathered_step, (o, lse), jnp.arange(1, tiling.n))
    else:
        nxt = _permute(kv, tiling) if tiling.n > 1 else kv
        o_b, lse = attend(kv, 0, True)
        o = o_b.astype(acc_dtype(q.dtype))
        if tiling.n > 1:  # steps 1 .. n-2 pass the block on; the last one only attends
            (o, lse, kv), _ = jax.lax.scan(step, (o, lse, nxt), jnp.arange(1, tiling.n - 1))
            o, lse = _merge(o, lse, *attend(kv, tiling.n - 1, False))
    big_l = _denominator(lse, aux)
    out = o * _bthd(jnp.exp(lse - _finite_or_zero(big_l)))
    residuals = (q, k, v, q_ids, kv_ids, mask, aux, out, lse, big_l)
    return (out.astype(q.dtype), lse), residuals


#: One source block's gradients: ``grads(kv, s, first) -> (dq, dk, dv)`` of the block held at step s.
_Grads = Callable[[tuple[Array, Array, Array], Any, bool], tuple[Array, Array, Array]]


def _gathered_backward(tiling: RingTiling, grads: _Grads, kv: tuple[Array, Array, Array],
                       acc: Any) -> tuple[Array, Array, Array]:
    """``comm="all_gather"``'s backward: every source's block from one gather, every device's
    dK/dV home in one reduce-scatter. ``(dq, dk, dv)`` in ``acc``."""
    index = jax.lax.axis_index(tiling.axis)

    def gathered_step(carry: Any, s: Array) -> tuple[Any, None]:
        # Each device computes each source's block once: its gradients replace zeros.
        dq, dk, dv = carry
        src = (index - s) % tiling.n
        g_q, g_k, g_v = grads(_take(full, src, tiling), s, False)
        return (dq + g_q, put(dk, g_k, src), put(dv, g_v, src)), None

    def put(x: Array, rows: Array, src: Array) -> Array:
        return put_device_rows(x, rows.astype(acc), _gathered_order(tiling), src, tiling.n, tiling.s_local, 1)

    # K/V gathered again rather than kept from the forward: residuals stay O(S/n) per device.
    full = _gather(kv, tiling)
    dq, g_k, g_v = grads(_take(full, index, tiling), 0, True)
    dk = put(jnp.zeros(full[0].shape, acc), g_k, index)
    dv = put(jnp.zeros(full[1].shape, acc), g_v, index)
    (dq, dk, dv), _ = jax.lax.scan(gathered_step, (dq.astype(acc), dk, dv), jnp.arange(1, tiling.n))
    # One reduce-scatter brings every device its own keys' gradients, summed over the queries.
    dk, dv = (jax.lax.psum_scatter(x, tiling.axis, scatter_dimension=1, tiled=True) for x in (dk, dv))
    return dq, dk, dv


def _permuted_backward(tiling: RingTiling, grads: _Grads, kv: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
    """The ring's backward by neighbour transfers: dK/dV accumulators travel with their K/V block
    and arrive home after ``n`` passes. ``(dq, dk, dv)``."""

    def step(carry: Any, s: Array) -> tuple[Any, None]:
        # Holding block index-s; the accumulators arriving now belong to it too.
        dq, kv, dkv = carry
        nxt = _permute(kv, tiling)
        dkv = _permute(dkv, tiling)  # needed only after this block's gradients: overlaps them
        g_q, g_k, g_v = grads(kv, s, False)
        return (dq + g_q, nxt, (dkv[0] + g_k, dkv[1] + g_v)), None

    nxt = _permute(kv, tiling) if tiling.n > 1 else kv
    dq, dk, dv = grads(kv, 0, True)
    if tiling.n > 1:
        (dq, kv, dkv), _ = jax.lax.scan(step, (dq, nxt, (dk, dv)), jnp.arange(1, tiling.n - 1))
        dk, dv = _permute(dkv, tiling)
        g_q, g_k, g_v = grads(kv, tiling.n - 1, False)
        # The n-th pass of the accumulators brings each device's own dK/dV home.
        dq, (dk, dv) = dq + g_q, _permute((dk + g_k, dv + g_v), tiling)
    return dq, dk, dv


def _ring_backward(tiling: RingTiling, kernel: BlockKernel, residuals: tuple[Array, ...],
                   cts: tuple[Array, Array]) -> tuple[Array, ...]:
    """The ring's backward: each block's gradients at the global statistics (module docstring),
    the ring run again in the forward's schedule."""
    q, k, v, q_ids, kv_ids, mask, aux, out, lse, big_l = residuals
    d_out, d_lse = cts
    acc = out.dtype
    d_out = d_out.astype(acc)
    d_lse = d_lse.astype(acc)
    delta = jnp.swapaxes(jnp.sum(d_out * out, axis=-1), 1, 2)  # D = rowsum(dO * O), (B, H, T)
    lse_safe, big_l_safe = _finite_or_zero(lse), _finite_or_zero(big_l)
    kern = gradient_kernel(kernel, q, k, v)
    index = jax.lax.axis_index(tiling.axis)
    # The lse cotangent in terms of L: exp(S - lse) d_lse = exp(S - L) exp(L - lse) d_lse.
    res = Residuals(out, big_l_safe, d_out, jnp.exp(big_l_safe - lse_safe) * d_lse)

    def grads(kv: tuple[Array, Array, Array], s: Any, first: bool) -> tuple[Array, Array, Array]:
        k_blk, v_blk, ids_blk = kv
        src = (index - s) % tiling.n
        if kern.residual_backward:
            return block_grads(tiling, kern, q, k_blk, v_blk, q_ids, ids_blk, mask, res, index=index, src=src,
                               first=first)

        def f(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
            return _run_block(tiling, kern, q, k, v, q_ids, ids_blk, mask, src, first)

        (o_b, lse_b), vjp = jax.vjp(f, q, k_blk, v_blk)
        w = jnp.exp(lse_b - big_l_safe)  # this block's share of the final softmax
        d_o_b = _bthd(w) * d_out
        row = jnp.swapaxes(jnp.sum(d_out * o_b.astype(acc), axis=-1), 1, 2)
        d_lse_b = w * (row - delta) + jnp.exp(lse_b - lse_safe) * d_lse
        dq, dk, dv = vjp((d_o_b.astype(o_b.dtype), d_lse_b.astype(lse_b.dtype)))
        return dq.astype(acc), dk.astype(acc), dv.astype(acc)

    if tiling.comm == "all_gather":
        dq, dk, dv = _gathered_backward(tiling, grads, (k, v, kv_ids), acc)
    else:
        dq, dk, dv = _permuted_backward(tiling, grads, (k, v, kv_ids))
    return _finish(q, k, v, aux, delta, big_l_safe, acc, dq, dk, dv)


def make_ring(tiling: RingTiling, kernel: BlockKernel) -> Callable[..., Any]:
    """``ring(q, k, v, q_ids, kv_ids, mask, aux) -> (output, lse)`` for one device's shards: a
    ``custom_vjp`` of ``_ring_forward`` whose backward (``_ring_backward``) runs the ring again."""

    def forward(q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array, mask: Array,
                aux: Array) -> tuple[tuple[Array, Array], tuple[Array, ...]]:
        return _ring_forward(tiling, kernel, q, k, v, q_ids, kv_ids, mask, aux)

    def backward(residuals: tuple[Array, ...], cts: tuple[Array, Array]) -> tuple[Array, ...]:
        return _ring_backward(tiling, kernel, residuals, cts)

    @jax.custom_vjp
    def ring(q: Array, k: Array, v: Array, q_ids: Array, kv_ids: Array, mask: Array,
             aux: Array) -> tuple[Array, Array]:
        return forward(q, k, v, q_ids, kv_ids, mask, aux)[0]

    ring.defvjp(forward, backward)
    return ring
