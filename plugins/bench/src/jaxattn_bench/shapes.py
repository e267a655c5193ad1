"""The shapes ``jaxattn bench`` and ``jaxattn tune`` time, and the FLOP count of each.

FLOPs follow CONTRIBUTING.md ("Measuring"): 4*B*H*T*S*D for a forward pass, halved for causal, and
forward+backward counted as 3.5x the forward (the backward does 2.5 forwards' worth of
matrix products). With a sliding window T*S becomes the query-key pairs the window leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["FWDBWD_FACTOR", "MODES", "BenchShape", "default_matrix", "parse_shape", "quick_matrix"]

FWDBWD_FACTOR = 3.5
MODES = ("fwd", "fwdbwd")
MODE_LABELS = {"fwd": "forward", "fwdbwd": "forward+backward"}


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One attention call to time: BTHD inputs, self-attention unless ``seq_q != seq_k``."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str
    #: ``(left, right)`` keys a query sees around its position (jaxattn's ``sliding_window``).
    sliding_window: tuple[int, int] | None = None
    #: ``logits_soft_cap``.
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q {self.heads_q} must be a multiple of heads_kv {self.heads_kv}")

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def label(self) -> str:
        """``B4 S4096 H32 D128 causal`` (``H32/8`` for GQA, ``T1 S4096`` for cross/decode)."""
        seq = f"S{self.seq_k}" if self.seq_q == self.seq_k else f"T{self.seq_q} S{self.seq_k}"
        heads = f"H{self.heads_q}" + (f"/{self.heads_kv}" if self.group > 1 else "")
        extra = "" if self.sliding_window is None else " window {},{}".format(*self.sliding_window)
        extra += "" if self.soft_cap is None else f" cap {self.soft_cap:g}"
        return f"B{self.batch} {seq} {heads} D{self.head_dim} {'causal' if self.causal else 'full'}{extra}"

    @property
    def call_kwargs(self) -> dict[str, Any]:
        """What ``jaxattn.attention`` takes for this call besides q, k and v."""
        kw: dict[str, Any] = {"causal": self.causal}
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
        if self.soft_cap is not None:
            kw["logits_soft_cap"] = self.soft_cap
        return kw

    def pairs(self) -> float:
        """Query-key pairs a head computes: T*S, halved for causal; a window's, counted."""
        if self.sliding_window is None:
            return self.seq_q * self.seq_k / (2 if self.causal else 1)
        left, right = self.sliding_window
        right = min(right, 0) if self.causal else right
        offset = self.seq_k - self.seq_q
        return float(sum(max(0, min(self.seq_k - 1, i + offset + right) - max(0, i + offset - left) + 1)
                         for i in range(self.seq_q)))

    def flops(self, mode: str) -> float:
        fwd = 4.0 * self.batch * self.heads_q * self.pairs() * self.head_dim
        return fwd * (FWDBWD_FACTOR if mode == "fwdbwd" else 1.0)

    def structs(self) -> tuple[Any, Any, Any]:
        """``jax.ShapeDtypeStruct``s of q, k, v (asks backends without allocating anything)."""
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.dtype)
        q = jax.ShapeDtypeStruct((self.batch, self.seq_q, self.heads_q, self.head_dim), dtype)
        kv = jax.ShapeDtypeStruct((self.batch, self.seq_k, self.heads_kv, self.head_dim), dtype)
        return q, kv, kv

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label}


def _heads_for(head_dim: int, heads: int | None) -> int:
    # The reference matrix (docs/bench.md): 32 heads, 16 for D=256 (keeps memory per token comparable).
    if heads is not None:
        return heads
    return 16 if head_dim >= 256 else 32


def default_matrix(
    *,
    dtype: str = "bfloat16",
    seqs: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
    head_dims: Sequence[int] = (128, 64, 256),
    tokens: int = 16384,
    heads: int | None = None,
    gqa: int = 4,
    gqa_head_dims: Sequence[int] = (128,),
    masks: Iterable[bool] = (False, True),
    batch: int | None = None,
) -> list[BenchShape]:
    """The reference matrix (docs/bench.md): B*S = ``tokens``, every D and S, causal and full, plus GQA ``gqa``:1.

    GQA is timed for ``gqa_head_dims`` only (D=128 by default): it changes K/V traffic, not
    the FLOPs, so one head dim shows it and keeps the full run short. D=128 comes first: a
    run cut short by ``--time-budget`` still has the shapes the targets are about.
    """
    masks = tuple(masks)
    out: list[BenchShape] = []
    for d in head_dims:
        h = _heads_for(d, heads)
        groups = [1] + ([gqa] if gqa > 1 and d in gqa_head_dims and h % gqa == 0 else [])
        for group in groups:
            for s in seqs:
                b = batch if batch is not None else max(1, tokens // s)
                out.extend(BenchShape(b, s, s, h, h // group, d, causal, dtype) for causal in masks)
    return out


def quick_matrix(dtype: str = "float32", masks: Iterable[bool] = (False, True)) -> list[BenchShape]:
    """Tiny shapes that compile and run in seconds on a CPU (CI, smoke tests)."""
    return default_matrix(dtype=dtype, seqs=(64, 128), head_dims=(32,), tokens=128, heads=4, gqa=4,
                          gqa_head_dims=(32,), masks=masks)


def parse_shape(text: str, *, dtype: str, masks: Iterable[bool]) -> list[BenchShape]:
    """``B,S,H,D`` or ``B,S,H,D,Hkv`` (or ``B,T,S,H,D,Hkv``), once per mask in ``masks``."""
    try:
        dims = [int(x) for x in text.replace("x", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected integers B,S,H,D[,Hkv] or B,T,S,H,D,Hkv") from None
    if len(dims) == 4:
        b, s, h, d = dims
        t, hkv = s, h
    elif len(dims) == 5:
        b, s, h, d, hkv = dims
        t = s
    elif len(dims) == 6:
        b, t, s, h, d, hkv = dims
    else:
        raise ValueError(f"--shape {text!r}: expected B,S,H,D[,Hkv] or B,T,S,H,D,Hkv")
    return [BenchShape(b, t, s, h, hkv, d, causal, dtype) for causal in masks]
