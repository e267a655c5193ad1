"""Probe: how fast can a decode kernel read a (B, S, Hkv, D) cache, by access pattern?

Pure-read Triton kernels (two ``tl.dot`` per tile so the loads are pipelined like the attention
kernels' loads) beside cuDNN's dense decode, the plain reduction and our paged decode, in
one process. Patterns:

* ``head``: one program per (sequence, KV head[, split]), ``[BN, D]`` tiles whose rows are
  ``Hkv * D`` elements apart (what the paged kernel reads); ``hf``: the same with the head as
  the grid's fastest axis.
* ``contig``: one program per (sequence, split) reading every head of its tokens: tiles of
  ``BR`` consecutive rows of the ``(S * Hkv, D)`` view, fully contiguous.

Modes: ``--patterns`` (the reads above), ``--tables`` (paged decode on a permuted vs an
in-order page table, same tiles), ``--kv-heads`` (``PagedTiles.kv_heads`` configurations on
a permuted table), ``--sorted`` (each row's pages read in address order), ``--runs`` (pools
fragmented in runs of consecutive pages), ``--occupancy`` (two programs per SM at 16 sequences),
``--power`` (power, clocks and time per call of decodes run for seconds on end),
``--gap`` (a quantized cache made and decoded the sweep's way and the public API's way),
``--quant-floor`` (pure reads of an int8 cache beside the int8 decode), ``--ncu`` (the int8
decode and a pure read in its program shape at 16 x 32k, three calls each, to run under Nsight
Compute: ``ncu -k regex:paged_attn_kernel -c 1 --set full python3 plugins/triton/benchmarks/paged_probe.py --ncu``).
On the GPU machine: ``python3 plugins/triton/benchmarks/paged_probe.py --kv-heads [--json OUT]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "core" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "bench" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "triton" / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HQ, HKV, D = 32, 8, 128


@triton.jit
def read_head_kernel(K, V, Out, S: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                     SPLITS: tl.constexpr, HEADS_FAST: tl.constexpr):  # fmt: skip
    if HEADS_FAST:
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    sp = tl.program_id(2)
    PER: tl.constexpr = S // SPLITS
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    base = b.to(tl.int64) * S * HKV * D + h * D
    ones = tl.full([16, BN], 1.0, tl.float32).to(K.dtype.element_ty)
    acc = tl.zeros([16, D], tl.float32)
    for s0 in range(sp * PER, sp * PER + PER, BN):
        rows = (s0 + offs_n).to(tl.int64) * (HKV * D)
        k = tl.load(K + base + rows[:, None] + offs_d[None, :])
        v = tl.load(V + base + rows[:, None] + offs_d[None, :])
        acc = tl.dot(ones, k, acc)
        acc = tl.dot(ones, v, acc)
    row = (b * HKV + h) * SPLITS + sp
    tl.store(Out + row * D + offs_d, tl.sum(acc, 0))


@triton.jit
def read_contig_kernel(K, V, Out, ROWS: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    PER: tl.constexpr = ROWS // SPLITS
    offs_r = tl.arange(0, BR)
    offs_d = tl.arange(0, D)
    base = b.to(tl.int64) * ROWS * D
    ones = tl.full([16, BR], 1.0, tl.float32).to(K.dtype.element_ty)
    acc = tl.zeros([16, D], tl.float32)
    for r0 in range(sp * PER, sp * PER + PER, BR):
        rows = (r0 + offs_r).to(tl.int64) * D
        k = tl.load(K + base + rows[:, None] + offs_d[None, :])
        v = tl.load(V + base + rows[:, None] + offs_d[None, :])
        acc = tl.dot(ones, k, acc)
        acc = tl.dot(ones, v, acc)
    tl.store(Out + (b * SPLITS + sp) * D + offs_d, tl.sum(acc, 0))


@triton.jit
def read_pages_kernel(K, V, Table, Out, PPS: tl.constexpr, PS: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      HEADS: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    """Reads a paged cache through the table: ``HEADS`` adjacent KV heads x ``BN`` tokens a tile.
    With ``AHEAD`` the table entries are read a tile ahead, as the paged kernel reads them: the
    K/V addresses then depend on no load of their own iteration, and Triton's pipeliner keeps
    ``num_stages - 1`` tiles in flight (without, the index load takes a stage: one K/V buffer)."""
    b = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS
    sp = tl.program_id(2)
    PER: tl.constexpr = PPS * PS // SPLITS
    offs_c = tl.arange(0, BN * HEADS)
    offs_d = tl.arange(0, D)
    ones = tl.full([16, BN * HEADS], 1.0, tl.float32).to(K.dtype.element_ty)
    acc = tl.zeros([16, D], tl.float32)
    if AHEAD:
        page_next = tl.load(Table + b * PPS + (sp * PER + offs_c // HEADS) // PS)
    for s0 in range(sp * PER, sp * PER + PER, BN):
        tok = s0 + offs_c // HEADS
        if AHEAD:
            page = page_next.to(tl.int64)
            nxt = tok + BN
            page_next = tl.load(Table + b * PPS + nxt // PS, mask=nxt < sp * PER + PER, other=0)
        else:
            page = tl.load(Table + b * PPS + tok // PS).to(tl.int64)
        rows = (page * PS + tok % PS) * (HKV * D) + (h0 + offs_c % HEADS) * D
        k = tl.load(K + rows[:, None] + offs_d[None, :])
        v = tl.load(V + rows[:, None] + offs_d[None, :])
        acc = tl.dot(ones, k, acc)
        acc = tl.dot(ones, v, acc)
    row = (b * (HKV // HEADS) + tl.program_id(1)) * SPLITS + sp
    tl.store(Out + row * D + offs_d, tl.sum(acc, 0))


@triton.jit
def sort_rows_kernel(Table, Lens, Out, PPS: tl.constexpr, BLOCK: tl.constexpr, PS: tl.constexpr, QL: tl.constexpr):
    """``jaxattn.pages_in_address_order`` (no window) as one Triton launch: a program sorts one
    row's fully visible pages."""
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    n = tl.load(Lens + b)
    free = tl.maximum(n - QL, 0) // PS  # pages wholly before the first query's own position
    row = tl.load(Table + b * PPS + j, mask=j < PPS, other=0)
    inside = j < free
    ordered = tl.sort(tl.where(inside, row, 2147483647))
    tl.store(Out + b * PPS + j, tl.where(inside, ordered, row), mask=j < PPS)


