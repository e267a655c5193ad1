"""Split-K decode over a dense KV cache in plain XLA: the kernel of ``autoregressive_decodeattn``.

A decode step (or a few queries: speculative decoding, T <= 16) reads the whole cache once,
so it is bound by memory, not arithmetic. Two things decide its speed in XLA:

* **Dot operations over packed heads.** Both contractions are matrix products batched over B
  and the KV heads, the query heads of each KV head packed together (``R = T * G`` rows per
  KV head, G = Hq / Hkv, so each K/V element serves all of them and K and V are never
  repeated over the group); XLA lays the operands out as its dot wants (on a CPU that can
  mean a copy of K and V). They are dot operations on purpose: the multiply-and-reduce this
  kernel used before (``sum(k[:, :, :, None, :] * q[:, None], -1)``) is lowered by jaxlib
  0.10.2's XLA:CPU into a YNNPACK fusion that computes wrong logits at many GQA decode shapes
  (docs/decode.md). A variant batched over B only, reading K and V in place and keeping the
  diagonal head blocks of an Hkv-times-larger product, measured slower on a CPU (float32,
  B=8 T=1 Hq=32 Hkv=8 D=128 S=4096: 204 vs 175 ms, median of 9).
* **Split-K (flash-decoding).** The keys of a step are cut into ``num_chunks`` contiguous
  chunks; each chunk gets its own partial softmax (row max ``m_c``, sum ``l_c`` and
  unnormalised output ``o_c``), computed side by side (the chunks are folded into the batch
  dimension, so XLA runs them as independent reductions), and the chunks are combined
  exactly: with ``M = max_c m_c``, ``out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c``.
  Steps of ``step`` keys run in a ``lax.scan`` that folds each step's chunks into a running
  ``(M, l, o)`` by the same combine. How many chunks pay depends on the platform: on a CPU
  XLA already spreads one long reduction over the cores, and more chunks measured slower
  (see ``impl``), so the impl asks for one there.

With several steps, a step whose keys no query can see (past the longest ``kv_lengths``, or
left of every query's sliding window) is skipped with ``lax.cond``: with steps shorter than S, a cache of
capacity S filled to L costs about ``L / S`` of a full read (XLA copies each step's slice of
the cache, though, so one step over all S is faster for full caches). The last step is
shifted left to end at S (no padded copy of the cache is ever made) and masks the keys an
earlier step already counted.

Semantics are the contract's (docs/contract.md): soft cap, then masking (keys ``j >=
kv_lengths[b]``, causal and the window aligned to ``kv_lengths[b]`` or S), softmax in
``softmax_dtype`` (float32 by default; float64 inputs stay float64), sinks in the
denominator. Rows that see no key give zeros and ``lse = -inf``. Everything is plain JAX:
gradients come from autodiff (the shifts ``m_c`` and ``M`` are ``stop_gradient`` constants,
which is exact since the softmax does not depend on them), and ``lax.cond`` / ``lax.scan``
are differentiable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads

__all__ = ["DecodeResult", "DecodeTiling", "decode_attention", "decode_tiling"]

Array = jax.Array


class DecodeResult(NamedTuple):
    """``output (B, T, Hq, Dv)`` in q's dtype; ``lse (B, Hq, T)``: log-sum-exp of the final logits
    over visible keys (sink excluded, ``-inf`` for empty rows), in the accumulation dtype."""

    output: Array
    lse: Array


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """How the S keys are cut: ``steps`` scan steps of ``step_keys`` keys, each split into
    ``num_chunks`` chunks of ``chunk`` keys. Step ``n`` reads keys ``[start, start + step_keys)``
    with ``start = min(n * step_keys, S - step_keys)`` (the last step is shifted left to end
    at S) and counts only keys ``>= n * step_keys``."""

    s: int
    step_keys: int
    num_chunks: int

    @property
    def chunk(self) -> int:
        return self.step_keys // self.num_chunks

    @property
    def steps(self) -> int:
        return -(-self.s // self.step_keys)


def decode_tiling(s: int, num_chunks: int | None = None, step: int | None = None) -> DecodeTiling:
    """Steps of ``min(step, S)`` keys (default S: one step), each cut into the largest number
    of equal chunks that is at most ``num_chunks`` (default 1) and divides the step."""
    step_keys = s if step is None else int(step)
    want = 1 if num_chunks is None else int(num_chunks)
    if step_keys <= 0 or want <= 0:
        raise ValueError(f"step and num_chunks must be positive, got {step} and {num_chunks}")
    step_keys = min(step_keys, s)
    chunks = max(c for c in range(1, min(want, step_keys) + 1) if step_keys % c == 0)
    return DecodeTiling(s=s, step_keys=step_keys, num_chunks=chunks)


def _visible_range(t: int, s: int, lengths: Array | None, window: tuple[int, int] | None) -> tuple[Array, Array]:
    """``[lo, hi)``: the keys some query of the batch can see (steps outside are skipped).

    Keys past the longest sequence are invisible (causal cuts nothing below it: the last
    query sits on the last valid key); with a window, so are keys left of the first query's
    window in the shortest sequence (query 0 sits at ``L - T``).
    """
    longest = jnp.asarray(s, jnp.int32) if lengths is None else jnp.max(lengths)
    shortest = jnp.asarray(s, jnp.int32) if lengths is None else jnp.min(lengths)
    lo = jnp.asarray(0, jnp.int32)
    if window is not None:
        lo = jnp.maximum(lo, shortest - t - window[0])
    return lo, longest


def _logits(k: Array, qt: Array, dtype: Any) -> Array:
    """``k (N, sc, Hkv, D)`` against ``qt (N, D, Hkv * R)``: ``(N, sc, Hkv, R)`` in ``dtype``.

    One product batched over N and the KV heads, contracting D: a dot operation, never the
    multiply-and-reduce that jaxlib 0.10.2's XLA:CPU miscompiled (wrong logits at many GQA
    decode shapes under jit). XLA places the batch axes as its dot wants them.
    """
    n, _, hkv, d = k.shape
    r = qt.shape[-1] // hkv
    out = lax.dot_general(k, qt.reshape(n, d, hkv, r), (((3,), (1,)), ((0, 2), (0, 2))),
                          preferred_element_type=dtype)  # (N, Hkv, sc, R)
    return out.transpose(0, 2, 1, 3)


def _weighted_values(p: Array, v: Array, dtype: Any) -> Array:
    """``sum_j p[:, j, h, r] v[:, j, h, :]``: ``p (N, sc, Hkv, R)``, ``v (N, sc, Hkv, Dv)`` ->
    ``(N, Hkv, R, Dv)`` accumulated in ``dtype``.

    One product batched over N and the KV heads, contracting the keys (a dot operation, as in
    ``_logits``). A 16-bit V multiplies probabilities rounded to its dtype (as flash attention
    kernels do), so V is never copied into a wider one.
    """
    wide = jnp.promote_types(v.dtype, jnp.float32) == v.dtype
    pdtype = jnp.promote_types(p.dtype, v.dtype) if wide else v.dtype
    out: Array = lax.dot_general(p.astype(pdtype), v.astype(pdtype), (((1,), (1,)), ((0, 2), (0, 2))),
                                 preferred_element_type=dtype)  # (N, Hkv, R, Dv)
    return out


def _and(a: Array | None, b: Array) -> Array:
    return b if a is None else a & b


class _Steps(NamedTuple):
    """What every key step of one ``decode_attention`` call reads (``_attend``, ``_combine``)."""

    k: Array
    v: Array
    qt: Array  # the query rows of each KV head side by side: (B * nc, D, Hkv * R)
    lengths: Array | None
    pos: Array  # (B, R): each row's position
    dims: tuple[int, int, int, int, int, int, int]  # b, s, hkv, d, dv, r, keys
    tiling: DecodeTiling
    precisions: tuple[Any, Any, Any]  # cdtype (the product's), sdtype (the softmax's), adtype (accumulation)
    scale: float
    unscaled: bool
    factor: Array
    soft_cap: float | None
    lowest: Array
    window: tuple[int, int] | None
    cuts: tuple[bool, bool, bool, bool]  # shifted, causal for T > 1, the window's left and right edges


def _seen_max(m: Array, fallback: Any, lowest: Array) -> Array:
    """``m`` where some key was seen (finite and above ``lowest``), else ``fallback``."""
    return jnp.where(jnp.isfinite(m) & (m > lowest), m, fallback)


def _keep(c: _Steps, n: Array, start: Array) -> Array | None:
    """``(B|1, nc, sc, 1, R|1)``: which keys of step n (read from ``start``) each row sees."""
    nc, sc, keys = c.tiling.num_chunks, c.tiling.chunk, c.dims[6]
    shifted, cut_causal, cut_left, cut_right = c.cuts
    lengths, window = c.lengths, c.window
    j = (start + jnp.arange(keys, dtype=jnp.int32)).reshape(1, nc, sc, 1, 1)
    p_ = c.pos[:, None, None, None, :]  # (B, 1, 1, 1, R)
    keep: Array | None = None
    if shifted:  # keys an earlier step counted
        keep = j >= n * keys
    if lengths is not None:  # a query at a negative position (T > L) is no token: it sees nothing
        keep = _and(keep, (j < lengths[:, None, None, None, None]) & (p_ >= 0))
    if cut_causal:
        keep = _and(keep, j <= p_)
    if cut_left and window is not None:
        keep = _and(keep, j >= p_ - window[0])
    if cut_right and window is not None:
        keep = _and(keep, j <= p_ + window[1])
    return keep


def _attend(c: _Steps, n: Array) -> tuple[Array, Array, Array]:
    """Step n's chunks: ``(m, l, o)`` of shapes (B, nc, Hkv, R) and (B, nc, Hkv, R, Dv)."""
    b, s, hkv, d, dv, r, keys = c.dims
    nc, sc = c.tiling.num_chunks, c.tiling.chunk
    cdtype, sdtype, adtype = c.precisions
    lengths = c.lengths
    first = n * keys
    start = jnp.minimum(first, s - keys)  # the last step ends at S: no padded copy
    kb = lax.dynamic_slice_in_dim(c.k, start, keys, axis=1).reshape(b * nc, sc, hkv, d)
    vb = lax.dynamic_slice_in_dim(c.v, start, keys, axis=1).reshape(b * nc, sc, hkv, dv)
    if lengths is not None:
        # Past a length the cache may hold NaN: hidden logits are -inf, but p = 0 times a NaN
        # value is NaN in P @ V (and dS = 0 times a NaN key in dq), so a select zeroes them.
        live = (start + jnp.arange(keys, dtype=jnp.int32)).reshape(1, nc, sc) < lengths[:, None, None]
        live = live.reshape(b * nc, sc, 1, 1)
        kb = jnp.where(live, kb, jnp.zeros((), kb.dtype))
        vb = jnp.where(live, vb, jnp.zeros((), vb.dtype))
    x = _logits(kb.astype(cdtype), c.qt, sdtype)  # (B * nc, sc, Hkv, R)
    if not c.unscaled:
        x = x * jnp.asarray(c.scale, sdtype)
    if c.soft_cap is not None:
        cap = jnp.asarray(c.soft_cap, sdtype)
        x = cap * jnp.tanh(x / cap)
    keep = _keep(c, n, start)
    if keep is not None:
        keep = jnp.broadcast_to(keep, (b, nc, sc, 1, keep.shape[-1]))
        keep = keep.reshape(b * nc, sc, 1, keep.shape[-1])
    low = jnp.asarray(jnp.finfo(x.dtype).min, x.dtype)  # the softmax dtype's own lowest
    hidden = x if keep is None else jnp.where(keep, x, low)
    m = lax.stop_gradient(jnp.max(hidden, axis=1))  # (B * nc, Hkv, R); a shift: no gradient
    seen = jnp.isfinite(m) & (m > low)
    m_safe = jnp.where(seen, m, 0)
    exponent = (x - m_safe[:, None]) * c.factor
    p = jnp.exp(exponent if keep is None else jnp.where(keep, exponent, c.lowest))
    m = jnp.where(seen, m.astype(adtype), c.lowest)
    l_c = jnp.sum(p, axis=1, dtype=adtype)
    o_c = _weighted_values(p, vb, adtype)  # (B * nc, Hkv, R, Dv)
    return (m.astype(adtype).reshape(b, nc, hkv, r), l_c.reshape(b, nc, hkv, r),
            o_c.reshape(b, nc, hkv, r, dv))


