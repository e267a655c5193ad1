"""The paged attention kernels on torch tensors (interpreted on CPU hosts) against float64 NumPy.

The reference gathers each sequence's keys through the page table, masks (causal per
sequence, kv_lengths, window), soft-caps, and takes the softmax with the sink in the
denominator, all in float64; rows that see no key are zeros. Shapes are tiny but span
several key tiles (tiles of 16 keys) and several splits, with page sizes below, equal to and
above the tile, so the page gather, the split boundaries and the edge sweeps all run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jaxattn_triton.paged import launch as LP

from ._env import BF16_DOT_OK, TORCH_DEVICE, needs_kernels

pytestmark = [
    needs_kernels,
    # log2(0) = -inf is how empty rows get lse = -inf; numpy (the interpreter) warns about it.
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]

# max |got - want| / max(1, max |want|): float32 dots are exact in the interpreter (tf32 on
# a GPU); 16-bit inputs round P to the input dtype before P @ V.
TOL = {"float32": 2e-5 if TORCH_DEVICE == "cpu" else 5e-3, "float16": 4e-3, "bfloat16": 3e-2}


def reference(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    page_table: np.ndarray,
    kv_lengths: np.ndarray,
    cu_q_lens: np.ndarray,
    num_seqs: int,
    *,
    scale: float,
    softcap: float | None = None,
    left: int | None = None,
    right: int | None = 0,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out (N, Hq, Dv), lse (N, Hq))`` in float64 for token-major q and a separate-layout cache."""
    n, hq, _ = q.shape
    page_size, hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    group = hq // hkv
    out = np.zeros((n, hq, dv))
    lse = np.full((n, hq), -np.inf)
    for s in range(num_seqs):
        kv_len = int(kv_lengths[s])
        q0, q1 = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        j = np.arange(kv_len)
        pages = page_table[s, j // page_size]
        keys = np.repeat(k_pages[pages, j % page_size].astype(np.float64), group, axis=1)  # (L, Hq, D)
        vals = np.repeat(v_pages[pages, j % page_size].astype(np.float64), group, axis=1)
        for i in range(q1 - q0):
            r = q0 + i
            pos = kv_len - (q1 - q0) + i
            keep = j < kv_len
            if right is not None:
                keep &= j <= pos + right
            if left is not None:
                keep &= j >= pos - left
            if not keep.any():
                continue
            x = np.einsum("hd,lhd->hl", q[r].astype(np.float64), keys) * scale  # (Hq, L)
            if softcap is not None:
                x = softcap * np.tanh(x / softcap)
            x = np.where(keep[None, :], x, -np.inf)
            m = x.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, sinks[:, None])
            e = np.exp(x - m)
            den = e.sum(axis=1)
            lse[r] = m[:, 0] + np.log(den)
            if sinks is not None:
                den = den + np.exp(sinks - m[:, 0])
            out[r] = np.einsum("hl,lhd->hd", e, vals) / den[:, None]
    return out, lse


@dataclasses.dataclass(frozen=True)
class Paged:
    """One call: ``q_lens`` per real sequence (None: uniform ``q_len`` = paged decode)."""

    kv_lens: tuple[int, ...] = (37, 5, 64)
    q_len: int | None = 1
    q_lens: tuple[int, ...] | None = None
    pad_seqs: int = 0  # page-table rows past num_seqs (ragged)
    pad_tokens: int = 0  # query rows past cu_q_lens[num_seqs] (ragged)
    hq: int = 8
    hkv: int = 1
    d: int = 16
    dv: int | None = None
    page_size: int = 8
    pages_per_seq: int = 9
    spare_pages: int = 3
    page_order: str = "permuted"  # "permuted", "shared" (prefix sharing), "identity"
    layout: str = LP.SEPARATE
    dtype: str = "float32"
    scale: float | None = None
    softcap: float | None = None
    left: int | None = None
    right: int | None = 0
    sinks: bool = False
    splits: int = 1
    block_q: int | None = None
    head_chunk: int | None = None
    kv_heads: int = 1  # KV heads per program (their tiles' columns are token x head)
    block_n: int = 16
    warps: int | None = None  # the default tiles' unless given
    q_gain: float = 1.0
    seed: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    def lens(self) -> list[int]:
        if self.q_lens is not None:
            return list(self.q_lens)
        assert self.q_len is not None
        return [self.q_len] * self.num_seqs


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    return torch.from_numpy(np.asarray(x, np.float64)).to(getattr(torch, dtype)).to(torch.float64).numpy()


