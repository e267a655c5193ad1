"""FlashAttention-2 for JAX: the Triton kernels behind ``jax.custom_vjp``.

On a CUDA GPU the kernels are launched with ``jax_triton.triton_call`` (imported when the
first kernel is built). With ``interpret=True`` the same launches go through
``jax.pure_callback`` to the Triton interpreter on torch CPU tensors instead, which lets
CI check this module's autodiff wiring without a GPU (``TRITON_INTERPRET=1`` must have
been set before triton was imported).

Layout is BTHD throughout: q ``(B, T, Hq, D)``, k ``(B, S, Hkv, D)``, v ``(B, S, Hkv, Dv)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn_triton.flash import launch as L
from jaxattn_triton.spec import AttnSpec

Array = jax.Array


def _execute(lz: L.Launch, inputs: Sequence[Array], interpret: bool) -> list[Array]:
    out_shape = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in lz.outputs]
    if interpret:
        return _execute_interpreted(lz, inputs, out_shape)
    import jax_triton as jt

    outs = jt.triton_call(
        *inputs,
        kernel=lz.kernel,
        out_shape=out_shape,
        grid=lz.grid,
        num_warps=lz.num_warps,
        num_stages=lz.num_stages,
        zeroed_outputs=lz.zeroed,
        **lz.constexprs,
    )
    return list(outs)


def _execute_interpreted(lz: L.Launch, inputs: Sequence[Array], out_shape: list[jax.ShapeDtypeStruct]) -> list[Array]:
    from jaxattn_triton import torch_launch

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        outs = torch_launch.run_launch(lz, [torch_launch.from_numpy(np.asarray(a)) for a in arrays])
        return [torch_launch.to_numpy(o) for o in outs]

    return list(jax.pure_callback(host, out_shape, *inputs))


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(
    spec: AttnSpec,
    tiles: L.Tiles,
    interpret: bool,
    q: Array,
    k: Array,
    v: Array,
    bias: Array,
    sinks: Array,
    mask: Array,
    qseg: Array,
    kseg: Array,
    bits: Array,
    seen: Array,
    slopes: Array,
) -> tuple[Array, Array]:
    lists = tile_lists(spec, tiles.fwd, bits)
    out, lse = _execute(L.forward(spec, tiles.fwd),
                        [q, k, v, mask, bias, qseg, kseg, sinks, bits, seen, lists, slopes], interpret)
    return out, lse


def _flash_fwd(
    spec: AttnSpec,
    tiles: L.Tiles,
    interpret: bool,
    q: Array,
    k: Array,
    v: Array,
    bias: Array,
    sinks: Array,
    mask: Array,
    qseg: Array,
    kseg: Array,
    bits: Array,
    seen: Array,
    slopes: Array,
) -> tuple[tuple[Array, Array], tuple[Array, ...]]:
    out, lse = _flash(spec, tiles, interpret, q, k, v, bias, sinks, mask, qseg, kseg, bits, seen, slopes)
    return (out, lse), (q, k, v, bias, sinks, mask, qseg, kseg, bits, seen, slopes, out, lse)


def _flash_bwd(
    spec: AttnSpec,
    tiles: L.Tiles,
    interpret: bool,
    residuals: tuple[Array, ...],
    cotangents: tuple[Array, Array],
) -> tuple[Array | None, ...]:
    q, k, v, bias, sinks, mask, qseg, kseg, bits, seen, slopes, out, lse = residuals
    dout, dlse = cotangents
    dout = dout.astype(q.dtype)
    delta, lse_b, dsink_rows, lse_term = _execute(
        L.preprocess(spec), [out, dout, lse, dlse.astype(jnp.float32), sinks], interpret
    )
    common = [q, k, v, mask, bias, qseg, kseg, dout, lse_b, delta, bits, seen]
    by_keys = [*common, tile_lists(spec, tiles.dkdv, bits, by_keys=True), slopes]
    if tiles.dkdv_split:
        _, dv, _, _ = _execute(L.dkdv(spec, tiles.dkdv, part=L.PART_DV), by_keys, interpret)
        dk, _, dbias_full, dq_acc = _execute(L.dkdv(spec, tiles.dkdv, tiles.dq_mode, L.PART_DK), by_keys, interpret)
    else:
        dk, dv, dbias_full, dq_acc = _execute(L.dkdv(spec, tiles.dkdv, tiles.dq_mode), by_keys, interpret)
    dslope_tiles = None
    if tiles.dq_mode == L.DQ_KERNEL:
        dq, dslope_tiles = _execute(L.dq(spec, tiles.dq), [*common, tile_lists(spec, tiles.dq, bits), slopes,
                                                           lse_term], interpret)  # fmt: skip
    else:
        dq = (dq_acc * spec.softmax_scale).astype(q.dtype)
    if spec.bias_shape is not None:
        dbias = _reduce_to(dbias_full, spec.bias_shape).astype(bias.dtype)
    else:
        dbias = jnp.zeros_like(bias)
    if spec.sinks:
        dsinks = jnp.sum(dsink_rows, axis=(0, 2)).astype(sinks.dtype)
    else:
        dsinks = jnp.zeros_like(sinks)
    # masks.alibi's slopes: each query tile's share, per (batch, head), summed here (an alibi
    # call's tiles have the dQ kernel: flash_attention).
    if spec.alibi:
        assert dslope_tiles is not None, "an alibi backward needs the dQ kernel (DQ_KERNEL)"
        dslopes = jnp.sum(dslope_tiles, axis=(0, 2)).astype(slopes.dtype)
    else:
        dslopes = jnp.zeros_like(slopes)
    # mask, segment ids and a mask_mod's bits are integer inputs: no cotangent.
    return dq, dk, dv, dbias, dsinks, None, None, None, None, None, dslopes


_flash.defvjp(_flash_fwd, _flash_bwd)


def make_spec(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool = False,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    segments: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: bool = False,
    mod_shape: tuple[int, int] | None = None,
    alibi: bool = False,
) -> AttnSpec:
    """The :class:`AttnSpec` of a call, from arrays or ``ShapeDtypeStruct``s."""
    b, t, hq, d = (int(x) for x in q.shape)
    _, s, hkv, _ = (int(x) for x in k.shape)

    def rank4(x: Any) -> tuple[int, int, int, int] | None:
        if x is None:
            return None
        shape = (1,) * (4 - x.ndim) + tuple(int(n) for n in x.shape)
        return (shape[0], shape[1], shape[2], shape[3])

    window = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
    return AttnSpec(
        batch=b,
        seq_q=t,
        seq_k=s,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        head_dim_v=int(v.shape[-1]),
        dtype=jnp.dtype(q.dtype).name,
        softmax_scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=None if window is None else (window[0], window[1]),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        mask_shape=rank4(mask),
        bias_shape=rank4(bias),
        segments=segments,
        sinks=sinks,
        mod_shape=mod_shape,
        alibi=alibi,
    )


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Array | None = None,
    mask_mod: Any = None,
    block_mask: Any = None,
    alibi_slopes: Array | None = None,
    tiles: L.Tiles | None = None,
    interpret: bool = False,
    overrides: dict[str, int] | None = None,
) -> tuple[Array, Array]:
    """Attention output ``(B, T, Hq, Dv)`` and log-sum-exp ``(B, Hq, T)`` (float32).

    Differentiable in q, k, v, bias, softmax_aux, alibi_slopes (and through the log-sum-exp).
    ``alibi_slopes`` ``(Hq,)``: ``masks.alibi``'s term ``slopes[h] * (kv_idx - q_idx)`` (raw
    positions) added to every score after the soft cap and the bias.
    ``tiles`` overrides the tuned tile sizes (``overrides``: the metadata's, applied to them).
    ``mask_mod`` (``jaxattn.masks``): see ``mod_bits``; ``block_mask`` lends its bits when
    built with ``bits=True``.
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if mask_mod is not None:
        bits = mod_bits(q, k, mask_mod, block_mask, mask=mask, causal=causal, sliding_window=sliding_window,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
        mask = q_segment_ids = kv_segment_ids = sliding_window = None  # folded into the bits
        causal = False
    spec = make_spec(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        sliding_window=sliding_window,
        segments=q_segment_ids is not None,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sinks=softmax_aux is not None,
        mod_shape=None if mask_mod is None else (int(bits.shape[0]), int(bits.shape[1])),
        alibi=alibi_slopes is not None,
    )
    if tiles is None:
        from jaxattn_triton.tuning import tiles_for

        tiles = tiles_for(spec, interpret=interpret, overrides=overrides)
    if spec.alibi and tiles.dq_mode != L.DQ_KERNEL:
        # The slopes' gradient needs each row's sums over all its keys: the dQ kernel's.
        tiles = dataclasses.replace(tiles, dq_mode=L.DQ_KERNEL)
    bias_arg, sinks, mask_arg, qseg, kseg = _optional_args(mask, bias, q_segment_ids, kv_segment_ids, softmax_aux)
    if mask_mod is None:
        bits = seen = jnp.zeros((1,), jnp.int32)
    else:
        from jaxattn import masks

        seen = masks.seen_words(bits, spec.heads_kv)
    if alibi_slopes is None:
        slopes = jnp.zeros((1,), jnp.float32)
    else:
        if tuple(alibi_slopes.shape) != (spec.heads_q,):
            raise ValueError(f"alibi_slopes must be ({spec.heads_q},), one per query head, got {alibi_slopes.shape}")
        slopes = jnp.asarray(alibi_slopes, jnp.float32)
    out, lse = _flash(spec, tiles, interpret, q, k, v, bias_arg, sinks, mask_arg, qseg, kseg, bits, seen, slopes)
    return out, lse


def mod_bits(q: Any, k: Any, mask_mod: Any, block_mask: Any = None, *, mask: Array | None = None,
             causal: bool = False, sliding_window: int | tuple[int | None, int | None] | None = None,
             q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None) -> Array:
    """A mask_mod's packed visibility (``jaxattn.masks.mask_bits``, int32 ``(B|1, Hq|1, T,
    ceil(S / 32))``) with the call's other rules ANDed in: the causal rule and window (bottom-right,
    as the kernels apply them), segment ids and a boolean mask. The kernels then apply one rule,
    exactly, whatever the mask_mod computes (captured arrays, b and h, under jit). A ``block_mask``
    built with ``bits=True`` gives its bits (the mask_mod is not evaluated again; the other rules
    are); its tile kinds are not read: each kernel classifies its own tiles from the bits."""
    from jaxattn import masks

    b, t, hq, _ = (int(n) for n in q.shape)
    spec = make_spec(q, k, k, causal=causal, sliding_window=sliding_window)
    rules: list[Any] = []
    if q_segment_ids is not None and kv_segment_ids is not None:
        qs, ks = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        rules.append(lambda b_, h_, qi, kv: qs[b_, qi] == ks[b_, kv])
    if mask is not None:
        m4 = jnp.asarray(mask, bool).reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))

        def dense(b_: Any, h_: Any, qi: Any, kv: Any) -> Any:  # size-1 dims stay 1 in the bits
            return m4[tuple(0 if n == 1 else i for n, i in zip(m4.shape, (b_, h_, qi, kv), strict=True))]

        rules.append(dense)
    bits: Array = masks.call_bits(mask_mod, block_mask, b, hq, t, int(k.shape[1]),
                                  window=(spec.window_left, spec.window_right), rules=tuple(rules))
    return bits


