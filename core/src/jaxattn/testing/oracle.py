"""Float64 NumPy reference of the attention contract (docs/contract.md), forward and backward.

The oracle is what every backend is checked against, so it must not share code (or
bugs) with any of them: it imports NumPy only, never jax, and spells every rule of the
contract out in the most direct form, materialising the full ``(B, Hq, T, S)`` logits and
the repeated K/V heads. Speed is irrelevant; keep the shapes small.

Semantics (docs/contract.md):

* layout BTHD: q ``(B, T, Hq, D)``, k ``(B, S, Hkv, D)``, v ``(B, S, Hkv, Dv)``; query
  head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA/MQA);
* logits ``x = softmax_scale * q.k`` (scale defaults to ``D ** -0.5``), then the soft cap
  ``c * tanh(x / c)``, then the additive bias, then masking;
* a key is visible when the boolean mask is True, it is causal-visible
  (``j <= i + S - T``: bottom-right alignment), inside the sliding window
  (``i' - left <= j <= i' + right`` with ``i' = i + S - T``), and in the query's segment;
* ``softmax_aux`` adds one raw logit per query head to the denominator only (a sink: neither
  scaled nor soft-capped); a ``+inf`` sink takes the whole mass (the head's output and
  probabilities are zeros, its gradients zero), a ``-inf`` one is no sink;
* dropout multiplies the probabilities by ``keep / (1 - p)`` for a given keep-mask;
* ``kv_lengths (B,)`` (a dense KV cache of capacity S): keys ``j >= L_b`` are invisible and
  causal masking and the window align to ``i' = i + L_b - T`` instead; a query whose
  position ``i'`` is negative sees no key;
* a row that sees no key gives zeros (output, probabilities, gradients), ``lse = -inf``;
* ``mask_mod(b, h, q_idx, kv_idx)`` (raw positions) ANDs into the visibility, and
  ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites the biased logits before masking. These
  are the user's JAX functions, so they are the one thing the oracle runs with jax: on the
  host, at float64 (``jax.enable_x64``), on the whole ``(B, Hq, T, S)`` grid, and their
  gradients come from ``jax.vjp`` of the function alone (``_ScoreMod``).

:func:`paged_attention` spells out the paged contract (docs/contract.md, "Serving attention"):
gather each sequence's tokens from its pages, then attend causally as above. A paged call's
``mask_mod(seq, h, q_pos, kv_pos)`` (positions within the sequence) is evaluated the same way,
on each sequence's whole index grid (:func:`paged_mask_mod_grid`), and ANDed in as a mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "OracleGrads",
    "OracleResult",
    "attention",
    "attention_backward",
    "mask_mod_grid",
    "paged_attention",
    "paged_mask_mod_grid",
    "paged_visibility",
    "visibility",
]

F64 = npt.NDArray[np.float64]
Window = int | tuple[int, int] | None


@dataclass(frozen=True)
class OracleResult:
    """Forward results, all float64.

    ``probs`` are the softmax probabilities before dropout (the sink's share is excluded,
    so a row sums to less than 1 when ``softmax_aux`` is given); ``weights`` are the
    probabilities that actually multiplied V (``probs`` after dropout); ``lse`` is the
    log-sum-exp of the final logits over visible real keys, ``-inf`` for empty rows.
    """

    output: F64  # (B, T, Hq, Dv)
    probs: F64  # (B, Hq, T, S)
    weights: F64  # (B, Hq, T, S)
    lse: F64  # (B, Hq, T)
    visible: npt.NDArray[np.bool_]  # (B, Hq, T, S), every masking rule combined


@dataclass(frozen=True)
class OracleGrads:
    """Gradients of ``sum(output * d_output)``; bias and softmax_aux ones are None if absent."""

    dq: F64
    dk: F64
    dv: F64
    dbias: F64 | None  # reduced to the shape of the bias that was passed
    dsoftmax_aux: F64 | None  # (Hq,)
    dscore_params: Any = None  # the gradients of ``score_params`` (its pytree), None without them


def _indices(b: int, h: int, t: int, s: int) -> list[Any]:
    """A mask_mod's index arguments: int32, broadcasting as (B,1,1,1), (1,Hq,1,1), (1,1,T,1), (1,1,1,S)."""
    import jax.numpy as jnp

    return [jnp.arange(n, dtype=jnp.int32).reshape([n if a == i else 1 for a in range(4)])
            for i, n in enumerate((b, h, t, s))]


