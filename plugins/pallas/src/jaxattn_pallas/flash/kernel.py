"""The attention contract (docs/contract.md) on top of the Pallas TPU flash-attention kernel.

``jax.experimental.pallas.ops.tpu.flash_attention`` takes BHTD tensors with equal head
counts and equal q/k/v head dims, an additive bias of the full ``(B, H, T, S)`` shape,
segment ids and a top-left aligned causal flag, and requires tile-aligned lengths. This
module translates every contract feature onto that, exactly:

* layout BTHD <-> BHTD;
* GQA/MQA: without in-kernel causal masking the query heads of a group are folded into
  the query rows of their kv head (no K/V copy; a decode step reads K/V once per group);
  with it, K/V are repeated to Hq (the row index must stay the query position);
* causal, bottom-right aligned (query i sees keys j <= i + S - T):
  T == S is the kernel's own causal; T > S drops the first T - S queries (they see no
  key, their output is zero) and the rest is T == S; T == 1 sees every key; 1 < T < S
  goes into the additive bias when there is one anyway, otherwise the queries are
  front-padded with S - T dummy rows so the kernel's top-left diagonal lands right;
* boolean mask -> a large negative additive bias; user bias divided by the softmax
  scale because the kernel adds the bias *before* scaling;
* padding of T/S to tile multiples (keys masked through segment ids), of head dims to
  what the kernel takes (zeros change neither logits nor the kept output columns);
* a query row that sees no key yields zeros (the kernel would average the masked keys).

The Pallas TPU modules are imported here at module level; this module itself is only
imported when a kernel is built (see ``impl.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

from jaxattn.backend import traced_under, x64_off, zero_unseen_keys

from .rules import LANES, FlashTiling, flash_tiling

__all__ = ["flash_attention", "kernel_block_sizes"]

#: The scaled logit a masked key gets. Finite, so that even a row whose keys are all masked
#: never forms inf - inf; far below any real logit, so exp() of it is exactly 0 once a
#: visible key sets the row max; and small enough in magnitude that adding the kernel's own
#: mask value (-0.7 * float32 max) cannot overflow to -inf.
_MASKED_LOGIT = -1e30
_MAX_BIAS_MAGNITUDE = 1e37  # |bias / scale| bound, far from float32 overflow


def kernel_block_sizes(tiling: FlashTiling) -> tpu_flash.BlockSizes:
    """The kernel's BlockSizes for a tiling (forward and both backward kernels)."""
    return tpu_flash.BlockSizes(
        block_q=tiling.block_q,
        block_k_major=tiling.block_k,
        block_k=tiling.block_k,
        block_b=1,
        block_q_major_dkv=tiling.block_q_bwd,
        block_k_major_dkv=tiling.block_k_bwd,
        block_k_dkv=tiling.block_k_bwd,
        block_q_dkv=tiling.block_q_bwd,
        block_k_major_dq=tiling.block_k_bwd,
        block_k_dq=tiling.block_k_bwd,
        block_q_dq=tiling.block_q_bwd,
    )


def _pad_axis(x: jax.Array, axis: int, before: int, after: int, value: Any = 0) -> jax.Array:
    if before == 0 and after == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, after)
    return jnp.pad(x, widths, constant_values=value)


def _rows(x: jax.Array | None, start: int) -> jax.Array | None:
    """Drop the first ``start`` query rows of a rank-4 mask/bias (kept if broadcast over T)."""
    if x is None or start == 0 or x.shape[2] == 1:
        return x
    return x[:, :, start:, :]


def _visibility(
    mask: jax.Array | None,
    bias: jax.Array | None,
    causal_offset: int | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    t: int,
    s: int,
) -> jax.Array | None:
    """Which keys each query sees, broadcastable to (B, H, T, S); None when all of them.

    A bias of -inf hides a key as well: the oracle then gives the row zeros if nothing
    else is left, and the clipped bias the kernel receives could not say so by itself.
    """
    vis = None if mask is None else mask.astype(bool)
    if bias is not None:
        finite = bias > -jnp.inf
        vis = finite if vis is None else vis & finite
    if causal_offset is not None:
        # At rank 4, as the mask: no operand needs rank promotion (jax_numpy_rank_promotion="raise").
        causal = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + causal_offset)[None, None]
        vis = causal if vis is None else vis & causal
    if q_seg is not None and kv_seg is not None:
        same = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
        vis = same if vis is None else vis & same
    return vis