def tile_lists(spec: AttnSpec, tiles: L.KernelTiles, bits: Array, by_keys: bool = False) -> Array:
    """A kernel's tiles to visit under a mask_mod (``jaxattn.masks.tile_lists`` at the kernel's
    tile sizes): int32 ``launch.mod_lists_shape``. A one-element dummy without a mask_mod."""
    if spec.mod_shape is None:
        return jnp.zeros((1,), jnp.int32)
    from jaxattn import masks

    out: Array = masks.tile_lists(bits, spec.seq_k, block_q=tiles.block_m, block_kv=tiles.block_n, by_keys=by_keys)
    assert out.shape == L.mod_lists_shape(spec, tiles, by_keys), (out.shape, spec, tiles)
    return out


def flash_attention_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array,
    *,
    mask: Array | None = None,
    causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    overrides: dict[str, int] | None = None,
    interpret: bool = False,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` at cotangents ``(d_out, d_lse)`` from the residuals ``out`` ``(B, T, Hq, Dv)``
    and ``lse`` ``(B, Hq, T)`` of *any* forward of these inputs: the backward kernels alone.

    Ring attention hands it the whole ring's output and log-denominator for each block of keys:
    a flash backward at the global statistics is exactly that block's share of the gradients,
    with no block forward run again. No bias or sinks (ring's blocks have none). ``overrides``:
    tile sizes set in the metadata, as for the forward.
    """
    from jaxattn_triton.tuning import tiles_for

    spec = make_spec(q, k, v, mask=mask, causal=causal, segments=q_segment_ids is not None,
                     softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)
    tiles = tiles_for(spec, interpret=interpret, overrides=overrides)
    bias_arg, sinks, mask_arg, qseg, kseg = _optional_args(mask, None, q_segment_ids, kv_segment_ids, None)
    none = jnp.zeros((1,), jnp.int32)  # no mask_mod: no bits, no seen keys
    residuals = (q, k, v, bias_arg, sinks, mask_arg, qseg, kseg, none, none, jnp.zeros((1,), jnp.float32),
                 out.astype(q.dtype), lse.astype(jnp.float32))
    dq, dk, dv = _flash_bwd(spec, tiles, interpret, residuals, (d_out, d_lse))[:3]
    return dq, dk, dv  # type: ignore[return-value]  # never None: q, k and v are differentiable


def _optional_args(mask: Array | None, bias: Array | None, q_segment_ids: Array | None,
                   kv_segment_ids: Array | None, softmax_aux: Array | None) -> tuple[Array, ...]:
    """The kernels' bias, sinks, mask and segment-id arguments; absent ones still occupy their slot."""

    def dummy(dtype: Any) -> Array:
        return jnp.zeros((1,), dtype)

    def rank4(x: Array) -> Array:
        return jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))

    mask_arg = dummy(jnp.int8) if mask is None else rank4(mask).astype(jnp.int8)
    bias_arg = dummy(jnp.float32) if bias is None else rank4(bias)
    qseg = dummy(jnp.int32) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
    kseg = dummy(jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    sinks = dummy(jnp.float32) if softmax_aux is None else softmax_aux.astype(jnp.float32)
    return bias_arg, sinks, mask_arg, qseg, kseg