def mask_mod_grid(mask_mod: Any, b: int, h: int, t: int, s: int) -> npt.NDArray[np.bool_]:
    """``mask_mod`` evaluated on the whole ``(B, Hq, T, S)`` grid, as NumPy booleans."""
    out = np.asarray(mask_mod(*_indices(b, h, t, s)))
    if out.dtype != np.bool_:
        raise ValueError(f"mask_mod must return booleans, got {out.dtype}")
    return np.broadcast_to(out, (b, h, t, s))


class _ScoreMod:
    """``score_mod`` at float64 on the grid: the rewritten scores, and the pullback of the
    scores and of ``score_params`` (with params, ``score_mod(params)`` is the function)."""

    def __init__(self, score_mod: Any, params: Any, scores: F64) -> None:
        import jax
        import jax.numpy as jnp

        self.params = params
        with jax.enable_x64(True):
            index = _indices(*scores.shape)

            def apply(score: Any, params: Any) -> Any:
                fn = score_mod if params is None else score_mod(params)
                return fn(score, *index)

            wide = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
            out, self._pullback = jax.vjp(apply, jnp.asarray(scores, jnp.float64), wide)
            self.scores: F64 = np.asarray(out, dtype=np.float64)
        if self.scores.shape != scores.shape:
            raise ValueError(f"score_mod must return the scores' shape {scores.shape}, got {self.scores.shape}")

    def pullback(self, d_scores: F64) -> tuple[F64, Any]:
        import jax

        with jax.enable_x64(True):
            d_in, d_params = self._pullback(d_scores)
        as_np = jax.tree_util.tree_map(lambda g: np.asarray(g, dtype=np.float64), d_params)
        return np.asarray(d_in, dtype=np.float64), (None if self.params is None else as_np)


@dataclass(frozen=True)
class _Inputs:
    """Validated float64 inputs with the K/V heads repeated to Hq (the oracle may be wasteful)."""

    q: F64
    k: F64  # (B, S, Hq, D)
    v: F64  # (B, S, Hq, Dv)
    groups: int
    bias: F64 | None  # as passed (unbroadcast), float64
    aux: F64 | None
    keep_scaled: F64 | None  # (B, Hq, T, S): keep / (1 - p), or None without dropout
    visible: npt.NDArray[np.bool_]
    scale: float
    cap: float | None
    score_mod: Any = None
    score_params: Any = None


def _f64(x: Any) -> F64:
    return np.asarray(x, dtype=np.float64)


def _normalize_window(window: Window) -> tuple[int, int] | None:
    if window is None:
        return None
    if isinstance(window, (int, np.integer)):
        left = right = int(window)
    else:
        left, right = (int(w) for w in window)
    if left < 0 or right < 0:
        raise ValueError(f"sliding_window: sizes must be >= 0, got {window!r}")
    return left, right


