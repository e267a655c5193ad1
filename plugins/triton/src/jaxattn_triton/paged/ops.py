"""Serving attention for JAX on NVIDIA GPUs: paged decode, ragged paged attention, dense decode.

Forward only. The arrays follow the serving contract (int32 index arrays; ``kv_lengths``
counts the tokens queried in this call; queries are causal and bottom-right aligned to each
sequence's own length; rows without a visible key are zeros):

* :func:`paged_decode`: q ``(num_seqs, T, Hq, D)``, T small (1 = decode, a few =
  speculative decoding), over a paged cache;
* :func:`ragged_paged`: q ``(num_tokens, Hq, D)``, sequences packed back to back
  (``cu_q_lens``, ``num_seqs``), prefill chunks and decode rows mixed;
* :func:`dense_decode`: q ``(B, T, Hq, D)`` over a dense ``(B, S, Hkv, D)`` cache with
  optional per-sequence lengths, the cache seen as one page per sequence (no copy).

The cache is ``k_pages (P, page_size, Hkv, D)`` and ``v_pages (P, page_size, Hkv, Dv)``,
or ``kv_pages (P, page_size, 2*Hkv, D)`` (K head h at 2h, V head h at 2h + 1) passed by
keyword with ``k_pages``/``v_pages`` None; both are read in place through strides.

A quantized cache (int8, float8_e4m3fn or float8_e5m2 values, q 16-bit) comes with float32
``k_scale`` and ``v_scale`` broadcasting against the cache's shape without its last axis
(``()`` per tensor, ``(Hkv,)`` per head, ``(P, page_size, Hkv)`` or ``(B, S, Hkv)`` per token):
the cache means ``values.astype(float32) * scale[..., None]``; the kernels read the narrow
values and the scales in place and dequantize in registers (``paged.launch``).

On a CUDA GPU the kernels launch through ``jax_triton`` (imported on first call); with
``interpret=True`` they run in the Triton interpreter on torch CPU tensors through
``jax.pure_callback`` (tests; ``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn.backend import zero_past_lengths
from jaxattn_triton.flash.launch import Launch
from jaxattn_triton.paged import launch as LP

Array = jax.Array

__all__ = ["decode_with_flash_grad", "dense_decode", "dense_spec", "paged_decode", "ragged_paged", "visibility_mask"]

FORWARD_ONLY = (
    "the Triton paged/decode kernels are forward only (serving); differentiate through "
    "jaxattn_triton.flash.ops.flash_attention or an impl that declares Feature.GRAD instead"
)


@functools.cache
def _num_sms() -> int:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return LP.DEFAULT_NUM_SMS
    count = getattr(device, "core_count", None)
    return int(count) if isinstance(count, int) and count > 0 else LP.DEFAULT_NUM_SMS


def _execute_all(
    spec: LP.PagedSpec, tiles: LP.PagedTiles, inputs: Sequence[Array], interpret: bool
) -> tuple[Array, Array]:
    from jaxattn_triton.flash.ops import _execute

    def execute(lz: Launch, arrays: Sequence[Array]) -> list[Array]:
        return _execute(lz, arrays, interpret)

    return LP.run(spec, tiles, inputs, execute)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _forward(
    spec: LP.PagedSpec, tiles: LP.PagedTiles, interpret: bool, q: Array, k: Array, v: Array, sinks: Array,
    page_table: Array, kv_lengths: Array, cu_q_lens: Array, num_seqs: Array, k_scale: Array, v_scale: Array,
    mask_words: Array | None = None, mask_bounds: Array | None = None,
) -> tuple[Array, Array]:  # fmt: skip
    inputs = [q, k, v, page_table, kv_lengths, cu_q_lens, num_seqs, sinks, k_scale, v_scale]
    if mask_words is not None and mask_bounds is not None:
        inputs += [mask_words, mask_bounds]
    return _execute_all(spec, tiles, inputs, interpret)


def _refuse_fwd(*args: Any) -> Any:
    raise NotImplementedError(FORWARD_ONLY)


def _refuse_bwd(*args: Any) -> Any:  # never reached: the forward rule raises
    raise NotImplementedError(FORWARD_ONLY)


_forward.defvjp(_refuse_fwd, _refuse_bwd)


def _int32(x: Any, name: str, shape: tuple[int, ...]) -> Array:
    arr = jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integers, got {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr.astype(jnp.int32)


def _cache(
    k_pages: Array | None, v_pages: Array | None, kv_pages: Array | None
) -> tuple[Array, Array, str, int, int, int, int, int]:
    """``(k, v, layout, num_pages, page_size, heads_kv, head_dim, head_dim_v)``."""
    if kv_pages is not None:
        if k_pages is not None or v_pages is not None:
            raise ValueError("pass either kv_pages or k_pages and v_pages, not both")
        if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
            raise ValueError(f"kv_pages must be (num_pages, page_size, 2*Hkv, D), got {kv_pages.shape}")
        p, ps, h2, d = kv_pages.shape
        return kv_pages, kv_pages, LP.COMBINED, p, ps, h2 // 2, d, d
    if k_pages is None or v_pages is None:
        raise ValueError("pass k_pages and v_pages, or kv_pages=")
    if k_pages.ndim != 4 or v_pages.ndim != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must be (num_pages, page_size, Hkv, D|Dv)"
        )
    p, ps, hkv, d = k_pages.shape
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must share a dtype")
    return k_pages, v_pages, LP.SEPARATE, p, ps, hkv, d, v_pages.shape[3]


def _sinks(sinks: Array | None, heads_q: int) -> Array:
    if sinks is None:
        return jnp.zeros((1,), jnp.float32)
    if sinks.shape != (heads_q,):
        raise ValueError(f"sinks (softmax_aux) must have shape ({heads_q},), got {sinks.shape}")
    return sinks.astype(jnp.float32)


def _cache_dtype(q: Any, k: Any) -> str | None:
    """The cache's dtype when it is quantized (``LP.QUANT_DTYPES``), None when it is q's."""
    name: str = jnp.dtype(k.dtype).name
    if name in LP.QUANT_DTYPES:
        return name
    if q.dtype != k.dtype:
        raise ValueError(
            f"q ({q.dtype}) and the cache ({k.dtype}) must share a dtype, or the cache be quantized "
            f"({', '.join(sorted(LP.QUANT_DTYPES))}; jaxattn.quantize_kv)"
        )
    return None


def _scales(
    cache_dtype: str | None, k_scale: Any, v_scale: Any, lead: tuple[int, ...]
) -> tuple[dict[str, Any], Array, Array]:
    """``(PagedSpec fields, k_scale, v_scale)``: the scales' strides against ``lead`` (the cache's
    shape without its last axis) and the scales as flat float32 arrays (one-element dummies
    when absent: an unscaled quantized cache means its raw values)."""
    if cache_dtype is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale scale a quantized cache (int8/float8); this cache is not quantized")
        dummy = jnp.zeros((1,), jnp.float32)
        return {}, dummy, dummy
    fields: dict[str, LP.ScaleStrides | None] = {}
    arrays = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            fields[name] = None
            arrays.append(jnp.zeros((1,), jnp.float32))
            continue
        arr = jnp.asarray(scale)
        fields[name] = LP.scale_strides(arr.shape, lead, name)
        # Flat and C-contiguous: the strides above index it; no broadcast copy is made.
        arrays.append(jnp.reshape(arr.astype(jnp.float32), (-1,)))
    return fields, arrays[0], arrays[1]


def _tiles(spec: LP.PagedSpec, tiles: LP.PagedTiles | None, num_splits: int | None) -> LP.PagedTiles:
    if tiles is None:
        return LP.default_tiles(spec, _num_sms(), num_splits)
    if num_splits is not None and num_splits != tiles.num_splits:
        raise ValueError(f"num_splits={num_splits} contradicts tiles.num_splits={tiles.num_splits}")
    return tiles


def paged_decode(
    q: Array,
    k_pages: Array | None,
    v_pages: Array | None,
    page_table: Array,
    kv_lengths: Array,
    *,
    kv_pages: Array | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    sinks: Array | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    num_splits: int | None = None,
    tiles: LP.PagedTiles | None = None,
    return_lse: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
    """Attention of ``q (num_seqs, T, Hq, D)`` over a paged cache; ``(num_seqs, T, Hq, Dv)``.

    Query ``i`` of sequence ``s`` sits at position ``kv_lengths[s] - T + i`` and sees keys
    ``max(0, pos - window_left) <= j <= pos``. ``sinks`` (Hq,) float32 join each row's
    softmax denominator. ``num_splits`` overrides the number of key splits (default: enough
    programs for the GPU), ``tiles`` the whole tiling. A quantized cache takes ``k_scale`` and
    ``v_scale`` (see the module). With ``return_lse`` also returns the
    log-sum-exp ``(num_seqs, Hq, T)`` float32 (natural log, sinks excluded, -inf for rows
    without keys).
    """
    k, v, layout, num_pages, page_size, hkv, d, dv = _cache(k_pages, v_pages, kv_pages)
    if q.ndim != 4 or q.shape[3] != d:
        raise ValueError(f"q must be (num_seqs, T, Hq, {d}), got {q.shape}")
    cache_dtype = _cache_dtype(q, k)
    scale_fields, ks, vs = _scales(cache_dtype, k_scale, v_scale, (num_pages, page_size, hkv))
    num_seqs, t, hq, _ = q.shape
    if page_table.ndim != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(f"page_table must be (num_seqs={num_seqs}, pages_per_seq), got {page_table.shape}")
    spec = LP.PagedSpec(
        num_tokens=num_seqs * t, max_seqs=num_seqs, q_len=t, heads_q=hq, heads_kv=hkv, head_dim=d,
        head_dim_v=dv, dtype=jnp.dtype(q.dtype).name, num_pages=num_pages, page_size=page_size,
        pages_per_seq=int(page_table.shape[1]), layout=layout,
        softmax_scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        window_left=None if window_left is None else int(window_left), window_right=0,
        sinks=sinks is not None, cache_dtype=cache_dtype, **scale_fields,
    )  # fmt: skip
    table = _int32(page_table, "page_table", tuple(page_table.shape))
    lengths = _int32(kv_lengths, "kv_lengths", (num_seqs,))
    sink_arr = _sinks(sinks, hq)
    if num_seqs == 0:
        out = jnp.zeros((0, t, hq, dv), q.dtype)
        return (out, jnp.zeros((0, hq, t), jnp.float32)) if return_lse else out
    dummy = jnp.zeros((1,), jnp.int32)
    chosen = _tiles(spec, tiles, num_splits)
    out, lse = _forward(
        spec, chosen, interpret, q.reshape(num_seqs * t, hq, d), k, v, sink_arr, table, lengths, dummy, dummy, ks, vs
    )
    out = out.reshape(num_seqs, t, hq, dv)
    if not return_lse:
        return out
    return out, jnp.transpose(lse.reshape(num_seqs, t, hq), (0, 2, 1))


def ragged_paged(
    q: Array,
    k_pages: Array | None,
    v_pages: Array | None,
    page_table: Array,
    kv_lengths: Array,
    cu_q_lens: Array,
    num_seqs: Array | int,
    *,
    kv_pages: Array | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    sinks: Array | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    num_splits: int | None = None,
    tiles: LP.PagedTiles | None = None,
    mask_mod: Any = None,
    return_lse: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
    """Ragged paged attention of ``q (num_tokens, Hq, D)``; returns ``(num_tokens, Hq, Dv)``.

    Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s] : cu_q_lens[s+1]`` (``q_len_s``
    of them), row ``cu_q_lens[s] + i`` sitting at position ``kv_lengths[s] - q_len_s + i``
    (causal per sequence); rows at and past ``cu_q_lens[num_seqs]`` are padding and give
    zeros. ``page_table (max_num_seqs, pages_per_seq)``, ``kv_lengths (max_num_seqs,)``,
    ``cu_q_lens (max_num_seqs + 1,)``, ``num_seqs`` a (1,) int32 array or a scalar. Other
    arguments as :func:`paged_decode`; the log-sum-exp is ``(num_tokens, Hq)``.

    ``mask_mod(seq, h, q_pos, kv_pos) -> bool`` (positions within the sequence, a JAX function)
    narrows what each row sees, ANDed with the rest: it is evaluated here into packed bits and
    key bounds per token (``paged.visibility``) that the kernel reads.
    """
    k, v, layout, num_pages, page_size, hkv, d, dv = _cache(k_pages, v_pages, kv_pages)
    if q.ndim != 3 or q.shape[2] != d:
        raise ValueError(f"q must be (num_tokens, Hq, {d}), got {q.shape}")
    cache_dtype = _cache_dtype(q, k)
    scale_fields, ks, vs = _scales(cache_dtype, k_scale, v_scale, (num_pages, page_size, hkv))
    n, hq, _ = q.shape
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be (max_num_seqs, pages_per_seq), got {page_table.shape}")
    max_seqs = int(page_table.shape[0])
    spec = LP.PagedSpec(
        num_tokens=n, max_seqs=max_seqs, q_len=None, heads_q=hq, heads_kv=hkv, head_dim=d,
        head_dim_v=dv, dtype=jnp.dtype(q.dtype).name, num_pages=num_pages, page_size=page_size,
        pages_per_seq=int(page_table.shape[1]), layout=layout,
        softmax_scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        window_left=None if window_left is None else int(window_left), window_right=0,
        sinks=sinks is not None, cache_dtype=cache_dtype, **scale_fields,
    )  # fmt: skip
    table = _int32(page_table, "page_table", tuple(page_table.shape))
    lengths = _int32(kv_lengths, "kv_lengths", (max_seqs,))
    cu = _int32(cu_q_lens, "cu_q_lens", (max_seqs + 1,))
    ns = jnp.reshape(jnp.asarray(num_seqs), (-1,))
    ns = _int32(ns, "num_seqs", (1,))
    sink_arr = _sinks(sinks, hq)
    if n == 0 or max_seqs == 0:
        out = jnp.zeros((n, hq, dv), q.dtype)
        return (out, jnp.full((n, hq), -jnp.inf, jnp.float32)) if return_lse else out
    mask: tuple[Array, ...] = ()
    if mask_mod is not None:
        from jaxattn_triton.paged.visibility import visibility_words

        mask = visibility_words(mask_mod, n, hq, lengths, cu, ns, spec.capacity, spec.window_left)
        spec = dataclasses.replace(spec, mask_heads=int(mask[0].shape[0]))
    chosen = _tiles(spec, tiles, num_splits)
    out, lse = _forward(spec, chosen, interpret, q, k, v, sink_arr, table, lengths, cu, ns, ks, vs, *mask)
    return (out, lse) if return_lse else out


def dense_spec(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: bool = False,
    k_scale: Any = None,
    v_scale: Any = None,
) -> LP.PagedSpec:
    """The :class:`~jaxattn_triton.paged.launch.PagedSpec` of a :func:`dense_decode` call
    (arrays or ``ShapeDtypeStruct``s, the scales too); raises ``ValueError`` with the reasons
    it cannot run."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("dense_decode takes BTHD arrays: q (B, T, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv)")
    b, t, hq, d = (int(x) for x in q.shape)
    kb, s, hkv, kd = (int(x) for x in k.shape)
    if kb != b or kd != d or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} do not match")
    if s < 1:
        raise ValueError("the cache must hold at least one position")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype, got {k.dtype}, {v.dtype}")
    cache_dtype = _cache_dtype(q, k)
    lead = (b, s, hkv)
    if cache_dtype is None and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale/v_scale scale a quantized cache (int8/float8); this cache is not quantized")
    scale_fields: dict[str, Any] = {} if cache_dtype is None else {
        name: None if x is None else LP.scale_strides(x.shape, lead, name)
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale))
    }  # fmt: skip
    pair = (window, window) if isinstance(window, int) else window
    left, right = (None, None) if pair is None else pair
    if causal:
        right = 0 if right is None else min(int(right), 0)
    return LP.PagedSpec(
        num_tokens=b * t, max_seqs=b, q_len=t, heads_q=hq, heads_kv=hkv, head_dim=d,
        head_dim_v=int(v.shape[3]), dtype=jnp.dtype(q.dtype).name, num_pages=b, page_size=s,
        pages_per_seq=1, layout=LP.DENSE,
        softmax_scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        window_left=None if left is None else int(left), window_right=None if right is None else int(right),
        sinks=sinks, cache_dtype=cache_dtype, **scale_fields,
    )  # fmt: skip


