"""What jaxattn-pallas's kernel families share, importing no jax (importing this costs nothing):
the TPU tile rules (``flash/`` and the splash plugin) and the base class of the two paged impls
(``ragged/`` and ``decode/``).

Tiling, in pure Python: a sequence axis gets a padded length, a forward tile and a
backward tile. The rules the TPU kernels share: a tile is a multiple of its ``quantum`` (128
lanes for keys; for query rows 8 sublanes of 32-bit values, 16 for 16-bit dtypes, or 128 where a
kernel puts queries on lanes), it divides the padded length, and it is no longer than the
sequence. Lengths that fit none of these are padded (the caller masks the padding). The kernels'
own default of 128 everywhere leaves TPUs dominated by per-grid-step overhead, so tiles grow up
to ``cap`` (512 by default) where that costs little padding. The rules are unit-tested on their own.

The paged impls' base (``PallasPagedBase``), what the paged mechanisms' impls on TPU (op kind
"paged") share: ``ragged_page_attention_v3`` (:mod:`jaxattn_pallas.ragged.impl`) and
``page_attention`` (:mod:`jaxattn_pallas.decode.impl`). Ranking on a TPU: the ragged kernel
(priority 100) is the faster one for decode steps too (no transpose of the pool per step, no
extra terms for float32) and takes every call shape, so "auto" runs it first; ``page_attention``
(priority 50) serves that name, and "auto" in TPU interpret mode (where the ragged kernel cannot
run on jax 0.10.2-0.12.1: its rules ask the interpreter) picks it for decode steps. Both rank
above jaxattn-vanilla's pure-JAX references (priority 0), which provide the same names on every
platform. Neither imports a Pallas module until a call runs (interpret mode's question to the
interpreter aside).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from jaxattn.backend import PagedAttentionImpl, PagedProblem

__all__ = [
    "DEFAULT_CAP",
    "LANES",
    "MAX_PAD_FRACTION",
    "PallasPagedBase",
    "axis_tiling",
    "divisor_tile",
    "round_up",
    "sublanes_for",
]

LANES = 128
#: Largest default tile: 512x512 float32 logits (1 MiB) plus the q/k/v tiles, double buffered,
#: stay well inside the scoped VMEM of every TPU generation for head dims <= 256.
DEFAULT_CAP = 512
#: A larger tile is taken only when it pads the sequence by at most this fraction.
MAX_PAD_FRACTION = 1 / 8


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def sublanes_for(itemsize: int) -> int:
    """Rows per query tile quantum: 8 for 32-bit dtypes, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // itemsize)


def default_tile(n: int, quantum: int, cap: int) -> int:
    """One tile if the sequence fits under ``cap``, else the largest power-of-two multiple
    of 128 up to ``cap`` that pads ``n`` by at most :data:`MAX_PAD_FRACTION` (else 128)."""
    whole = round_up(n, quantum)
    if whole <= cap:
        return whole
    tile = cap
    while tile > LANES and round_up(n, tile) - n > n * MAX_PAD_FRACTION:
        tile //= 2
    return max(tile, LANES)


def divisor_tile(length: int, quantum: int, cap: int) -> int:
    """Largest multiple of ``quantum``, at most ``cap``, that divides ``length``."""
    return max((t for t in range(quantum, min(cap, length) + 1, quantum) if length % t == 0), default=quantum)


def axis_tiling(n: int, quantum: int, fwd: int | None, bwd: int | None, *, cap: int = DEFAULT_CAP,
              names: tuple[str, str], kernel: str) -> tuple[int, int, int]:
    """``(padded length, forward tile, backward tile)`` of one sequence axis of ``n``.

    Explicit tiles win, clamped to the padded length (a tile longer than the sequence is not
    an error); one that is not a positive multiple of ``quantum`` raises ``ValueError``
    naming ``names`` (the forward and backward option) and ``kernel``. Without a backward
    tile, the backward takes the largest tile that divides the forward's padded length.
    """
    whole = round_up(n, quantum)
    for name, value in zip(names, (fwd, bwd), strict=True):
        if value is not None and (value <= 0 or value % quantum):
            raise ValueError(f"{name}={value} must be a positive multiple of {quantum} for the {kernel}")
    fwd = None if fwd is None else min(fwd, whole)
    bwd = None if bwd is None else min(bwd, whole)
    if fwd is None:
        fwd = default_tile(n, quantum, cap) if bwd is None else bwd
    if bwd is None:
        length = round_up(n, fwd)
        return length, fwd, divisor_tile(length, quantum, cap)
    return round_up(n, math.lcm(fwd, bwd)), fwd, bwd


# -- the paged impls' base ----------------------------------------------------------------------

_REFERENCE = "impl='vanilla_paged' (jaxattn-vanilla's pure-JAX reference) runs it, and impl='auto' picks it"


def _generation(platform: str, device: Any, interpret: bool) -> int | None:
    """The TPU generation number (4 for v4, 5 for v5e/v5p...) of a real TPU host, else None."""
    gen = getattr(device, "tpu_generation", None)
    if platform != "tpu" or interpret or getattr(device, "platform", None) != "tpu" or not gen:
        return None
    match = re.match(r"v(\d+)", gen)
    return int(match.group(1)) if match else None


class PallasPagedBase(PagedAttentionImpl):
    """What both share: the float32 softmax, the advice on a decline."""

    #: Why JAX's kernel does not read jaxattn's quantized caches (Feature.QUANTIZED_KV is not declared).
    quantized_why: ClassVar[str] = ""

    def instead(self) -> str:
        """Where a call this backend declines runs: jaxattn-vanilla's reference."""
        return "instead: " + _REFERENCE

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        """The kernel's own limits beyond the declarations (each with its own advice)."""
        return []

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        declared = self.declared_reasons(problem)
        # The base class starts from the declarations and adds the op kind's own rules (the mesh).
        rest = super().not_supported_reasons(problem)[len(declared):]
        own = []
        if self.metadata.softmax_dtype != "float32":
            own.append(f"the kernel computes the softmax in float32; softmax_dtype={self.metadata.softmax_dtype!r} "
                       "cannot be honoured")
        if problem.kv_dtype is not None and self.quantized_why:
            own.append(f"a cache of dtype {problem.kv_dtype}: {self.quantized_why}")
        mine = [f"{r}; {self.instead()}" for r in declared + own]
        return mine + self.kernel_reasons(problem) + rest

    def generation(self) -> int | None:
        return _generation(self.platform, self.device, self.metadata.interpret)
