"""Paged decode and ragged paged attention over the Pallas TPU ragged kernel.

The kernel cannot run in TPU interpret mode on these jax versions (see
``jaxattn_pallas.ragged.rules``), so on CPU the wrappers are checked three ways:

* numerics: the wrappers run over an emulation of the kernel, built from upstream's own
  validation, head tiling and reference (``ref_ragged_paged_attention``), which also
  asserts the preconditions the wrappers promise (no empty real sequence, no page index
  out of range, whole query blocks, head dim a multiple of 128, the tiled head path) and
  leaves NaN wherever the kernel leaves garbage; compared with a float64 NumPy oracle;
* the real kernel: the wrappers are lowered for TPU from this CPU host (the Pallas to
  Mosaic lowering of every kernel argument they build);
* interpret mode: refused, and a canary fails once jax's interpreter starts running the
  kernel, so that the refusal can be lifted.

On a TPU host the numerics tests also run the real kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel

from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.errors import InvalidInputError, UnsupportedError
from jaxattn.testing.paged_conformance import PagedConformanceSuite
from jaxattn_pallas.ragged import rules as ragged_rules
from jaxattn_pallas.ragged.decode import paged_decode
from jaxattn_pallas.ragged.impl import PallasRaggedPagedAttention
from jaxattn_pallas.ragged.kernel import ragged_paged_attention

ON_TPU = jax.default_backend() == "tpu"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The stand-in computes in float32 on the CPU. On a TPU the MXU's float32 matmul passes
# are looser (upstream's own tests use 0.15).
TOLERANCE = {("emulated", "float32"): 2e-5, ("emulated", "bfloat16"): 3e-2,
             ("tpu", "float32"): 1e-2, ("tpu", "bfloat16"): 5e-2}


# --- the kernel's stand-in on CPU -------------------------------------------------------


def _tiled(n: int, packing: int) -> bool:
    return n % packing == 0 and (n // packing in (1, 2, 4, 8) or (n // packing) % 8 == 0)


def _kernel_math(q: np.ndarray, kv: np.ndarray, lens: np.ndarray, table: np.ndarray, cu: np.ndarray, n: int, *,
                 sm_scale: float, sliding_window: int | None, soft_cap: float | None, mask_value: float,
                 out_dtype: Any) -> np.ndarray:
    """The kernel's arithmetic in float32 NumPy, step for step as upstream's
    ``ref_ragged_paged_attention`` states it, with NaN wherever the kernel leaves garbage
    (rows no sequence owns: uninitialised VMEM; rows with no visible key: an average of
    masked keys)."""
    page_size, hkv = kv.shape[1], kv.shape[2] // 2
    group = q.shape[1] // hkv
    out = np.full(q.shape, np.nan, np.float32)
    for s in range(n):
        start, stop, kv_len = int(cu[s]), int(cu[s + 1]), int(lens[s])
        pages = kv[table[s, : -(-kv_len // page_size)]]
        k = np.repeat(pages[:, :, 0::2].reshape(-1, hkv, kv.shape[3])[:kv_len], group, axis=1)
        v = np.repeat(pages[:, :, 1::2].reshape(-1, hkv, kv.shape[3])[:kv_len], group, axis=1)
        attn = np.einsum("qhd,khd->hqk", q[start:stop], k).astype(np.float32) * np.float32(sm_scale)
        q_span = kv_len - (stop - start) + np.arange(stop - start)[None, :, None]
        kv_span = np.arange(kv_len)[None, None, :]
        mask = q_span < kv_span
        if sliding_window is not None:
            mask |= q_span - sliding_window >= kv_span
        if soft_cap is not None:
            attn = np.float32(soft_cap) * np.tanh(attn / np.float32(soft_cap))
        attn = attn + np.where(mask, np.float32(mask_value), np.float32(0))
        attn = np.exp(attn - attn.max(axis=-1, keepdims=True))
        attn /= attn.sum(axis=-1, keepdims=True)
        rows = np.einsum("hqk,khd->qhd", attn, v)
        rows[np.asarray(mask.all(axis=-1))[0]] = np.nan
        out[start:stop] = rows
    return out.astype(out_dtype)


def _emulated_kernel(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = rpa_kernel.DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """The kernel's stand-in: its own static checks at trace time, the wrappers' promises
    asserted on the values, then :func:`_kernel_math` on the host."""
    rpa_kernel.static_validate_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
    )
    q_heads_per_block, _ = rpa_kernel.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype)
    assert _tiled(q_heads_per_block, rpa_kernel.get_dtype_packing(q.dtype)), "kernel left its tiled head path"
    assert q.shape[-1] % 128 == 0, "the kernel asserts head dims of multiples of 128"
    assert num_kv_pages_per_block is not None and num_queries_per_block is not None, "tuned lookup raises off TPU"
    assert q.shape[0] % num_queries_per_block == 0
    assert k_scale is None and v_scale is None

    def host(q: np.ndarray, kv: np.ndarray, lens: np.ndarray, table: np.ndarray, cu: np.ndarray,
             num_seqs: np.ndarray) -> np.ndarray:
        n = int(num_seqs[0])
        num_pages, page_size = kv.shape[:2]
        assert 1 <= n <= lens.shape[0], "num_seqs == 0 leaves the kernel's first prefetch unawaited"
        assert (lens[:n] >= 1).all(), "an empty real sequence breaks the kernel's prefetch chain"
        for s in range(n):
            read = table[s, : -(-lens[s] // page_size)]  # and entry 0, for every slot past the last page
            assert ((read >= 0) & (read < num_pages)).all() and 0 <= table[s, 0] < num_pages
        return _kernel_math(np.asarray(q, np.float32), np.asarray(kv, np.float32), lens, table, cu, n,
                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            mask_value=rpa_kernel.DEFAULT_MASK_VALUE if mask_value is None else mask_value,
                            out_dtype=q.dtype)

    result: jax.Array = jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), q, kv_pages, kv_lens,
                                          page_indices, cu_q_lens, num_seqs)
    return result


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulation_is_upstreams_reference(dtype: str) -> None:
    # The stand-in's arithmetic against upstream's own statement of the kernel, on rows
    # that see a key (where the stand-in has NaN the kernel has garbage).
    c = _make_case([(3, 9), (1, 1), (4, 3)], hq=4, hkv=2, d=128, dtype=dtype, pad_rows=0, seed=7)
    kv = _caches(c, "combined")["kv_pages"]
    q = jnp.asarray(c.q, DTYPES[dtype])
    table = np.maximum(c.page_table, 0)
    features: dict[str, Any] = {"sm_scale": 0.2, "sliding_window": 3, "soft_cap": 2.5}
    # The reference loops over sequences in Python: lengths and offsets stay NumPy constants.
    constants: dict[str, Any] = {"kv_lens": c.kv_lens, "page_indices": table, "cu_q_lens": c.cu_q_lens,
                                 "num_seqs": np.asarray([c.num_seqs], np.int32)}
    ref = functools.partial(rpa_kernel.ref_ragged_paged_attention, **constants, **features)
    theirs = np.asarray(jax.jit(ref)(q, kv).astype(jnp.float32))
    mine = _kernel_math(np.asarray(q, np.float32), np.asarray(kv, np.float32), c.kv_lens, table, c.cu_q_lens,
                        c.num_seqs, mask_value=rpa_kernel.DEFAULT_MASK_VALUE, out_dtype=np.float32, **features)
    assert np.isnan(mine).any(axis=(1, 2)).sum() == 1  # the one row of sequence 2 at position -1
    seen = ~np.isnan(mine).any(axis=(1, 2))
    _check(mine[seen].astype(np.float64), theirs[seen].astype(np.float64), dtype)


@pytest.fixture(params=["emulated", pytest.param("tpu", marks=pytest.mark.skipif(not ON_TPU, reason="needs a TPU"))])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "emulated":
        monkeypatch.setattr(rpa_kernel, "ragged_paged_attention", _emulated_kernel)
    return str(request.param)


# --- inputs and the float64 oracle ------------------------------------------------------


@dataclasses.dataclass
class Case:
    q: np.ndarray  # (num_tokens, Hq, D), already rounded to the dtype
    k: np.ndarray  # (num_pages, page_size, Hkv, D); NaN in every row no sequence uses
    v: np.ndarray  # (num_pages, page_size, Hkv, Dv)
    page_table: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: int
    dtype: str


def _make_case(
    seqs: list[tuple[int, int]],
    *,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    page_size: int = 4,
    max_seqs: int | None = None,
    pad_rows: int = 3,
    dtype: str = "float32",
    seed: int = 0,
) -> Case:
    """``seqs`` are (q_len, kv_len) of the real sequences. Pages are shuffled, sequence 1
    shares sequence 0's first page where both fill it (prefix sharing), unused table
    entries hold junk, padding sequences junk lengths."""
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    n = len(seqs)
    max_seqs = n + 2 if max_seqs is None else max_seqs
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = max([*pages_needed, 1]) + 1
    num_pages = sum(pages_needed) + 3
    order = rng.permutation(num_pages)
    table = rng.choice([-7, num_pages, num_pages + 50, 2**30], size=(max_seqs, pages_per_seq)).astype(np.int32)
    used = 0
    for s, count in enumerate(pages_needed):
        table[s, :count] = order[used : used + count]
        used += count
    if n > 1 and min(seqs[0][1], seqs[1][1]) >= page_size:
        table[1, 0] = table[0, 0]  # a full page, read whole by both
    k = rng.standard_normal((num_pages, page_size, hkv, d))
    v = rng.standard_normal((num_pages, page_size, hkv, dv))
    live = np.zeros((num_pages, page_size), bool)
    for s, (_, kv) in enumerate(seqs):
        for p in range(kv):
            live[table[s, p // page_size], p % page_size] = True
    k[~live], v[~live] = np.nan, np.nan

    kv_lens = np.full(max_seqs, 999, np.int32)  # padding sequences: never read
    kv_lens[:n] = [kv for _, kv in seqs]
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum([ql for ql, _ in seqs])
    num_tokens = int(cu[n]) + pad_rows
    cu[n + 1 :] = np.minimum(cu[n] + np.arange(1, max_seqs - n + 1), num_tokens)  # still non-decreasing
    q = rng.standard_normal((num_tokens, hq, d))

    def rounded(x: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(x, DTYPES[dtype]).astype(jnp.float32), np.float64)

    return Case(rounded(q), rounded(k), rounded(v), table, kv_lens, cu, n, dtype)


def _oracle(c: Case, *, scale: float, logits_soft_cap: float | None = None,
            window_left: int | None = None) -> np.ndarray:
    """Float64: gather each sequence's pages, causal bottom-right per sequence, window, cap."""
    num_tokens, hq, _ = c.q.shape
    page_size, hkv, dv = c.k.shape[1], c.k.shape[2], c.v.shape[3]
    out = np.zeros((num_tokens, hq, dv))
    heads = np.arange(hq) // (hq // hkv)
    for s in range(c.num_seqs):
        length, start, stop = int(c.kv_lens[s]), int(c.cu_q_lens[s]), int(c.cu_q_lens[s + 1])
        pages = c.page_table[s, : -(-length // page_size)]
        keys = c.k[pages].reshape(-1, hkv, c.k.shape[3])[:length]
        values = c.v[pages].reshape(-1, hkv, dv)[:length]
        for r in range(start, stop):
            pos = length - (stop - start) + (r - start)
            low = 0 if window_left is None else max(0, pos - window_left)
            if pos < 0:
                continue
            x = scale * np.einsum("hd,jhd->hj", c.q[r], keys[low : pos + 1, heads])
            if logits_soft_cap is not None:
                x = logits_soft_cap * np.tanh(x / logits_soft_cap)
            p = np.exp(x - x.max(axis=1, keepdims=True))
            out[r] = np.einsum("hj,jhd->hd", p / p.sum(axis=1, keepdims=True), values[low : pos + 1, heads])
    return out


def _caches(c: Case, layout: str) -> dict[str, Any]:
    dt = DTYPES[c.dtype]
    k, v = jnp.asarray(c.k, dt), jnp.asarray(c.v, dt)
    if layout == "separate":
        return {"k_pages": k, "v_pages": v}
    combined = jnp.stack([k, v], axis=3).reshape(*c.k.shape[:2], 2 * c.k.shape[2], c.k.shape[3])
    return {"k_pages": None, "v_pages": None, "kv_pages": combined}


def _ragged(c: Case, layout: str, **features: Any) -> np.ndarray:
    caches = _caches(c, layout)
    run = jax.jit(functools.partial(ragged_paged_attention, **features))
    out = run(
        jnp.asarray(c.q, DTYPES[c.dtype]), caches.pop("k_pages"), caches.pop("v_pages"), jnp.asarray(c.page_table),
        jnp.asarray(c.kv_lens), jnp.asarray(c.cu_q_lens), jnp.asarray([c.num_seqs], jnp.int32), **caches,
    )
    assert out.dtype == DTYPES[c.dtype] and out.shape == (*c.q.shape[:2], c.v.shape[3])
    return np.asarray(out.astype(jnp.float32), np.float64)


def _check(got: np.ndarray, want: np.ndarray, dtype: str, kernel: str = "emulated") -> None:
    tol = TOLERANCE[kernel, dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


# Real sequences: a prefill chunk over a longer cache, a sequence with no queries, a decode
# step on a one-token cache, queries without any cache (zeros), more queries than keys (the
# first row sees nothing), and a cache that is not a whole number of pages.
MIXED = [(3, 9), (0, 5), (1, 1), (2, 0), (3, 2), (4, 6)]
HEADS = {"gqa8": (8, 1, 64), "mha": (2, 2, 128)}  # (Hq, Hkv, D): D = 64 is padded to 128
FEATURES: dict[str, dict[str, Any]] = {"plain": {}, "window_cap": {"window_left": 2, "logits_soft_cap": 1.5}}


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["separate", "combined"])
def test_ragged_matches_oracle(kernel: str, layout: str, dtype: str, heads: str, features: str) -> None:
    hq, hkv, d = HEADS[heads]
    c = _make_case(MIXED, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=len(heads) + len(features))
    scale = 0.7 * d**-0.5
    got = _ragged(c, layout, softmax_scale=scale, **FEATURES[features])
    _check(got, _oracle(c, scale=scale, **FEATURES[features]), dtype, kernel)
    assert not got[int(c.cu_q_lens[c.num_seqs]) :].any()  # padding rows
    assert not got[int(c.cu_q_lens[3]) : int(c.cu_q_lens[4])].any()  # queries without a cache


def test_window_of_zero_sees_only_itself(kernel: str) -> None:
    c = _make_case([(4, 7)], hq=2, hkv=1, d=32)
    got = _ragged(c, "combined", softmax_scale=0.3, window_left=0)
    for row in range(4):
        pos = 3 + row  # the value of the query's own position, for both query heads
        _check(got[row], c.v[c.page_table[0, pos // 4], pos % 4][[0, 0]], "float32", kernel)


def test_heads_and_groups_padded_where_the_kernel_would_not_tile(kernel: str) -> None:
    # float32 with 3 KV heads: 2*Hkv = 6 does not tile (the kernel raises), so a fourth
    # zero KV head is added; bfloat16 12:2 would take the kernel's untiled fallback (the
    # case upstream reports broken), so each group of 6 query heads is padded to 8.
    for dtype, hq, hkv, expect in (("float32", 6, 3, (4, 2)), ("bfloat16", 12, 2, (2, 8))):
        tiling = ragged_rules.ragged_tiling(q_dtype=dtype, kv_dtype=dtype, num_q_heads=hq, num_kv_heads=hkv,
                                            head_dim=16, v_head_dim=16, layout="combined", page_size=4, pages_per_seq=3,
                                            num_tokens=5)
        assert (tiling.num_kv_heads, tiling.q_per_kv) == expect
        c = _make_case([(2, 5), (3, 8)], hq=hq, hkv=hkv, d=16, dtype=dtype, seed=3)
        for layout in ("separate", "combined"):
            _check(_ragged(c, layout, softmax_scale=0.25), _oracle(c, scale=0.25), dtype, kernel)


def test_value_head_dim_differs(kernel: str) -> None:
    c = _make_case([(2, 6), (1, 3)], hq=4, hkv=2, d=40, dv=24, seed=4)
    got = _ragged(c, "separate", softmax_scale=0.2, logits_soft_cap=3.0)
    _check(got, _oracle(c, scale=0.2, logits_soft_cap=3.0), "float32", kernel)


def test_several_query_and_kv_blocks(kernel: str) -> None:
    # 8-row query blocks over 21 rows (padded to 24) and one page per KV block, so that
    # sequences straddle query blocks and every sequence spans several KV blocks.
    c = _make_case([(7, 11), (9, 9), (3, 14)], hq=4, hkv=1, d=32, page_size=3, pad_rows=2, seed=5)
    got = _ragged(c, "combined", softmax_scale=0.2, window_left=5, num_queries_per_block=8, num_kv_pages_per_block=1)
    _check(got, _oracle(c, scale=0.2, window_left=5), "float32", kernel)


@pytest.mark.parametrize("num_seqs", [0, 2])
def test_num_seqs_bounds_real_sequences(kernel: str, num_seqs: int) -> None:
    c = _make_case([(2, 5), (1, 4), (3, 6)], hq=2, hkv=1, d=16, seed=6)
    c.num_seqs = num_seqs  # the rest becomes padding
    caches = _caches(c, "separate")
    out = jax.jit(functools.partial(ragged_paged_attention, softmax_scale=0.5))(
        jnp.asarray(c.q, jnp.float32), caches["k_pages"], caches["v_pages"], jnp.asarray(c.page_table),
        jnp.asarray(c.kv_lens), jnp.asarray(c.cu_q_lens), jnp.int32(num_seqs),  # a scalar
    )
    _check(np.asarray(out, np.float64), _oracle(c, scale=0.5), "float32", kernel)


def test_nothing_to_compute_gives_zeros_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> jax.Array:
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(rpa_kernel, "ragged_paged_attention", never)
    z = jnp.zeros
    no_rows = ragged_paged_attention(z((0, 4, 8)), z((3, 2, 2, 8)), z((3, 2, 2, 5)), z((2, 2), jnp.int32),
                                     z((2,), jnp.int32), z((3,), jnp.int32), z((1,), jnp.int32), softmax_scale=1.0)
    assert no_rows.shape == (0, 4, 5)
    no_pages = ragged_paged_attention(jnp.ones((3, 4, 8)), z((3, 2, 2, 8)), z((3, 2, 2, 5)), z((2, 0), jnp.int32),
                                      z((2,), jnp.int32), z((3,), jnp.int32), z((1,), jnp.int32), softmax_scale=1.0)
    assert no_pages.shape == (3, 4, 5) and not no_pages.any()
    no_seqs = paged_decode(z((0, 2, 4, 8)), z((3, 2, 2, 8)), z((3, 2, 2, 8)), z((0, 2), jnp.int32),
                           z((0,), jnp.int32), softmax_scale=1.0)
    assert no_seqs.shape == (0, 2, 4, 8)


# --- paged decode -----------------------------------------------------------------------


def _decode_case(t: int, dtype: str, hq: int, hkv: int, seed: int) -> Case:
    # kv_lens 9, 0 (no key at all), 2 (fewer keys than queries when T = 3), 4 (one page).
    return _make_case([(t, 9), (t, 0), (t, 2), (t, 4)], hq=hq, hkv=hkv, d=32, max_seqs=4, pad_rows=0, dtype=dtype,
                      seed=seed)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["separate", "combined"])
@pytest.mark.parametrize("t", [1, 3])
def test_paged_decode_matches_oracle(kernel: str, t: int, layout: str, dtype: str, features: str) -> None:
    hq, hkv = (8, 1) if t == 1 else (4, 4)
    c = _decode_case(t, dtype, hq, hkv, seed=t)
    caches = _caches(c, layout)
    b = c.num_seqs
    run = jax.jit(functools.partial(paged_decode, softmax_scale=0.3, **FEATURES[features]))
    out = run(
        jnp.asarray(c.q.reshape(b, t, hq, 32), DTYPES[dtype]), caches.pop("k_pages"), caches.pop("v_pages"),
        jnp.asarray(c.page_table), jnp.asarray(c.kv_lens), **caches,
    )
    assert out.shape == (b, t, hq, 32) and out.dtype == DTYPES[dtype]
    want = _oracle(c, scale=0.3, **FEATURES[features]).reshape(b, t, hq, 32)
    _check(np.asarray(out.astype(jnp.float32), np.float64), want, dtype, kernel)
    assert not np.asarray(out[1]).any()


# --- refusals and malformed calls -------------------------------------------------------


def test_declined_features_raise_every_reason() -> None:
    c = _make_case([(1, 3)], hq=2, hkv=1, d=8)
    caches = _caches(c, "separate")
    args = (jnp.asarray(c.q, jnp.float16), caches["k_pages"], caches["v_pages"], jnp.asarray(c.page_table),
            jnp.asarray(c.kv_lens), jnp.asarray(c.cu_q_lens), jnp.asarray([1], jnp.int32))
    with pytest.raises(UnsupportedError) as err:
        ragged_paged_attention(*args, softmax_scale=1.0, sinks=jnp.zeros(2), interpret=True, window_left=-1)
    text = " | ".join(err.value.reasons)
    for part in ("float16", "share a dtype", "sinks", "interpret", "window_left"):
        assert part in text
    assert len(err.value.reasons) == 5
    with pytest.raises(UnsupportedError, match="pallas_paged_decode"):
        paged_decode(jnp.zeros((1, 1, 2, 8)), caches["k_pages"], caches["v_pages"], jnp.asarray(c.page_table[:1]),
                     jnp.asarray(c.kv_lens[:1]), softmax_scale=1.0, logits_soft_cap=0.0)


def test_malformed_calls() -> None:
    q = jnp.zeros((4, 2, 8))
    k = jnp.zeros((3, 2, 1, 8))
    tables = (jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32),
              jnp.ones((1,), jnp.int32))
    bad: list[Callable[[], object]] = [
        lambda: ragged_paged_attention(q, None, None, *tables, softmax_scale=1.0),
        lambda: ragged_paged_attention(q, k, k, *tables, kv_pages=jnp.zeros((3, 2, 2, 8)), softmax_scale=1.0),
        lambda: ragged_paged_attention(q, None, None, *tables, kv_pages=jnp.zeros((3, 2, 3, 8)), softmax_scale=1.0),
        lambda: ragged_paged_attention(q, jnp.zeros((3, 2, 1, 4)), k, *tables, softmax_scale=1.0),
        lambda: ragged_paged_attention(q, k, k.astype(jnp.bfloat16), *tables, softmax_scale=1.0),
        lambda: ragged_paged_attention(q, k, k, tables[0], tables[1], tables[1], tables[3], softmax_scale=1.0),
        lambda: ragged_paged_attention(q, k, k, *tables[:3], jnp.ones((2,), jnp.int32), softmax_scale=1.0),
        lambda: ragged_paged_attention(q[None], k, k, *tables, softmax_scale=1.0),
        lambda: paged_decode(q, k, k, tables[0], tables[1], softmax_scale=1.0),
        lambda: paged_decode(q[None], k, k, tables[0], tables[1], softmax_scale=1.0),
    ]
    for call in bad:
        with pytest.raises(InvalidInputError):
            call()


# --- the real kernel, lowered for TPU from this host ------------------------------------


def _lower_for_tpu(fn: Callable[..., jax.Array], *args: Any) -> str:
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return str(jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module())


LOWERINGS: dict[str, tuple[str, str, int, int, int, int, dict[str, Any]]] = {
    # (layout, dtype, Hq, Hkv, D, Dv, features)
    "combined_bf16_gqa8_window_cap": ("combined", "bfloat16", 8, 1, 128, 128, FEATURES["window_cap"]),
    "separate_f32_mha_d64": ("separate", "float32", 2, 2, 64, 64, {}),
    "separate_bf16_dv_differs": ("separate", "bfloat16", 4, 2, 80, 48, {"logits_soft_cap": 2.0}),
    "combined_bf16_12to2_group_padded": ("combined", "bfloat16", 12, 2, 128, 128, {}),
    "combined_f32_6to3_heads_padded": ("combined", "float32", 6, 3, 256, 256, {"window_left": 0}),
}


@pytest.mark.parametrize("name", LOWERINGS)
def test_real_kernel_lowers_for_tpu(name: str) -> None:
    layout, dtype, hq, hkv, d, dv, features = LOWERINGS[name]
    dt = DTYPES[dtype]
    sds = jax.ShapeDtypeStruct
    if layout == "separate":
        caches = [sds((40, 16, hkv, d), dt), sds((40, 16, hkv, dv), dt)]
    else:
        caches = [sds((40, 16, 2 * hkv, d), dt)]
    i32 = jnp.int32

    def ragged(q: jax.Array, *rest: jax.Array) -> jax.Array:
        kv: dict[str, Any] = {"kv_pages": rest[0]} if layout == "combined" else {}
        kn, vn = (None, None) if layout == "combined" else rest[:2]
        table, lens, cu, n = rest[-4:]
        return ragged_paged_attention(q, kn, vn, table, lens, cu, n, softmax_scale=0.1, **kv, **features)

    def decode(q: jax.Array, *rest: jax.Array) -> jax.Array:
        kv: dict[str, Any] = {"kv_pages": rest[0]} if layout == "combined" else {}
        kn, vn = (None, None) if layout == "combined" else rest[:2]
        return paged_decode(q, kn, vn, rest[-2], rest[-1], softmax_scale=0.1, **kv, **features)

    text = _lower_for_tpu(ragged, sds((70, hq, d), dt), *caches, sds((6, 5), i32), sds((6,), i32), sds((7,), i32),
                          sds((1,), i32))
    assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text
    text = _lower_for_tpu(decode, sds((6, 3, hq, d), dt), *caches, sds((6, 5), i32), sds((6,), i32))
    assert "ragged_paged_attention_kernel" in text


# --- interpret mode ---------------------------------------------------------------------


def test_interpret_mode_is_refused_where_the_interpreter_cannot_run_the_kernel() -> None:
    reasons = ragged_rules.ragged_reasons(q_dtype="float32", kv_dtype="float32", num_q_heads=2, num_kv_heads=1,
                                         head_dim=128, v_head_dim=128, layout="combined", page_size=4, interpret=True)
    assert reasons == ([] if ragged_rules.interpreter_runs_kernel("float32") else [reasons[0]])
    if reasons:
        assert "TPU interpret mode of jax" in reasons[0] and "reshapes and bitcasts" in reasons[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_interpreter_probe_is_a_tpu_kernel(dtype: str) -> None:
    # So a False from the probe is the interpreter's limit, not a kernel of ours that no TPU
    # would run either.
    call, x = ragged_rules.interpreter_probe(dtype)
    text = jax.jit(call).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.fixture
def interpreter_reset() -> Iterator[None]:
    yield
    pltpu.reset_tpu_interpret_mode_state()  # a failed interpretation poisons the next one


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_interpreter_probe_agrees_with_the_kernel(dtype: str, monkeypatch: pytest.MonkeyPatch,
                                                      interpreter_reset: None) -> None:
    # The probe's answer on this jax is what the kernel does: where it says no, the kernel
    # fails in the interpreter as the probe did; where it says yes, the kernel runs (and the
    # conformance suite's numerics run in interpret mode: tests/pallas/test_paged_conformance).
    runs = ragged_rules.interpreter_runs_kernel(dtype)
    c = _make_case([(1, 3)], hq=2, hkv=1, d=128, pad_rows=0, dtype=dtype)
    monkeypatch.setattr(ragged_rules, "interpreter_runs_kernel", lambda _: True)
    if runs:
        _ragged(c, "combined", softmax_scale=1.0, interpret=True)
    else:
        with pytest.raises(Exception, match="ReshapeTransform"):
            _ragged(c, "combined", softmax_scale=1.0, interpret=True)


# --- the static rules -------------------------------------------------------------------


def _facts(**changes: Any) -> dict[str, Any]:
    facts: dict[str, Any] = {"q_dtype": "bfloat16", "kv_dtype": "bfloat16", "num_q_heads": 8, "num_kv_heads": 2,
                             "head_dim": 128, "v_head_dim": 128, "layout": "combined", "page_size": 16}
    return facts | changes


def test_reasons_accept_the_supported_calls() -> None:
    assert ragged_rules.ragged_reasons(**_facts()) == []
    assert ragged_rules.ragged_reasons(**_facts(q_dtype="float32", kv_dtype="float32", num_q_heads=3,
                                               num_kv_heads=3, head_dim=20, v_head_dim=20, page_size=1,
                                               logits_soft_cap=30.0, window_left=0, tpu_generation=6)) == []
    assert ragged_rules.ragged_reasons(**_facts(layout="separate", v_head_dim=64)) == []
    assert ragged_rules.paged_decode_reasons(q_len=4, **_facts(window_left=7)) == []
    assert ragged_rules.ragged_reasons(**_facts(interpret=True, interpreter_runs=True)) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"q_dtype": "float16", "kv_dtype": "float16"}, ["q dtype float16", "KV cache dtype float16"]),
        ({"kv_dtype": "float32"}, ["share a dtype"]),
        ({"num_q_heads": 6, "num_kv_heads": 4}, ["not a multiple"]),
        ({"v_head_dim": 64}, ["one head dim"]),
        ({"head_dim": 0, "v_head_dim": 0}, ["positive"]),
        ({"page_size": 0}, ["page_size"]),
        ({"softmax_scale": float("nan")}, ["softmax_scale"]),
        ({"logits_soft_cap": -1.0}, ["logits_soft_cap"]),
        ({"window_left": -1}, ["window_left"]),
        ({"window_left": 2.0}, ["window_left"]),
        ({"has_sinks": True}, ["sinks"]),
        ({"num_queries_per_block": 0, "num_kv_pages_per_block": -1}, ["num_queries_per_block", "num_kv_pages"]),
        ({"interpret": True, "interpreter_runs": False}, ["TPU interpret mode of jax"]),
        ({"tpu_generation": 3}, ["TPU v4 or newer"]),
        ({"layout": "separate", "allow_cache_copy": False}, ["interleaved"]),
        ({"head_dim": 64, "v_head_dim": 64, "allow_cache_copy": False}, ["zero-padded from 64 to 128"]),
        ({"num_kv_heads": 3, "num_q_heads": 6, "allow_cache_copy": False}, ["zero KV heads added (3 -> 4)"]),
    ],
)
def test_reasons_name_each_refusal(changes: dict[str, Any], expected: list[str]) -> None:
    reasons = ragged_rules.ragged_reasons(**_facts(**changes))
    assert len(reasons) == len(expected)
    for reason, part in zip(reasons, expected, strict=True):
        assert part in reason