def visibility(
    batch: int,
    heads: int,
    t: int,
    s: int,
    *,
    mask: Any = None,
    causal: bool = False,
    sliding_window: Window = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    kv_lengths: Any = None,
    mask_mod: Any = None,
) -> npt.NDArray[np.bool_]:
    """The ``(B, Hq, T, S)`` boolean of which keys each query may see (every rule ANDed)."""
    visible = np.ones((batch, heads, t, s), dtype=bool)
    if mask_mod is not None:
        visible &= mask_mod_grid(mask_mod, batch, heads, t, s)
    if mask is not None:
        visible &= np.broadcast_to(np.asarray(mask, dtype=bool), visible.shape)
    # i' = i + L - T puts the last query on the last valid key (KV-cache decoding convention);
    # L is S, or each sequence's own length.
    ends = np.full((batch,), s) if kv_lengths is None else np.asarray(kv_lengths).reshape(batch)
    i_aligned = np.arange(t)[None, None, :, None] + (ends - t)[:, None, None, None]  # (B, 1, T, 1)
    j = np.arange(s)[None, None, None, :]
    if kv_lengths is not None:
        # Keys past the length are not tokens of the sequence, and neither is a query whose
        # position is negative (T > L): it sees nothing, whatever causal and the window say.
        visible &= (j < ends[:, None, None, None]) & (i_aligned >= 0)
    if causal:
        visible &= j <= i_aligned
    window = _normalize_window(sliding_window)
    if window is not None:
        left, right = window
        visible &= (j >= i_aligned - left) & (j <= i_aligned + right)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids)
        ks = np.asarray(kv_segment_ids)
        if qs.shape != (batch, t) or ks.shape != (batch, s):
            raise ValueError(
                f"segment ids must be (B, T)=({batch}, {t}) and (B, S)=({batch}, {s}), got {qs.shape} and {ks.shape}"
            )
        visible &= qs[:, None, :, None] == ks[:, None, None, :]
    return visible