def _combine(c: _Steps, m_c: Array, l_c: Array, o_c: Array,
             run: tuple[Array, Array, Array] | None = None) -> tuple[Array, Array, Array]:
    """The split-K combine: chunk partials (and the running ones) rescaled to one max."""
    m_new = jnp.max(m_c, axis=1) if run is None else jnp.maximum(run[0], jnp.max(m_c, axis=1))
    safe = _seen_max(m_new, 0, c.lowest)
    w_c = jnp.exp((_seen_max(m_c, safe[:, None], c.lowest) - safe[:, None]) * c.factor)
    l_new = jnp.sum(w_c * l_c, axis=1)
    o_new = jnp.sum(w_c[..., None] * o_c, axis=1)
    if run is not None:
        w_run = jnp.exp((_seen_max(run[0], safe, c.lowest) - safe) * c.factor)
        l_new, o_new = w_run * run[1] + l_new, w_run[..., None] * run[2] + o_new
    return m_new, l_new, o_new


def _run_steps(c: _Steps, lo: Array, hi: Array) -> tuple[Array, Array, Array]:
    """Every key step, combined: the running ``(m, l, o)`` of (B, Hkv, R) and (B, Hkv, R, Dv);
    a step no query sees a key of (outside ``lo .. hi``) is skipped."""
    b, _, hkv, _, dv, r, keys = c.dims

    def scan_step(run: tuple[Array, Array, Array], n: Array) -> tuple[tuple[Array, Array, Array], None]:
        seen = (n * keys < hi) & ((n + 1) * keys > lo)  # some query can see a key of this step
        return lax.cond(seen, lambda run: _combine(c, *_attend(c, n), run), lambda run: run, run), None

    if c.tiling.steps == 1:  # one step over the whole cache: nothing to skip, no loop
        return _combine(c, *_attend(c, jnp.int32(0)))
    adtype = c.precisions[2]
    init = (
        jnp.full((b, hkv, r), c.lowest, adtype),
        jnp.zeros((b, hkv, r), adtype),
        jnp.zeros((b, hkv, r, dv), adtype),
    )
    run, _ = lax.scan(scan_step, init, jnp.arange(c.tiling.steps, dtype=jnp.int32))
    return run


