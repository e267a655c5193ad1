"""Launch descriptions of the attention kernels, independent of the array library.

Each function returns a :class:`Launch`: the ``@triton.jit`` kernel, its grid, the
shapes and dtypes of its outputs and the ``constexpr`` arguments. ``ops.py`` runs it
through ``jax_triton.triton_call`` and ``torch_launch.py`` on torch tensors, so both
launch exactly the same kernels with the same arguments.

Positional kernel arguments are always: the inputs in the order the function's
docstring gives (absent optional inputs replaced by a one-element dummy), then the
outputs. Strides are ``constexpr``: they follow from the static shapes, and constant
strides let Triton prove the 16-byte alignment it needs for vectorised loads
(jax_triton passes integer scalars without divisibility hints).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxattn_triton.spec import AttnSpec, block_dim, contiguous_strides

OutSpec = tuple[tuple[int, ...], str]


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# How the backward computes dQ (``Tiles.dq_mode``).
DQ_KERNEL = 0  # a dQ kernel of its own (recomputes Q K^T and dO V^T: seven products)
DQ_ATOMIC = 1  # the dK/dV kernel adds dS @ K into a float32 accumulator (five products)

# What one dK/dV launch computes (``dkdv(part=...)``).
PART_BOTH = 0
PART_DV = 1  # dV only
PART_DK = 2  # dK (and dBias, and dQ with DQ_ATOMIC) only


@dataclasses.dataclass(frozen=True)
class Tiles:
    fwd: KernelTiles
    dkdv: KernelTiles
    dq: KernelTiles
    # DQ_KERNEL or DQ_ATOMIC; with DQ_ATOMIC ``dq`` is unused.
    dq_mode: int = DQ_KERNEL
    # True: dV and dK in two launches (PART_DV, PART_DK) of the ``dkdv`` tiles, each
    # holding one accumulator (large head dims, whose two accumulators spill).
    dkdv_split: bool = False


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: Any
    grid: tuple[int, int, int]
    outputs: tuple[OutSpec, ...]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    zeroed: tuple[int, ...] = ()


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter, which has no inline PTX (``ASM`` off)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bthd_strides(prefix: str, shape: tuple[int, int, int, int]) -> dict[str, int]:
    sb, st, sh, _ = contiguous_strides(shape)
    names = ("b", "t", "h") if prefix in ("q", "o", "do", "dq") else ("b", "n", "h")
    return {f"stride_{prefix}{n}": s for n, s in zip(names, (sb, st, sh), strict=True)}


def _broadcast_strides(prefix: str, shape: tuple[int, int, int, int] | None) -> dict[str, int]:
    strides = (0, 0, 0, 0) if shape is None else contiguous_strides(shape)
    return {f"stride_{prefix}{n}": s for n, s in zip("bhts", strides, strict=True)}


def mod_lists_shape(spec: AttnSpec, tiles: KernelTiles, by_keys: bool = False) -> tuple[int, int, int, int]:
    """The tile lists' shape under a mask_mod (``ops.tile_lists``): per (B|1, Hq|1) and query tile
    (``by_keys``: key tile, the dK/dV kernel's), the count of partial and of full tiles of the
    other axis, then their indices, partial first; empty tiles are not listed."""
    assert spec.mod_shape is not None
    nq, nk = _cdiv(spec.seq_q, tiles.block_m), _cdiv(spec.seq_k, tiles.block_n)
    rows, cols = (nk, nq) if by_keys else (nq, nk)
    return (*spec.mod_shape, rows, cols + 2)


def _mod(spec: AttnSpec, tiles: KernelTiles, by_keys: bool = False) -> dict[str, Any]:
    """Strides of the mask_mod's bits ``(B|1, Hq|1, T, WORDS)``, the keys seen per (batch, KV
    head) ``(B|1, Hkv|1, WORDS)`` and the tile lists (zeros, and dummies, without one)."""
    if spec.mod_shape is None:
        zeros = ("stride_wb", "stride_wh", "stride_sb", "stride_sh", "stride_lb", "stride_lh", "stride_lr")
        return {**dict.fromkeys(zeros, 0), "HAS_MOD": False, "WORDS": 1}
    words = spec.words
    bb, bh = spec.mod_shape
    sb, sh, _ = contiguous_strides((bb, spec.heads_kv if bh > 1 else 1, words))
    lb, lh, lr, _ = contiguous_strides(mod_lists_shape(spec, tiles, by_keys))
    return {
        "stride_wb": bh * spec.seq_q * words if bb > 1 else 0,
        "stride_wh": spec.seq_q * words if bh > 1 else 0,
        "stride_sb": sb,
        "stride_sh": sh,
        "stride_lb": lb,
        "stride_lh": lh,
        "stride_lr": lr,
        "HAS_MOD": True,
        "WORDS": words,
    }


def _features(spec: AttnSpec) -> dict[str, Any]:
    left, right = spec.window_left, spec.window_right
    return {
        "HQ": spec.heads_q,
        "GROUP": spec.group,
        "T": spec.seq_q,
        "S": spec.seq_k,
        "D": spec.head_dim,
        "DV": spec.head_dim_v,
        "SM_SCALE": float(spec.softmax_scale),
        "SOFTCAP": float(spec.softcap) if spec.softcap else 1.0,
        "LEFT": spec.unbounded if left is None else int(left),
        "RIGHT": spec.unbounded if right is None else int(right),
        "HAS_LEFT": left is not None,
        "HAS_RIGHT": right is not None,
        "HAS_MASK": spec.mask_shape is not None,
        "HAS_BIAS": spec.bias_shape is not None,
        "HAS_SEG": spec.segments,
        "HAS_SOFTCAP": bool(spec.softcap),
        "HAS_ALIBI": spec.alibi,
        "BLOCK_D": block_dim(spec.head_dim),
        "BLOCK_DV": block_dim(spec.head_dim_v),
        "ASM": not interpreted(),
    }


def _shapes(spec: AttnSpec) -> dict[str, tuple[int, int, int, int]]:
    b, t, s = spec.batch, spec.seq_q, spec.seq_k
    return {
        "q": (b, t, spec.heads_q, spec.head_dim),
        "k": (b, s, spec.heads_kv, spec.head_dim),
        "v": (b, s, spec.heads_kv, spec.head_dim_v),
        "o": (b, t, spec.heads_q, spec.head_dim_v),
    }


def forward(spec: AttnSpec, tiles: KernelTiles) -> Launch:
    """Inputs: q, k, v, mask(int8), bias, q_seg, kv_seg, sinks(f32), bits, seen, list (int32,
    dummies without a mask_mod), slopes (f32 ``(Hq,)``, a dummy without alibi). Outputs: out, lse."""
    from jaxattn_triton.flash.forward import attn_fwd_kernel

    sh = _shapes(spec)
    constexprs = {
        **_bthd_strides("q", sh["q"]),
        **_bthd_strides("k", sh["k"]),
        **_bthd_strides("v", sh["v"]),
        **_bthd_strides("o", sh["o"]),
        **_broadcast_strides("m", spec.mask_shape),
        **_broadcast_strides("b", spec.bias_shape),
        **_features(spec),
        **_mod(spec, tiles),
        "HAS_SINK": spec.sinks,
        # Heavy query tiles first only pays when later tiles do more work.
        "REVERSE_M": spec.window_right is not None and spec.mod_shape is None,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
    }
    return Launch(
        kernel=attn_fwd_kernel,
        grid=(_cdiv(spec.seq_q, tiles.block_m), spec.batch * spec.heads_q, 1),
        outputs=(
            (sh["o"], spec.dtype),
            ((spec.batch, spec.heads_q, spec.seq_q), "float32"),
        ),
        constexprs=constexprs,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


PREPROCESS_BLOCK_M = 64


def preprocess(spec: AttnSpec) -> Launch:
    """Inputs: out, dout, lse, dlse, sinks. Outputs: delta, lse_b (base 2, sinks in), dsink rows,
    and with alibi the lse cotangent's term folded into delta (a one-element dummy otherwise)."""
    from jaxattn_triton.flash.backward import attn_bwd_preprocess_kernel

    sh = _shapes(spec)
    rows = ((spec.batch, spec.heads_q, spec.seq_q), "float32")
    constexprs = {
        **_bthd_strides("o", sh["o"]),
        **_bthd_strides("do", sh["o"]),
        "HQ": spec.heads_q,
        "T": spec.seq_q,
        "DV": spec.head_dim_v,
        "HAS_SINK": spec.sinks,
        "HAS_ALIBI": spec.alibi,
        "BLOCK_M": PREPROCESS_BLOCK_M,
        "BLOCK_DV": block_dim(spec.head_dim_v),
    }
    return Launch(
        kernel=attn_bwd_preprocess_kernel,
        grid=(_cdiv(spec.seq_q, PREPROCESS_BLOCK_M), spec.batch * spec.heads_q, 1),
        outputs=(rows, rows, rows, rows if spec.alibi else ((1,), "float32")),
        constexprs=constexprs,
        num_warps=4,
        num_stages=1,
    )


