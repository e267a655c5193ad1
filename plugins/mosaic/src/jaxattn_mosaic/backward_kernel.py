"""The backward attention kernels of jaxattn-mosaic, in Pallas Mosaic GPU (sm_90 only).

Like :mod:`jaxattn_mosaic.kernel`, this module imports jax's Mosaic GPU dialect at its top:
only a differentiated call imports it, and it needs nothing of jaxattn (the benchmark script
loads it by path).

A flash backward recomputes the probabilities block by block from the forward's log-sum-exp
and splits the work in two kernels, each a CTA of three warpgroups (two consumers issuing
asynchronous wgmma, one TMA producer streaming blocks into a ring of ``stages`` slots):

* **dQ**: a CTA per (query head, tile of ``2 * block_q`` rows, batch). Each consumer holds its
  ``block_q`` rows of Q and dO; the producer streams K and V blocks. Per block:
  ``S = Q K^T``, ``dP = dO V^T``, ``P = exp2(S * c - lse2)``, ``dS = P (dP - delta)``,
  ``dQ += dS K``.
* **dK/dV**: a CTA per (KV head, tile of ``2 * block_kv`` keys, batch). Each consumer holds
  its ``block_kv`` keys of K and V; the producer streams Q, dO, lse and delta blocks of every
  query head of the GQA group and every query block that sees the tile. Per block (all
  transposed, keys as rows): ``S^T = K Q^T``, ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``,
  ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q``. The group's sum happens in the
  accumulators: no per-query-head dK/dV in memory and no atomics, so the result is
  deterministic (bit-identical from run to run).

``delta_i = sum_d dO_id O_id - d_lse_i``: the lse's own cotangent enters exactly there
(``d lse_i / d logit_ij = P_ij``), so a loss through the lse costs nothing extra.

A logits soft cap recomputes the capped scores ``S_c = c tanh(S / c)`` (``blocks.soft_capped``;
``c`` the cap over the scale), takes ``P`` from them and multiplies ``dS`` by ``1 - tanh^2``.

Masks: causal is bottom-right (query ``i`` sees key ``j`` iff ``j <= i + S - T``), as the
forward, and a sliding window narrows both kernels to bands (``blocks.KeyBlocks``: the key
blocks a dQ tile's rows see, the query blocks that see a dK/dV tile's keys). Probabilities of
masked pairs and of keys past ``S`` are zeroed; query rows past ``T`` and rows that see no key
(lse ``-inf``) get an lse of ``_NO_KEY`` (``1e30``), so their ``P`` is 0 and they add nothing. Blocks that
need no mask run without the iota/compare.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn_mosaic.blocks import (
    NO_WINDOW,
    TRANSFORMS,
    KeyBlocks,
    Window,
    bits_keep,
    cdiv,
    check_inputs,
    load_vector,
    plus,
    release_unread,
    ring_slot,
    soft_cap_slope,
    soft_capped,
    stream_kv,
    transposed,
    window_sides,
)
from jaxattn_mosaic.mods import WORD, row_blocks, tile_lists

__all__ = ["BackwardConfig", "default_backward_config", "mosaic_attention_backward"]

_LOG2E = math.log2(math.e)
#: The log2-sum-exp given to rows that see no key (padded rows too): exp2(s - _NO_KEY) is 0 for
#: any score the kernels compute, and it is finite.
_NO_KEY = 1e30


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel's tiles: ``block_q`` query rows and ``block_kv`` keys (per consumer or per
    streamed block, by kernel) and ``stages`` slots in its producer's ring."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2

    def __post_init__(self) -> None:
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"blocks must be multiples of 64, got {self}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """``dq``: ``block_q`` rows per consumer, ``block_kv`` keys per streamed block.
    ``dkv``: ``block_kv`` keys per consumer, ``block_q`` rows per streamed block."""

    dq: Tiles = Tiles()
    dkv: Tiles = Tiles()


#: Head dims the backward takes: at 256 the dK/dV accumulators alone (2 x 64 x 256 float32
#: per consumer) exceed a warpgroup's registers, and K, V and two Q/dO stages the shared memory.
HEAD_DIMS = (64, 128)


def default_backward_config(head_dim: int) -> BackwardConfig:
    """Tiles that fit the registers: per consumer, dQ holds ``S``, ``dP`` (block_q x block_kv)
    and dQ (block_q x D) in float32; dK/dV holds dK and dV (block_kv x D) and ``S^T``, ``dP^T``."""
    del head_dim  # 64 x 64 blocks fit both head dims; see benchmarks/mosaic_bench.py --bwd-sweep
    return BackwardConfig()


def mosaic_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array | None = None,
    *,
    causal: bool,
    softmax_scale: float,
    soft_cap: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    config: BackwardConfig | None = None,
    bits: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """``(dq, dk, dv)`` of attention of q ``(B, T, Hq, D)`` over k, v ``(B, S, Hkv, D)``, the
    logits capped at ``soft_cap`` and the keys seen through ``sliding_window`` as the forward's;
    or through a mask_mod's ``bits`` as the forward's (``kernel.mosaic_attention_forward``): each
    kernel then walks its tiles' lists (``mods.tile_lists``), partial blocks masked by the bits.
    With ``alibi_slopes`` (``(Hq,)``, as the forward's) ALiBi's term enters every score, and the
    slopes' gradient ``sum dS * (kv_idx - q_idx)`` comes from the dQ kernel's row sums (float32,
    exact whatever the dtype): then ``(dq, dk, dv, d_slopes)``.

    ``out`` and ``lse`` ``(B, Hq, T)``, natural log, are the forward's; ``d_out`` and ``d_lse``
    their cotangents (``d_lse`` None: the loss does not use the lse). Gradients in the
    inputs' dtypes.
    """
    check_inputs(q, k, v, HEAD_DIMS, "the backward")
    _, t_len, hq, head_dim = q.shape
    _, s_len, hkv, _ = k.shape
    if bits is not None and (causal or sliding_window is not None):
        raise ValueError("with bits, AND the causal rule and the window into them (mods.call_bits)")
    cfg = config or default_backward_config(head_dim)
    # dQ tiles hold 2 x its block_q rows, dK/dV tiles 2 x its block_kv keys; the keys span at
    # least the dQ ring's stages.
    rows = math.lcm(2 * cfg.dq.block_q, cfg.dkv.block_q)
    cols = math.lcm(2 * cfg.dkv.block_kv, cfg.dq.block_kv)
    t_pad = cdiv(t_len, rows) * rows
    s_pad = max(cdiv(s_len, cols) * cols, cdiv(cfg.dq.stages * cfg.dq.block_kv, cols) * cols)

    f32 = jnp.float32
    delta = jnp.einsum("bthd,bthd->bht", out.astype(f32), d_out.astype(f32))
    if d_lse is not None:
        delta = delta - d_lse.astype(f32)
    # _NO_KEY for rows that see no key: their P is exp2(-huge) = 0 (not exp2(+inf)). Finite, as
    # the contract asks of the rows a kernel pads (no Inf in any array, for jax.debug_infs).
    lse2 = jnp.where(jnp.isfinite(lse), lse.astype(f32) * _LOG2E, _NO_KEY)
    if t_pad != t_len:
        pad = ((0, 0), (0, t_pad - t_len), (0, 0), (0, 0))
        q, d_out = jnp.pad(q, pad), jnp.pad(d_out.astype(q.dtype), pad)
        lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, t_pad - t_len)), constant_values=_NO_KEY)
        delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_pad - t_len)))
    d_out = d_out.astype(q.dtype)
    if s_pad != s_len:
        pad = ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    shape = _Shape(t_len=t_len, s_len=s_len, hq=hq, hkv=hkv, causal=causal, scale=float(softmax_scale), cfg=cfg,
                   cap=None if soft_cap is None else float(soft_cap) / float(softmax_scale),
                   window=window_sides(sliding_window, t_len, s_len))
    dq_mods = dkv_mods = None
    if bits is not None:
        tq, tkv = cfg.dq, cfg.dkv
        dq_mods = (tile_lists(bits, s_len, rows=2 * tq.block_q, keys=tq.block_kv),
                   row_blocks(bits, rows=tq.block_q, t_pad=t_pad, words=s_pad // WORD))
        dkv_mods = (tile_lists(bits, s_len, rows=tkv.block_q, keys=2 * tkv.block_kv, by_keys=True),
                    row_blocks(bits, rows=tkv.block_q, t_pad=t_pad, words=s_pad // WORD))
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, f32) / float(softmax_scale)
    dq, *slope_rows = _dq_call(q, k, v, d_out, lse2, delta, shape, dq_mods, slopes)
    dk, dv = _dkv_call(q, k, v, d_out, lse2, delta, shape, dkv_mods, slopes)
    grads = (dq[:, :t_len], dk[:, :s_len], dv[:, :s_len])
    return grads if not slope_rows else (*grads, jnp.sum(slope_rows[0][:, :, :t_len], axis=(0, 2)))


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What both kernels need beyond the (padded) arrays' shapes: the real lengths, heads, mask, scale, tiles."""

    t_len: int
    s_len: int
    hq: int
    hkv: int
    causal: bool
    scale: float
    cfg: BackwardConfig
    #: The soft cap in the unscaled scores' units (cap / scale), or None.
    cap: float | None = None
    #: The sliding window's sides that cut (``blocks.window_sides``).
    window: Window = NO_WINDOW

    @property
    def offset(self) -> int:
        """Bottom-right causal: row ``i`` sees keys ``j <= i + offset``."""
        return self.s_len - self.t_len

    @property
    def qk_scale(self) -> float:
        return self.scale * _LOG2E

    def key_blocks(self, block: int) -> KeyBlocks:
        return KeyBlocks(s_len=self.s_len, block=block, causal=self.causal, offset=self.offset, left=self.window[0],
                         right=self.window[1])


def _zeros(shape: tuple[int, int]) -> Any:
    return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)


