"""From jaxattn's masking rules to ``jax.nn.dot_product_attention``'s arguments (NumPy only).

jaxattn aligns ``causal`` and ``sliding_window`` bottom-right: query ``i`` stands at key
position ``i' = i + S - T`` (the KV-cache convention, so a decode step sees every key).
``jax.nn`` aligns both top-left: its ``is_causal`` keeps ``j <= i`` and its
``local_window_size=(l, r)`` keeps ``i - l <= j <= i + r``. Both rules keep, for each query,
one interval of keys, so either can be written as a *band* ``i + lo <= j <= i + hi`` in
top-left coordinates, and that band is what we hand to ``jax.nn``.

Everything here is static (shapes and Python ints, or concrete segment ids), so it runs at
trace time and costs nothing in the compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Band",
    "band_row_valid",
    "kv_band_restricts",
    "padding_lengths",
    "structural_band",
]

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int32]


@dataclasses.dataclass(frozen=True)
class Band:
    """Keys ``j`` with ``i + lo <= j <= i + hi`` (top-left coordinates); None = unbounded side.

    At least one side is bounded, and a bounded side excludes at least one (query, key)
    pair: sides that exclude nothing are dropped, so ``Band`` never costs a useless mask.
    """

    lo: int | None
    hi: int | None

    @property
    def is_top_left_causal(self) -> bool:
        """Exactly ``jax.nn``'s ``is_causal=True`` (``j <= i``)."""
        return self.lo is None and self.hi == 0

    def local_window_size(self, t: int, s: int) -> tuple[int, int]:
        """The ``(left, right)`` that ``jax.nn`` reads as ``i - left <= j <= i + right``.

        An unbounded side becomes the smallest size that admits every key: ``t - 1`` on the
        left (query ``t - 1`` still reaches key 0), ``s - 1`` on the right.
        """
        left = t - 1 if self.lo is None else -self.lo
        right = s - 1 if self.hi is None else self.hi
        return left, right


def structural_band(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> Band | None:
    """The band of ``causal`` and ``sliding_window=(left, right)`` for T queries and S keys.

    Bottom-right: ``j <= i'`` (causal) and ``i' - left <= j <= i' + right`` with
    ``i' = i + d``, ``d = S - T``; so ``lo = d - left`` and ``hi = d + right`` (causal caps
    ``hi`` at ``d``). Returns None when nothing is excluded (e.g. causal decode, T = 1).
    """
    d = s - t
    lo: int | None = None
    hi: int | None = None
    if window is not None:
        left, right = window
        lo, hi = d - left, d + right
    if causal:
        hi = d if hi is None else min(hi, d)
    # j >= i + lo holds for every j >= 0 and i <= t - 1 exactly when t - 1 + lo <= 0.
    if lo is not None and t - 1 + lo <= 0:
        lo = None
    # j <= i + hi holds for every j <= s - 1 and i >= 0 exactly when hi >= s - 1.
    if hi is not None and hi >= s - 1:
        hi = None
    if lo is None and hi is None:
        return None
    return Band(lo, hi)


def kv_band_restricts(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> bool:
    """Whether causal / the window can hide a key that ``kv_lengths`` alone leaves visible.

    With per-sequence lengths L (``0 <= L <= S``) query ``i`` sits at ``i' = L - T + i`` and
    sees keys ``j < L``; then (over every L):

    * causal ``j <= i'`` cuts only when T > 1 (for T = 1, ``i' = L - 1``);
    * the window's left edge ``j >= i' - left`` only when ``left < S - 1`` (``i' <= S - 1``);
    * its right edge ``j <= i' + right`` only when ``right < T - 1`` (``i' + right >= L - 1``
      for every query exactly when ``right >= T - 1``).

    False means ``key_value_seq_lengths`` alone is the whole rule; True means the rule
    depends on each sequence's length, and is spelled out per sequence.
    """
    if causal and t > 1:
        return True
    if window is not None:
        left, right = window
        return left < s - 1 or right < t - 1
    return False


def band_row_valid(
    band: Band | None, t: int, s: int, kv_lengths: IntArray | None = None
) -> BoolArray:
    """Whether each query row sees at least one key: ``(T,)``, or ``(B, T)`` with lengths.

    Keys ``j >= kv_lengths[b]`` are padding. A row's visible keys form the interval
    ``[max(0, i + lo), min(S, kv_len) - 1 ∧ i + hi]``, so this is exact and O(B * T).
    """
    i = np.arange(t)
    first = np.zeros(t, dtype=np.int64) if band is None or band.lo is None else np.maximum(0, i + band.lo)
    last = np.full(t, s - 1, dtype=np.int64) if band is None or band.hi is None else np.minimum(s - 1, i + band.hi)
    if kv_lengths is None:
        return np.asarray(first <= last)
    limit = np.asarray(kv_lengths, dtype=np.int64)[:, None] - 1
    return np.asarray(first[None, :] <= np.minimum(last[None, :], limit))


def _prefix_run(ids: npt.NDArray[Any], value: Any) -> int:
    """Length of the leading run of ``value`` in the 1-d array ``ids``."""
    differs = np.flatnonzero(ids != value)
    return int(differs[0]) if differs.size else int(ids.size)


def padding_lengths(q_ids: npt.ArrayLike, kv_ids: npt.ArrayLike) -> tuple[IntArray, IntArray] | None:
    """``(q_lengths, kv_lengths)`` when segment ids only mark right padding, else None.

    Segment ids say: query ``t`` sees key ``s`` iff ``q_ids[b, t] == kv_ids[b, s]``. That
    equals ``jax.nn``'s ``query_seq_lengths`` / ``key_value_seq_lengths`` rule
    (``t < Lq[b] and s < Lk[b]``) exactly when, per batch row, the queries and keys start
    with a run of one id ``c`` (lengths ``Lq`` and ``Lk >= 1``) and no other pair matches:
    ``c`` does not occur after either run, and the ids after the two runs share no value.
    Padded queries then see nothing, as in ``jax.nn`` (which gives them zeros).

    A batch row with no real key (``Lk = 0``) returns None: cuDNN's padding path has no
    defined answer for empty key sets, and the mask path handles them exactly.
    """
    q = np.asarray(q_ids)
    kv = np.asarray(kv_ids)
    if q.ndim != 2 or kv.ndim != 2 or q.shape[0] != kv.shape[0]:
        raise ValueError(f"segment ids must be (B, T) and (B, S), got {q.shape} and {kv.shape}")
    q_len = np.empty(q.shape[0], dtype=np.int32)
    kv_len = np.empty(q.shape[0], dtype=np.int32)
    for row, (qb, kb) in enumerate(zip(q, kv, strict=True)):
        c = qb[0]
        lq, lk = _prefix_run(qb, c), _prefix_run(kb, c)
        q_rest, kv_rest = qb[lq:], kb[lk:]
        if lk == 0 or c in kv_rest or c in q_rest or np.intersect1d(q_rest, kv_rest).size:
            return None
        q_len[row], kv_len[row] = lq, lk
    return q_len, kv_len