def decode_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    kv_lengths: ArrayLike | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: ArrayLike | None = None,
    softmax_dtype: Any = jnp.float32,
    num_chunks: int | None = None,
    step: int | None = None,
) -> DecodeResult:
    """Decode attention over a dense cache, split-K; see the module docstring.

    q ``(B, T, Hq, D)``, k ``(B, S, Hkv, D)``, v ``(B, S, Hkv, Dv)``; ``kv_lengths (B,)``
    (values outside 0..S, which jit cannot check, are clamped); ``softmax_aux (Hq,)``.
    ``num_chunks`` and ``step`` cut the keys (``decode_tiling``).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    g = hq // hkv
    r = t * g  # query rows per KV head: (t, g) order
    window = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
    sdtype = jnp.promote_types(jnp.dtype(softmax_dtype), q.dtype)
    adtype = jnp.promote_types(sdtype, jnp.float32)
    scale = float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)
    tiling = decode_tiling(s, num_chunks, step)
    # Without a soft cap the logits keep their scale out until the max is subtracted, and the
    # running maxima are unscaled: XLA fuses ``x * scale - m`` into one multiply-add, whose
    # exact product sits up to half an ulp of the rounded max away, and past ~2^32 that gap
    # alone overflows exp(). ``(x - m) * scale`` has nothing to fuse.
    # A scale below the smallest normal is applied first too: flushed to zero, as a factor it
    # would turn a hidden key's -inf into NaN (-inf * 0), and such logits cannot be large.
    unscaled = logits_soft_cap is None and scale >= float(jnp.finfo(sdtype).tiny)
    factor = jnp.asarray(scale if unscaled else 1.0, adtype)
    nc, keys = tiling.num_chunks, tiling.step_keys

    lengths = None if kv_lengths is None else jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, s)
    ends = jnp.full((b,), s, jnp.int32) if lengths is None else lengths
    # Row r of KV head h is query i = r // G of head h * G + r % G; it sits at key L - T + i.
    pos = (ends[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]).repeat(g, axis=1)  # (B, R)
    # The query rows of each KV head side by side, as the right operand of the logits' product
    # (a few KB): (B * nc, D, Hkv * R), in K's dtype (a 16-bit cache is multiplied as it is
    # stored, into sdtype), the scale applied to the logits.
    cdtype = jnp.promote_types(q.dtype, k.dtype)
    qt = q.reshape(b, t, hkv, g, d).transpose(0, 4, 2, 1, 3).reshape(b, 1, d, hkv * r).astype(cdtype)
    qt = jnp.broadcast_to(qt, (b, nc, d, hkv * r)).reshape(b * nc, d, hkv * r)
    # A +inf sink: a finite stand-in here, its heads zeroed at the end (jaxattn.backend.sinks).
    softmax_aux, absorbed = split_absorbing_sinks(softmax_aux)
    aux = None if softmax_aux is None else softmax_aux.astype(adtype)
    lo, hi = _visible_range(t, s, lengths, window)
    # Hidden logits and the maxima of chunks that see no key are the lowest finite value, not
    # -inf: jax.debug_infs(True) flags every -inf an operation makes. Such a chunk's sum and
    # values are exactly 0, so its weight in the combine only has to be finite.
    lowest = jnp.asarray(jnp.finfo(adtype).min, adtype)
    # Which rules can hide a key of a step (others are left out of the program): the shifted
    # last step's overlap, the lengths, causal for T > 1, and the window's edges where they cut.
    cuts = (s % keys != 0, causal and t > 1, window is not None and window[0] < s - 1,
            window is not None and window[1] < t - 1)
    steps = _Steps(k=k, v=v, qt=qt, lengths=lengths, pos=pos, dims=(b, s, hkv, d, dv, r, keys), tiling=tiling,
                   precisions=(cdtype, sdtype, adtype), scale=scale, unscaled=unscaled, factor=factor,
                   soft_cap=logits_soft_cap, lowest=lowest, window=window, cuts=cuts)
    m_run, l_run, o_run = _run_steps(steps, lo, hi)

    has = l_run > 0
    m_safe = _seen_max(m_run, 0, lowest) * factor
    lse = jnp.where(has, m_safe + jnp.log(jnp.where(has, l_run, 1)), -jnp.inf)
    if aux is None:
        out = o_run / jnp.where(has, l_run, 1)[..., None]
    else:
        # The sink joins the denominator: out = o / (l + e^(sink - m)), with no lse - m to lose
        # to rounding at huge logits. An empty row (o = 0) stays 0.
        sink = jnp.broadcast_to(aux.reshape(1, hkv, 1, g), (1, hkv, t, g)).reshape(1, hkv, r)
        out = o_run * jnp.where(has, 1 / (l_run + jnp.exp(sink - m_safe)), 0)[..., None]
    # (B, Hkv, T*G, Dv) -> (B, T, Hq, Dv); lse (B, Hkv, T, G) -> (B, Hq, T)
    out = out.reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
    lse = lse.reshape(b, hkv, t, g).transpose(0, 1, 3, 2).reshape(b, hq, t)
    return DecodeResult(output=zero_absorbed_heads(out.astype(q.dtype), absorbed, 2), lse=lse)