def _lead(mods: Any, b: Any, head: Any) -> tuple[Any, Any]:
    """Where ``(b, head)`` finds its tile lists and bits: index 0 along a dim the mask_mod's
    bits do not vary along."""
    lists = mods[0]
    return b if lists.shape[0] > 1 else 0, head if lists.shape[1] > 1 else 0


def _alibi(shape: tuple[int, int], key0: Any, row0: Any, key_axis: int) -> Any:
    """``key - row`` (raw positions) over a tile of ``shape`` whose ``key_axis`` counts keys from
    ``key0`` and whose other axis counts rows from ``row0``: ALiBi's term over its slope, float32."""
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_axis, layout=plgpu.Layout.WGMMA)
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 1 - key_axis, layout=plgpu.Layout.WGMMA)
    return (keys - rows + (key0 - row0)).astype(jnp.float32)


def _dq_call(q: Any, k: Any, v: Any, do: Any, lse2: Any, delta: Any, sh: _Shape, mods: Any = None,
             slopes: Any = None) -> list[Any]:
    batch, t_pad, hq, d = q.shape
    s_pad = k.shape[1]
    dtype = q.dtype
    group = sh.hq // sh.hkv
    bq, bkv, stages = sh.cfg.dq.block_q, sh.cfg.dq.block_kv, sh.cfg.dq.stages
    n_q_tiles = t_pad // (2 * bq)
    stages = max(2, min(stages, s_pad // bkv))
    blocks = sh.key_blocks(bkv)
    causal = sh.causal

    per_block = bkv // WORD

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, dq_ref: Any,
             mod_refs: Any, alibi_refs: Any, scoped: Any) -> None:
        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem), row_ready, (k_ready, v_ready), kv_free, \
            *mod_scoped = scoped
        q_ready, do_ready, lse_ready, delta_ready = row_ready
        k_free, v_free = kv_free
        b = lax.axis_index("b")
        head = lax.axis_index("h")
        # Heavy (late) causal tiles first, as the forward.
        q_tile = (n_q_tiles - 1) - lax.axis_index("q") if causal else lax.axis_index("q")
        wg = lax.axis_index("wg")
        tile_start = q_tile * (2 * bq)
        cta_blocks = blocks.seen_before(tile_start + 2 * bq)
        lo = blocks.first_seen(tile_start)  # the CTA streams blocks lo .. cta_blocks - 1
        listed = beside = None
        if mods is not None:  # the tile's list (mods.tile_lists): partial blocks, then full ones
            (list_ref, bits_ref), ((bits_smem, bits_ready),) = mod_refs, mod_scoped
            lead = _lead(mods, b, head)
            n_partial = list_ref[(*lead, q_tile, 0)]
            cta_blocks = n_partial + list_ref[(*lead, q_tile, 1)]

            def listed(i: Any) -> Any:
                return list_ref[(*lead, q_tile, i + 2)]

            def beside(j: Any, key_block: Any, slot: Any) -> None:
                words = bits_ref.at[(*lead, pl.ds(2 * q_tile, 2), pl.ds(key_block * per_block, per_block))]
                pl.when(j < n_partial)(lambda: plgpu.copy_gmem_to_smem(words, bits_smem.at[slot],
                                                                       bits_ready.at[slot]))

        @pl.when(wg < 2)
        def _consumer() -> None:
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            row0 = tile_start + wg * bq
            if mods is not None:
                n_blocks, start = cta_blocks, 0
                spans: Any = ((0, n_partial, True), (n_partial, n_blocks, False))
            else:
                n_blocks = blocks.seen_before(row0 + bq)
                start = blocks.run_start(row0, lo, n_blocks)
                spans = blocks.spans(row0, bq, start, n_blocks)
            rows = (b, pl.ds(row0, bq), head)
            stats = (b, head, pl.ds(row0, bq))
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_ready.at[wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem2.at[wg], lse_ready.at[wg])
            plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem2.at[wg], delta_ready.at[wg])
            for ready in row_ready:
                plgpu.barrier_wait(ready.at[wg])
            lse = load_vector(lse_smem2.at[wg], plgpu.Layout.WGMMA.reduce(1))
            delta = load_vector(delta_smem2.at[wg], plgpu.Layout.WGMMA.reduce(1))

            def step(j: Any, carry: Any, masked: bool) -> Any:
                dq, d_rows = carry if alibi_refs else (carry, None)
                slot = ring_slot(plus(j, -lo), stages)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])

                def gemms(s_ref: Any, dp_ref: Any) -> tuple[Any, Any]:
                    plgpu.wgmma(s_ref, q_smem, transposed(k_smem.at[slot]))
                    plgpu.wgmma(dp_ref, do_smem, transposed(v_smem.at[slot]))
                    return s_ref[...], dp_ref[...]

                s, dp = pl.run_scoped(gemms, plgpu.ACC((bq, bkv), jnp.float32), plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                s = soft_capped(s, sh.cap)
                scores = s
                if alibi_refs:  # ALiBi's term, on the capped scores (its slope over the scale)
                    rel = _alibi((bq, bkv), (j if listed is None else listed(j)) * bkv, row0, 1)
                    scores = s + rel * slope
                # No probability exceeds 1: the cap keeps the fused s * scale - lse, up to half
                # an ulp of lse off past ~2^32, from overflowing exp2.
                p = jnp.exp2(jnp.minimum(scores * sh.qk_scale - lax.broadcast_in_dim(lse, s.shape, [0]), 0.0))
                if masked and mods is not None:
                    plgpu.barrier_wait(bits_ready.at[slot])
                    words = [load_vector(bits_smem.at[slot, wg, w], plgpu.Layout.WGMMA.reduce(1))
                             for w in range(per_block)]
                    p = jnp.where(bits_keep(words, (bq, bkv), 1), p, 0.0)
                elif masked:
                    p = jnp.where(blocks.keep(j, row0, (bq, bkv)), p, 0.0)
                ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                if alibi_refs:  # d slope = sum dS (kv_idx - q_idx), dS the capped score's gradient
                    d_rows = d_rows + (ds * rel).sum(axis=1)
                if sh.cap is not None:
                    ds = ds * soft_cap_slope(s, sh.cap)

                def dq_gemm(acc_ref: Any) -> None:
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

                dq = pl.run_state(dq_gemm)(plgpu.ACC.init(dq))
                plgpu.barrier_arrive(k_free.at[slot])
                return dq if d_rows is None else (dq, d_rows)

            def drain(j: Any) -> None:
                # The other consumer needs more blocks: release our share of them, once each
                # has landed (no barrier keeps the two consumers in step here).
                release_unread(plus(j, -lo), (k_ready, v_ready), (k_free, v_free), stages=stages)

            if blocks.left is not None:
                pl.loop(lo, start)(drain)  # a window's blocks left of this consumer's rows
            carry: Any = _zeros((bq, d))
            if alibi_refs:
                slopes_ref, d_rows_ref = alibi_refs
                slope = slopes_ref[head]
                carry = (carry, plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
            for begin, end, masked in spans:
                carry = lax.fori_loop(begin, end, functools.partial(step, masked=masked), carry)
            pl.loop(n_blocks, cta_blocks)(drain)
            dq = carry
            if alibi_refs:
                dq, d_rows = carry
                d_rows_ref[b, head, pl.ds(row0, bq)] = d_rows  # from registers, as the forward's lse

            q_smem[...] = (dq * sh.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer() -> None:
            plgpu.set_max_registers(40, action="decrease")
            stream_kv(k_ref, v_ref, (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free), b=b,
                      kv_head=lax.div(head, jnp.int32(group)), n_blocks=plus(cta_blocks, -lo), block=bkv,
                      stages=stages, first=lo, listed=listed, beside=beside)

    def entry(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any) -> None:
        n_mods = 0 if mods is None else 2
        mod_refs, refs = refs[:n_mods], refs[n_mods:]
        # With ALiBi: its slopes beside the inputs, the rows' slope gradients beside dQ.
        dq_ref, alibi_refs = (refs[1], (refs[0], refs[2])) if slopes is not None else (refs[0], ())
        smem = [
            plgpu.SMEM((2, bq, d), dtype, transforms=TRANSFORMS),  # q
            plgpu.SMEM((2, bq, d), dtype, transforms=TRANSFORMS),  # dO
            plgpu.SMEM((2, bq), jnp.float32),  # lse2
            plgpu.SMEM((2, bq), jnp.float32),  # delta
            plgpu.SMEM((stages, bkv, d), dtype, transforms=TRANSFORMS),
            plgpu.SMEM((stages, bkv, d), dtype, transforms=TRANSFORMS),
        ]
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, mod_refs, alibi_refs, scoped),
            smem,
            (plgpu.Barrier(num_barriers=2),) * 4,
            (plgpu.Barrier(num_barriers=stages),) * 2,
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            # A mask_mod's bits: a partial block's words for each consumer's rows, beside its K/V slot.
            *(((plgpu.SMEM((stages, 2, per_block, bq), jnp.int32), plgpu.Barrier(num_barriers=stages)),)
              if mods is not None else ()),
            collective_axes="wg",
        )

    outs = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                  *(() if slopes is None else (jax.ShapeDtypeStruct((batch, hq, t_pad), jnp.float32),))),
        grid=(hq, n_q_tiles, batch),
        grid_names=("h", "q", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, do, lse2, delta, *(mods or ()), *(() if slopes is None else (slopes,)))
    return list(outs)