def dense_decode(
    q: Array,
    k: Array,
    v: Array,
    kv_lengths: Array | None = None,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: Array | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    num_splits: int | None = None,
    tiles: LP.PagedTiles | None = None,
    return_lse: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
    """Decode-shaped attention (T small) of ``q (B, T, Hq, D)`` over a dense BTHD cache.

    Keys ``j >= kv_lengths[b]`` (default: the cache's length S) are invisible; query ``i``
    sits at position ``kv_lengths[b] - T + i``, the reference of ``causal`` and of
    ``window = (left, right)`` (an int w means (w, w)). Returns ``(B, T, Hq, Dv)``, and with
    ``return_lse`` also the log-sum-exp ``(B, Hq, T)`` float32 (sinks excluded). A quantized
    cache takes ``k_scale``/``v_scale`` broadcasting against ``(B, S, Hkv)`` (forward only).
    """
    b, t, hq, _ = q.shape
    dv = v.shape[3]
    if b == 0 or t == 0:
        out = jnp.zeros((b, t, hq, dv), q.dtype)
        return (out, jnp.zeros((b, hq, t), jnp.float32)) if return_lse else out
    spec = dense_spec(
        q, k, v, causal=causal, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window=window, sinks=sinks is not None, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    lengths = jnp.full((b,), k.shape[1], jnp.int32) if kv_lengths is None else _int32(kv_lengths, "kv_lengths", (b,))
    sink_arr = _sinks(sinks, hq)
    _, ks, vs = _scales(spec.cache_dtype, k_scale, v_scale, tuple(k.shape[:3]))
    chosen = _tiles(spec, tiles, num_splits)
    out, lse = _forward(spec, chosen, interpret, *_dense_inputs(q, k, v, sink_arr, lengths), ks, vs)
    out, lse = out.reshape(b, t, hq, dv), jnp.transpose(lse.reshape(b, t, hq), (0, 2, 1))
    if kv_lengths is not None:
        out, lse = _before_the_start_empty(out, lse, lengths)
    if not return_lse:
        return out
    return out, lse


def _before_the_start_empty(out: Array, lse: Array, lengths: Array) -> tuple[Array, Array]:
    """``out (B, T, Hq, Dv)`` and ``lse (B, Hq, T)`` with the rows of queries at a negative position
    (``L_b - T + i < 0``) empty: zeros and ``-inf``. Such a query is no token of its sequence
    (docs/contract.md); the kernel would show it the keys below the length when nothing cuts."""
    t = out.shape[1]
    real = jnp.clip(lengths, 0, None)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :] >= 0  # (B, T)
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out, jnp.where(real[:, None, :], lse, jnp.asarray(-jnp.inf, lse.dtype))


def _dense_inputs(q: Array, k: Array, v: Array, sinks: Array, lengths: Array) -> tuple[Array, ...]:
    """``_forward``'s array arguments for a dense cache (one page per sequence, no table)."""
    b, t, hq, d = q.shape
    dummy = jnp.zeros((1,), jnp.int32)
    return q.reshape(b * t, hq, d), k, v, sinks, dummy, lengths, dummy, dummy


def decode_with_flash_grad(
    q: Array,
    k: Array,
    v: Array,
    kv_lengths: Array | None = None,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    sinks: Array | None = None,
    flash_tiles: Any = None,
    flash_overrides: dict[str, int] | None = None,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """:func:`dense_decode` that can be differentiated.

    Returns ``(out (B, T, Hq, Dv), lse (B, Hq, T))`` like ``ops.flash_attention``. The forward
    is the split-K kernel; the VJP is FlashAttention-2's backward kernels (``ops``) run on
    this forward's output and log-sum-exp, which are what they need. With ``kv_lengths`` the
    backward takes the visibility as a ``(B, 1, T, S)`` mask built from the lengths (keys
    ``j < L_b``, causal and window aligned to ``L_b - T + i``), the forward's own rule, so
    the gradients are those of the forward (the flash kernels have no per-sequence lengths).
    ``flash_tiles`` is that backward's :class:`~jaxattn_triton.flash.launch.Tiles`; when None they
    are tuned ones for its spec, with ``flash_overrides`` (metadata block sizes) applied.
    """
    from jaxattn_triton.flash.ops import make_spec

    b, t, hq, _ = q.shape
    s = k.shape[1]
    mask = None if kv_lengths is None else jax.ShapeDtypeStruct((b, 1, t, s), jnp.int8)
    fspec = make_spec(
        q, k, v, mask=mask, causal=causal and mask is None, sliding_window=window if mask is None else None,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks is not None,
    )  # fmt: skip
    if b == 0 or t == 0:
        return jnp.zeros((b, t, hq, v.shape[3]), q.dtype), jnp.full((b, hq, t), -jnp.inf, jnp.float32)
    if flash_tiles is None:
        from jaxattn_triton.tuning import tiles_for

        flash_tiles = tiles_for(fspec, interpret=interpret, overrides=flash_overrides)
    pspec = dense_spec(
        q, k, v, causal=causal, softmax_scale=fspec.softmax_scale, logits_soft_cap=logits_soft_cap,
        window=window, sinks=sinks is not None,
    )  # fmt: skip
    ptiles = LP.default_tiles(pspec, _num_sms())
    if kv_lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    else:
        lengths = _int32(kv_lengths, "kv_lengths", (b,))
    return _decode_vjp(pspec, ptiles, fspec, flash_tiles, interpret, q, k, v, _sinks(sinks, hq), lengths)


def visibility_mask(spec: LP.PagedSpec, lengths: Array) -> Array:
    """``(B, 1, T, S)`` int8: which keys each query of a dense-decode call sees (the kernel's rule).

    Key ``j`` is visible to query ``i`` of sequence ``b`` when ``j < L_b`` and, with
    ``pos = L_b - T + i``, ``pos - left <= j <= pos + right`` for the bounded sides; lengths
    are clamped to ``0..S`` as the kernel clamps them.
    """
    assert spec.q_len is not None
    t, s = spec.q_len, spec.page_size
    lens = jnp.clip(lengths.astype(jnp.int32), 0, s)[:, None, None, None]
    i = jnp.arange(t, dtype=jnp.int32)[None, None, :, None]
    j = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
    pos = lens - t + i
    seen = (j < lens) & (pos >= 0)  # a query at a negative position is no token: it sees nothing
    if spec.window_left is not None:
        seen &= j >= pos - spec.window_left
    if spec.window_right is not None:
        seen &= j <= pos + spec.window_right
    return seen.astype(jnp.int8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _decode_vjp(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    q: Array, k: Array, v: Array, sinks: Array, lengths: Array,
) -> tuple[Array, Array]:  # fmt: skip
    b, t, hq, _ = q.shape
    q2, k2, v2, sinks2, table, lengths2, cu, ns = _dense_inputs(q, k, v, sinks, lengths)
    # The kernels' argument order (paged.launch.attention), not _forward's.
    out, lse = _execute_all(pspec, ptiles, [q2, k2, v2, table, lengths2, cu, ns, sinks2], interpret)  # no scales
    out, lse = out.reshape(b, t, hq, v.shape[3]), jnp.transpose(lse.reshape(b, t, hq), (0, 2, 1))
    if fspec.mask_shape is not None:  # kv_lengths given (the backward's mask is built from them)
        out, lse = _before_the_start_empty(out, lse, lengths)
    return out, lse


def _decode_vjp_fwd(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    q: Array, k: Array, v: Array, sinks: Array, lengths: Array,
) -> tuple[tuple[Array, Array], tuple[Array, ...]]:  # fmt: skip
    out, lse = _decode_vjp(pspec, ptiles, fspec, ftiles, interpret, q, k, v, sinks, lengths)
    return (out, lse), (q, k, v, sinks, lengths, out, lse)


def _decode_vjp_bwd(
    pspec: LP.PagedSpec, ptiles: LP.PagedTiles, fspec: Any, ftiles: Any, interpret: bool,
    residuals: tuple[Array, ...], cotangents: tuple[Array, Array],
) -> tuple[Array | None, ...]:  # fmt: skip
    from jaxattn_triton.flash.ops import _flash_bwd

    q, k, v, sinks, lengths, out, lse = residuals
    # The flash backward's optional inputs, absent here: one-element dummies as in ops. With
    # kv_lengths its spec has a mask instead of causal/window: the visibility, built here.
    bias = jnp.zeros((1,), jnp.float32)
    mask = jnp.zeros((1,), jnp.int8) if fspec.mask_shape is None else visibility_mask(pspec, lengths)
    if fspec.mask_shape is not None:
        # The cache may hold NaN past a length; the flash backward multiplies it by its zero
        # probabilities (dq = dS K, dP = dO V^T), so it gets zeros there, by a select.
        k, v = zero_past_lengths(k, v, jnp.clip(lengths, 0, k.shape[1]))
    seg = jnp.zeros((1,), jnp.int32)
    grads = _flash_bwd(fspec, ftiles, interpret, (q, k, v, bias, sinks, mask, seg, seg, out, lse), cotangents)
    dq, dk, dv, _, dsinks = grads[:5]
    # lengths are integers: no cotangent.
    return dq, dk, dv, dsinks, None


_decode_vjp.defvjp(_decode_vjp_fwd, _decode_vjp_bwd)
