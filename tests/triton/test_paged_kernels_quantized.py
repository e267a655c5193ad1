"""The paged kernels over quantized caches (int8, float8_e4m3fn, float8_e5m2), interpreted on CPU.

Each case quantizes ``test_paged_kernels``' cache (one scale per tensor, per KV head, or per
token and head), runs the kernels on the narrow values and float32 scales, and compares with
the float64 reference applied to the dequantized cache (``values.astype(float64) * scale``):
the kernels must compute attention over exactly that cache. q in float32 makes the check
tight (the interpreter multiplies float32 exactly, and converting the narrow values to q's
dtype is exact), so a scale applied to the wrong row, column or head shows.

Unread positions are poisoned: values past each length hold NaN (fp8) or the extreme codes
(int8, which has no NaN), and per-token scales there hold NaN; neither may reach an output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jaxattn_triton.paged import launch as LP

from . import test_paged_kernels as base
from ._env import BF16_DOT_OK, TORCH_DEVICE, needs_kernels

pytestmark = [
    needs_kernels,
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")
GRANULARITIES = ("tensor", "head", "token")
#: Largest finite magnitude of each format: amax maps to it.
_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _narrow(x: np.ndarray, fmt: str) -> Any:
    """``x`` (float64, finite) in ``fmt``: a torch tensor (int8 rounds to nearest, fp8 casts)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, np.float64))
    if fmt == "int8":
        return t.round().clamp(-127, 127).to(torch.int8)
    return t.to(torch.float32).to(getattr(torch, fmt))


def quantize(
    cache: np.ndarray, fmt: str, granularity: str, live: np.ndarray, rng: np.random.Generator
) -> tuple[Any, np.ndarray, np.ndarray]:
    """``(values (torch), scale (float32), dequantized (float64, NaN where unread))`` of a
    ``(P, page_size, Hkv, D)`` cache; ``live`` (P, page_size) marks the positions read."""
    finite = np.where(np.isfinite(cache), cache, 0.0)
    amax = np.abs(finite).max(axis=3)  # (P, ps, Hkv)
    if granularity == "tensor":
        scale = np.asarray(amax.max() / _MAX[fmt], np.float32)
    elif granularity == "head":
        scale = (amax.max(axis=(0, 1)) / _MAX[fmt]).astype(np.float32)
    else:
        scale = (np.maximum(amax, 1e-3) / _MAX[fmt]).astype(np.float32)
    full = np.broadcast_to(scale, amax.shape).astype(np.float64)
    values = _narrow(finite / full[..., None], fmt)
    dequant = values.to(dtype=__import__("torch").float64).numpy() * full[..., None]
    dequant[~live] = np.nan
    # Poison what no kernel may read: the values past each length, and their token scales.
    import torch

    poison = torch.from_numpy(~live)
    if fmt == "int8":
        codes = torch.from_numpy(rng.choice(np.array([127, -128], np.int8), values.shape))
        values = torch.where(poison[..., None, None], codes, values)
    else:
        values = torch.where(poison[..., None, None], torch.tensor(float("nan")).to(values.dtype), values)
    if granularity == "token":
        scale = scale.copy()
        scale[~live] = np.nan
    return values, scale, dequant


@dataclasses.dataclass(frozen=True)
class Quant:
    paged: base.Paged
    k_fmt: str = "int8"
    v_fmt: str | None = None  # None: k_fmt (the kernels take one cache dtype; tests keep them equal)
    k_gran: str = "token"
    v_gran: str | None = None
    k_scale: bool = True
    v_scale: bool = True
    nan_scales: bool = False  # every scale NaN (for calls that read no position)
    #: (decode_q, decode_block_n) of the tiles; None: the default tiles' (``base.tiles_of``).
    decode: tuple[int, int] | None = None
    #: log2 of a gain per query head (cycled over the heads), and of one spread over the head
    #: dim (a ramp from the first to the second, one head in two): powers of two, so q stays
    #: exact in its dtype. Rows far apart in magnitude, and parts of a row far below its top.
    q_log2_gains: tuple[int, ...] = ()
    q_log2_spread: tuple[int, int] | None = None

    @property
    def fmt(self) -> str:
        return self.k_fmt