def _dkv_call(q: Any, k: Any, v: Any, do: Any, lse2: Any, delta: Any, sh: _Shape,
              mods: Any = None, slopes: Any = None) -> tuple[Any, Any]:
    batch, _, _, d = q.shape
    dtype = q.dtype
    group = sh.hq // sh.hkv
    bq, bkv, stages = sh.cfg.dkv.block_q, sh.cfg.dkv.block_kv, sh.cfg.dkv.stages
    n_kv_tiles = cdiv(sh.s_len, 2 * bkv)  # tiles holding any key (dK/dV rows past them are sliced off)
    n_q_blocks = cdiv(sh.t_len, bq)  # blocks holding any query row
    blocks = sh.key_blocks(bkv)
    per_block = bkv // WORD

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, dk_ref: Any,
             dv_ref: Any, mod_refs: Any, slopes_ref: Any, scoped: Any) -> None:
        (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem), (k_ready, v_ready), block_ready, free, \
            *mod_scoped = scoped
        q_ready, do_ready, lse_ready, delta_ready = block_ready
        b = lax.axis_index("b")
        kv_head = lax.axis_index("h")
        wg = lax.axis_index("wg")
        kv_tile = lax.axis_index("k")
        tile_start = kv_tile * (2 * bkv)
        zero = tile_start * 0  # traced: a concrete array cannot enter the kernel
        # Query blocks q_first .. q_end - 1 see some key of the tile, in spans masked or not.
        q_first, q_end, spans = blocks.row_spans(tile_start, 2 * bkv, bq, n_q_blocks)
        per_head = q_end - q_first
        n_steps = group * per_head

        def head_list(g: Any) -> tuple[Any, Any, Any, Any, Any]:
            """A mask_mod's list for query head ``g`` of the group (mods.tile_lists by keys): its
            head, where its lists and bits are (``_lead``), its count of partial and of all query
            blocks, and its ``i``-th block."""
            h = kv_head * group + g
            lead = _lead(mods, b, h)
            n_partial = list_ref[(*lead, kv_tile, 0)]
            return (h, lead, n_partial, n_partial + list_ref[(*lead, kv_tile, 1)],
                    lambda i: list_ref[(*lead, kv_tile, i + 2)])

        if mods is not None:
            (list_ref, bits_ref), ((bits_smem, bits_ready),) = mod_refs, mod_scoped

        @pl.when(wg < 2)
        def _consumer() -> None:
            plgpu.set_max_registers(232, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            k0 = tile_start + wg * bkv
            keys = (b, pl.ds(k0, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, v_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])

            def step(qb: Any, carry: Any, first: Any, masked: bool, g: Any) -> Any:
                # The producer's step: head h's blocks from h * per_head.
                return block_step(first + qb, qb, carry, masked, g)

            def block_step(i: Any, qb: Any, carry: Any, masked: bool, g: Any) -> Any:
                """The producer's ``i``-th step: query block ``qb`` of the group's ``g``-th head."""
                dk, dv = carry
                slot = ring_slot(i, stages)
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.barrier_wait(lse_ready.at[slot])

                def st_gemm(acc_ref: Any) -> Any:
                    plgpu.wgmma(acc_ref, k_smem, transposed(q_smem.at[slot]))
                    return acc_ref[...]

                s_t = pl.run_scoped(st_gemm, plgpu.ACC((bkv, bq), jnp.float32))
                lse = load_vector(lse_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                s_t = soft_capped(s_t, sh.cap)
                scores = s_t
                if slopes_ref is not None:  # ALiBi's term (its slope over the scale), transposed
                    scores = s_t + _alibi((bkv, bq), k0, qb * bq, 0) * slopes_ref[kv_head * group + g]
                p_t = jnp.exp2(jnp.minimum(scores * sh.qk_scale - lax.broadcast_in_dim(lse, s_t.shape, [1]), 0.0))
                if masked and mods is not None:
                    plgpu.barrier_wait(bits_ready.at[slot])
                    words = [load_vector(bits_smem.at[slot, wg * per_block + w], plgpu.Layout.WGMMA.reduce(0))
                             for w in range(per_block)]
                    p_t = jnp.where(bits_keep(words, (bkv, bq), 0), p_t, 0.0)
                elif masked:
                    kr = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)
                    qc = plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
                    keep = blocks.sees(kr + k0, qc, qb * bq)
                    p_t = jnp.where(keep, p_t, 0.0)
                plgpu.barrier_wait(do_ready.at[slot])
                plgpu.barrier_wait(delta_ready.at[slot])

                def dv_dp(refs: Any) -> None:
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p_t.astype(dtype), do_smem.at[slot])
                    plgpu.wgmma(dp_ref, v_smem, transposed(do_smem.at[slot]))

                dv, dp_t = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(_zeros((bkv, bq)))))
                delta = load_vector(delta_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
                if sh.cap is not None:
                    ds_t = ds_t * soft_cap_slope(s_t, sh.cap)

                def dk_gemm(acc_ref: Any) -> None:
                    plgpu.wgmma(acc_ref, ds_t.astype(dtype), q_smem.at[slot])

                dk = pl.run_state(dk_gemm)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            def head_steps(h: Any, carry: Any) -> Any:
                # Step index of block qb of head h: h * per_head + (qb - q_first).
                first = h * per_head - q_first
                for begin, end, masked in spans:
                    carry = lax.fori_loop(begin, end, functools.partial(step, first=first, masked=masked, g=h), carry)
                return carry

            def listed_steps(g: Any, carry: Any) -> Any:
                # A mask_mod's: head g's list, partial blocks masked, then full ones.
                _, _, n_partial, n_listed, listed = head_list(g)
                dk_dv, i0 = carry
                for begin, end, masked in ((0, n_partial, True), (n_partial, n_listed, False)):
                    dk_dv = lax.fori_loop(begin, end, lambda i, c, m=masked: block_step(i0 + i, listed(i), c, m, g),
                                          dk_dv)
                return dk_dv, i0 + n_listed

            zeros = (_zeros((bkv, d)), _zeros((bkv, d)))
            if mods is not None:
                (dk, dv), _ = lax.fori_loop(0, group, listed_steps, (zeros, zero))
            else:
                dk, dv = lax.fori_loop(0, group, head_steps, zeros)
            k_smem[...] = (dk * sh.scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer() -> None:
            plgpu.set_max_registers(40, action="decrease")

            def load_block(h: Any, qb: Any, slot: Any) -> None:
                rows = (b, pl.ds(qb * bq, bq), h)
                stats = (b, h, pl.ds(qb * bq, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], lse_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], delta_ready.at[slot])

            def load(i: Any, slot: Any) -> None:
                per = jnp.maximum(per_head, 1)
                load_block(kv_head * group + lax.div(i, per), q_first + lax.rem(i, per), slot)

            if mods is not None:
                def head_loads(g: Any, i0: Any) -> Any:
                    h, lead, n_partial, n_listed, listed = head_list(g)

                    @pl.loop(0, n_listed)
                    def _load(i: Any) -> None:
                        ring = i0 + i
                        slot = ring_slot(ring, stages)
                        qb = listed(i)
                        pl.when(ring >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                        load_block(h, qb, slot)
                        words = bits_ref.at[(*lead, qb, pl.ds(kv_tile * (2 * per_block), 2 * per_block))]
                        pl.when(i < n_partial)(lambda: plgpu.copy_gmem_to_smem(words, bits_smem.at[slot],
                                                                               bits_ready.at[slot]))

                    return i0 + n_listed

                lax.fori_loop(0, group, head_loads, zero)
                return

            for i in range(stages):
                pl.when(i < n_steps)(functools.partial(load, zero + i, i))

            @pl.loop(0, jnp.maximum(n_steps - stages, 0))
            def _refill(j: Any) -> None:
                slot = ring_slot(j, stages)
                plgpu.barrier_wait(free.at[slot])
                load(j + stages, slot)

    def entry(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any) -> None:
        *ins, dk_ref, dv_ref = refs
        mod_refs, slopes_ref = (ins[:-1], ins[-1]) if slopes is not None else (ins, None)
        smem = [
            plgpu.SMEM((2, bkv, d), dtype, transforms=TRANSFORMS),  # k
            plgpu.SMEM((2, bkv, d), dtype, transforms=TRANSFORMS),  # v
            plgpu.SMEM((stages, bq, d), dtype, transforms=TRANSFORMS),  # q
            plgpu.SMEM((stages, bq, d), dtype, transforms=TRANSFORMS),  # dO
            plgpu.SMEM((stages, bq), jnp.float32),  # lse2
            plgpu.SMEM((stages, bq), jnp.float32),  # delta
        ]
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, mod_refs, slopes_ref,
                                 scoped),
            smem,
            (plgpu.Barrier(num_barriers=2),) * 2,
            (plgpu.Barrier(num_barriers=stages),) * 4,
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            # A mask_mod's bits: a partial query block's words for both consumers' keys, beside it.
            *(((plgpu.SMEM((stages, 2 * per_block, bq), jnp.int32), plgpu.Barrier(num_barriers=stages)),)
              if mods is not None else ()),
            collective_axes="wg",
        )

    kv_shape = jax.ShapeDtypeStruct(k.shape, dtype)
    dk, dv = plgpu.kernel(
        entry,
        out_type=(kv_shape, kv_shape),
        grid=(sh.hkv, n_kv_tiles, batch),
        grid_names=("h", "k", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, do, lse2, delta, *(mods or ()), *(() if slopes is None else (slopes,)))
    return dk, dv
