"""Static description of one attention call, shared by every launcher.

An :class:`AttnSpec` holds what the kernels are specialised on (shapes, dtype,
features) and no arrays, so it is hashable: it keys compiled kernels, tuning results
and ``jax.custom_vjp``'s non-differentiable argument. Nothing here imports triton.
"""

from __future__ import annotations

import dataclasses
import math

Shape4 = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    """Shapes (BTHD layout) and features of one call.

    ``window`` is ``(left, right)`` relative to the bottom-right aligned query position,
    either side ``None`` when unbounded; ``causal`` is folded into it by
    :attr:`window_right`. ``mask_shape``/``bias_shape`` are rank-4 shapes broadcastable
    to ``(B, Hq, T, S)`` (each dim 1 or full). ``mod_shape``: with a mask_mod, the leading
    ``(B|1, Hq|1)`` of its packed bits (``jaxattn.masks.mask_bits``), into which the call's
    causal rule, window, segment ids and mask are folded (those fields are then unset).
    ``alibi``: a ``masks.alibi`` score_mod, its ``(Hq,)`` slopes an input of the kernels.
    """

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    softmax_scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    mask_shape: Shape4 | None = None
    bias_shape: Shape4 | None = None
    segments: bool = False
    sinks: bool = False
    mod_shape: tuple[int, int] | None = None
    alibi: bool = False

    def __post_init__(self) -> None:
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q={self.heads_q} must be a multiple of heads_kv={self.heads_kv}")
        full = (self.batch, self.heads_q, self.seq_q, self.seq_k)
        for name, shape in (("mask", self.mask_shape), ("bias", self.bias_shape)):
            if shape is not None and (
                len(shape) != 4 or any(d not in (1, f) for d, f in zip(shape, full, strict=True))
            ):
                raise ValueError(f"{name} shape {shape} does not broadcast to {full}")

    @property
    def words(self) -> int:
        """int32 words of a mask_mod's bits per query row: 32 keys each."""
        return -(-self.seq_k // 32)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def window_left(self) -> int | None:
        return None if self.window is None else self.window[0]

    @property
    def window_right(self) -> int | None:
        right = None if self.window is None else self.window[1]
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return right

    @property
    def unbounded(self) -> int:
        # Larger than any distance between a query position and a key, plus a tile:
        # the kernels' range arithmetic then needs no "unbounded" branch.
        return self.seq_q + self.seq_k + 1024

    def band_fraction(self) -> float:
        """Fraction of the T x S score matrix inside the causal/window band (for FLOPs)."""
        left, right = self.window_left, self.window_right
        diag = self.seq_k - self.seq_q
        seen = 0
        for i in range(self.seq_q):
            lo = 0 if left is None else max(0, i + diag - left)
            hi = self.seq_k - 1 if right is None else min(self.seq_k - 1, i + diag + right)
            seen += max(0, hi - lo + 1)
        return seen / (self.seq_q * self.seq_k)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides, 0 for size-1 dims so they broadcast in the kernels."""
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step if dim != 1 else 0)
        step *= dim
    return tuple(reversed(strides))


def block_dim(d: int) -> int:
    """Head dims that are not a power of two are padded (masked) to the next one."""
    return max(16, 1 << math.ceil(math.log2(d)))
