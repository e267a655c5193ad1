"""The attention contract (docs/contract.md) on top of the Pallas TPU splash-attention kernel.

``jax.experimental.pallas.ops.tpu.splash_attention`` runs one batch element of
``(H, T, D)`` queries against ``(Hkv, S, D)`` (``make_splash_mha``, grouped heads native)
or ``(S, D)`` (``make_splash_mqa``) keys, under a static per-head mask whose all-masked
tiles it skips. It has no softmax scale (q is pre-scaled, so the soft cap sees scaled
logits, as the contract wants), takes segment ids and sinks per call, and needs tile
multiples of 128. This module translates, exactly:

* BTHD <-> HTD: the batch folds into the heads (one kernel call), except with segment
  ids, which splash takes per batch element (``jax.vmap`` over the batch);
* causal / sliding window, aligned bottom-right, as ``CausalMask`` / ``LocalMask`` with
  ``offset = S - T`` (a causal window is the window with no right side); no causal and no
  window is ``FullMask``. Causal with ``T > S`` drops the first ``T - S`` queries, which see
  no key (splash calls such rows undefined);
* lengths padded to tiles; padded keys hidden through segment ids where the static mask
  does not hide them already;
* a query row that sees no key yields zeros (the kernel would average the masked keys, or
  divide by zero in tiles it skipped);
* a ``mask_mod`` (``jaxattn.masks``; static: no traced captures, the same for every b) is
  evaluated on the host when the kernel is built, ANDed with causal / the window, into one
  ``NumpyMask`` per head (splash skips its empty tiles); keys no query of a KV head sees are
  replaced by zeros with a select (they may hold NaN, which the kernel's ``p = 0`` would keep).

The Pallas TPU modules are imported here at module level; this module itself is only
imported when a kernel is built (see ``impl.py``).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

from jaxattn import masks

from .blocks import SplashTiling, splash_tiling

__all__ = ["build_kernel", "splash_attention"]


def _pad_axis(x: jax.Array, axis: int, before: int, after: int, value: int | float | jax.Array = 0) -> jax.Array:
    if before == 0 and after == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, after)
    return jnp.pad(x, widths, constant_values=value)


def _static_mask(
    shape: tuple[int, int], causal: bool, window: tuple[int, int] | None, offset: int
) -> splash.Mask:
    """One head's mask over the padded (T, S) grid."""
    if window is not None:
        left, right = window
        return splash.LocalMask(shape, window_size=(left, 0 if causal else right), offset=offset)
    if causal:
        return splash.CausalMask(shape, offset=offset)
    return splash.FullMask(shape)


def mod_grid(mask_mod: Any, hq: int, t: int, s: int, tiling: SplashTiling, causal: bool,
             window: tuple[int, int] | None, offset: int) -> np.ndarray:
    """``(Hq, q_len, kv_len)`` bool on the host: the static mask_mod (raw positions, for b = 0)
    ANDed with causal and the window (bottom-right, ``offset = S - T``); padded keys hidden,
    padded query rows (discarded) see every real key."""
    with jax.ensure_compile_time_eval():
        seen = np.asarray(jnp.broadcast_to(mask_mod(*masks.indices(1, hq, t, s)), (1, hq, t, s))[0])
    i = np.arange(t)[:, None] + offset
    j = np.arange(s)[None, :]
    if causal:
        seen = seen & (j <= i)
    if window is not None:
        seen = seen & (j >= i - window[0]) & (j <= i + (0 if causal else window[1]))
    grid = np.zeros((hq, tiling.q_len, tiling.kv_len), bool)
    grid[:, :t, :s] = seen
    grid[:, t:, :s] = True
    return grid


@functools.lru_cache(maxsize=64)
def build_kernel(
    heads: int,
    mqa: bool,
    tiling: SplashTiling,
    causal: bool,
    window: tuple[int, int] | None,
    offset: int,
    soft_cap: float | None,
    interpret: bool,
    mask_mod: Any = None,
    mod_shape: tuple[int, int, int] | None = None,
) -> splash_attention_kernel.SplashAttentionKernel:
    """The splash kernel for one configuration (cached: building it analyses the mask).

    Built under ``ensure_compile_time_eval`` so its mask tables are concrete arrays even
    when the first call happens inside ``jax.jit`` (a cached tracer would leak). With a static
    ``mask_mod`` (``mod_shape = (Hq, T, S)``) the heads' masks are its grid (``mod_grid``),
    repeated over the ``heads // Hq`` batch elements folded into the heads.
    """
    if mask_mod is not None and mod_shape is not None:
        hq, t, s = mod_shape
        grid = mod_grid(mask_mod, hq, t, s, tiling, causal, window, offset)
        per_head = [splash.NumpyMask(grid[h]) for h in range(hq)]
        masks_of_heads: list[splash.Mask] = [per_head[h % hq] for h in range(heads)]
    else:
        masks_of_heads = [_static_mask((tiling.q_len, tiling.kv_len), causal, window, offset)] * heads
    block_sizes = splash.BlockSizes(
        block_q=tiling.block_q,
        block_kv=tiling.block_kv,
        block_kv_compute=tiling.block_kv,
        block_q_dkv=tiling.block_q_bwd,
        block_kv_dkv=tiling.block_kv_bwd,
        block_kv_dkv_compute=tiling.block_kv_bwd,
        block_q_dq=tiling.block_q_bwd,
        block_kv_dq=tiling.block_kv_bwd,
    )
    make = splash.make_splash_mqa if mqa else splash.make_splash_mha
    with jax.ensure_compile_time_eval():
        kernel: splash_attention_kernel.SplashAttentionKernel = make(
            splash.MultiHeadMask(masks_of_heads),
            block_sizes=block_sizes,
            attn_logits_soft_cap=soft_cap,
            head_shards=1,
            q_seq_shards=1,
            # TPU interpret mode (simulated VMEM/SMEM, out-of-bounds reads raise), not the
            # generic HLO interpreter that interpret=True would select. The builder annotates
            # a bool but hands the value to pallas_call, which takes InterpretParams.
            interpret=pltpu.InterpretParams() if interpret else False,  # type: ignore[arg-type]
        )
    return kernel


