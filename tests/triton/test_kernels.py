"""The Triton kernels on torch tensors (interpreted on CPU hosts) against the float64 oracle.

Forward (output and log-sum-exp) and backward (dQ, dK, dV, dBias, dSinks) of one feature
at a time, at shapes that span several tiles in both directions (tiles of 16, or uneven
tiles) so that tile skipping, edge masks and tails are exercised, not just one block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jaxattn.testing import oracle
from jaxattn_triton.flash.launch import DQ_ATOMIC, DQ_KERNEL, KernelTiles, Tiles
from jaxattn_triton.spec import AttnSpec

from ._env import BF16_DOT_OK, TORCH_DEVICE, needs_kernels

pytestmark = [
    needs_kernels,
    # log2(0) = -inf is how empty rows get lse = -inf; numpy (the interpreter) warns about it.
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]

# Tolerances on max |a - b| / max(1, max |ref|): float32 runs exact float32 dots in the
# interpreter (tf32 on a GPU); 16-bit inputs round P to the input dtype before P @ V.
TOL = {"float32": 2e-5 if TORCH_DEVICE == "cpu" else 5e-3, "float16": 4e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Problem:
    b: int = 1
    t: int = 24
    s: int = 40
    hq: int = 4
    hkv: int = 2
    d: int = 32
    dv: int | None = None
    dtype: str = "float32"
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    mask: tuple[int, int, int, int] | None = None  # shape; filled at random
    empty_rows: bool = False  # mask out every key of some rows
    bias: tuple[int, int, int, int] | None = None
    segments: bool = False
    sinks: bool = False
    scale: float | None = None
    q_gain: float = 1.0
    tiles: tuple[int, int] = (16, 16)
    dq_mode: int = DQ_KERNEL
    dkdv_split: bool = False
    seed: int = 0


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    return torch.from_numpy(x).to(getattr(torch, dtype)).to(torch.float64).numpy()


def _inputs(p: Problem) -> dict[str, Any]:
    rng = np.random.default_rng(p.seed)
    dv = p.dv or p.d
    x: dict[str, Any] = {
        "q": _round(rng.standard_normal((p.b, p.t, p.hq, p.d)) * p.q_gain, p.dtype),
        "k": _round(rng.standard_normal((p.b, p.s, p.hkv, p.d)), p.dtype),
        "v": _round(rng.standard_normal((p.b, p.s, p.hkv, dv)), p.dtype),
        "dout": _round(rng.standard_normal((p.b, p.t, p.hq, dv)), p.dtype),
    }
    if p.mask is not None:
        mask = rng.random(p.mask) > 0.3
        if p.empty_rows:
            mask[..., 1, :] = False
            mask[..., p.mask[2] - 2, :] = False
        x["mask"] = mask
    if p.bias is not None:
        x["bias"] = rng.standard_normal(p.bias)
    if p.segments:
        # Packed sequences: three segments in q, and a segment id in q that k never has,
        # so those query rows see nothing.
        qs = np.sort(rng.integers(0, 3, (p.b, p.t)), axis=1)
        qs[:, -3:] = 7
        ks = np.sort(rng.integers(0, 3, (p.b, p.s)), axis=1)
        x["q_segment_ids"], x["kv_segment_ids"] = qs.astype(np.int32), ks.astype(np.int32)
    if p.sinks:
        x["softmax_aux"] = rng.standard_normal(p.hq)
    return x


def _oracle_kwargs(p: Problem, x: dict[str, Any]) -> dict[str, Any]:
    kw = {n: x[n] for n in ("mask", "bias", "q_segment_ids", "kv_segment_ids", "softmax_aux") if n in x}
    return dict(
        kw, causal=p.causal, sliding_window=p.window, logits_soft_cap=p.softcap,
        softmax_scale=p.scale,
    )  # fmt: skip


def _run_kernels(p: Problem, x: dict[str, Any]) -> dict[str, np.ndarray | None]:
    import torch

    from . import torch_ops

    dt = getattr(torch, p.dtype)

    def tensor(name: str, dtype: Any = dt) -> torch.Tensor | None:
        if name not in x:
            return None
        return torch.from_numpy(np.asarray(x[name])).to(device=TORCH_DEVICE, dtype=dtype)

    q, k, v, dout = (tensor(n) for n in ("q", "k", "v", "dout"))
    assert q is not None and k is not None and v is not None and dout is not None
    extra = torch_ops.TorchInputs(
        q,
        tensor("mask", torch.bool),
        tensor("bias", torch.float32),
        tensor("q_segment_ids", torch.int32),
        tensor("kv_segment_ids", torch.int32),
        tensor("softmax_aux", torch.float32),
    )
    spec = AttnSpec(
        batch=p.b, seq_q=p.t, seq_k=p.s, heads_q=p.hq, heads_kv=p.hkv, head_dim=p.d,
        head_dim_v=p.dv or p.d, dtype=p.dtype,
        softmax_scale=p.scale if p.scale is not None else p.d**-0.5,
        causal=p.causal, window=p.window, softcap=p.softcap,
        mask_shape=p.mask, bias_shape=p.bias, segments=p.segments, sinks=p.sinks,
    )  # fmt: skip
    bm, bn = p.tiles
    kt = KernelTiles(bm, bn, 4, 1)
    tiles = Tiles(kt, KernelTiles(bn, bm, 4, 1), kt, p.dq_mode, p.dkdv_split)  # dK/dV tiles swap roles
    out, lse = torch_ops.forward(spec, tiles, q, k, v, extra)
    dq, dk, dv, dbias, dsinks = torch_ops.backward(spec, tiles, q, k, v, extra, out, lse, dout)

    def np64(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.to(device="cpu", dtype=torch.float64).numpy()

    return {
        "out": np64(out), "lse": np64(lse), "dq": np64(dq), "dk": np64(dk), "dv": np64(dv),
        "dbias": np64(dbias), "dsinks": np64(dsinks),
    }  # fmt: skip


def _close(name: str, got: np.ndarray | None, want: np.ndarray | None, tol: float) -> None:
    assert (got is None) == (want is None), f"{name}: got {got is not None}, want {want is not None}"
    if got is None or want is None:
        return
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name} has NaN"
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{name}: infinities differ"
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: infinities differ"
    err = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    scale = max(1.0, np.max(np.abs(want[finite]), initial=0.0))
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def check(p: Problem) -> dict[str, np.ndarray | None]:
    x = _inputs(p)
    got = _run_kernels(p, x)
    kw = _oracle_kwargs(p, x)
    ref = oracle.attention(x["q"], x["k"], x["v"], **kw)
    grads = oracle.attention_backward(x["q"], x["k"], x["v"], x["dout"], **kw)
    tol = TOL[p.dtype]
    _close("out", got["out"], ref.output, tol)
    _close("lse", got["lse"], ref.lse, tol)
    _close("dq", got["dq"], grads.dq, tol * 2)
    _close("dk", got["dk"], grads.dk, tol * 2)
    _close("dv", got["dv"], grads.dv, tol * 2)
    _close("dbias", got["dbias"], grads.dbias, tol * 2)
    _close("dsinks", got["dsinks"], grads.dsoftmax_aux, tol * 2)
    return got


CASES = {
    "plain": Problem(t=32, s=32),
    "tails_padded_dims": Problem(t=23, s=37, d=24, dv=40),
    "causal": Problem(t=40, s=40, causal=True),
    "causal_t_lt_s_gqa": Problem(t=20, s=52, hq=4, hkv=2, causal=True),
    "causal_t_gt_s_empty_rows": Problem(t=40, s=24, causal=True),
    "window_cross": Problem(t=30, s=44, window=(5, 3)),
    "window_causal": Problem(t=36, s=50, window=(9, 4), causal=True),
    "window_tiles_32x16": Problem(t=40, s=56, window=(6, 20), tiles=(32, 16)),
    "window_tiles_16x32": Problem(t=40, s=56, window=(20, 0), tiles=(16, 32)),
    "segments_with_empty_rows": Problem(b=2, t=28, s=36, segments=True),
    "soft_cap": Problem(softcap=2.0, q_gain=4.0),
    "sinks_causal": Problem(t=24, s=40, causal=True, sinks=True),
    "mask_with_empty_rows": Problem(b=2, mask=(2, 1, 24, 40), empty_rows=True),
    "mask_per_head": Problem(mask=(1, 4, 24, 40)),
    "bias_per_head": Problem(bias=(1, 4, 24, 40)),
    "bias_broadcast_keys": Problem(b=2, bias=(1, 1, 1, 40), causal=True),
    "mqa_d64": Problem(hq=3, hkv=1, d=64, t=20, s=33),
    "softmax_scale": Problem(scale=0.37),
    "everything": Problem(
        b=2,
        t=26,
        s=38,
        hq=4,
        hkv=2,
        d=16,
        causal=True,
        window=(12, 3),
        softcap=3.0,
        q_gain=2.0,
        mask=(2, 1, 26, 38),
        bias=(1, 4, 26, 38),
        segments=True,
        sinks=True,
    ),
    "float16_causal_gqa": Problem(dtype="float16", t=33, s=47, causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_oracle(name: str) -> None:
    check(CASES[name])


# dQ summed by atomic adds in the dK/dV kernel (the default on Hopper for head dims up to
# 128), and dK/dV in two launches (PART_DV, PART_DK; large head dims): every feature again.
ATOMIC_CASES = {
    **{f"atomic_{n}": dataclasses.replace(p, dq_mode=DQ_ATOMIC) for n, p in CASES.items()},
    **{f"split_{n}": dataclasses.replace(p, dkdv_split=True) for n, p in CASES.items()},
    "atomic_and_split_everything": dataclasses.replace(CASES["everything"], dq_mode=DQ_ATOMIC, dkdv_split=True),
    "atomic_long_loop_causal_tiles_32x16": Problem(t=96, s=100, causal=True, tiles=(32, 16), dq_mode=DQ_ATOMIC),
}


@pytest.mark.parametrize("name", list(ATOMIC_CASES))
def test_atomic_dq_and_split_dkdv_against_oracle(name: str) -> None:
    check(ATOMIC_CASES[name])


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
def test_bfloat16_against_oracle() -> None:
    check(Problem(dtype="bfloat16", t=33, s=47, causal=True, sinks=True))


def test_empty_rows_are_zero_not_nan() -> None:
    # Causal with T > S: the first T - S query rows see no key at all.
    got = check(Problem(t=40, s=24, causal=True))
    assert got["out"] is not None and got["lse"] is not None and got["dq"] is not None
    assert np.all(got["out"][:, :16] == 0.0)
    assert np.all(got["dq"][:, :16] == 0.0)
    assert np.all(got["lse"][:, :, :16] == -np.inf)


def test_window_changes_the_result() -> None:
    # Guards the window tests above against a kernel that ignores the window.
    windowed = _run_kernels(Problem(window=(3, 1)), _inputs(Problem(window=(3, 1))))
    full = _run_kernels(Problem(), _inputs(Problem()))
    assert windowed["out"] is not None and full["out"] is not None
    assert np.max(np.abs(windowed["out"] - full["out"])) > 0.1