def triton_sorted(table: jax.Array, lengths: jax.Array, q_len: int, page_size: int) -> jax.Array:
    import jax_triton as jt

    b, pps = table.shape
    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    return jt.triton_call(table, lengths, kernel=sort_rows_kernel, out_shape=out,
                          grid=(b,), num_warps=4, PPS=pps, BLOCK=triton.next_power_of_2(pps), PS=page_size,
                          QL=q_len)  # fmt: skip


def pages_read(b: int, pps: int, ps: int, heads: int, bn: int, splits: int, warps: int, stages: int,
               d: int = D, ahead: bool = False) -> Any:  # fmt: skip
    import jax_triton as jt

    out = jax.ShapeDtypeStruct((b * HKV // heads * splits, d), jnp.float32)

    def fn(k: jax.Array, v: jax.Array, table: jax.Array) -> jax.Array:
        return jt.triton_call(k, v, table, kernel=read_pages_kernel, out_shape=out, grid=(b, HKV // heads, splits),
                              num_warps=warps, num_stages=stages, PPS=pps, PS=ps, HKV=HKV, D=d, HEADS=heads, BN=bn,
                              SPLITS=splits, AHEAD=ahead)  # fmt: skip

    return fn


def head_read(b: int, s: int, bn: int, splits: int, heads_fast: bool, warps: int, stages: int) -> Any:
    import jax_triton as jt

    grid = (HKV, b, splits) if heads_fast else (b, HKV, splits)
    out = jax.ShapeDtypeStruct((b * HKV * splits, D), jnp.float32)

    def fn(k: jax.Array, v: jax.Array) -> jax.Array:
        return jt.triton_call(k, v, kernel=read_head_kernel, out_shape=out, grid=grid, num_warps=warps,
                              num_stages=stages, S=s, HKV=HKV, D=D, BN=bn, SPLITS=splits,
                              HEADS_FAST=heads_fast)  # fmt: skip

    return fn


def contig_read(b: int, s: int, br: int, splits: int, warps: int, stages: int) -> Any:
    import jax_triton as jt

    out = jax.ShapeDtypeStruct((b * splits, D), jnp.float32)

    def fn(k: jax.Array, v: jax.Array) -> jax.Array:
        return jt.triton_call(k, v, kernel=read_contig_kernel, out_shape=out, grid=(b, splits, 1), num_warps=warps,
                              num_stages=stages, ROWS=s * HKV, D=D, BR=br, SPLITS=splits)  # fmt: skip

    return fn


Candidate = tuple[str, Any, tuple[Any, ...]]


class Case:
    """One decode shape: a dense cache, the same tokens as pages (permuted and in-order tables)."""

    def __init__(self, b: int, s: int, ps: int) -> None:
        from jaxattn_triton.paged import launch as LP

        self.b, self.s, self.ps = b, s, ps
        self.nbytes = 2 * b * s * HKV * D * 2
        self.k = jax.random.normal(jax.random.PRNGKey(0), (b, s, HKV, D), jnp.bfloat16)
        self.v = jax.random.normal(jax.random.PRNGKey(1), (b, s, HKV, D), jnp.bfloat16)
        self.q = jax.random.normal(jax.random.PRNGKey(2), (b, 1, HQ, D), jnp.bfloat16)
        self.lens = jnp.full((b,), s, jnp.int32)
        n_pages = b * s // ps
        self.kp = self.k.reshape(n_pages, ps, HKV, D)
        self.vp = self.v.reshape(n_pages, ps, HKV, D)
        order = np.random.default_rng(0).permutation(n_pages).reshape(b, s // ps).astype(np.int32)
        self.permuted = jnp.asarray(order)
        self.in_order = jnp.arange(n_pages, dtype=jnp.int32).reshape(b, s // ps)
        self.spec = LP.PagedSpec(num_tokens=b, max_seqs=b, q_len=1, heads_q=HQ, heads_kv=HKV, head_dim=D,
                                 head_dim_v=D, dtype="bfloat16", num_pages=n_pages, page_size=ps,
                                 pages_per_seq=s // ps)  # fmt: skip

    def cudnn(self) -> Candidate:
        def fn(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> jax.Array:
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n, implementation="cudnn")

        return ("cudnn dense decode", fn, (self.q, self.k, self.v, self.lens))

    def paged(self, name: str, tiles: Any, table: jax.Array) -> Candidate:
        from jaxattn_triton.paged.ops import paged_decode

        def fn(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array) -> jax.Array:
            return paged_decode(q, k, v, tb, n, tiles=tiles)

        return (name, fn, (self.q, self.kp, self.vp, table, self.lens))

    def free(self) -> None:
        for a in (self.k, self.v, self.kp, self.vp):
            with contextlib.suppress(Exception):
                a.delete()


def measure(case: Case, cands: list[Candidate], rows: list[dict[str, Any]], deadline: float, rounds: int = 8) -> None:
    """Times the candidates in interleaved rounds (a b c, c b a, ...), as ``jaxattn bench`` does.

    Each round takes one sample (back-to-back calls lasting >= 10 ms after a 100 ms pre-roll)
    of every candidate, so drift hits them alike; a row reports the median time and the median
    of its per-round ratios to the first candidate (cuDNN), printed and recorded.
    """
    from jaxattn_bench.timing import Program, preroll, run_once, run_sample, size_samples

    out_path = Path(sys.argv[sys.argv.index("--json") + 1]) if "--json" in sys.argv else None
    live: list[tuple[dict[str, Any], Program, tuple[Any, ...], int, int]] = []
    for name, fn, args in cands:
        row: dict[str, Any] = {"B": case.b, "S": case.s, "ps": case.ps, "name": name, "times_us": []}
        rows.append(row)
        if time.monotonic() > deadline:
            row["error"] = "out of time"
            continue
        try:
            program = Program(jax.jit(fn), None, 0.0)
            run_once(program, args)
            live.append((row, program, args, *size_samples(program, args, run_once(program, args), 10.0, 100.0)))
        except Exception as err:  # a failed candidate must not end the probe
            row["error"] = f"{type(err).__name__}: {err}"[:300]
    for r in range(rounds):
        if time.monotonic() > deadline:
            break
        for row, program, args, number, warm in live if r % 2 == 0 else live[::-1]:
            preroll(program, args, warm)
            row["times_us"].append(run_sample(program, args, number) * 1e3)
    ref = live[0][0]["times_us"] if live else []
    for row, *_ in live:
        times = row["times_us"]
        row["us"] = statistics.median(times)
        row["GBps"] = case.nbytes / row["us"] / 1e3
        row["vs_first"] = statistics.median(a / b for a, b in zip(ref, times, strict=False))
        spread = (max(times) - min(times)) / row["us"]
        print(f"B={case.b} S={case.s} ps={case.ps} {row['name']}: {row['us']:.1f} us {row['GBps']:.0f} GB/s "
              f"{row['vs_first']:.3f}x first (spread {spread:.1%})", flush=True)  # fmt: skip
    for row in rows:
        if "error" in row:
            print(f"B={case.b} S={case.s} ps={case.ps} {row['name']}: {row['error']}", flush=True)
    if out_path:
        out_path.write_text(json.dumps(rows, indent=1))


def patterns(case: Case) -> list[Candidate]:
    """Pure reads by access pattern, beside cuDNN, the reduction and our two decode kernels."""
    from jaxattn_triton.decode.ops import dense_decode

    def reduction(k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)

    def dense(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> jax.Array:
        return dense_decode(q, k, v, n, causal=True)

    b, s, kv = case.b, case.s, (case.k, case.v)
    cands = [case.cudnn(), ("memory read (jnp.sum)", reduction, kv), ("ours dense_decode", dense, (case.q, *kv)),
             case.paged("ours paged_decode (permuted)", None, case.permuted)]  # fmt: skip
    for hf in (False, True):
        for bn, w, st in ((128, 8, 3), (64, 4, 3), (32, 4, 4)):
            cands += [(f"read head{' hf' if hf else ''} bn={bn} w={w} st={st} splits={sp}",
                       head_read(b, s, bn, sp, hf, w, st), kv) for sp in ((1, 2) if b == 16 else (1,))]  # fmt: skip
    for br, w, st in ((128, 4, 3), (128, 4, 4), (64, 4, 4)):
        cands += [(f"read contig br={br} w={w} st={st} splits={sp}", contig_read(b, s, br, sp, w, st), kv)
                  for sp in ((8, 16, 33) if b == 16 else (2, 4))]  # fmt: skip
    return cands


def tables(case: Case) -> list[Candidate]:
    """Permuted vs in-order page tables (same tiles), against the dense kernel and cuDNN."""
    from jaxattn_triton.paged import launch as LP

    base = LP.default_tiles(case.spec)
    split2 = functools.partial(dataclasses.replace, base, num_warps=4, num_splits=2)
    base = dataclasses.replace(base, kv_heads=1)
    variants = {"default": base, "bn64 w4 st3 x2": split2(block_n=64, num_stages=3),
                "bn32 w4 st4 x2": split2(block_n=32, num_stages=4)}  # fmt: skip
    cands = [case.cudnn()]
    for name, t in variants.items():
        cands += [case.paged(f"paged {order} {name}", t, table)
                  for order, table in (("permuted", case.permuted), ("in-order", case.in_order))]  # fmt: skip
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def kv_heads(case: Case) -> list[Candidate]:
    """Several KV heads per program (``PagedTiles.kv_heads``) on permuted tables, against cuDNN."""
    from jaxattn_triton.paged import launch as LP

    base = dataclasses.replace(LP.default_tiles(case.spec), kv_heads=1)
    few = case.b <= 16
    configs = [(1, 128, 8, 3, 1) if few else (1, 32, 4, 4, 1)]
    configs += [(2, bn, 4, st, sp) for bn, st in ((64, 3), (32, 4)) for sp in ((2, 3) if few else (1,))]
    configs += [(4, 32, w, 3, sp) for w in (4, 8) for sp in ((4, 6) if few else (1, 2))]
    configs += [(4, 16, 4, 4, sp) for sp in ((4, 6) if few else (1, 2))]
    configs += [(8, 16, w, 3, sp) for w in (4, 8) for sp in ((8, 12) if few else (2, 3))]
    cands = [case.cudnn()]
    for kvh, bn, w, st, sp in configs:
        t = dataclasses.replace(base, kv_heads=kvh, block_n=bn, num_warps=w, num_stages=st, num_splits=sp)
        cands.append(case.paged(f"paged kvh={kvh} bn={bn} w={w} st={st} splits={sp}", t, case.permuted))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def pipelines(case: Case) -> list[Candidate]:
    """Deeper pipelines of the one-wave decode tiles, and pure reads of the same pages (permuted
    and in order): how much a random page order costs a read that computes nothing."""
    from jaxattn_triton.paged import launch as LP

    base = LP.default_tiles(case.spec)
    cands = [case.cudnn()]
    for bn, w, st in ((128, 8, 3), (64, 4, 4), (64, 4, 5), (64, 4, 6), (64, 8, 6), (32, 4, 6), (32, 4, 8)):
        t = dataclasses.replace(base, kv_heads=1, block_n=bn, num_warps=w, num_stages=st, num_splits=1)
        cands.append(case.paged(f"paged permuted bn={bn} w={w} st={st}", t, case.permuted))
    kv = (case.kp, case.vp)
    pps = case.s // case.ps
    for heads, bn, w, st, sp in ((1, 128, 8, 3, 1), (1, 64, 4, 6, 1), (8, 16, 4, 3, 8), (4, 32, 4, 3, 4)):
        fn = pages_read(case.b, pps, case.ps, heads, bn, sp, w, st)
        for order, table in (("permuted", case.permuted), ("in-order", case.in_order)):
            cands.append((f"read pages {order} heads={heads} bn={bn} w={w} st={st} splits={sp}", fn, (*kv, table)))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def sorted_tables(case: Case) -> list[Candidate]:
    """Reading each sequence's pages in address order: a pre-sorted table, a per-call sort."""
    from jaxattn.backend.paging import pages_in_address_order
    from jaxattn_triton.paged.ops import paged_decode

    presorted = jnp.sort(case.permuted, axis=1)

    def sort_then_decode(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array) -> jax.Array:
        return paged_decode(q, k, v, pages_in_address_order(tb, n, case.ps), n)

    def triton_sort_then_decode(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array) -> jax.Array:
        return paged_decode(q, k, v, triton_sorted(tb, n, 1, case.ps), n)

    args = (case.q, case.kp, case.vp, case.permuted, case.lens)
    cands = [case.cudnn(), case.paged("paged permuted", None, case.permuted),
             case.paged("paged permuted, rows pre-sorted", None, presorted),
             ("paged permuted, jnp.sort per call", sort_then_decode, args),
             ("paged permuted, triton sort per call", triton_sort_then_decode, args),
             case.paged("paged in-order", None, case.in_order)]  # fmt: skip
    if case.b <= 16:
        from jaxattn_triton.paged import launch as LP

        base = dataclasses.replace(LP.default_tiles(case.spec), kv_heads=1)
        for kvh, bn, w, st, sp in ((1, 64, 4, 4, 1), (2, 64, 4, 3, 2)):
            t = dataclasses.replace(base, kv_heads=kvh, block_n=bn, num_warps=w, num_stages=st, num_splits=sp)
            cands.append(case.paged(f"paged pre-sorted kvh={kvh} bn={bn} w={w} st={st} splits={sp}", t, presorted))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def runs(case: Case) -> list[Candidate]:
    """Pools fragmented in runs of R consecutive pages (the runs in a random order): at which run
    length does a random pool read as fast as an in-order one? 2 MB runs (64 pages of 16 tokens
    here) are the GPU's large-page size; several KV heads per program touch each page from one SM."""
    from jaxattn_triton.paged import launch as LP

    n_pages, pps = case.b * case.s // case.ps, case.s // case.ps
    rng = np.random.default_rng(0)

    def table(run: int) -> jax.Array:
        starts = rng.permutation(n_pages // run) * run
        return jnp.asarray((starts[:, None] + np.arange(run)).reshape(case.b, pps).astype(np.int32))

    presorted = jnp.sort(case.permuted, axis=1)
    cands = [case.cudnn(), case.paged("paged in-order", None, case.in_order)]
    cands += [case.paged(f"paged runs of {r}", None, table(r)) for r in (1, 4, 16, 64, 256)]
    cands.append(case.paged("paged runs of 1, rows sorted", None, presorted))
    base = dataclasses.replace(LP.default_tiles(case.spec), kv_heads=1)
    for kvh, bn, sp in ((8, 16, 8), (4, 32, 4)):
        t = dataclasses.replace(base, kv_heads=kvh, block_n=bn, num_warps=4, num_stages=3, num_splits=sp)
        for name, tb in (("runs of 1", case.permuted), ("rows sorted", presorted), ("in-order", case.in_order)):
            cands.append(case.paged(f"paged kvh={kvh} bn={bn} splits={sp} {name}", t, tb))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def occupancy(case: Case) -> list[Candidate]:
    """Two programs per SM at 16 sequences (half the GQA group each, or two key splits), so one
    computes while the other loads, against the one-program default and a pure read of the
    same permuted pages (the bar for any kernel on this layout)."""
    from jaxattn_triton.paged import launch as LP

    base = dataclasses.replace(LP.default_tiles(case.spec), kv_heads=1)
    cands = [case.cudnn(), case.paged("paged default", None, case.permuted)]
    for hc, bn, w, st, sp in ((2, 64, 4, 3, 1), (2, 64, 4, 2, 1), (2, 32, 4, 4, 1), (2, 128, 4, 2, 1),
                              (1, 64, 4, 3, 2)):  # fmt: skip
        t = dataclasses.replace(base, head_chunk=hc, block_n=bn, num_warps=w, num_stages=st, num_splits=sp)
        cands.append(case.paged(f"paged head_chunk={hc} bn={bn} w={w} st={st} splits={sp}", t, case.permuted))
    read = pages_read(case.b, case.s // case.ps, case.ps, 1, 128, 1, 8, 3)
    cands.append(("read pages permuted heads=1 bn=128 w=8 st=3", read, (case.kp, case.vp, case.permuted)))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def int8_pages(case: Case) -> tuple[tuple[jax.Array, jax.Array], Any, tuple[jax.Array, jax.Array]]:
    """``(int8 pages (K, V), their decode (q, k, v, table, lengths), the same bytes as fp16
    pairs)`` of ``case``: the pages times 40 in int8, per-head scales of 1/40. The pairs are D/2
    "values" a row, for the pure reads through the 16-bit dot, whose operands Triton stages
    with cp.async in every pipeline stage. (An int8 dot of the bytes as they are did not compile
    with triton 3.6 once the table was read ahead.)"""
    from jaxattn_triton.paged.ops import paged_decode

    kv = ((case.kp * 40).astype(jnp.int8), (case.vp * 40).astype(jnp.int8))
    scale = jnp.full((HKV,), 1 / 40, jnp.float32)

    def decode(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array) -> jax.Array:
        return paged_decode(q, k, v, tb, n, k_scale=scale, v_scale=scale)

    k2, v2 = (jax.lax.bitcast_convert_type(x.reshape(*x.shape[:3], D // 2, 2), jnp.float16) for x in kv)
    return kv, decode, (k2, v2)


def quant_floor(case: Case) -> list[Candidate]:
    """What an int8 cache's decode could reach: pure reads of the same int8 pages (permuted), in
    the shape of the quantized decode's programs (one KV head x 128 tokens, 4 warps, 3 stages, 2
    splits at 16 sequences: the default until the ninth session) and others, beside cuDNN's bf16
    dense decode, our int8 decode (per-head scales) and the reduction over the int8 bytes
    (``jaxattn bench``'s memory-read bar)."""
    kv, decode, pairs = int8_pages(case)

    def reduction(k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(k, dtype=jnp.int32) + jnp.sum(v, dtype=jnp.int32)

    pps = case.s // case.ps
    case.nbytes //= 2  # the int8 bytes: every GB/s below is over what the int8 rows read
    cands = [case.cudnn(), ("int8 paged decode (default)", decode, (case.q, *kv, case.permuted, case.lens)),
             ("memory read of the int8 bytes (jnp.sum)", reduction, kv)]  # fmt: skip
    few = case.b <= 16
    for heads, bn, w, st, sp in ((1, 128, 4, 3, 2 if few else 1), (1, 128, 4, 4, 2 if few else 1),
                                 (1, 256, 8, 3, 1), (1, 128, 8, 4, 1), (2, 64, 4, 3, 4 if few else 1),
                                 (8, 16, 4, 3, 16 if few else 2), (8, 32, 8, 3, 8 if few else 1)):  # fmt: skip
        label = f"heads={heads} bn={bn} w={w} st={st} splits={sp}"
        fn = pages_read(case.b, pps, case.ps, heads, bn, sp, w, st, D // 2, ahead=True)
        cands.append((f"read int8 pages as fp16 pairs {label}", fn, (*pairs, case.permuted)))
        if heads == 1 and bn == 128:
            fn = pages_read(case.b, pps, case.ps, heads, bn, sp, w, st, D // 2)
            cands.append((f"read int8 pages as fp16 pairs, table in the tile {label}", fn, (*pairs, case.permuted)))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


def api(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array, ks: jax.Array,
        vs: jax.Array) -> jax.Array:  # fmt: skip
    """A quantized paged decode through the public API, as ``jaxattn bench --serving`` calls it."""
    import jaxattn

    return jaxattn.paged_attention(q, k, v, tb, n, k_scale=ks, v_scale=vs, impl="ragged_page_attention_v3")


def gap(case: Case) -> list[Candidate]:
    """Why the public API's quantized decode measured slower than the kernel's own sweep: each
    format's cache made two ways (the sweep's: the values times a gain, cast, one scale of
    1/gain; ``jaxattn.quantize_kv`` per head, as ``jaxattn bench --serving`` makes it), each
    decoded two ways (``paged_decode``, as the sweep calls it, and ``jaxattn.paged_attention``
    with ``ragged_page_attention_v3``), beside cuDNN's bf16 dense decode."""
    import jaxattn
    from jaxattn_triton.paged.ops import paged_decode

    def kernel(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array, ks: jax.Array,
               vs: jax.Array) -> jax.Array:  # fmt: skip
        return paged_decode(q, k, v, tb, n, k_scale=ks, v_scale=vs)

    case.nbytes //= 2  # GB/s over the 8-bit bytes
    cands = [case.cudnn()]
    for fmt, gain in (("int8", 40.0), ("float8_e4m3fn", 1.0)):
        dt = jnp.dtype(fmt)
        scale = jnp.full((HKV,), 1 / gain, jnp.float32)
        made = {  # (k, k_scale, v, v_scale)
            "gain-cast": ((case.kp * gain).astype(dt), scale, (case.vp * gain).astype(dt), scale + 0.0),
            "quantize_kv": (*jaxattn.quantize_kv(case.kp, fmt, "head"), *jaxattn.quantize_kv(case.vp, fmt, "head")),
        }
        for data, (k, ks, v, vs) in made.items():
            for path, fn in (("paged_decode", kernel), ("paged_attention", api)):
                cands.append((f"{fmt} {data} data, {path}", fn, (case.q, k, v, case.permuted, case.lens, ks, vs)))
    return [*cands, ("cudnn dense decode (again)", *cands[0][1:])]


#: nvidia-smi's fields sampled by --power, every 100 ms.
POWER_FIELDS = "power.draw,clocks.sm,clocks.mem,temperature.gpu,clocks_event_reasons.active"


def power(case: Case) -> list[Candidate]:
    """Whether a decode slows as it keeps running: each of cuDNN's dense decode and the int8
    and e4m3 decodes (``jaxattn.quantize_kv`` per head, the public API) runs back to back for
    ``POWER_S`` seconds while ``nvidia-smi`` samples power, clocks and the reasons the clocks
    are held down (a bit mask: 0x4 the power cap, 0x20/0x40 temperature, 0x80 the power brake).
    Prints the time per call in the first and the last half second, and the samples' medians."""
    import subprocess

    import jaxattn

    cands = [case.cudnn()]
    for fmt in ("int8", "float8_e4m3fn"):
        k, ks = jaxattn.quantize_kv(case.kp, fmt, "head")
        v, vs = jaxattn.quantize_kv(case.vp, fmt, "head")
        cands.append((f"{fmt} decode", api, (case.q, k, v, case.permuted, case.lens, ks, vs)))
    cands.append(("cudnn dense decode (again)", *cands[0][1:]))
    for name, fn, args in cands:
        f = jax.jit(fn)
        f(*args).block_until_ready()
        time.sleep(POWER_REST_S)  # each candidate starts from a rested chip
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={POWER_FIELDS}", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)  # fmt: skip
        chunks: list[tuple[float, float]] = []  # (seconds since the start, µs per call)
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < POWER_S:
            out = None
            for _ in range(50):
                out = f(*args)
            jax.block_until_ready(out)
            chunks.append((now - start, (time.perf_counter() - now) / 50 * 1e6))
        smi.terminate()
        lines = [ln.split(", ") for ln in smi.communicate()[0].splitlines() if ln.count(",") == 4]
        first = statistics.median(t for s, t in chunks if s < 0.5)
        last = statistics.median(t for s, t in chunks if s > POWER_S - 0.5)
        watts = statistics.median(float(x[0]) for x in lines) if lines else float("nan")
        sm = statistics.median(float(x[1]) for x in lines) if lines else float("nan")
        low = min((float(x[1]) for x in lines), default=float("nan"))
        temp = max((float(x[3]) for x in lines), default=float("nan"))
        reasons = sorted({x[4] for x in lines})
        print(f"B={case.b} S={case.s} ps={case.ps} {name}: first 0.5 s {first:.1f} us, last 0.5 s {last:.1f} us; "
              f"{watts:.0f} W, SM {sm:.0f} MHz (lowest {low:.0f}), {temp:.0f} C, reasons {reasons}",
              flush=True)  # fmt: skip
    return []


#: --power: seconds each decode runs, and the pause before it.
POWER_S, POWER_REST_S = 4.0, 2.0


def ncu(case: Case) -> list[Candidate]:
    """The int8 decode (default tiles, per-head scales) and a pure read of its pages in the
    decode's program shape (one KV head x 64 tokens, 2 warps, 3 stages, 4 splits), each called
    three times: a profiler's target, not a timing (``main`` runs no ``measure``)."""
    kv, decode_fn, pairs = int8_pages(case)
    decode = jax.jit(decode_fn)
    read = jax.jit(pages_read(case.b, case.s // case.ps, case.ps, 1, 64, 4, 2, 3, D // 2, ahead=True))
    for _ in range(3):
        decode(case.q, *kv, case.permuted, case.lens).block_until_ready()
    for _ in range(3):
        read(*pairs, case.permuted).block_until_ready()
    return []


MODES = {
    "--power": (power, ((16, 32768, 16), (64, 8192, 16))),
    "--gap": (gap, ((16, 32768, 16), (64, 8192, 16), (16, 8192, 16))),
    "--ncu": (ncu, ((16, 32768, 16),)),
    "--quant-floor": (quant_floor, ((16, 8192, 16), (16, 32768, 16), (64, 8192, 16))),
    "--occupancy": (occupancy, ((16, 8192, 16), (16, 32768, 16))),
    "--runs": (runs, ((16, 32768, 16), (16, 65536, 16))),
    "--sorted": (
        sorted_tables,
        ((16, 8192, 16), (16, 32768, 16), (16, 65536, 16), (16, 32768, 64), (64, 8192, 16), (64, 32768, 16)),
    ),
    "--pipelines": (pipelines, ((16, 8192, 16), (16, 32768, 16))),
    "--patterns": (patterns, ((16, 8192, 16), (16, 32768, 16), (64, 8192, 16), (64, 32768, 16))),
    "--tables": (tables, ((16, 8192, 16), (16, 32768, 16), (16, 32768, 64), (64, 32768, 16))),
    "--kv-heads": (kv_heads, ((16, 8192, 16), (16, 32768, 16), (64, 8192, 16), (16, 32768, 64), (64, 32768, 16))),
}


def main() -> None:
    mode = next((m for m in MODES if m in sys.argv), None)
    if mode is None:
        raise SystemExit(f"usage: paged_probe.py {{{'|'.join(MODES)}}} [--json OUT]")
    build, shapes = MODES[mode]
    deadline = time.monotonic() + 480
    rows: list[dict[str, Any]] = []
    for b, s, ps in shapes:
        case = Case(b, s, ps)
        cands = build(case)
        if cands:
            measure(case, cands, rows, deadline)
        case.free()


if __name__ == "__main__":
    main()