def test_paged_decode_reasons() -> None:
    assert ragged_rules.paged_decode_reasons(q_len=-1, **_facts(has_sinks=True))[0].startswith("q_len")
    assert len(ragged_rules.paged_decode_reasons(q_len=0, **_facts(has_sinks=True))) == 1


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_head_tiling_mirrors_the_kernel(q_dtype: str, kv_dtype: str) -> None:
    for hkv in range(1, 20):
        for group in (1, 2, 3, 4, 6, 8):
            mine = ragged_rules.kernel_heads_per_block(hkv * group, hkv, q_dtype, kv_dtype)
            try:
                theirs: tuple[int, int] | None = rpa_kernel.get_min_heads_per_blk(
                    hkv * group, 2 * hkv, jnp.dtype(q_dtype), jnp.dtype(kv_dtype))
            except ValueError:
                theirs = None
            assert mine == theirs, (hkv, group)


def test_tilings() -> None:
    tiling = ragged_rules.ragged_tiling(**_facts(pages_per_seq=64, num_tokens=70))
    assert tiling == ragged_rules.RaggedTiling(head_dim=128, num_kv_heads=2, q_per_kv=4, num_queries_per_block=32,
                                          num_kv_pages_per_block=16, num_tokens=96, sliding_window=None,
                                          cache_copy=None)
    # Small calls get small blocks; a big page shrinks the KV block to the VMEM budget.
    small = ragged_rules.ragged_tiling(**_facts(pages_per_seq=3, num_tokens=5, window_left=4))
    assert (small.num_queries_per_block, small.num_kv_pages_per_block, small.num_tokens) == (5, 3, 5)
    assert small.sliding_window == 5
    big = ragged_rules.ragged_tiling(**_facts(q_dtype="float32", kv_dtype="float32", page_size=1024, head_dim=256,
                                           v_head_dim=256, pages_per_seq=64, num_tokens=8))
    assert big.num_kv_pages_per_block == 1
    explicit = ragged_rules.ragged_tiling(**_facts(pages_per_seq=3, num_tokens=5, num_queries_per_block=4,
                                                num_kv_pages_per_block=9))
    assert (explicit.num_queries_per_block, explicit.num_kv_pages_per_block, explicit.num_tokens) == (4, 3, 8)
    # What copies the cache, said once per call.
    separate = ragged_rules.ragged_tiling(**_facts(layout="separate", head_dim=64, v_head_dim=32, pages_per_seq=1,
                                                num_tokens=1))
    assert separate.cache_copy is not None and "interleaved" in separate.cache_copy
    assert "64 (K) and 32 (V) to 128" in separate.cache_copy
    with pytest.raises(ValueError, match="page_size"):
        ragged_rules.ragged_tiling(**_facts(page_size=0, pages_per_seq=1, num_tokens=1))


# --- the registered backend over the emulated kernel --------------------------------------

FAKE_TPU = DeviceInfo(platform="tpu", device_kind="TPU v5 lite", tpu_generation="v5e")


class TestRaggedBackendOverTheEmulatedKernel(PagedConformanceSuite):
    """``ragged_page_attention_v3`` as registered (``PallasRaggedPagedAttention``: its declines,
    the contract's arguments handed to the wrapper, x64 handling) against the paged conformance
    suite, on a TPU host as jaxattn sees it (a fake one here, with the kernel emulated: it
    cannot run in interpret mode on this jax); on a TPU host, the real kernel."""

    metadata = AttentionMetadata(platform="tpu")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    _impl: ClassVar[PallasRaggedPagedAttention | None] = None

    @classmethod
    def make_impl(cls) -> PallasRaggedPagedAttention:
        if cls._impl is None:
            cls._impl = PallasRaggedPagedAttention(cls.metadata, None if ON_TPU else FAKE_TPU)
        return cls._impl

    @pytest.fixture(autouse=True)
    def _kernel(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if not ON_TPU:
            monkeypatch.setattr(rpa_kernel, "ragged_paged_attention", _emulated_kernel)
