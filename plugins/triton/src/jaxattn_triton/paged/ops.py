"""Serving attention for JAX on NVIDIA GPUs: paged decode and ragged paged attention.

Forward only. The arrays follow the serving contract (int32 index arrays; ``kv_lengths``
counts the tokens queried in this call; queries are causal and bottom-right aligned to each
sequence's own length; rows without a visible key are zeros):

* :func:`paged_decode`: q ``(num_seqs, T, Hq, D)``, T small (1 = decode, a few =
  speculative decoding), over a paged cache;
* :func:`ragged_paged`: q ``(num_tokens, Hq, D)``, sequences packed back to back
  (``cu_q_lens``, ``num_seqs``), prefill chunks and decode rows mixed.

The split-K launch helpers below (``_forward`` and the argument checks) are the kernel's JAX
side, which ``decode.ops`` (the dense decode, reading a dense cache through the same kernel)
shares.

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
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn_triton.flash.launch import Launch
from jaxattn_triton.paged import launch as LP

Array = jax.Array

__all__ = ["paged_decode", "ragged_paged"]

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


def _scale_fields(cache_dtype: str | None, k_scale: Any, v_scale: Any, lead: tuple[int, ...]) -> dict[str, Any]:
    """The :class:`~jaxattn_triton.paged.launch.PagedSpec` fields of the scales (arrays, scalars or
    ``ShapeDtypeStruct``s): their strides against ``lead``, the cache's shape without its last
    axis (none for a cache that is not quantized, which takes no scale)."""
    if cache_dtype is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale scale a quantized cache (int8/float8); this cache is not quantized")
        return {}
    return {
        name: None if scale is None else LP.scale_strides(jnp.shape(scale), lead, name)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale))
    }


def _scales(
    cache_dtype: str | None, k_scale: Any, v_scale: Any, lead: tuple[int, ...]
) -> tuple[dict[str, Any], Array, Array]:
    """``(PagedSpec fields, k_scale, v_scale)``: :func:`_scale_fields` and the scales as flat
    float32 arrays (one-element dummies when absent: an unscaled quantized cache means its raw
    values)."""
    fields = _scale_fields(cache_dtype, k_scale, v_scale, lead)
    # Flat and C-contiguous: the strides index it; no broadcast copy is made.
    arrays = [
        jnp.zeros((1,), jnp.float32) if scale is None else jnp.reshape(jnp.asarray(scale).astype(jnp.float32), (-1,))
        for scale in (k_scale, v_scale)
    ]
    return fields, arrays[0], arrays[1]


def _spec(
    q: Any,
    cache: tuple[int, int, int],
    head_dim_v: int,
    *,
    layout: str,
    max_seqs: int,
    q_len: int | None,
    pages_per_seq: int,
    softmax_scale: float | None,
    logits_soft_cap: float | None,
    window_left: int | None,
    window_right: int | None,
    sinks: bool,
    cache_dtype: str | None,
    scale_fields: dict[str, Any],
) -> LP.PagedSpec:
    """The :class:`~jaxattn_triton.paged.launch.PagedSpec` of a call of the split-K kernel with
    query ``q`` (tokens, or sequences by T, then ``(Hq, D)``) over a cache ``(num_pages,
    page_size, heads_kv)`` by ``head_dim_v`` (a dense one: a page per sequence); raises
    ``ValueError`` with the reasons it cannot run. The softmax scale defaults to ``D**-0.5``."""
    num_pages, page_size, heads_kv = cache
    *lead, heads_q, d = (int(x) for x in q.shape)
    return LP.PagedSpec(
        num_tokens=math.prod(lead), max_seqs=max_seqs, q_len=q_len, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=d, head_dim_v=int(head_dim_v), dtype=jnp.dtype(q.dtype).name, num_pages=num_pages,
        page_size=page_size, pages_per_seq=pages_per_seq, layout=layout,
        softmax_scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        window_left=None if window_left is None else int(window_left),
        window_right=None if window_right is None else int(window_right),
        sinks=sinks, cache_dtype=cache_dtype, **scale_fields,
    )  # fmt: skip


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
    spec = _spec(
        q, (num_pages, page_size, hkv), dv, layout=layout, max_seqs=num_seqs, q_len=t,
        pages_per_seq=int(page_table.shape[1]), softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_left, window_right=0, sinks=sinks is not None, cache_dtype=cache_dtype,
        scale_fields=scale_fields,
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
    return out, jnp.transpose(_no_key_inf(lse).reshape(num_seqs, t, hq), (0, 2, 1))


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
    visibility: tuple[Array, Array] | None = None,
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
    key bounds per token (``paged.visibility``) that the kernel reads. ``visibility``: those
    ``(words, bounds)`` of this call's mask_mod and arrays, built once for a step's layers
    (``visibility_words``) instead of in every call.
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
    spec = _spec(
        q, (num_pages, page_size, hkv), dv, layout=layout, max_seqs=max_seqs, q_len=None,
        pages_per_seq=int(page_table.shape[1]), softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_left, window_right=0, sinks=sinks is not None, cache_dtype=cache_dtype,
        scale_fields=scale_fields,
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

        if visibility is None:
            visibility = visibility_words(mask_mod, n, hq, lengths, cu, ns, spec.capacity, spec.window_left)
        words, bounds = visibility
        width = -(-spec.capacity // 32)
        if words.ndim != 3 or words.shape[0] not in (1, hq) or tuple(words.shape[1:]) != (n, width) or \
                tuple(bounds.shape) != (n, 4):
            raise ValueError(f"visibility must be words (1 or {hq}, {n}, {width}) and bounds ({n}, 4), got "
                             f"{words.shape} and {bounds.shape}")
        mask = (words, bounds)
        spec = dataclasses.replace(spec, mask_heads=int(words.shape[0]))
    chosen = _tiles(spec, tiles, num_splits)
    out, lse = _forward(spec, chosen, interpret, q, k, v, sink_arr, table, lengths, cu, ns, ks, vs, *mask)
    return (out, _no_key_inf(lse)) if return_lse else out


def _no_key_inf(lse: Array) -> Array:
    """The kernel's lse with its rows of no key (``launch.NO_KEY_LSE``) at -inf, as the contract
    gives them."""
    return jnp.where(lse == LP.NO_KEY_LSE, -jnp.inf, lse)
