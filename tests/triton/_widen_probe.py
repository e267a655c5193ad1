"""A Triton kernel that runs ``paged/widen.py`` on a 16 x 16 tile (``test_widening_is_exact``).

Imported on first use, after ``._env`` has chosen the interpreter or the GPU (triton reads
``TRITON_INTERPRET`` when a kernel is decorated).
"""

# mypy: allow-untyped-defs
import triton
import triton.language as tl

from jaxattn_triton.paged.widen import join_lanes, widen, word_lanes


@triton.jit
def probe(X, W, Y, Z, FMT: tl.constexpr, ASM: tl.constexpr):
    """``Y = widen(X)`` elementwise (K's path) and ``Z`` the same values from int32 words ``W`` (V's)."""
    rows = tl.arange(0, 16)
    y = widen(tl.load(X + rows[:, None] * 16 + tl.arange(0, 16)[None, :]), FMT, Y.dtype.element_ty, ASM)
    tl.store(Y + rows[:, None] * 16 + tl.arange(0, 16)[None, :], y)
    w = tl.load(W + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
    e0, e1, e2, e3 = word_lanes(w, FMT, Z.dtype.element_ty, ASM)
    z = join_lanes(e0, e1, e2, e3, 16, 16)
    tl.store(Z + rows[:, None] * 16 + tl.arange(0, 16)[None, :], z)