def make(p: Paged) -> dict[str, Any]:
    rng = np.random.default_rng(p.seed)
    dv = p.dv or p.d
    max_seqs = p.num_seqs + p.pad_seqs
    num_pages = max_seqs * p.pages_per_seq + p.spare_pages
    table = rng.integers(0, num_pages, (max_seqs, p.pages_per_seq))
    if p.page_order == "permuted":
        table = rng.permutation(num_pages)[: max_seqs * p.pages_per_seq].reshape(max_seqs, p.pages_per_seq)
    elif p.page_order == "shared":
        # Sequences 0 and 1 share their first two pages; sequence 2 reuses one page twice.
        table = rng.permutation(num_pages)[: max_seqs * p.pages_per_seq].reshape(max_seqs, p.pages_per_seq)
        table[1, :2] = table[0, :2]
        if max_seqs > 2:
            table[2, 3] = table[2, 1]
    elif p.page_order == "identity":
        table = np.arange(max_seqs * p.pages_per_seq).reshape(max_seqs, p.pages_per_seq)
    kv_lens = np.zeros(max_seqs, np.int64)
    kv_lens[: p.num_seqs] = p.kv_lens
    # Page-table entries past a sequence's last used page are never read: make them invalid.
    for s in range(max_seqs):
        used = -(-int(kv_lens[s]) // p.page_size)
        table[s, used:] = 10**6 + s
    lens = p.lens()
    cu = np.concatenate([[0], np.cumsum(lens)])
    n = int(cu[-1]) + p.pad_tokens
    cu_full = np.concatenate([cu, np.full(p.pad_seqs, cu[-1])])
    x: dict[str, Any] = {
        "q": _round(rng.standard_normal((n, p.hq, p.d)) * p.q_gain, p.dtype),
        "k_pages": _round(rng.standard_normal((num_pages, p.page_size, p.hkv, p.d)), p.dtype),
        "v_pages": _round(rng.standard_normal((num_pages, p.page_size, p.hkv, dv)), p.dtype),
        "page_table": table.astype(np.int32),
        "kv_lengths": kv_lens.astype(np.int32),
        "cu_q_lens": cu_full.astype(np.int32),
        "num_seqs": np.array([p.num_seqs], np.int32),
        "sinks": rng.standard_normal(p.hq) if p.sinks else None,
    }
    # Rows past each used length hold NaN: the kernels must never let them reach an output.
    for s in range(p.num_seqs):
        last = -(-p.kv_lens[s] // p.page_size)
        if last and p.kv_lens[s] % p.page_size:
            page = table[s, last - 1]
            x["k_pages"][page, p.kv_lens[s] % p.page_size :] = np.nan
            x["v_pages"][page, p.kv_lens[s] % p.page_size :] = np.nan
    if p.page_order == "shared":
        # A shared page must hold the same tokens for both sequences: no NaN tails there.
        x["k_pages"] = np.nan_to_num(x["k_pages"], nan=0.5)
        x["v_pages"] = np.nan_to_num(x["v_pages"], nan=0.5)
    return x


def spec_of(p: Paged, x: dict[str, Any]) -> LP.PagedSpec:
    n, hq, d = x["q"].shape
    return LP.PagedSpec(
        num_tokens=n,
        max_seqs=p.num_seqs + p.pad_seqs,
        q_len=None if p.q_lens is not None else p.q_len,
        heads_q=hq,
        heads_kv=p.hkv,
        head_dim=d,
        head_dim_v=p.dv or p.d,
        dtype=p.dtype,
        num_pages=x["k_pages"].shape[0],
        page_size=p.page_size,
        pages_per_seq=p.pages_per_seq,
        layout=p.layout,
        softmax_scale=p.scale if p.scale is not None else d**-0.5,
        softcap=p.softcap,
        window_left=p.left,
        window_right=p.right,
        sinks=p.sinks,
    )


def tiles_of(p: Paged, spec: LP.PagedSpec) -> LP.PagedTiles:
    base = LP.default_tiles(spec, num_splits=p.splits)
    return dataclasses.replace(
        base,
        block_q=p.block_q or base.block_q,
        head_chunk=p.head_chunk or base.head_chunk,
        kv_heads=p.kv_heads,
        block_n=p.block_n,
        num_warps=p.warps or base.num_warps,
        num_stages=1,
    )


def run_kernels(p: Paged, x: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    import torch


    spec = spec_of(p, x)
    tiles = tiles_of(p, spec)
    dt = getattr(torch, p.dtype)

    def t(a: np.ndarray, dtype: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=TORCH_DEVICE, dtype=dtype)

    if p.layout == LP.COMBINED:
        kv = np.stack([x["k_pages"], x["v_pages"]], axis=3).reshape(*x["k_pages"].shape[:2], 2 * p.hkv, p.d)
        k = v = t(kv, dt)
    else:
        k, v = t(x["k_pages"], dt), t(x["v_pages"], dt)
    sinks = torch.zeros(1) if x["sinks"] is None else t(x["sinks"], torch.float32)
    inputs = [
        t(x["q"], dt), k, v, t(x["page_table"], torch.int32), t(x["kv_lengths"], torch.int32),
        t(x["cu_q_lens"], torch.int32), t(x["num_seqs"], torch.int32), sinks.to(TORCH_DEVICE),
    ]  # fmt: skip
    return launched(spec, tiles, inputs)


def launched(spec: LP.PagedSpec, tiles: LP.PagedTiles, inputs: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of the launch as float64 arrays, the lse of rows with no key at -inf (the
    kernel writes ``LP.NO_KEY_LSE`` there; ``ops`` maps it as this does)."""
    import torch

    from jaxattn_triton.torch_launch import run_launch

    out, lse = LP.run(spec, tiles, inputs, run_launch)
    lse = torch.where(lse == LP.NO_KEY_LSE, float("-inf"), lse)
    return out.to(device="cpu", dtype=torch.float64).numpy(), lse.to(device="cpu", dtype=torch.float64).numpy()


def _close(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name} has NaN"
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{name}: infinities differ"
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: infinities differ"
    err = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    scale = max(1.0, np.max(np.abs(want[finite]), initial=0.0))
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def expected(p: Paged, x: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference of case ``p`` on its inputs ``x``."""
    return reference(
        x["q"], x["k_pages"], x["v_pages"], x["page_table"], x["kv_lengths"], x["cu_q_lens"], p.num_seqs,
        scale=p.scale if p.scale is not None else p.d**-0.5, softcap=p.softcap, left=p.left, right=p.right,
        sinks=x["sinks"],
    )  # fmt: skip


def check(p: Paged) -> tuple[np.ndarray, np.ndarray]:
    x = make(p)
    got_out, got_lse = run_kernels(p, x)
    want_out, want_lse = expected(p, x)
    _close("out", got_out, want_out, TOL[p.dtype])
    _close("lse", got_lse, want_lse, TOL[p.dtype])
    return got_out, got_lse


RAGGED = Paged(q_len=None, q_lens=(3, 1, 0, 6, 1), kv_lens=(40, 17, 9, 6, 0), pad_seqs=2, pad_tokens=3)
rep = dataclasses.replace

CASES = {
    # Paged decode (uniform q_len).
    "decode_gqa8": Paged(),
    "decode_gqa8_splits3": Paged(splits=3),
    "decode_mha_splits2": Paged(hq=2, hkv=2, splits=2),
    "decode_gqa2_two_kv_heads": Paged(hq=4, hkv=2, kv_lens=(30, 1, 71), splits=4),
    "decode_empty_and_full_sequences": Paged(kv_lens=(0, 72, 16), splits=2),
    "decode_page_size_32_tile_per_page": Paged(page_size=32, pages_per_seq=3, kv_lens=(70, 33, 9), splits=2),
    "decode_page_size_5_odd": Paged(page_size=5, pages_per_seq=15, kv_lens=(71, 24, 3), splits=3),
    "decode_page_size_16_equals_tile": Paged(page_size=16, pages_per_seq=5, kv_lens=(65, 16, 31)),
    "decode_shared_pages": Paged(page_order="shared", kv_lens=(20, 40, 50), splits=2),
    "decode_speculative_t3": Paged(q_len=3, hq=4, hkv=2, kv_lens=(37, 2, 64), splits=2),
    "decode_t4_block_q2": Paged(q_len=4, hq=4, hkv=2, block_q=2, kv_lens=(45, 3, 20)),
    "decode_window": Paged(q_len=2, left=9, kv_lens=(60, 7, 33), splits=2),
    "decode_window_wide_tiles": Paged(q_len=3, left=20, kv_lens=(70, 25, 50), block_n=32, splits=2),
    "decode_soft_cap": Paged(softcap=1.5, q_gain=4.0, splits=2),
    "decode_sinks": Paged(sinks=True, kv_lens=(37, 0, 64), splits=3),
    "decode_sinks_one_split": Paged(sinks=True, kv_lens=(37, 0, 64)),
    "decode_scale": Paged(scale=0.3),
    "decode_padded_dims": Paged(d=24, dv=40, splits=2),
    "decode_head_chunks": Paged(hq=8, hkv=1, head_chunk=3, splits=2),
    "decode_combined_layout": Paged(layout=LP.COMBINED, hq=4, hkv=2, splits=2),
    "decode_combined_layout_one_split": Paged(layout=LP.COMBINED, hq=8, hkv=2, sinks=True),
    # Several KV heads per program: a row sees only its own head's columns of a tile.
    "decode_kv_heads_4_of_4": Paged(hq=8, hkv=4, kv_heads=4, kv_lens=(30, 1, 71), splits=2),
    "decode_kv_heads_2_of_4_page_per_tile": Paged(hq=8, hkv=4, kv_heads=2, page_size=16, pages_per_seq=5,
                                                  kv_lens=(65, 0, 31)),
    "decode_kv_heads_window_softcap_sinks": Paged(q_len=2, hq=4, hkv=2, kv_heads=2, left=9, softcap=2.0, q_gain=3.0,
                                                  sinks=True, kv_lens=(60, 7, 33), splits=3),
    "decode_kv_heads_combined_layout": Paged(layout=LP.COMBINED, hq=4, hkv=4, kv_heads=4, page_size=5,
                                             pages_per_seq=15, kv_lens=(71, 24, 3), splits=2),
    # Ragged paged attention.
    "ragged": RAGGED,
    "ragged_splits3": rep(RAGGED, splits=3),
    "ragged_block_q1": rep(RAGGED, block_q=1, splits=2),
    "ragged_block_q4_gqa2": rep(RAGGED, hq=4, hkv=2, block_q=4),
    "ragged_prefill_chunk": Paged(q_len=None, q_lens=(20, 1, 1), kv_lens=(33, 50, 8), hq=4, hkv=2, block_q=8, splits=2),
    "ragged_window_softcap_sinks": rep(RAGGED, left=7, softcap=2.0, q_gain=3.0, sinks=True, splits=2),
    "ragged_combined_layout": rep(RAGGED, layout=LP.COMBINED, splits=2),
    "ragged_kv_heads": rep(RAGGED, hq=4, hkv=2, kv_heads=2, block_q=2, splits=2),
    "ragged_decode_rows": Paged(q_len=None, q_lens=(1, 1, 0, 1), kv_lens=(9, 40, 3, 0), pad_tokens=2, splits=2),
    # Everything at once.
    "everything": Paged(
        q_len=None,
        q_lens=(5, 2, 1),
        kv_lens=(44, 9, 63),
        pad_seqs=1,
        pad_tokens=2,
        hq=4,
        hkv=2,
        d=24,
        page_size=6,
        pages_per_seq=11,
        page_order="shared",
        layout=LP.COMBINED,
        left=11,
        softcap=2.5,
        sinks=True,
        splits=3,
        q_gain=2.0,
    ),
    "float16_decode": Paged(dtype="float16", splits=2, sinks=True),
    "float16_ragged": rep(RAGGED, dtype="float16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_reference(name: str) -> None:
    check(CASES[name])


@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.parametrize("splits", [1, 2])
def test_bfloat16_against_reference(splits: int) -> None:
    check(Paged(dtype="bfloat16", q_len=None, q_lens=(2, 1, 1), kv_lens=(40, 13, 0), splits=splits, sinks=True))


def test_empty_rows_are_zero_with_sinks() -> None:
    # kv_length 0, and a query whose position is < 0 (q_len > kv_len): zeros, lse -inf.
    p = Paged(q_len=None, q_lens=(3, 1), kv_lens=(2, 0), sinks=True, splits=2, pad_tokens=2)
    out, lse = check(p)
    assert np.all(out[0] == 0.0) and np.all(lse[0] == -np.inf)  # pos = -1
    assert np.all(out[3:] == 0.0) and np.all(lse[3:] == -np.inf)  # empty sequence, padding


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_splits_agree(splits: int) -> None:
    # The same call with any number of splits (including more splits than tiles).
    p = Paged(kv_lens=(70, 5, 33), sinks=True, splits=splits)
    check(p)


def _run_poisoned(lz: Any, inputs: list[Any]) -> list[Any]:
    """``run_launch`` with every output not zeroed by the launch filled with NaN (-1 for
    integers) first: a row the kernels leave unwritten shows."""
    import torch

    outs = []
    for i, (shape, dtype) in enumerate(lz.outputs):
        dt = getattr(torch, dtype)
        fill = 0 if i in lz.zeroed else (float("nan") if dt.is_floating_point else -1)
        outs.append(torch.full(shape, fill, dtype=dt, device=inputs[0].device))
    lz.kernel[lz.grid](*inputs, *outs, **lz.constexprs, num_warps=lz.num_warps, num_stages=lz.num_stages)
    return outs


@pytest.mark.parametrize("name", ["decode_gqa8_splits3", "ragged_splits3", "ragged_decode_rows", "everything"])
def test_merge_in_the_launch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # With splits the last split of each program group merges in the attention launch (FUSE):
    # every group draws exactly one ticket per split, every row (padding rows, empty sequences)
    # is written over NaN-filled outputs, and the result is the float64 oracle's.
    from jaxattn_triton import torch_launch

    p = CASES[name]
    x = make(p)
    tiles = tiles_of(p, spec_of(p, x))
    assert tiles.num_splits > 1 and LP.fused(tiles)
    launches: list[Any] = []

    def execute(lz: Any, inputs: list[Any]) -> list[Any]:
        outs = _run_poisoned(lz, inputs)
        launches.append((lz, outs))
        return outs

    monkeypatch.setattr(torch_launch, "run_launch", execute)
    fused_out, fused_lse = run_kernels(p, x)
    assert len(launches) == 1 and launches[0][0].constexprs["FUSE"]
    tickets = launches[0][1][5]
    assert tickets.shape == (launches[0][0].grid[0] * launches[0][0].grid[1],)
    assert bool((tickets == tiles.num_splits).all()), tickets
    want_out, want_lse = expected(p, x)
    _close("out", fused_out, want_out, TOL[p.dtype])
    _close("lse", fused_lse, want_lse, TOL[p.dtype])


def test_window_and_soft_cap_change_the_result() -> None:
    # Guards the cases above against kernels that ignore a feature.
    base = Paged(q_len=2, kv_lens=(60, 40, 33))
    x = make(base)
    plain, _ = run_kernels(base, x)
    for variant in (dataclasses.replace(base, left=5), dataclasses.replace(base, softcap=0.5, q_gain=4.0)):
        other, _ = run_kernels(variant, make(variant))
        assert np.max(np.abs(other - plain)) > 0.05, variant


def test_default_splits_fill_the_gpu() -> None:
    # Decode at H100 shapes: >= 2 programs per SM, or one nearly full wave unsplit (16 sequences x
    # 8 KV heads = 128 programs for 132 SMs: measured faster than 3 splits, launch_paged says
    # where), and no more splits than the cache has tiles. With 64 sequences (512 one-head
    # programs) 4 KV heads share a program: 128 programs, one wave again; 48 sequences have no
    # such count (96 or 192 programs), so they keep one head per program. Between one and two
    # waves (32 sequences: 256 programs) the base tiles run unsplit, one head per program.
    for batch, ctx in ((16, 2048), (64, 8192), (1, 65536), (16, 256), (4, 8192), (14, 8192), (15, 8192),
                       (48, 8192), (64, 2048), (128, 4096), (32, 4096), (32, 16384)):  # fmt: skip
        spec = LP.PagedSpec(
            num_tokens=batch, max_seqs=batch, q_len=1, heads_q=32, heads_kv=8, head_dim=128,
            head_dim_v=128, dtype="bfloat16", num_pages=batch * ctx // 16, page_size=16,
            pages_per_seq=ctx // 16,
        )  # fmt: skip
        tiles = LP.default_tiles(spec)
        programs = LP.query_blocks(spec, tiles.block_q) * spec.heads_kv // tiles.kv_heads * tiles.num_splits
        assert tiles.block_m == 16 and tiles.head_chunk == 4
        one_wave = 7 * LP.DEFAULT_NUM_SMS <= 8 * programs <= 8 * LP.DEFAULT_NUM_SMS
        more_than_one = programs > LP.DEFAULT_NUM_SMS
        assert (programs >= 2 * LP.DEFAULT_NUM_SMS or one_wave or more_than_one
                or tiles.num_splits * 4 * tiles.block_n >= ctx), (batch, ctx)
        assert one_wave == (batch in (15, 16, 64)), (batch, ctx, tiles)  # 120 of 132 SMs: 7/8 or more
        assert tiles.kv_heads == (4 if batch == 64 else 1), (batch, ctx, tiles)
        if batch == 64:
            assert (tiles.num_splits, tiles.block_n, tiles.num_warps, tiles.num_stages) == (1, 32, 4, 3)
        elif batch == 32:
            assert (tiles.num_splits, tiles.block_n, tiles.num_warps, tiles.num_stages) == (1, 64, 4, 3)
        elif one_wave:
            assert (tiles.num_splits, tiles.block_n, tiles.num_warps, tiles.num_stages) == (1, 128, 8, 3)
        else:
            assert tiles.num_splits > 1 or programs >= 2 * LP.DEFAULT_NUM_SMS, (batch, ctx, tiles)


def test_default_splits_of_prefill_blocks() -> None:
    # A speculative step's 16 draft tokens per sequence (64-row blocks, not decode-shaped): as many
    # programs as SMs (8 KV heads per sequence), each split keeping >= 16 key tiles; measured
    # faster than twice the SMs' programs (launch._split_count says where).
    for batch, ctx, want in ((1, 32768, 17), (2, 32768, 9), (4, 32768, 5), (8, 32768, 3), (1, 8192, 8),
                             (16, 32768, 2), (1, 1024, 1)):  # fmt: skip
        spec = LP.PagedSpec(
            num_tokens=16 * batch, max_seqs=batch, q_len=None, heads_q=32, heads_kv=8, head_dim=128,
            head_dim_v=128, dtype="bfloat16", num_pages=batch * ctx // 16, page_size=16, pages_per_seq=ctx // 16,
        )  # fmt: skip
        tiles = LP.default_tiles(spec, num_sms=132)
        assert tiles.block_m == 64 and tiles.num_splits == want, (batch, ctx, tiles)
        assert tiles.num_splits == 1 or tiles.num_splits * 16 * tiles.block_n <= ctx, (batch, ctx, tiles)


def test_spec_reasons() -> None:
    with pytest.raises(ValueError, match="D == Dv"):
        LP.PagedSpec(
            num_tokens=1, max_seqs=1, q_len=1, heads_q=2, heads_kv=1, head_dim=16, head_dim_v=32,
            dtype="float32", num_pages=1, page_size=4, pages_per_seq=1, layout=LP.COMBINED,
        )  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        LP.PagedSpec(
            num_tokens=1, max_seqs=1, q_len=1, heads_q=2, heads_kv=1, head_dim=16, head_dim_v=16,
            dtype="int8", num_pages=1, page_size=4, pages_per_seq=1,
        )  # fmt: skip


@pytest.mark.parametrize("name", ["ragged_prefill_chunk", "ragged_window_softcap_sinks", "decode_window", "ragged"])
def test_unread_pages_may_hold_nan(name: str) -> None:
    # Every position no sequence reads holds NaN: page tails and whole unused pages. With pages
    # smaller than a tile, a causal block's last tile reaches past the block's last visible key
    # into table entries the kernel does not read (a stand-in page): those rows must be masked
    # like the rows past a length (on a GPU they were not: NaN reached prefill rows).
    p = CASES[name]
    x = make(p)
    live = np.zeros(x["k_pages"].shape[:2], bool)
    for s in range(p.num_seqs):
        j = np.arange(p.kv_lens[s])
        live[x["page_table"][s, j // p.page_size], j % p.page_size] = True
    for key in ("k_pages", "v_pages"):
        x[key][~live] = np.nan
    got_out, got_lse = run_kernels(p, x)
    want_out, want_lse = expected(p, x)
    _close("out", got_out, want_out, TOL[p.dtype])
    _close("lse", got_lse, want_lse, TOL[p.dtype])
