"""The conformance matrix: small attention problems, one or two features each, as data.

A ``Case`` describes shapes and features; ``make_inputs`` turns it into NumPy arrays
(already rounded to the dtype under test, so the float64 oracle sees exactly what the
backend sees). NumPy only: the matrix can be listed and checked without jax.

Every feature case is built so that the feature changes the result (soft caps that
actually clip, windows that actually cut, segments that actually split); the project's
own tests check that, so a backend that ignores a feature cannot pass.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_CASES",
    "DEFAULT_TOLERANCES",
    "FULL_CASES",
    "SWEEP_SEED_ENV",
    "Case",
    "DtypeTolerance",
    "Tolerance",
    "cases_for",
    "decode_sweep",
    "magnitude_inputs",
    "make_inputs",
    "round_to_dtype",
    "static_features",
]

Level = Literal["default", "full"]
# A bias/mask shape as labels: "B", "H", "T", "S" take the full size, 1 stays 1.
ShapeSpec = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|``.

    The atol term is relative to the largest expected value once that exceeds 1, so one
    tolerance serves outputs (O(1)) and gradients (which can be larger).
    """

    atol: float
    rtol: float


@dataclasses.dataclass(frozen=True)
class DtypeTolerance:
    forward: Tolerance
    grad: Tolerance


