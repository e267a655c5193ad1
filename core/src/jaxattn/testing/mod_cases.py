"""Conformance cases of masks and scores as programs (``mask_mod``, ``score_mod``; docs/masks.md).

Each ``ModCase`` is a small problem with a mask_mod and/or a score_mod named by a recipe: every
constructor of ``jaxattn.masks``, user functions of ``b`` and ``h``, compositions, and score_mods
whose captured arrays (ALiBi slopes, a relative-bias table) are differentiated. A recipe builds
its function from the case's arrays, so under ``jax.jit`` the captured arrays are traced, as in a
model. The shapes repeat (two of them), so that a backend compiles few programs.

Importing this module imports NumPy only; the recipes import jax (and ``jaxattn.masks``) when
they run.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .cases import Case, make_inputs

__all__ = ["MOD_CASES", "MOD_PARAMS", "ModCase", "build_mods", "make_mod_inputs", "score_factory"]


@dataclasses.dataclass(frozen=True)
class ModCase:
    """A base ``Case`` (shapes and the static rules it adds, ANDed with the mask_mod) and the
    recipes of its mask_mod and score_mod (keys of ``MASK_MODS`` / ``SCORE_MODS``)."""

    name: str
    base: Case
    mask_mod: str | None = None
    score_mod: str | None = None

    def describe(self) -> str:
        return f"{self.base.describe()} mask_mod={self.mask_mod} score_mod={self.score_mod}"


Arrays = Mapping[str, Any]


def _masks() -> Any:
    from jaxattn import masks

    return masks


def _lambda_bh(a: Arrays) -> Any:
    # A user's function of b and h: per sequence and KV head (h // 2 with Hq = 4, Hkv = 2) every
    # fourth key is hidden from every query (those keys are poisoned), and a per-head causal offset.
    return lambda b, h, q, kv: ((kv + b + h // 2) % 4 != 3) & (q + h >= kv)


#: mask_mod recipes: the case's arrays -> a mask_mod.
MASK_MODS: dict[str, Callable[[Arrays], Any]] = {
    "causal": lambda a: _masks().causal(),
    "sliding_window": lambda a: _masks().sliding_window(3, 1),
    "chunked_causal": lambda a: _masks().chunked_causal(4),
    "prefix_lm": lambda a: _masks().prefix_lm(a["prefix_lengths"]),
    "document": lambda a: _masks().and_(_masks().causal(), _masks().document(a["doc_q_ids"], a["doc_kv_ids"])),
    "lambda_bh": _lambda_bh,
    "or_composed": lambda a: _masks().or_(_masks().sliding_window(1, 0), lambda b, h, q, kv: kv < h + 2 * b + 1),
    # T < S: raw positions, the last S - T - 4 keys are seen by no query (poisoned).
    "cross": lambda a: (lambda b, h, q, kv: kv <= q + 4),
}


def _alibi(a: Arrays) -> Any:
    # The constructor: a backend may recognise it (the Triton flash kernels add its term in registers).
    return _masks().alibi(a["slopes"])


def _relative(a: Arrays) -> Any:
    import jax.numpy as jnp

    table = a["rel_table"]  # (Hq, 9): a learned bias per head and clipped distance -4..4

    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return 2.0 * jnp.tanh(score / 2.0) + table[h, jnp.clip(kv - q, -4, 4) + 4]

    return score_mod


#: score_mod recipes: the case's arrays -> a score_mod.
SCORE_MODS: dict[str, Callable[[Arrays], Any]] = {
    "alibi": _alibi,
    "relative": _relative,
    "of_b_and_h": lambda a: (lambda score, b, h, q, kv: score * (1.0 + 0.25 * h) - 0.5 * b),
}

#: The float32 parameters each score_mod recipe captures (differentiated by the suite).
MOD_PARAMS: dict[str, tuple[str, ...]] = {"alibi": ("slopes",), "relative": ("rel_table",), "of_b_and_h": ()}

_SQUARE = Case("mods", b=2, t=12, s=12, hq=4, hkv=2, d=16)
_CROSS = Case("mods_cross", b=2, t=5, s=12, hq=4, hkv=2, d=16)

MOD_CASES: tuple[ModCase, ...] = (
    ModCase("mm_causal", _SQUARE, mask_mod="causal"),
    ModCase("mm_sliding_window", _SQUARE, mask_mod="sliding_window"),
    ModCase("mm_chunked_causal", _SQUARE, mask_mod="chunked_causal"),
    ModCase("mm_prefix_lm", _SQUARE, mask_mod="prefix_lm"),
    ModCase("mm_document", _SQUARE, mask_mod="document"),
    ModCase("mm_lambda_bh", _SQUARE, mask_mod="lambda_bh"),
    # ANDed with the call's own rules: causal=True (bottom-right, equal here) and a window.
    ModCase("mm_or_composed_causal_window", dataclasses.replace(_SQUARE, causal=True, sliding_window=(5, 0)),
            mask_mod="or_composed"),
    ModCase("mm_cross", _CROSS, mask_mod="cross"),
    ModCase("sm_alibi_causal", _SQUARE, mask_mod="causal", score_mod="alibi"),
    # After the soft cap and the bias; with a document mask.
    ModCase("sm_relative_cap_bias", dataclasses.replace(_SQUARE, logits_soft_cap=3.0, q_gain=2.0,
                                                         bias=(1, "H", "T", "S")),
            mask_mod="document", score_mod="relative"),
    ModCase("sm_of_b_and_h", _CROSS, score_mod="of_b_and_h"),
)


def make_mod_inputs(case: ModCase, dtype: str) -> dict[str, Any]:
    """``make_inputs(case.base, dtype)`` plus the arrays the recipes capture: ``prefix_lengths``
    (B,), ``doc_q_ids`` / ``doc_kv_ids`` (packed documents), ``slopes`` (Hq,), ``rel_table`` (Hq, 9)."""
    base = case.base
    out = make_inputs(base, dtype)
    rng = np.random.default_rng([zlib.crc32(case.name.encode()), 1])
    out["prefix_lengths"] = np.asarray([3, base.s - 2][: base.b] + [1] * max(0, base.b - 2), np.int32)
    for name, n in (("doc_q_ids", base.t), ("doc_kv_ids", base.s)):
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(2, n - 1), replace=False))
        out[name] = np.stack([np.searchsorted(cuts, np.arange(n), side="right")] * base.b).astype(np.int32)
    out["slopes"] = np.exp2(-np.arange(1, base.hq + 1, dtype=np.float64)).astype(np.float32)
    out["rel_table"] = rng.normal(size=(base.hq, 9)).astype(np.float32)
    return out


def build_mods(case: ModCase, arrays: Arrays) -> dict[str, Any]:
    """The call's ``mask_mod`` / ``score_mod`` keyword arguments, built from ``arrays``."""
    mods: dict[str, Any] = {}
    if case.mask_mod is not None:
        mods["mask_mod"] = MASK_MODS[case.mask_mod](arrays)
    if case.score_mod is not None:
        mods["score_mod"] = SCORE_MODS[case.score_mod](arrays)
    return mods


def score_factory(case: ModCase, arrays: Arrays) -> tuple[Callable[[Any], Any], dict[str, Any]] | None:
    """For the oracle: ``(params -> score_mod, params)`` with the recipe's captured parameters."""
    if case.score_mod is None:
        return None
    names = MOD_PARAMS[case.score_mod]
    params = {n: arrays[n] for n in names}
    recipe = SCORE_MODS[case.score_mod]
    return (lambda p: recipe({**arrays, **p})), params