def _prepare(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any,
    bias: Any,
    causal: bool,
    sliding_window: Window,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    softmax_scale: float | None,
    logits_soft_cap: float | None,
    softmax_aux: Any,
    dropout_prob: float,
    dropout_keep: Any,
    kv_lengths: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
) -> _Inputs:
    q64, k64, v64 = _f64(q), _f64(k), _f64(v)
    if q64.ndim != 4 or k64.ndim != 4 or v64.ndim != 4:
        raise ValueError("q, k, v must be rank 4 (B, T/S, H, D)")
    b, t, hq, d = q64.shape
    _, s, hkv, _ = k64.shape
    if k64.shape[:3] != v64.shape[:3] or k64.shape[0] != b or k64.shape[3] != d:
        raise ValueError(f"incompatible shapes q{q64.shape} k{k64.shape} v{v64.shape}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    groups = hq // hkv
    visible = visibility(
        b,
        hq,
        t,
        s,
        mask=mask,
        causal=causal,
        sliding_window=sliding_window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        kv_lengths=kv_lengths,
        mask_mod=mask_mod,
    )
    aux = None
    if softmax_aux is not None:
        aux = _f64(softmax_aux)
        if aux.shape != (hq,):
            raise ValueError(f"softmax_aux must have shape (Hq,)=({hq},), got {aux.shape}")
    keep_scaled = None
    if dropout_prob > 0.0:
        if dropout_keep is None:
            raise ValueError("dropout_prob > 0 needs dropout_keep, the boolean keep-mask to apply")
        if not 0.0 < dropout_prob < 1.0:
            raise ValueError(f"dropout_prob must be in [0, 1), got {dropout_prob}")
        keep = np.broadcast_to(np.asarray(dropout_keep, dtype=bool), visible.shape)
        keep_scaled = keep / (1.0 - dropout_prob)
    bias64 = None
    if bias is not None:
        bias64 = _f64(bias)
        np.broadcast_shapes(bias64.shape, visible.shape)  # raises on a bias that does not fit
    return _Inputs(
        q=q64,
        k=np.repeat(k64, groups, axis=2),  # head h reads kv head h // groups
        v=np.repeat(v64, groups, axis=2),
        groups=groups,
        bias=bias64,
        aux=aux,
        keep_scaled=keep_scaled,
        visible=visible,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        cap=None if logits_soft_cap is None else float(logits_soft_cap),
        score_mod=score_mod,
        score_params=score_params,
    )


@dataclass(frozen=True)
class _Forward:
    raw: F64  # scale * q.k, before the soft cap
    probs: F64
    sink_prob: F64  # (B, Hq, T): the sink's share of each row (0 without a sink)
    weights: F64
    lse: F64
    output: F64
    mod: _ScoreMod | None = None


def _forward(x: _Inputs) -> _Forward:
    raw = np.einsum("bthd,bshd->bhts", x.q, x.k) * x.scale
    logits = raw if x.cap is None else x.cap * np.tanh(raw / x.cap)
    if x.bias is not None:
        logits = logits + x.bias
    mod = None
    if x.score_mod is not None:
        mod = _ScoreMod(x.score_mod, x.score_params, np.broadcast_to(logits, x.visible.shape))
        logits = mod.scores
    logits = np.where(x.visible, logits, -np.inf)
    row_max = logits.max(axis=-1)
    aux = x.aux
    absorbed = np.zeros(logits.shape[1], dtype=bool) if aux is None else np.isposinf(aux)
    if aux is not None:
        aux = np.where(absorbed, -np.inf, aux)  # a +inf sink's heads are overridden below
        row_max = np.maximum(row_max, aux[None, :, None])
    # Rows where everything (sink included) is -inf: shift by 0 so exp gives 0, not nan.
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    exp = np.exp(logits - shift[..., None])
    key_sum = exp.sum(axis=-1)
    sink = np.zeros_like(key_sum) if aux is None else np.exp(aux[None, :, None] - shift)
    denom = key_sum + sink
    safe = np.where(denom > 0, denom, 1.0)
    probs = exp / safe[..., None]
    sink_prob = sink / safe
    # exp(+inf) / (sum + exp(+inf)) is 1: the sink takes everything, the keys nothing.
    probs = np.where(absorbed[None, :, None, None], 0.0, probs)
    sink_prob = np.where(absorbed[None, :, None], 1.0, sink_prob)
    with np.errstate(divide="ignore"):
        lse = np.where(key_sum > 0, shift + np.log(np.where(key_sum > 0, key_sum, 1.0)), -np.inf)
    weights = probs if x.keep_scaled is None else probs * x.keep_scaled
    output = np.einsum("bhts,bshd->bthd", weights, x.v)
    return _Forward(raw=raw, probs=probs, sink_prob=sink_prob, weights=weights, lse=lse, output=output, mod=mod)


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool = False,
    sliding_window: Window = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    dropout_prob: float = 0.0,
    dropout_keep: Any = None,
    kv_lengths: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
) -> OracleResult:
    """Attention in float64 with exactly docs/contract.md's semantics.

    ``dropout_keep`` is a boolean keep-mask broadcastable to ``(B, Hq, T, S)``; the oracle
    has no random generator, so a test that wants to compare dropout numerics supplies the
    same mask the backend drew. ``score_params``: a pytree of arrays; with it ``score_mod(score_params)``
    is the score_mod (so that ``attention_backward`` can return their gradients).
    """
    x = _prepare(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        sliding_window=sliding_window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux,
        dropout_prob=dropout_prob,
        dropout_keep=dropout_keep,
        kv_lengths=kv_lengths,
        mask_mod=mask_mod,
        score_mod=score_mod,
        score_params=score_params,
    )
    f = _forward(x)
    return OracleResult(output=f.output, probs=f.probs, weights=f.weights, lse=f.lse, visible=x.visible)