# Inputs are rounded to the dtype before the oracle sees them, so these bound only the
# backend's arithmetic: float32 accumulation, and for the 16-bit types the rounding of the
# probabilities and of the output (bfloat16 keeps 8 mantissa bits: ~4e-3 relative).
DEFAULT_TOLERANCES: Mapping[str, DtypeTolerance] = {
    "float64": DtypeTolerance(Tolerance(1e-10, 1e-10), Tolerance(1e-9, 1e-9)),
    "float32": DtypeTolerance(Tolerance(1e-4, 1e-4), Tolerance(2e-4, 2e-4)),
    "float16": DtypeTolerance(Tolerance(3e-3, 3e-3), Tolerance(1e-2, 1e-2)),
    "bfloat16": DtypeTolerance(Tolerance(2e-2, 2e-2), Tolerance(5e-2, 5e-2)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem of the matrix (shapes, features; the values come from ``seed``)."""

    name: str
    b: int = 2
    t: int = 8
    s: int = 8
    hq: int = 2
    hkv: int = 2
    d: int = 16
    dv: int | None = None  # None: same as d
    causal: bool = False
    mask: ShapeSpec | None = None
    empty_rows: bool = False  # some (b, t) rows of the mask see no key at all
    bias: ShapeSpec | None = None
    sliding_window: int | tuple[int, int] | None = None
    segments: bool = False
    logits_soft_cap: float | None = None
    sinks: bool = False
    softmax_scale: float | None = None
    neg_inf_bias_rows: bool = False  # bias rows 1 and T-1 are all -inf: those queries see nothing
    kv_lengths: tuple[int, ...] | None = None  # per-batch key lengths (a dense KV cache of capacity S)
    q_gain: float = 1.0  # multiplies q, to push logits where a soft cap bites
    grad: bool = True  # also part of the gradient tests
    seed: int = 0

    @property
    def value_dim(self) -> int:
        return self.d if self.dv is None else self.dv

    def describe(self) -> str:
        defaults = {f.name: f.default for f in dataclasses.fields(Case)}
        shapes = {"name", "b", "t", "s", "hq", "hkv", "d", "dv", "grad", "seed"}
        # `is not` / type check: True == 1.0, so a plain comparison would hide causal=True
        feats = [
            name
            for name, default in defaults.items()
            if name not in shapes and (type(getattr(self, name)) is not type(default) or getattr(self, name) != default)
        ]
        return (
            f"{self.name}: B={self.b} T={self.t} S={self.s} Hq={self.hq} Hkv={self.hkv} "
            f"D={self.d} Dv={self.value_dim} [{', '.join(feats) or 'plain'}]"
        )


# Small shapes: the suite must take seconds per backend on a CPU. Odd sizes, T < S, T > S
# and T == 1 are all here; the full level adds larger and more combined problems.
DEFAULT_CASES: tuple[Case, ...] = (
    Case("plain"),
    Case("odd_sizes", b=1, t=7, s=13, hq=3, hkv=3, d=5),
    Case("causal", t=9, s=9, causal=True),
    Case("causal_t_lt_s", t=5, s=12, causal=True),
    Case("causal_t_gt_s", t=6, s=4, causal=True),  # the first T - S queries see nothing
    Case("decode", t=1, s=11, hq=4, hkv=2, causal=True),
    Case("gqa", hq=6, hkv=2),
    Case("mqa_causal", hq=4, hkv=1, t=7, s=10, causal=True),
    Case("value_dim", d=16, dv=8),
    Case("mask", mask=("B", 1, "T", "S")),
    Case("mask_per_head", hq=4, hkv=2, mask=("B", "H", "T", "S")),
    Case("bias", bias=("B", "H", "T", "S")),
    Case("bias_broadcast", hq=4, hkv=2, bias=(1, "H", 1, "S")),
    Case("sliding_window", t=12, s=12, sliding_window=(3, 2)),
    Case("window_causal_cross", t=6, s=10, sliding_window=4, causal=True),
    Case("segment_ids", t=10, s=10, segments=True),
    Case("soft_cap", logits_soft_cap=2.0, q_gain=4.0),
    Case("sinks", hq=4, hkv=2, sinks=True),
    Case("softmax_scale", softmax_scale=0.37),
    Case("empty_rows", mask=("B", 1, "T", "S"), empty_rows=True),
    # A whole query row of -inf bias is an empty row: zeros in the output and every gradient.
    Case("bias_neg_inf_rows", t=6, s=7, hq=4, hkv=2, bias=("B", "H", "T", "S"), neg_inf_bias_rows=True),
    # A dense KV cache of capacity S with per-sequence lengths: decode, and speculative decoding
    # whose first query sits before the cache's start (length 2 < T = 3: that row sees nothing).
    Case("kv_lengths_decode", t=1, s=12, hq=4, hkv=2, causal=True, kv_lengths=(5, 12)),
    Case("kv_lengths_spec", t=3, s=16, hq=4, hkv=1, causal=True, kv_lengths=(2, 9)),
    # GQA decode over a cache of 64: the shape at which jaxlib 0.10.2's XLA:CPU miscompiled a
    # multiply-and-reduce decode kernel (only in a forward-only program at default options).
    Case("decode_gqa_s64", b=1, t=1, s=64, hq=4, hkv=2, d=16, causal=True),
    Case(
        "combined",
        b=2,
        t=6,
        s=9,
        hq=4,
        hkv=2,
        d=8,
        causal=True,
        mask=("B", 1, "T", "S"),
        bias=(1, "H", "T", "S"),
        sliding_window=(4, 2),  # right > 0 so that causal still cuts
        segments=True,
        logits_soft_cap=3.0,
        sinks=True,
        q_gain=2.0,
    ),
)

FULL_CASES: tuple[Case, ...] = (
    *DEFAULT_CASES,
    Case("large", b=3, t=64, s=64, hq=4, hkv=4, d=64, seed=1),
    Case("large_causal_gqa", b=2, t=48, s=80, hq=8, hkv=2, d=64, causal=True, seed=2),
    Case("head_dim_128", b=1, t=16, s=16, hq=2, hkv=1, d=128, seed=3),
    Case("odd_head_dim_causal", b=1, t=11, s=11, hq=2, hkv=2, d=7, dv=3, causal=True),
    Case("decode_mqa_window", t=1, s=33, hq=8, hkv=1, sliding_window=(8, 0), causal=True),
    Case("key_padding_mask", t=9, s=12, mask=("B", 1, 1, "S")),
    Case("mask_2d", mask=("T", "S")),
    Case("bias_2d", bias=("T", "S")),
    Case("bias_batch", bias=("B", 1, "T", "S")),
    Case("window_int", t=16, s=16, sliding_window=3),
    Case("window_left_only", t=10, s=14, sliding_window=(2, 0)),
    Case("segments_causal", t=12, s=12, segments=True, causal=True),
    Case("segments_cross", t=6, s=11, segments=True),
    Case("soft_cap_bias", logits_soft_cap=1.5, q_gain=3.0, bias=("B", "H", "T", "S")),
    Case("sinks_causal_mqa", hq=4, hkv=1, causal=True, sinks=True),
    Case("empty_rows_sinks", mask=("B", 1, "T", "S"), empty_rows=True, sinks=True),
    Case("empty_rows_bias", mask=("B", "H", "T", "S"), empty_rows=True, bias=("B", "H", "T", "S")),
    Case("t_gt_s_window", t=9, s=5, sliding_window=(1, 1)),
    Case("kv_lengths_empty", t=1, s=8, kv_lengths=(0, 4)),
    Case("kv_lengths_window", t=2, s=20, hq=4, hkv=2, causal=True, sliding_window=(4, 2), kv_lengths=(7, 20)),
    Case("kv_lengths_sinks_cap", t=1, s=16, hq=2, hkv=1, causal=True, kv_lengths=(3, 11), sinks=True,
         logits_soft_cap=2.0, q_gain=3.0),
)


def cases_for(level: Level) -> tuple[Case, ...]:
    """The matrix of a level: "default" (seconds) or "full" (a minute or so on a CPU)."""
    if level == "default":
        return DEFAULT_CASES
    if level == "full":
        return FULL_CASES
    raise ValueError(f"conformance level must be 'default' or 'full', got {level!r}")


#: Environment variable that picks the decode sweep's seed (default 0): ``decode_sweep(seed)``.
SWEEP_SEED_ENV = "JAXATTN_SWEEP_SEED"


def decode_sweep(seed: int, count: int = 4) -> tuple[Case, ...]:
    """``count`` random decode-shaped cases drawn from ``seed`` (the same seed, the same cases).

    Shapes a serving loop makes and a small fixed matrix misses: D 16-128, Hkv 1, 2 or 8, GQA
    groups of 1, 2 or 4, caches of odd and even sizes (64 and 512 among them), T = 1..16
    queries, with and without causal and ``kv_lengths`` (lengths anywhere in 0..S, a query
    before the cache's start included). No mask, bias or segment ids: every decode backend
    takes these calls. The name carries the seed (``sweep_s{seed}_{i}``).
    """
    rng = np.random.default_rng([0x5EEB, seed])
    out = []
    for i in range(count):
        b = int(rng.integers(1, 4))
        hkv = int(rng.choice([1, 2, 8]))
        # The group and the cache's size take turns (so any 3 or 4 cases of a run span them all);
        # the seed shifts which goes with which.
        group = (2, 4, 1)[(i + seed) % 3]
        d = int(rng.choice([16, 32, 64, 80, 128]))
        s = (64, 512, int(rng.integers(17, 300)) | 1, int(rng.integers(10, 300)) & ~1)[i % 4]
        t = int(rng.integers(1, 17))
        causal = bool(rng.integers(2))
        lengths = tuple(int(n) for n in rng.integers(0, s + 1, size=b)) if rng.integers(2) else None
        out.append(Case(f"sweep_s{seed}_{i}", b=b, t=t, s=s, hq=hkv * group, hkv=hkv, d=d, causal=causal,
                        kv_lengths=lengths, seed=seed))
    return tuple(out)


def round_to_dtype(x: npt.ArrayLike, dtype: str) -> npt.NDArray[np.float64]:
    """Round float64 values to ``dtype`` (bfloat16 through ml_dtypes) and back to float64."""
    arr = np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        import ml_dtypes  # a dependency of jax; kept out of import time

        return arr.astype(ml_dtypes.bfloat16).astype(np.float64)
    return arr.astype(np.dtype(dtype)).astype(np.float64)


def magnitude_inputs(q: npt.NDArray[np.float64], k: npt.NDArray[np.float64], dtype: str) -> tuple[
        npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """``q (..., Hq, D)`` and ``k (..., Hkv, D)`` made into logits of any finite size
    (docs/contract.md; the conformance suites' ``test_logits_of_any_magnitude``), rounded to
    ``dtype``; with each query row's group and whether it is "hot".

    Heads 0 and 1 scale their rows by powers of two: 2^-100 .. 2^100 where the dtype holds
    them (float16: 2^-11 .. 2^11), so rows range from uniform to one-hot; row ``r`` (the
    leading axes flattened) of head ``h`` takes gain ``(2 r + h) % 8``. Heads 2 and up read KV
    head 1, whose keys are all one vector; their queries' and keys' components are 2^11 times
    integers 8 .. 15, so every score is exact in float32 whatever the order of its sum, and the
    scores of a row tie exactly near 2^35 (base-2 logits at a scale near 1), where half an ulp
    of the max overflows ``exp2``, in every dtype: the oracle's answer there is the mean of V.
    Groups: the gain's index, or 8 for the tied rows. Hot rows (gains above one, and the tied
    rows) have ill-conditioned gradients of q and k (a score's rounding times a huge q).
    """
    import ml_dtypes  # a dependency of jax; kept out of import time

    top = min(100, int(np.log2(float(ml_dtypes.finfo(dtype).max))) - 4)
    gains = np.array([-top, 0, top * 3 // 5, -top * 3 // 10, top, 7, -7, top // 5])
    rng = np.random.default_rng(7)
    lead = q.shape[:-2]
    group = np.full(q.shape[:-1], len(gains), dtype=np.int64)
    rows = np.arange(int(np.prod(lead))).reshape(lead)[..., None]
    group[..., :2] = (rows * 2 + np.arange(2)) % len(gains)
    q, k = q.copy(), k.copy()
    q[..., :2, :] *= np.exp2(gains[group[..., :2]])[..., None]
    q[..., 2:, :] = 2.0**11 * rng.integers(8, 16, q[..., 2:, :].shape)
    k[..., 1, :] = 2.0**11 * rng.integers(8, 16, k.shape[-1])
    hot = np.append(gains > 1, True)[group]
    return round_to_dtype(q, dtype), round_to_dtype(k, dtype), group, hot


def _resolve(spec: ShapeSpec, case: Case) -> tuple[int, ...]:
    sizes = {"B": case.b, "H": case.hq, "T": case.t, "S": case.s}
    return tuple(sizes[d] if isinstance(d, str) else int(d) for d in spec)


def _packed_segments(rng: np.random.Generator, b: int, n: int, segments: int = 3) -> np.ndarray:
    """Sorted ids in 0..segments-1 (packed sequences); every id present when n allows it."""
    out = np.empty((b, n), dtype=np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(segments - 1, n - 1), replace=False))
        out[row] = np.searchsorted(cuts, np.arange(n), side="right")
    return out


def make_inputs(case: Case, dtype: str) -> dict[str, Any]:
    """Arrays of ``case`` as float64 NumPy, rounded to ``dtype``; keys match the call's arguments.

    Always ``q, k, v, d_output``; plus ``mask``, ``bias``, ``q_segment_ids``,
    ``kv_segment_ids``, ``softmax_aux``, ``kv_lengths`` when the case uses them.
    ``softmax_aux`` is rounded to float32 (sinks are parameters, usually kept in float32); ``d_output`` is float32.
    """
    # crc32, not hash(): str hashes change per process, and failures must reproduce.
    rng = np.random.default_rng([zlib.crc32(case.name.encode()), case.seed])
    dv = case.value_dim
    out: dict[str, Any] = {
        "q": round_to_dtype(rng.normal(size=(case.b, case.t, case.hq, case.d)) * case.q_gain, dtype),
        "k": round_to_dtype(rng.normal(size=(case.b, case.s, case.hkv, case.d)), dtype),
        "v": round_to_dtype(rng.normal(size=(case.b, case.s, case.hkv, dv)), dtype),
        "d_output": round_to_dtype(rng.normal(size=(case.b, case.t, case.hq, dv)), "float32"),
    }
    if case.mask is not None:
        shape = _resolve(case.mask, case)
        mask = rng.random(shape) > 0.35
        # Keep every row attendable (one random key per row) unless rows should be empty.
        rows = mask.reshape(-1, shape[-1])
        rows[np.arange(rows.shape[0]), rng.integers(0, shape[-1], rows.shape[0])] = True
        if case.empty_rows:
            if len(shape) < 2 or shape[-2] < 2:
                raise ValueError(f"case {case.name}: empty_rows needs a mask with a T dim")
            mask[..., 1, :] = False
            mask[..., -1, :] = False
        out["mask"] = mask
    if case.bias is not None:
        out["bias"] = round_to_dtype(rng.normal(size=_resolve(case.bias, case)), dtype)
        if case.neg_inf_bias_rows:
            if len(case.bias) < 2 or _resolve(case.bias, case)[-2] < 2:
                raise ValueError(f"case {case.name}: neg_inf_bias_rows needs a bias with a T dim")
            out["bias"][..., 1, :] = -np.inf
            out["bias"][..., -1, :] = -np.inf
    if case.segments:
        out["q_segment_ids"] = _packed_segments(rng, case.b, case.t)
        out["kv_segment_ids"] = _packed_segments(rng, case.b, case.s)
    if case.sinks:
        out["softmax_aux"] = round_to_dtype(rng.normal(size=(case.hq,)), "float32")
    if case.kv_lengths is not None:
        if len(case.kv_lengths) != case.b or not all(0 <= n <= case.s for n in case.kv_lengths):
            raise ValueError(f"case {case.name}: kv_lengths must be B={case.b} values in 0..S={case.s}")
        out["kv_lengths"] = np.asarray(case.kv_lengths, dtype=np.int32)
    return out


def static_features(case: Case) -> dict[str, Any]:
    """The non-array keyword arguments of ``case``'s call (only those it sets)."""
    feats: dict[str, Any] = {}
    if case.causal:
        feats["causal"] = True
    if case.sliding_window is not None:
        feats["sliding_window"] = case.sliding_window
    if case.logits_soft_cap is not None:
        feats["logits_soft_cap"] = case.logits_soft_cap
    if case.softmax_scale is not None:
        feats["softmax_scale"] = case.softmax_scale
    return feats