def _segment_sentinel(q_seg: jax.Array) -> jax.Array:
    """An id no query carries, for padded keys: one below the smallest query id (or, in
    the absurd case where that is int32 min, one above the largest)."""
    low = jnp.min(q_seg)
    return jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, jnp.max(q_seg) + 1)


def _output(result: Any) -> jax.Array:
    """The kernel's result: built with save_residuals=False, that is the output alone."""
    return cast(jax.Array, result)


def _valid_rows(
    t: int,
    s: int,
    causal: bool,
    window: tuple[int, int] | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
) -> jax.Array | None:
    """(B|1, 1, T): whether each query sees any key; None when every one does."""
    if window is None and q_seg is None:
        return None  # causal alone leaves every row (of T <= S) a key
    i = jnp.arange(t)[:, None] + (s - t)  # bottom-right aligned query position
    j = jnp.arange(s)[None, :]
    vis = jnp.ones((t, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    vis = vis[None]
    if q_seg is not None and kv_seg is not None:
        vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])
    return jnp.any(vis, axis=-1)[:, None, :]


def _mod_rows_and_keys(
    mask_mod: Any,
    k: jax.Array,
    v: jax.Array,
    hq: int,
    t: int,
    tiling: SplashTiling,
    causal: bool,
    sliding_window: tuple[int, int] | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(rows, k, v)`` under a static ``mask_mod``: ``rows (1, Hq, T)``, whether each query
    sees a key; k and v with zeros at the keys no query of their KV head sees (they may hold
    NaN, which the kernel's ``p = 0`` would keep: a select, not a product)."""
    s, hkv = k.shape[1], k.shape[2]
    grid = mod_grid(mask_mod, hq, t, s, tiling, causal, sliding_window, s - t)[:, :t, :s]
    rows = jnp.asarray(grid.any(axis=-1))[None]  # (1, Hq, T): rows that see a key
    seen = jnp.asarray(grid.reshape(hkv, hq // hkv, t, s))  # keys no query of a KV head sees: zeros
    if q_segment_ids is not None and kv_segment_ids is not None:
        same = q_segment_ids[:, None, None, :, None] == kv_segment_ids[:, None, None, None, :]
        live = jnp.any(seen[None] & same, axis=(2, 3))  # (B, Hkv, S)
    else:
        live = jnp.any(seen, axis=(1, 2))[None]
    live = live.transpose(0, 2, 1)[..., None]
    return rows, jnp.where(live, k, jnp.zeros((), k.dtype)), jnp.where(live, v, jnp.zeros((), v.dtype))


def _segments(
    b: int,
    t: int,
    s: int,
    tiling: SplashTiling,
    causal: bool,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> splash.SegmentIds | None:
    """The kernel's segment ids over the padded grid; None where it needs none."""
    tail_q, tail_k = tiling.q_len - t, tiling.kv_len - s
    # Padded keys are hidden by causal masking (the last query sees key S - 1 at most);
    # otherwise by a key segment no query carries.
    if q_segment_ids is not None and kv_segment_ids is not None:
        q_ids = q_segment_ids.astype(jnp.int32)
        kv_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, 0, tail_k, _segment_sentinel(q_ids))
        return splash.SegmentIds(q=_pad_axis(q_ids, 1, 0, tail_q), kv=kv_ids)
    if tail_k and not causal:
        return splash.SegmentIds(
            q=jnp.zeros((b, tiling.q_len), jnp.int32),
            kv=jnp.broadcast_to((jnp.arange(tiling.kv_len) >= s).astype(jnp.int32), (b, tiling.kv_len)),
        )
    return None


def _call_kernel(
    qh: jax.Array,
    kh: jax.Array,
    vh: jax.Array,
    segments: splash.SegmentIds | None,
    sinks: jax.Array | None,
    tiling: SplashTiling,
    causal: bool,
    sliding_window: tuple[int, int] | None,
    offset: int,
    soft_cap: float | None,
    interpret: bool,
    mod: dict[str, Any],
) -> jax.Array:
    """The kernel on padded HTD ``qh (B, Hq, Tp, D)``, ``kh``, ``vh (B, Hkv, Sp, D|Dv)``:
    ``(B, Hq, Tp, Dv')``, its output unsliced."""
    b, hq = qh.shape[:2]
    hkv = kh.shape[1]
    mqa = hkv == 1 and hq > 1
    if segments is None:
        # One kernel over B * Hq heads: the batch folds into the heads (query head
        # b * Hq + h reads kv head b * Hkv + h // G, which is splash's own grouping).
        kernel = build_kernel(b * hq, False, tiling, causal, sliding_window, offset, soft_cap, interpret, **mod)
        fold = (b * hq, tiling.q_len, -1)
        kf, vf = kh.reshape(b * hkv, tiling.kv_len, -1), vh.reshape(b * hkv, tiling.kv_len, -1)
        folded_sinks = None if sinks is None else jnp.tile(sinks, b)
        out = _output(kernel(qh.reshape(fold), kf, vf, None, folded_sinks))
        return out.reshape(b, hq, tiling.q_len, -1)
    # Segment ids are per batch element: one kernel call per element.
    kernel = build_kernel(hq, mqa, tiling, causal, sliding_window, offset, soft_cap, interpret, **mod)
    if mqa:
        kh, vh = kh[:, 0], vh[:, 0]  # make_splash_mqa takes (S, D) keys
    if interpret:
        # The TPU interpreter of jax 0.10 cannot run a vmapped pallas_call (its grid
        # gains a dim its dimension_semantics lack); a sequential map computes the same.
        return _output(jax.lax.map(lambda xs: kernel(*xs, sinks), (qh, kh, vh, segments)))
    return _output(jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(qh, kh, vh, segments, sinks))


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    softmax_aux: jax.Array | None = None,
    block_sizes: dict[str, int] | None = None,
    interpret: bool = False,
    mask_mod: Any = None,
) -> jax.Array:
    """Attention of BTHD ``q (B, T, Hq, D)``, ``k (B, S, Hkv, D)``, ``v (B, S, Hkv, Dv)``.

    ``softmax_aux`` is one sink logit per query head ``(Hq,)``. ``block_sizes`` takes
    ``block_q``, ``block_k``, ``block_q_bwd``, ``block_k_bwd``. ``mask_mod``: a static one
    (see the module docstring). Returns ``(B, T, Hq, Dv)``.
    """
    b, t_in, hq, _ = q.shape
    s, dv = k.shape[1], v.shape[3]
    out_dtype = q.dtype

    skipped = t_in - s if causal and t_in > s else 0
    if skipped and mask_mod is not None:  # the mask_mod sees raw positions of all T queries
        inner = mask_mod
        mask_mod = lambda b_, h_, i_, j_: inner(b_, h_, i_ + skipped, j_)  # noqa: E731
    if skipped:
        q = q[:, skipped:]
        if q_segment_ids is not None:
            q_segment_ids = q_segment_ids[:, skipped:]
    t = t_in - skipped
    has_segments = q_segment_ids is not None and kv_segment_ids is not None
    valid = _valid_rows(
        t,
        s,
        causal,
        sliding_window,
        q_segment_ids if has_segments else None,
        kv_segment_ids if has_segments else None,
    )

    tiling = splash_tiling(t, s, **(block_sizes or {}))
    tail_q, tail_k = tiling.q_len - t, tiling.kv_len - s
    mod = {}
    if mask_mod is not None:
        mod = {"mask_mod": mask_mod, "mod_shape": (hq, t, s)}
        rows, k, v = _mod_rows_and_keys(mask_mod, k, v, hq, t, tiling, causal, sliding_window, q_segment_ids,
                                        kv_segment_ids)
        valid = rows if valid is None else valid & rows

    # Splash has no scale: scale q (in float32, then back) so logits and soft cap match.
    qh = (q.astype(jnp.float32) * softmax_scale).astype(q.dtype).transpose(0, 2, 1, 3)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    qh = _pad_axis(qh, 2, 0, tail_q)
    kh, vh = _pad_axis(kh, 2, 0, tail_k), _pad_axis(vh, 2, 0, tail_k)
    segments = _segments(b, t, s, tiling, causal, q_segment_ids, kv_segment_ids)

    soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
    # Sinks travel in the inputs' dtype: splash's backward returns their gradient in the
    # output's dtype, and a float32 primal with a bfloat16 cotangent fails JAX's VJP check.
    # (The kernel computes with them in float32 either way.)
    sinks = None if softmax_aux is None else softmax_aux.astype(q.dtype)
    out = _call_kernel(qh, kh, vh, segments, sinks, tiling, causal, sliding_window, s - t, soft_cap, interpret, mod)

    out = out[:, :, :t, :dv]
    if valid is not None:
        out = jnp.where(valid[..., None], out, 0)
    out = out.transpose(0, 2, 1, 3).astype(out_dtype)
    if skipped:
        out = _pad_axis(out, 1, skipped, 0)
    return out