def _segment_sentinel(q_seg: jax.Array) -> jax.Array:
    """An id no query carries, for padded keys: one below the smallest query id (or, in
    the absurd case where that is int32 min, one above the largest)."""
    low = jnp.min(q_seg)
    return jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, jnp.max(q_seg) + 1)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    causal: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float,
    block_sizes: dict[str, int] | None = None,
    interpret: bool = False,
    zero_unseen: bool = False,
) -> jax.Array:
    """Attention of BTHD ``q (B, T, Hq, D)``, ``k (B, S, Hkv, D)``, ``v (B, S, Hkv, Dv)``.

    ``mask`` (bool) and ``bias`` are rank 4 and broadcastable to ``(B, Hq, T, S)``.
    ``block_sizes`` takes ``block_q``, ``block_k``, ``block_q_bwd``, ``block_k_bwd``.
    ``zero_unseen``: keys no query of a sequence and KV head sees are unread (a mask_mod's,
    docs/masks.md), so they are replaced by zeros first. Returns ``(B, T, Hq, Dv)`` in q's dtype.
    """
    b, t_in, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    scale = float(softmax_scale)
    out_dtype = q.dtype

    # Causal with T > S: the first T - S queries see no key at all.
    skipped = t_in - s if causal and t_in > s else 0
    if skipped:
        q = q[:, skipped:]
        mask, bias = _rows(mask, skipped), _rows(bias, skipped)
        if q_segment_ids is not None:
            q_segment_ids = q_segment_ids[:, skipped:]
    t = t_in - skipped
    offset = s - t  # >= 0 from here on
    kernel_causal = causal and offset == 0
    causal_in_bias = causal and offset > 0 and t > 1 and (mask is not None or bias is not None)
    front_pad = offset if causal and offset > 0 and t > 1 and not causal_in_bias else 0
    kernel_causal = kernel_causal or front_pad > 0

    has_segments = q_segment_ids is not None and kv_segment_ids is not None
    # Rows left with no key: only a mask, segment ids or a -inf bias can do that now (with
    # causal masking on top of them).
    visible = None
    if mask is not None or bias is not None or has_segments:
        visible = _visibility(
            mask,
            bias,
            offset if causal else None,
            q_segment_ids if has_segments else None,
            kv_segment_ids if has_segments else None,
            t,
            s,
        )
    valid = None if visible is None else jnp.any(visible, axis=-1)  # (B|1, H|1, T)
    if zero_unseen and visible is not None:
        # The kernel hides keys by its bias, and 0 * NaN is NaN: a key no query of the group sees
        # must hold zeros when P @ V and dS @ K read it.
        k, v = zero_unseen_keys(visible, k, v)

    # The additive bias the kernel gets: user bias / scale, masked keys at _MASKED_LOGIT.
    fill = -min(-_MASKED_LOGIT / scale, _MAX_BIAS_MAGNITUDE)
    ab = None
    if mask is not None or bias is not None or causal_in_bias:
        ab = jnp.zeros((1, 1, 1, 1), jnp.float32)
        if bias is not None:
            ab = jnp.maximum(bias.astype(jnp.float32) / scale, fill)
        hide = _visibility(mask, None, offset if causal_in_bias else None, None, None, t, s)
        if hide is not None:
            ab = jnp.where(hide, ab, fill)
        ab = jnp.broadcast_to(ab, (b, hq, t, s))

    # BTHD -> BHTD, and the GQA layout.
    fold = group > 1 and not kernel_causal
    qh = q.transpose(0, 2, 1, 3)
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    q_seg = q_segment_ids if has_segments else None
    if fold:
        qh = qh.reshape(b, hkv, group * t, d)  # row g*T + i is query head kv*G + g, position i
        if ab is not None:
            ab = ab.reshape(b, hkv, group * t, s)
        if q_seg is not None:
            q_seg = jnp.tile(q_seg, (1, group))
    elif group > 1:
        kh = jnp.repeat(kh, group, axis=1)
        vh = jnp.repeat(vh, group, axis=1)
    rows = qh.shape[2]

    # Head dims: one size for q/k/v, at most 128 or a multiple of 128.
    dp = max(d, dv)
    if dp > LANES:
        dp = -(-dp // LANES) * LANES
    qh, kh, vh = _pad_axis(qh, 3, 0, dp - d), _pad_axis(kh, 3, 0, dp - d), _pad_axis(vh, 3, 0, dp - dv)

    tiling = flash_tiling(front_pad + rows, s, itemsize=jnp.dtype(q.dtype).itemsize, **(block_sizes or {}))
    tail_q = tiling.q_len - front_pad - rows
    tail_k = tiling.kv_len - s
    qh = _pad_axis(qh, 2, front_pad, tail_q)
    kh, vh = _pad_axis(kh, 2, 0, tail_k), _pad_axis(vh, 2, 0, tail_k)
    if ab is not None:
        ab = _pad_axis(_pad_axis(ab, 2, front_pad, tail_q), 3, 0, tail_k, value=fill)

    # Segment ids: the caller's, with a key segment no query has for padded keys. Without
    # them, padded keys are hidden by in-kernel causal masking or by the bias if there is
    # one, else by a segment of their own.
    segments = None
    if q_seg is not None and kv_segment_ids is not None:
        q_ids = q_seg.astype(jnp.int32)
        kv_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, 0, tail_k, _segment_sentinel(q_ids))
        segments = tpu_flash.SegmentIds(q=_pad_axis(q_ids, 1, front_pad, tail_q), kv=kv_ids)
    elif tail_k and not kernel_causal and ab is None:
        segments = tpu_flash.SegmentIds(
            q=jnp.zeros((b, tiling.q_len), jnp.int32),
            kv=(jnp.arange(tiling.kv_len) >= s).astype(jnp.int32)[None].repeat(b, axis=0),
        )

    kernel = functools.partial(
        tpu_flash.flash_attention,
        causal=kernel_causal,
        sm_scale=scale,
        block_sizes=kernel_block_sizes(tiling),
    )
    # The kernel indexes in int32 (it breaks under jax_enable_x64); interpret mode runs it on a CPU.
    contexts = (x64_off, pltpu.force_tpu_interpret_mode) if interpret else (x64_off,)
    out: jax.Array = traced_under(kernel, *contexts)(qh, kh, vh, ab, segments)

    out = out[:, :, front_pad : front_pad + rows, :dv]
    if fold:
        out = out.reshape(b, hq, t, dv)
    if valid is not None:
        out = jnp.where(valid[..., None], out, 0)
    out = out.transpose(0, 2, 1, 3).astype(out_dtype)
    if skipped:
        out = _pad_axis(out, 1, skipped, 0)
    return out