def live_positions(p: base.Paged, x: dict[str, Any]) -> np.ndarray:
    """(P, page_size) bool: the cache positions some sequence reads (below its length)."""
    num_pages = x["k_pages"].shape[0]
    live = np.zeros((num_pages, p.page_size), bool)
    for s in range(p.num_seqs):
        j = np.arange(p.kv_lens[s])
        live[x["page_table"][s, j // p.page_size], j % p.page_size] = True
    return live


def run_quantized(c: Quant) -> tuple[np.ndarray, np.ndarray]:
    import torch


    p = c.paged
    x = base.make(p)
    if c.q_log2_gains:
        gains = np.resize(np.exp2(np.asarray(c.q_log2_gains, np.float64)), p.hq)
        x["q"] = x["q"] * gains[None, :, None]
    if c.q_log2_spread is not None:
        ramp = np.exp2(np.round(np.linspace(*c.q_log2_spread, p.d)))
        x["q"][:, ::2, :] = x["q"][:, ::2, :] * ramp
    rng = np.random.default_rng(p.seed + 1)
    live = live_positions(p, x)
    kq, ks, kd = quantize(x["k_pages"], c.k_fmt, c.k_gran, live, rng)
    vq, vs, vd = quantize(x["v_pages"], c.k_fmt, c.v_gran or c.k_gran, live, rng)
    if c.nan_scales:
        ks, vs = np.full_like(ks, np.nan), np.full_like(vs, np.nan)
    if not c.k_scale:
        kd = kq.to(torch.float64).numpy().copy()
        kd[~live] = np.nan
    if not c.v_scale:
        vd = vq.to(torch.float64).numpy().copy()
        vd[~live] = np.nan
    num_pages = x["k_pages"].shape[0]
    lead = (num_pages, p.page_size, p.hkv)
    spec = dataclasses.replace(
        base.spec_of(p, x),
        cache_dtype=c.fmt,
        k_scale=LP.scale_strides(ks.shape, lead) if c.k_scale else None,
        v_scale=LP.scale_strides(vs.shape, lead) if c.v_scale else None,
    )
    tiles = base.tiles_of(p, spec)
    if c.decode is not None:
        tiles = dataclasses.replace(tiles, decode_q=c.decode[0], decode_block_n=c.decode[1])
    dt = getattr(torch, p.dtype)

    def t(a: np.ndarray, dtype: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=TORCH_DEVICE, dtype=dtype)

    if p.layout == LP.COMBINED:
        k = v = torch.stack([kq, vq], dim=3).reshape(num_pages, p.page_size, 2 * p.hkv, p.d).to(TORCH_DEVICE)
    else:
        k, v = kq.to(TORCH_DEVICE), vq.to(TORCH_DEVICE)
    sinks = torch.zeros(1) if x["sinks"] is None else t(x["sinks"], torch.float32)
    inputs = [
        t(x["q"], dt), k, v, t(x["page_table"], torch.int32), t(x["kv_lengths"], torch.int32),
        t(x["cu_q_lens"], torch.int32), t(x["num_seqs"], torch.int32), sinks.to(TORCH_DEVICE),
        t(np.reshape(ks, -1), torch.float32), t(np.reshape(vs, -1), torch.float32),
    ]  # fmt: skip
    got_out, got_lse = base.launched(spec, tiles, inputs)
    want_out, want_lse = base.reference(
        x["q"], kd, vd, x["page_table"], x["kv_lengths"], x["cu_q_lens"], p.num_seqs,
        scale=p.scale if p.scale is not None else p.d**-0.5, softcap=p.softcap, left=p.left, right=p.right,
        sinks=x["sinks"],
    )  # fmt: skip
    base._close("out", got_out, want_out, base.TOL[p.dtype])
    base._close("lse", got_lse, want_lse, base.TOL[p.dtype])
    return got_out, got_lse


# Pages of one tile (16 rows): a tile's rows past a length are read from the sequence's own
# last page, whose poisoned tail the masks must keep out (with smaller pages, the rows past the
# last used page come from the page-table entries' stand-in, page 0, which holds live data).
DECODE = base.Paged(hq=4, hkv=2, kv_lens=(37, 5, 0, 64), page_size=16, pages_per_seq=5, splits=2)
RAGGED = base.rep(base.RAGGED, hq=4, hkv=2)


# Every format x granularity, decode (split, an empty sequence) and ragged (padding rows).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("shape", ["decode", "ragged"])
def test_format_and_granularity(fmt: str, gran: str, shape: str) -> None:
    run_quantized(Quant(DECODE if shape == "decode" else RAGGED, k_fmt=fmt, k_gran=gran))


CASES = {
    # K and V at different granularities; one side unscaled (raw codes).
    "k_head_v_token": Quant(DECODE, k_gran="head", v_gran="token"),
    "k_token_v_tensor_fp8": Quant(DECODE, k_fmt="float8_e4m3fn", k_gran="token", v_gran="tensor"),
    "no_scales_fp8": Quant(DECODE, k_fmt="float8_e5m2", k_scale=False, v_scale=False),
    "k_scale_only": Quant(DECODE, k_gran="head", v_scale=False),
    # Several KV heads per program: a row's head and a column's head pick the scales.
    "kv_heads_token": Quant(base.Paged(hq=8, hkv=4, kv_heads=4, kv_lens=(30, 1, 71), splits=2)),
    "kv_heads_head_fp8": Quant(
        base.Paged(hq=8, hkv=4, kv_heads=2, page_size=16, pages_per_seq=5, kv_lens=(65, 0, 31)),
        k_fmt="float8_e4m3fn",
        k_gran="head",
    ),
    # Pages as large as a tile (one page-table read per tile), one split (the V row scale at the end).
    "page_per_tile_one_split": Quant(base.Paged(page_size=16, pages_per_seq=5, kv_lens=(65, 16, 31)), k_gran="head"),
    # Window, soft cap, sinks, speculative queries, padded head dims, shared pages.
    "window_softcap_sinks": Quant(
        base.Paged(q_len=2, hq=4, hkv=2, left=9, softcap=2.0, q_gain=3.0, sinks=True, kv_lens=(60, 7, 33), splits=3),
        k_fmt="float8_e4m3fn",
    ),
    "padded_dims_value_dim": Quant(base.Paged(d=24, dv=40, splits=2), k_gran="head", v_gran="token"),
    "shared_pages": Quant(base.Paged(page_order="shared", kv_lens=(20, 40, 50), splits=2), k_fmt="float8_e5m2"),
    "combined_layout": Quant(base.Paged(layout=LP.COMBINED, hq=4, hkv=2, splits=2), k_gran="token"),
    "ragged_prefill_chunk": Quant(
        base.Paged(q_len=None, q_lens=(20, 1, 1), kv_lens=(33, 50, 8), hq=4, hkv=2, block_q=8, splits=2),
        k_fmt="float8_e4m3fn",
        k_gran="head",
    ),
    "float16_q": Quant(base.rep(DECODE, dtype="float16"), k_fmt="int8", k_gran="token"),
    # The decode default's shape of program: 2 warps, 64-token tiles, 4 splits of several tiles.
    "two_warps_four_splits": Quant(
        base.rep(DECODE, dtype="float16", warps=2, block_n=64, splits=4, pages_per_seq=20, kv_lens=(300, 5, 0, 260)),
        k_fmt="int8",
        k_gran="head",
    ),
    "two_warps_four_splits_fp8_token": Quant(
        base.rep(DECODE, dtype="float16", warps=2, block_n=64, splits=4, pages_per_seq=20, kv_lens=(300, 70, 0, 129)),
        k_fmt="float8_e4m3fn",
        k_gran="token",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_case(name: str) -> None:
    run_quantized(CASES[name])


# A mixed ragged batch: prefill chunks, single-token decode rows, a 3-token (speculative) row,
# an empty sequence and padding. decode_q picks which sequences take the decode programs (0:
# none, 1: single tokens, 3: the speculative row too, 8: every sequence but the 9- and
# 20-token chunks), with decode tiles of their own size; every row must match the oracle
# whichever program wrote it, and the unwritten ones must not exist (the outputs are fresh).
MIXED = base.Paged(
    q_len=None, q_lens=(20, 1, 3, 0, 1, 9), kv_lens=(33, 50, 8, 5, 1, 9), hq=4, hkv=2, block_q=4,
    page_size=16, pages_per_seq=5, pad_seqs=1, pad_tokens=2,
)  # fmt: skip


@pytest.mark.parametrize("decode", [(0, 0), (1, 32), (3, 16), (8, 64)])
@pytest.mark.parametrize("splits", [1, 2])
def test_mixed_batch_decode_programs(decode: tuple[int, int], splits: int) -> None:
    run_quantized(Quant(base.rep(MIXED, splits=splits), k_fmt="int8", k_gran="token", decode=decode))


def test_mixed_batch_decode_programs_window_sinks_fp8() -> None:
    p = base.rep(MIXED, left=6, softcap=2.0, sinks=True, q_gain=3.0, splits=2)
    run_quantized(Quant(p, k_fmt="float8_e4m3fn", k_gran="head", v_gran="token", decode=(3, 32)))


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_q(fmt: str) -> None:
    run_quantized(Quant(base.rep(RAGGED, dtype="bfloat16", sinks=True), k_fmt=fmt, k_gran="token", v_gran="head"))


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gran", ["head", "token"])
def test_q_k_in_fp16_keeps_rows_of_any_magnitude(fmt: str, gran: str) -> None:
    # QK_F16 moves each bf16 q row into fp16 by a power of two of its own: rows 2^-100 .. 2^100
    # apart (fp16 alone spans 2^-24 .. 2^16) and parts of a row 2^24 below its top must score as
    # over the float64 oracle, through every format and K scale granularity. Scores near 2^100
    # also hold the GPU's fused s * scale - m to exp2(0) (it made inf, then NaN, before).
    p = base.rep(DECODE, dtype="bfloat16", hq=8)
    run_quantized(Quant(p, k_fmt=fmt, k_gran=gran, q_log2_gains=(-100, 0, 60, -30, 100, 7, -7, 20),
                        q_log2_spread=(-24, 0)))  # fmt: skip


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gran", ["head", "token"])
def test_v_read_as_words_by_lanes(fmt: str, gran: str) -> None:
    # V read as int32 words (Dv a power of two >= 32, a 16-bit q): P @ V as four dots, one per
    # byte lane, into an accumulator split and joined again around each sweep; decode with
    # splits and an empty sequence, and a ragged batch with padding rows, against the float64
    # oracle.
    for shape in (base.rep(DECODE, dtype="bfloat16", d=32), base.rep(RAGGED, dtype="bfloat16", d=32, sinks=True)):
        spec = dataclasses.replace(base.spec_of(shape, base.make(shape)), cache_dtype=fmt)
        assert LP.v_words(spec)
        run_quantized(Quant(shape, k_fmt=fmt, k_gran=gran))


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("gran", GRANULARITIES)
def test_int8_offset_is_taken_out(dtype: str, gran: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An int8 cache widened to fp16 as (v + 128) 2^-24 (INT8_OFFSET): the scores lose 128 sum(q)
    # and the accumulator 128 sum(P). Against the float64 oracle (run_quantized), and against
    # the exact widening of the same call to within float32's rounding of the offset's sums:
    # the oracle's tolerance for a 16-bit q would let an offset taken out wrong by 1% pass. The
    # exact form (widen.py's format 1) is what the kernel runs for a float32 q or per-token V
    # scales; here the test selects it for the same call.
    out, lse = {}, {}
    for offset in ("1", "0"):
        monkeypatch.setattr(LP, "int8_offset", lambda spec, on=offset == "1": on and spec.cache_dtype == "int8")
        shapes = (base.rep(DECODE, dtype=dtype, d=32), base.rep(RAGGED, dtype=dtype, d=32, sinks=True))
        for i, shape in enumerate(shapes):
            v_scale = (0, 0, 0) if gran == "tensor" else (0, 0, 1)
            spec = base.spec_of(shape, base.make(shape))
            spec = dataclasses.replace(spec, cache_dtype="int8", k_scale=(0, 0, 1), v_scale=v_scale)
            if gran == "token":
                spec = dataclasses.replace(spec, k_scale=(64, 8, 1), v_scale=(64, 8, 1))
            want = LP.INT8_OFFSET if offset == "1" else 1
            assert LP.k_widen(spec) == want
            assert LP.v_words(spec) == (1 if gran == "token" else want)  # per-token V scales ride in P
            out[offset, i], lse[offset, i] = run_quantized(Quant(shape, k_gran=gran))
    ulp = 2.0 ** (-8 if dtype == "bfloat16" else -11)
    for i in (0, 1):
        a, b = out["1", i], out["0", i]
        assert np.all(np.abs(a - b) <= 2 * ulp * np.abs(b) + 2**-14 * np.abs(b).max()), i
        live = np.isfinite(lse["0", i])
        la, lb = lse["1", i][live], lse["0", i][live]
        assert np.all(np.abs(la - lb) <= 1e-4 * (1 + np.abs(lb))), i


def test_q_k_runs_in_fp16_for_a_bf16_q_over_a_narrow_k() -> None:
    spec = LP.PagedSpec(
        num_tokens=16, max_seqs=16, q_len=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
        dtype="bfloat16", num_pages=16 * 64, page_size=16, pages_per_seq=64,
    )  # fmt: skip
    for fmt in FORMATS:
        for scale in (None, (0, 0, 0), (0, 0, 1), (128, 8, 1)):
            quantized = dataclasses.replace(spec, cache_dtype=fmt, k_scale=scale)
            assert LP.qk_f16(quantized), (fmt, scale)
            assert LP.attention(quantized, LP.default_tiles(quantized)).constexprs["QK_F16"]
            assert not LP.qk_f16(dataclasses.replace(quantized, dtype="float16"))
            assert not LP.qk_f16(dataclasses.replace(quantized, dtype="float32"))
    assert not LP.qk_f16(spec)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("gran", GRANULARITIES)
def test_unread_scales_do_not_leak(gran: str, splits: int) -> None:
    # No sequence reads a position (lengths 0, sinks present): a row's K and V scales, even one
    # per tensor or head, are unread: NaN there must give zeros (lse -inf), not NaN.
    c = Quant(base.Paged(kv_lens=(0, 0, 0), hq=4, hkv=2, sinks=True, splits=splits), k_gran=gran, nan_scales=True)
    out, lse = run_quantized(c)
    assert np.all(out == 0.0) and np.all(lse == -np.inf)


def test_the_scales_change_the_result() -> None:
    # Guards the cases above against kernels that ignore a scale: dropping either scale from the
    # launch (the kernel reading raw codes) must move the output far from the reference.
    c = Quant(DECODE, k_gran="token")
    got, _ = run_quantized(c)
    for variant in (dataclasses.replace(c, k_scale=False), dataclasses.replace(c, v_scale=False)):
        other, _ = run_quantized(variant)
        assert np.nanmax(np.abs(other - got)) > 0.05, variant


def test_scale_strides() -> None:
    lead = (6, 4, 3)
    assert LP.scale_strides((), lead) == (0, 0, 0)
    assert LP.scale_strides((1,), lead) == (0, 0, 0)
    assert LP.scale_strides((3,), lead) == (0, 0, 1)
    assert LP.scale_strides((6, 4, 3), lead) == (12, 3, 1)
    assert LP.scale_strides((6, 4, 1), lead) == (4, 1, 0)
    assert LP.scale_strides((4, 3), lead) == (0, 3, 1)
    assert [LP.scale_mode(LP.scale_strides(s, lead)) for s in ((), (3,), (6, 4, 3), (6, 4, 1))] == [1, 1, 2, 2]
    assert LP.scale_mode(None) == 0
    with pytest.raises(ValueError, match=r"k_scale has shape \(5,\).*per head"):
        LP.scale_strides((5,), lead, "k_scale")
    with pytest.raises(ValueError, match="does not broadcast"):
        LP.scale_strides((2, 6, 4, 3), lead)


def test_spec_declines_bad_quantized_specs() -> None:
    kw: dict[str, Any] = {
        "num_tokens": 1, "max_seqs": 1, "q_len": 1, "heads_q": 2, "heads_kv": 1, "head_dim": 16,
        "head_dim_v": 16, "dtype": "bfloat16", "num_pages": 1, "page_size": 4, "pages_per_seq": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="quantized cache's dtype uint8"):
        LP.PagedSpec(**kw, cache_dtype="uint8")
    with pytest.raises(ValueError, match="k_scale/v_scale scale a quantized cache"):
        LP.PagedSpec(**kw, k_scale=(0, 0, 0))
    # The 16-bit path is not specialised: no scale mode, as before the quantized kernels.
    launch = LP.attention(LP.PagedSpec(**kw), LP.PagedTiles(1, 2, 16, 4, 1, 1))
    assert launch.constexprs["K_QUANT"] == launch.constexprs["V_QUANT"] == 0


def test_default_tiles_of_a_quantized_cache() -> None:
    # One byte per value: decode takes one KV head x 64 tokens, 2 warps and about four programs
    # per SM (528 on 132 SMs): 4 splits of 16 sequences' 128 programs, 2 of 32's 256, 16 of 4's
    # 32, 64 sequences' 512 unsplit (and 128's 1024: two waves); the bf16 tiles of the same calls
    # are unchanged, and prefill blocks over a quantized cache take the bf16 tiles.
    cases = ((16, (128, 8, 1, 1), (64, 2, 1, 4)), (64, (32, 4, 4, 1), (64, 2, 1, 1)), (32, None, (64, 2, 1, 2)),
             (4, None, (64, 2, 1, 16)), (128, None, (64, 2, 1, 1)))  # fmt: skip
    for batch, bf16, quantized in cases:
        spec = LP.PagedSpec(
            num_tokens=batch, max_seqs=batch, q_len=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
            dtype="bfloat16", num_pages=batch * 2048, page_size=16, pages_per_seq=2048,
        )  # fmt: skip
        for fmt in (None, "int8", "float8_e4m3fn"):
            if fmt is None and bf16 is None:
                continue
            tiles = LP.default_tiles(dataclasses.replace(spec, cache_dtype=fmt, k_scale=(0, 0, 0) if fmt else None))
            got = (tiles.block_n, tiles.num_warps, tiles.kv_heads, tiles.num_splits)
            assert got == (quantized if fmt else bf16), (batch, fmt, got)
    # Short caches: a split keeps at least QUANT_SPLIT_KEYS (1024) keys of capacity, so 16
    # sequences of 512 and 1k keys run unsplit, 2k takes 2 splits, 4k and 8k 4 of 2 warps; up to
    # QUANT_SHORT_KEYS (2048) the tiles are 128 tokens on 4 warps, but for int8 with one scale
    # per KV head whose programs fill the SMs unsplit (64 sequences: 512 programs), which keeps
    # 64-token tiles. Per-head scales are (0, 0, 0) strides; per-token ones step along tokens.
    cases = ((16, 32, "int8", False, (128, 4, 1, 1)), (16, 64, "int8", False, (128, 4, 1, 1)),
             (16, 128, "int8", False, (128, 4, 1, 2)), (16, 256, "int8", False, (64, 2, 1, 4)),
             (16, 512, "int8", False, (64, 2, 1, 4)), (16, 64, "float8_e4m3fn", True, (128, 4, 1, 1)),
             (64, 32, "int8", False, (64, 4, 1, 1)), (64, 128, "int8", True, (128, 4, 1, 1)),
             (64, 128, "float8_e4m3fn", False, (128, 4, 1, 1)), (64, 256, "int8", False, (64, 2, 1, 1)),
             (4, 512, "int8", True, (64, 2, 1, 8)))  # fmt: skip
    for batch, pages, fmt, per_token, quantized in cases:
        lead = (batch * pages, 16, 8)
        spec = LP.PagedSpec(
            num_tokens=batch, max_seqs=batch, q_len=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
            dtype="bfloat16", num_pages=batch * pages, page_size=16, pages_per_seq=pages, cache_dtype=fmt,
            k_scale=LP.scale_strides(lead, lead) if per_token else (0, 0, 0),
        )  # fmt: skip
        assert LP.scale_mode(spec.k_scale) == (2 if per_token else 1)
        tiles = LP.default_tiles(spec)
        got = (tiles.block_n, tiles.num_warps, tiles.kv_heads, tiles.num_splits)
        assert got == quantized, (batch, pages, fmt, per_token, got)
    prefill = LP.PagedSpec(
        num_tokens=2112, max_seqs=68, q_len=None, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
        dtype="bfloat16", num_pages=68 * 288, page_size=16, pages_per_seq=288,
    )  # fmt: skip
    quantized_prefill = dataclasses.replace(prefill, cache_dtype="int8", k_scale=(0, 0, 0))
    # ... plus decode programs for the sequences of at most 16 rows (4 tokens of GQA 4).
    want = dataclasses.replace(LP.default_tiles(prefill), decode_q=4, decode_block_n=128)
    assert LP.default_tiles(quantized_prefill) == want
    assert LP.default_tiles(prefill).decode_q == 0


def test_p_v_runs_in_fp16_for_a_bf16_q_over_a_narrow_v_with_row_scales() -> None:
    # Every format's values are exact in fp16, and P in [0, 1] fits it; per-token V scales ride
    # in P (P diag(vs)), which fp16's range may not hold; a 16-bit cache is not widened at all.
    spec = LP.PagedSpec(
        num_tokens=16, max_seqs=16, q_len=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
        dtype="bfloat16", num_pages=16 * 64, page_size=16, pages_per_seq=64,
    )  # fmt: skip
    per_tensor, per_head, per_token = (0, 0, 0), (0, 0, 1), (128, 8, 1)
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for scale, want in ((None, True), (per_tensor, True), (per_head, True), (per_token, False)):
            quantized = dataclasses.replace(spec, cache_dtype=fmt, v_scale=scale)
            assert LP.pv_f16(quantized) is want, (fmt, scale)
            assert LP.attention(quantized, LP.default_tiles(quantized)).constexprs["PV_F16"] is want
            assert not LP.pv_f16(dataclasses.replace(quantized, dtype="float16"))
            assert not LP.pv_f16(dataclasses.replace(quantized, dtype="float32"))
    assert not LP.pv_f16(spec)


def test_k_widening_follows_the_format_and_the_scales() -> None:
    # widen.py's bit tricks for K where they measured faster (int8, e5m2, and e4m3 with per-token
    # scales); Triton's own cast for an e4m3 K with one scale per row; never for 16-bit caches or
    # a float32 q.
    spec = LP.PagedSpec(
        num_tokens=16, max_seqs=16, q_len=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
        dtype="bfloat16", num_pages=16 * 64, page_size=16, pages_per_seq=64,
    )  # fmt: skip
    per_head, per_token = (0, 0, 1), (128, 8, 1)
    # int8 widens to fp16 (Q K^T in fp16 for a bf16 q) with its offset left in (INT8_OFFSET).
    want = {("int8", per_head): LP.INT8_OFFSET, ("int8", per_token): LP.INT8_OFFSET, ("float8_e4m3fn", per_head): 0,
            ("float8_e4m3fn", per_token): 2, ("float8_e5m2", per_head): 3, ("float8_e5m2", per_token): 3}  # fmt: skip
    # (V's scales per token keep P V in bf16, where an e4m3 K with row scales takes Triton's
    # cast; with P V in fp16, ``pv_f16``, every K takes widen.py: below.)
    for (fmt, scale), code in want.items():
        quantized = dataclasses.replace(spec, cache_dtype=fmt, k_scale=scale, v_scale=per_token)
        assert LP.k_widen(quantized) == code, (fmt, scale)
        assert LP.attention(quantized, LP.default_tiles(quantized)).constexprs["K_WIDEN"] == code
        assert LP.k_widen(dataclasses.replace(quantized, dtype="float32")) == 0
    assert LP.k_widen(spec) == 0
    pv16 = dataclasses.replace(spec, cache_dtype="float8_e4m3fn", k_scale=per_head, v_scale=per_head)
    assert LP.pv_f16(pv16) and LP.k_widen(pv16) == 2
    e4m3 = dataclasses.replace(pv16, v_scale=per_token)
    int8 = dataclasses.replace(e4m3, cache_dtype="int8")
    assert LP.k_widen(int8) == LP.INT8_OFFSET
    assert LP.k_widen(dataclasses.replace(int8, dtype="float16")) == LP.INT8_OFFSET


def test_int8_offset_widening_is_exact() -> None:
    # Every int8 byte through widen.py's format 4 to fp16: (v + 128) 2^-24, a subnormal (or 0 for
    # -128), elementwise and as words, bit for bit; on a GPU the PTX.
    import torch

    from ._widen_probe import probe

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.view(torch.int8).reshape(16, 16)
    want = ((x.to(torch.float64) + 128) * 2.0**-24).to(torch.float16)
    assert torch.equal(want.to(torch.float64), (x.to(torch.float64) + 128) * 2.0**-24)  # exact in fp16
    y = torch.empty(16, 16, dtype=torch.float16, device=TORCH_DEVICE)
    z = torch.empty_like(y)
    probe[(1,)](x.to(TORCH_DEVICE), codes.view(torch.int32).reshape(16, 4).to(TORCH_DEVICE), y, z,
                FMT=LP.INT8_OFFSET, ASM=TORCH_DEVICE != "cpu")  # fmt: skip
    for name, got in (("elementwise", y), ("words", z)):
        bits, ref = got.cpu().view(torch.int16), want.view(torch.int16)
        assert torch.equal(bits, ref), f"int8 offset ({name}): {int((bits != ref).sum())} codes differ"


@pytest.mark.parametrize("out", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_widening_is_exact(fmt: str, out: str) -> None:
    # Every byte of each format through paged/widen.py, elementwise (K's path) and as int32
    # words (V's), against torch's cast: on a GPU the PTX bit tricks, bit for bit. NaN/inf
    # codes are left out (widened to finite numbers by design: they are never read).
    import torch

    from ._widen_probe import probe

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.view(getattr(torch, fmt)).reshape(16, 16)
    want = x.to(torch.float32).to(getattr(torch, out))
    y = torch.empty(16, 16, dtype=getattr(torch, out), device=TORCH_DEVICE)
    z = torch.empty_like(y)
    on_gpu = TORCH_DEVICE != "cpu"
    probe[(1,)](
        x.to(TORCH_DEVICE), codes.view(torch.int32).reshape(16, 4).to(TORCH_DEVICE), y, z,
        FMT={"int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}[fmt], ASM=on_gpu,
    )  # fmt: skip
    finite = torch.isfinite(want)
    for name, got in (("elementwise", y), ("words", z)):
        got = got.cpu()
        bits, ref = got.view(torch.int16)[finite], want.view(torch.int16)[finite]
        assert torch.equal(bits, ref), f"{fmt} -> {out} ({name}): {int((bits != ref).sum())} codes differ"