def _reduce_to(grad: F64, shape: tuple[int, ...]) -> F64:
    """Sum a broadcast gradient back to the shape of the operand that was broadcast."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(lead))) if lead else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return np.asarray(grad.sum(axis=axes, keepdims=True) if axes else grad, dtype=np.float64)


def _sum_groups(grad: F64, groups: int) -> F64:
    """(B, S, Hq, D) -> (B, S, Hkv, D): a kv head collects the gradients of its query heads."""
    b, s, hq, d = grad.shape
    return np.asarray(grad.reshape(b, s, hq // groups, groups, d).sum(axis=3), dtype=np.float64)


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    d_output: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool = False,
    sliding_window: Window = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Any = None,
    dropout_prob: float = 0.0,
    dropout_keep: Any = None,
    kv_lengths: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
) -> OracleGrads:
    """Analytic gradients of ``sum(attention(...).output * d_output)``, derived by hand.

    With ``P`` the post-sink probabilities and ``W = P * keep / (1 - p)``:
    ``dV = W^T dO``; ``dW = dO V^T``; ``dP = dW * keep / (1 - p)``; the softmax (sink in
    the denominator, sink output dropped) gives ``dL = P * (dP - rowsum(P * dP))`` and
    ``d aux = -p_sink * rowsum(P * dP)``; ``dbias = dL``; the soft cap multiplies by
    ``1 - tanh(x / c) ** 2``; then ``dQ = scale * dX K`` and ``dK = scale * dX^T Q``.
    Masked keys have ``P = 0`` so they get no gradient; empty rows get none either.
    """
    x = _prepare(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        sliding_window=sliding_window,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux,
        dropout_prob=dropout_prob,
        dropout_keep=dropout_keep,
        kv_lengths=kv_lengths,
        mask_mod=mask_mod,
        score_mod=score_mod,
        score_params=score_params,
    )
    f = _forward(x)
    d_out = _f64(d_output)
    if d_out.shape != f.output.shape:
        raise ValueError(f"d_output must have the output's shape {f.output.shape}, got {d_out.shape}")
    dv = _sum_groups(np.einsum("bhts,bthd->bshd", f.weights, d_out), x.groups)
    d_weights = np.einsum("bthd,bshd->bhts", d_out, x.v)
    d_probs = d_weights if x.keep_scaled is None else d_weights * x.keep_scaled
    row_dot = (f.probs * d_probs).sum(axis=-1)  # (B, Hq, T)
    d_logits = f.probs * (d_probs - row_dot[..., None])
    d_aux = None if x.aux is None else -(f.sink_prob * row_dot).sum(axis=(0, 2))
    d_params = None
    if f.mod is not None:  # through the score_mod, to the scores before it and to its parameters
        d_logits, d_params = f.mod.pullback(d_logits)
    d_bias = None if x.bias is None else _reduce_to(d_logits, x.bias.shape)
    d_raw = d_logits if x.cap is None else d_logits * (1.0 - np.tanh(f.raw / x.cap) ** 2)
    dq = np.einsum("bhts,bshd->bthd", d_raw, x.k) * x.scale
    dk = _sum_groups(np.einsum("bhts,bthd->bshd", d_raw, x.q) * x.scale, x.groups)
    return OracleGrads(dq=dq, dk=dk, dv=dv, dbias=d_bias, dsoftmax_aux=d_aux, dscore_params=d_params)


def paged_mask_mod_grid(mask_mod: Any, seq: int, heads: int, q_pos: Any, s: int) -> npt.NDArray[np.bool_]:
    """A paged call's ``mask_mod`` on sequence ``seq``'s grid, as NumPy booleans ``(Hq, T, S)``: called
    once with int32 arrays ``(1,1,1)`` (seq), ``(1,Hq,1)`` (the heads), ``(T,1,1)`` (the query
    positions ``q_pos``) and ``(1,1,S)`` (the keys ``0..S-1``), as the contract allows (n = T)."""
    import jax.numpy as jnp

    rows = np.asarray(q_pos, np.int32).reshape(-1, 1, 1)
    heads_idx = jnp.arange(heads, dtype=jnp.int32).reshape(1, heads, 1)
    out = np.asarray(mask_mod(jnp.full((1, 1, 1), seq, jnp.int32), heads_idx, jnp.asarray(rows),
                              jnp.arange(s, dtype=jnp.int32).reshape(1, 1, s)))
    if out.dtype != np.bool_:
        raise ValueError(f"mask_mod must return booleans, got {out.dtype}")
    return np.transpose(np.broadcast_to(out, (rows.shape[0], heads, s)), (1, 0, 2))


def _paged_sequences(kv_lengths: Any, cu_q_lens: Any, num_seqs: Any) -> list[tuple[int, int, int]]:
    """``(first row, rows, keys)`` of every real sequence (s < num_seqs)."""
    lengths, cu, count = np.asarray(kv_lengths), np.asarray(cu_q_lens), int(np.asarray(num_seqs).reshape(-1)[0])
    return [(int(cu[s]), int(cu[s + 1]) - int(cu[s]), int(lengths[s])) for s in range(count)]


def _paged_mask(mask_mod: Any, seq: int, heads: int, t: int, n: int) -> npt.NDArray[np.bool_] | None:
    """``(1, Hq, t, n)``: the mask_mod of sequence ``seq``'s t queries (at ``n - t .. n - 1``) over its n keys.
    A query at a negative position (t > n) sees no key: it is evaluated at 0 (never a wrapped index)."""
    if mask_mod is None or t == 0 or n == 0:
        return None
    return paged_mask_mod_grid(mask_mod, seq, heads, np.maximum(np.arange(n - t, n), 0), n)[None]


def paged_visibility(
    kv_lengths: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    heads: int,
    *,
    sliding_window: int | None = None,
    mask_mod: Any = None,
) -> list[npt.NDArray[np.bool_]]:
    """Per real sequence s (< num_seqs), ``(Hq, q_len_s, kv_lengths[s])``: which of its keys each of
    its queries may see (causal, the window, the mask_mod ANDed)."""
    out = []
    for seq, (_, t, n) in enumerate(_paged_sequences(kv_lengths, cu_q_lens, num_seqs)):
        window = None if sliding_window is None else (int(sliding_window), 0)
        out.append(visibility(1, heads, t, n, causal=True, sliding_window=window,
                              mask=_paged_mask(mask_mod, seq, heads, t, n))[0])
    return out


def paged_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    *,
    kv_pages: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Any = None,
    mask_mod: Any = None,
) -> F64:
    """A ragged paged call in float64: ``q (num_tokens, Hq, D)`` -> ``(num_tokens, Hq, Dv)``.

    Sequence s (< num_seqs) owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``; its keys are
    the first ``kv_lengths[s]`` tokens of its pages, in page-table order; its queries are the
    last q_len of those positions, causal, each seeing itself and the ``sliding_window`` keys
    before it, and the keys ``mask_mod(seq, h, q_pos, kv_pos)`` allows, if given. Every other
    row is zero. ``kv_pages`` (combined layout) replaces k_pages/v_pages.
    """
    q64 = _f64(q)
    if kv_pages is not None:
        kv = _f64(kv_pages)
        k64, v64 = kv[:, :, 0::2], kv[:, :, 1::2]
    else:
        k64, v64 = _f64(k_pages), _f64(v_pages)
    page_size, dv = k64.shape[1], v64.shape[-1]
    table = np.asarray(page_table)
    out = np.zeros((q64.shape[0], q64.shape[1], dv))
    for seq, (start, t, length) in enumerate(_paged_sequences(kv_lengths, cu_q_lens, num_seqs)):
        if t == 0 or length == 0:
            continue
        pages = table[seq, : -(-length // page_size)]
        k_seq = k64[pages].reshape(-1, *k64.shape[2:])[:length]
        v_seq = v64[pages].reshape(-1, *v64.shape[2:])[:length]
        window = None if sliding_window is None else (int(sliding_window), 0)
        res = attention(q64[None, start:start + t], k_seq[None], v_seq[None], causal=True, sliding_window=window,
                        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
                        mask=_paged_mask(mask_mod, seq, q64.shape[1], t, length))
        out[start:start + t] = res.output[0]
    return out