def dkdv(spec: AttnSpec, tiles: KernelTiles, dq_mode: int = DQ_KERNEL, part: int = PART_BOTH) -> Launch:
    """Inputs: q, k, v, mask, bias, q_seg, kv_seg, dout, lse_b, delta, bits, seen, list (by key
    tiles), slopes. Outputs: dk, dv, dbias, dq_acc.

    dbias is a dense ``(B, Hq, T, S)`` float32 buffer when there is a bias (zeroed, since
    skipped tiles are never written), a one-element dummy otherwise. With ``DQ_ATOMIC``,
    dq_acc is q's shape in float32, zeroed, and receives dQ divided by the softmax scale
    (the caller scales and casts it); a one-element dummy otherwise. ``part`` PART_DV or
    PART_DK computes half of the work; the outputs the launch does not compute (dk, or
    dv, dbias and dq_acc) are one-element dummies.
    """
    from jaxattn_triton.flash.backward import attn_bwd_dkdv_kernel

    sh = _shapes(spec)
    has_bias = spec.bias_shape is not None
    does_dk = part != PART_DV
    has_bias = has_bias and does_dk
    dbias_shape = (spec.batch, spec.heads_q, spec.seq_q, spec.seq_k) if has_bias else (1,)
    fuse = dq_mode != DQ_KERNEL and does_dk
    dq_shape = sh["q"] if fuse else (1,)
    constexprs = {
        **_bthd_strides("q", sh["q"]),
        **_bthd_strides("k", sh["k"]),
        **_bthd_strides("v", sh["v"]),
        **_bthd_strides("do", sh["o"]),
        **_bthd_strides("dk", sh["k"]),
        **_bthd_strides("dv", sh["v"]),
        **_broadcast_strides("m", spec.mask_shape),
        **_broadcast_strides("b", spec.bias_shape),
        **_features(spec),
        **_mod(spec, tiles, by_keys=True),
        "FUSE_DQ": fuse,
        "PART": part,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
    }
    zeroed = ((2,) if has_bias else ()) + ((3,) if fuse else ())
    return Launch(
        kernel=attn_bwd_dkdv_kernel,
        grid=(_cdiv(spec.seq_k, tiles.block_n), spec.batch * spec.heads_kv, 1),
        outputs=(
            (sh["k"] if does_dk else (1,), spec.dtype),
            (sh["v"] if part != PART_DK else (1,), spec.dtype),
            (dbias_shape, "float32"),
            (dq_shape, "float32"),
        ),
        constexprs=constexprs,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        zeroed=zeroed,
    )


