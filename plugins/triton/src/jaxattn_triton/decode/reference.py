"""What ``decode.ops.dense_decode`` computes, in NumPy float64: the reference beside the kernel.

Query ``i`` of sequence ``b`` sits at position ``pos = L_b - T + i``, ``L_b`` its length
(``kv_lengths[b]`` clamped to ``0..S``, or S); it sees the keys ``j < L_b`` with, for a window
``(left, right)``, ``pos - left <= j <= pos + right`` on each bounded side (causal: ``right``
at most 0). A query at a negative position is no token of its sequence and sees nothing. The
logits are ``softmax_scale * q k`` (``D ** -0.5`` by default), capped to
``cap * tanh(logit / cap)`` with ``logits_soft_cap``; ``sinks`` (Hq,) join each row's softmax
denominator and not its log-sum-exp. A row that sees no key is zeros, its log-sum-exp -inf.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["dense_decode_reference"]


def dense_decode_reference(
    q: Any, k: Any, v: Any, kv_lengths: Any = None, *, causal: bool, softmax_scale: float | None = None,
    logits_soft_cap: float | None = None, window: int | tuple[int | None, int | None] | None = None,
    sinks: Any = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(out (B, T, Hq, Dv), lse (B, Hq, T))`` in float64 of q ``(B, T, Hq, D)`` over a dense
    ``k (B, S, Hkv, D)``, ``v (B, S, Hkv, Dv)`` (GQA: query head h reads KV head ``h // (Hq // Hkv)``)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    lengths = np.full((b,), s) if kv_lengths is None else np.clip(np.asarray(kv_lengths), 0, s)
    pair = (window, window) if isinstance(window, int) else window
    left, right = (None, None) if pair is None else pair
    if causal:
        right = 0 if right is None else min(right, 0)
    keys, vals = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)  # (B, S, Hq, D|Dv)
    x = np.einsum("bthd,bshd->bhts", q, keys) * (d**-0.5 if softmax_scale is None else softmax_scale)
    if logits_soft_cap is not None:
        x = logits_soft_cap * np.tanh(x / logits_soft_cap)
    pos = lengths[:, None, None, None] - t + np.arange(t)[None, None, :, None]  # (B, 1, T, 1)
    j = np.arange(s)[None, None, None, :]
    seen = (j < lengths[:, None, None, None]) & (pos >= 0)
    if left is not None:
        seen &= j >= pos - left
    if right is not None:
        seen &= j <= pos + right
    x = np.where(seen, x, -np.inf)
    top = x.max(axis=3, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(x - top)
    total = e.sum(axis=3, keepdims=True)
    denominator = total if sinks is None else total + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - top)
    out = np.einsum("bhts,bshd->bthd", e / np.where(denominator > 0, denominator, 1.0), vals)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + top[..., 0], -np.inf)
    return out, lse