def dq(spec: AttnSpec, tiles: KernelTiles) -> Launch:
    """Inputs: q, k, v, mask, bias, q_seg, kv_seg, dout, lse_b, delta, bits, seen, list, slopes,
    lse_term. Outputs: dq, dslope: with alibi ``(B, Hq, query tiles)`` float32, each query tile's
    share of the slopes' gradient (a one-element dummy otherwise). An alibi call's backward
    always has this kernel (``DQ_KERNEL``): it alone sees every key of a row."""
    from jaxattn_triton.flash.backward import attn_bwd_dq_kernel

    sh = _shapes(spec)
    constexprs = {
        **_bthd_strides("q", sh["q"]),
        **_bthd_strides("k", sh["k"]),
        **_bthd_strides("v", sh["v"]),
        **_bthd_strides("do", sh["o"]),
        **_bthd_strides("dq", sh["q"]),
        **_broadcast_strides("m", spec.mask_shape),
        **_broadcast_strides("b", spec.bias_shape),
        **_features(spec),
        **_mod(spec, tiles),
        "REVERSE_M": spec.window_right is not None and spec.mod_shape is None,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
    }
    return Launch(
        kernel=attn_bwd_dq_kernel,
        grid=(_cdiv(spec.seq_q, tiles.block_m), spec.batch * spec.heads_q, 1),
        outputs=(
            (sh["q"], spec.dtype),
            ((spec.batch, spec.heads_q, _cdiv(spec.seq_q, tiles.block_m)) if spec.alibi else (1,), "float32"),
        ),
        constexprs=constexprs,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
