"""``jaxattn bench --serving``: decode and ragged serving calls over a paged KV cache, side by side.

Decode is memory-bound: a step reads every cached key and value once, so the figure of merit
is the bandwidth achieved, ``bytes of K and V read / time``, against what the device can read
at all (``memory read``: a reduction over exactly those bytes, timed in the same run). Per
shape, in one process:

* every paged backend here (``paged_attention(impl=name)``; ``ragged_paged_attention`` for
  mixed batches) and paged "auto";
* dense decode on the same tokens: every dense backend here that accepts a decode step over a
  dense cache of the same length (cuDNN through ``cudnn``, ``flash_attn2``'s split-K path,
  ``autoregressive_decodeattn``, ...), fed a contiguous cache (the layout costs nothing to
  read there, so it is the bar a paged kernel must meet);
* JAX's Pallas GPU ``paged_attention`` on CUDA GPUs (its own layout, built untimed).

With ``--kv-dtype`` (int8, fp8 = float8_e4m3fn, fp8_e5m2) the paged backends read a quantized
cache of the same tokens (``jaxattn.quantize_kv`` at ``--kv-granularity``): their rows count the
bytes actually read (narrow values + float32 scales), the memory-read bar reads exactly those
bytes, and beside them run the 16-bit paged kernel (rows ``NAME (16-bit cache)``) and dense
decode (cuDNN) over the 16-bit cache, so the ratios compare a quantized decode with a 16-bit
one over the same tokens in the same run. Every row also reports tokens/s (query tokens
computed per second: the decode throughput of the step).

A mixed shape packs prefill chunks and decode steps in one ragged call; each paged backend is
also timed running the two parts as separate calls, so "mixed vs separate" shows whether the
single call is at least as fast. Timing follows ``jaxattn bench`` (compiled ahead of time,
back-to-back samples, pre-roll on accelerators: :mod:`jaxattn_bench.timing`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxattn.backend import KV_DTYPE_FLAGS, AttentionMetadata

from .timing import Program, median, platform_defaults, platform_of, preroll, run_once, run_sample, size_samples

__all__ = ["ServingResult", "ServingShape", "auto_summary", "auto_vs_best", "fastest_paged", "run_serving",
           "serving_matrix"]

READ_PEAK = "memory read"
PALLAS_GPU_PAGED = "pallas_gpu_paged"
#: The rows ratios are taken against, first that ran: cuDNN's dense decode on NVIDIA GPUs, the
#: paged kernel where one serves page_attention, the pure-JAX paged reference elsewhere.
REFERENCES = ("cudnn (dense)", "page_attention", "vanilla_paged")
#: How a shape's page tables lay its sequences out in the pool (see ServingShape).
POOLS = ("random", "in order", "address order", "runs of 16")
_POOL_LABELS = {"random": "", "in order": " pages in order", "address order": " pages in address order",
                "runs of 16": " pages in runs of 16"}
#: Consecutive pages an allocator hands out at once in the "runs of 16" pool.
RUN = 16
#: Rows of a quantized shape that time a paged backend on the 16-bit cache of the same tokens.
WIDE_SUFFIX = " (16-bit cache)"


@dataclasses.dataclass(frozen=True)
class ServingShape:
    """``batch`` decode sequences of ``context`` cached tokens (T=``queries`` each); with
    ``prefill`` > 0 also ``prefill`` sequences adding a ``chunk``-token prefill chunk (a ragged
    mixed batch). ``pool``: ``"random"`` (a fragmented pool: every page table a random
    permutation of the pool's pages), ``"in order"`` (a fresh pool: each sequence's pages
    consecutive in memory), ``"address order"`` (the fragmented pool, each row's fully
    visible pages listed in address order by ``jaxattn.pages_in_address_order``, as an engine
    may pass them) or ``"runs of 16"`` (fragmented in runs of 16 consecutive pages, the runs in
    a random order: an allocator that grows a sequence 16 pages at a time)."""

    batch: int
    context: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    dtype: str
    queries: int = 1
    prefill: int = 0
    chunk: int = 0
    pool: str = "random"
    kv_dtype: str | None = None  # a quantized cache ("int8", "float8_e4m3fn", "float8_e5m2"), else None
    granularity: str = "token"  # of the quantized cache's scales: "tensor", "head" or "token"

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool={self.pool!r} must be one of {POOLS}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPE_FLAGS.values():
            raise ValueError(f"kv_dtype={self.kv_dtype!r} must be one of {sorted(KV_DTYPE_FLAGS.values())}")

    @property
    def mixed(self) -> bool:
        return self.prefill > 0

    @property
    def label(self) -> str:
        heads = f"H{self.heads_q}/{self.heads_kv}"
        base = f"B{self.batch} ctx{self.context} {heads} D{self.head_dim} page{self.page_size}"
        if self.mixed:
            base += f" + {self.prefill}x{self.chunk} prefill"
        elif self.queries != 1:
            base += f" T{self.queries}"
        if self.kv_dtype is not None:
            base += f" {self.kv_dtype} per {self.granularity}"
        return base + _POOL_LABELS[self.pool]

    @property
    def num_seqs(self) -> int:
        return self.batch + self.prefill

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def query_tokens(self) -> int:
        """Query tokens a call computes (decode rows and prefill chunks): tokens/s counts these."""
        return self.batch * self.queries + self.prefill * self.chunk

    def wide_bytes(self) -> int:
        """Bytes of a 16-bit (``dtype``) K and V cache a call reads: every cached token of every
        sequence, once."""
        import numpy as np

        itemsize = np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2
        return self.num_seqs * self.context * self.heads_kv * 2 * self.head_dim * itemsize

    def kv_bytes(self) -> int:
        """Bytes of K and V the paged backends read: :meth:`wide_bytes`, or for a quantized
        cache its one-byte values plus the float32 scales read (K's and V's)."""
        if self.kv_dtype is None:
            return self.wide_bytes()
        tokens = self.num_seqs * self.context
        scales = {"tensor": 1, "head": self.heads_kv, "token": tokens * self.heads_kv}[self.granularity]
        return tokens * self.heads_kv * 2 * self.head_dim + 2 * 4 * scales

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label}


def serving_matrix(*, quick: bool = False, dtype: str = "bfloat16", kv_dtype: str | None = None,
                   granularity: str = "token") -> list[ServingShape]:
    """The issue's targets: bf16, D=128, GQA 32/8, pages of 16 and 64, batch 16 and 64, 2k-64k
    tokens; plus mixed batches. ``quick``: tiny shapes for a CPU. With ``kv_dtype`` the
    quantized cache's targets: 8k-64k tokens, 16 and 64 sequences, pages of 16 and 64, two
    mixed batches, then 16 sequences of 512-4k tokens."""
    if kv_dtype is not None:
        return [dataclasses.replace(s, kv_dtype=kv_dtype, granularity=granularity)
                for s in _quantized_matrix(quick, dtype)]
    if quick:
        return [ServingShape(4, 96, 4, 2, 32, 16, dtype), ServingShape(4, 96, 4, 2, 32, 16, dtype, queries=2),
                ServingShape(4, 96, 4, 2, 32, 16, dtype, prefill=2, chunk=24)]
    def decode(ps: int) -> list[ServingShape]:
        return [ServingShape(b, ctx, 32, 8, 128, ps, dtype) for b in (16, 64) for ctx in (2048, 8192, 32768)]

    # Each target early, so that a run under --time-budget covers them all: decode with pages
    # of 16, the mixed batches, pages of 64, then the longest contexts; last, two shapes again
    # on a fresh pool (pages in order), which shows what the random page order costs, three on
    # the random pool with each row's pages listed in address order, and two on a pool
    # fragmented in runs of 16 pages.
    return [*decode(16),
            ServingShape(64, 4096, 32, 8, 128, 16, dtype, prefill=4, chunk=512),
            ServingShape(32, 16384, 32, 8, 128, 64, dtype, prefill=2, chunk=2048),
            *decode(64),
            *(ServingShape(16, 65536, 32, 8, 128, ps, dtype) for ps in (16, 64)),
            *(ServingShape(16, ctx, 32, 8, 128, 16, dtype, pool="in order") for ctx in (8192, 32768)),
            *(ServingShape(16, ctx, 32, 8, 128, 16, dtype, pool="address order") for ctx in (8192, 32768, 65536)),
            *(ServingShape(16, ctx, 32, 8, 128, 16, dtype, pool="runs of 16") for ctx in (32768, 65536))]


def _quantized_matrix(quick: bool, dtype: str) -> list[ServingShape]:
    if quick:
        return [ServingShape(4, 96, 4, 2, 32, 16, dtype), ServingShape(4, 96, 4, 2, 32, 16, dtype, prefill=2, chunk=24)]
    # Pages of 16 first (the common size), the mixed batches, then pages of 64 and 64k contexts;
    # last, short contexts (512 to 4k tokens), where a quantized cache must not be slower than
    # the 16-bit one.
    return [*(ServingShape(b, ctx, 32, 8, 128, 16, dtype) for b in (16, 64) for ctx in (8192, 32768)),
            ServingShape(64, 4096, 32, 8, 128, 16, dtype, prefill=4, chunk=512),
            ServingShape(32, 16384, 32, 8, 128, 64, dtype, prefill=2, chunk=2048),
            *(ServingShape(b, ctx, 32, 8, 128, 64, dtype) for b in (16, 64) for ctx in (8192, 32768)),
            *(ServingShape(16, 65536, 32, 8, 128, ps, dtype) for ps in (16, 64)),
            *(ServingShape(16, ctx, 32, 8, 128, 16, dtype) for ctx in (512, 1024, 2048, 4096))]


@dataclasses.dataclass
class ServingResult:
    shape: ServingShape
    backend: str
    status: str  # "ok", "declined", "failed"
    reason: str = ""
    note: str = ""
    median_ms: float | None = None
    gbps: float | None = None
    ratio: float | None = None  # reference time / this time: > 1 is faster than the reference
    of_read_peak: float | None = None  # GB/s as a fraction of the memory-read peer's
    times_ms: list[float] = dataclasses.field(default_factory=list)
    bytes_read: int | None = None  # K and V bytes this row's call reads (values + scales when quantized)
    tokens_per_s: float | None = None  # query tokens computed per second

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = self.shape.to_dict()
        out.update(row_fields(self.backend, self.shape.kv_dtype))
        return out


def row_fields(label: str, kv_dtype: str | None) -> dict[str, Any]:
    """What a row's label packs, as fields: ``impl`` (a registered name, or None for the bar and
    the outside kernel), ``call`` (paged, separate calls, dense, memory read, outside) and ``cache``
    (the dtype of the K/V it reads: the shape's quantized format, or "16-bit")."""
    suffixes = ((" (dense)", "dense", False), (" separate", "separate calls", True), (WIDE_SUFFIX, "paged", False))
    for suffix, call, narrow in suffixes:
        if label.endswith(suffix):
            return {"impl": label[: -len(suffix)], "call": call, "cache": (narrow and kv_dtype) or "16-bit"}
    if label in (READ_PEAK, PALLAS_GPU_PAGED, "(every backend)"):
        call = {READ_PEAK: "memory read", PALLAS_GPU_PAGED: "outside"}.get(label, "none")
        return {"impl": None, "call": call, "cache": "16-bit" if label == PALLAS_GPU_PAGED else kv_dtype or "16-bit"}
    return {"impl": label, "call": "paged", "cache": kv_dtype or "16-bit"}


# -- inputs ------------------------------------------------------------------------------------
def _inputs(shape: ServingShape, seed: int = 0) -> dict[str, Any]:
    """The cache (laid out as the shape's pool says), tables and queries, on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = jnp.dtype(shape.dtype)
    n, per_seq = shape.num_seqs, shape.pages_per_seq
    rng = np.random.default_rng(seed)
    num_pages = n * per_seq
    if shape.pool == "in order":
        order = np.arange(num_pages)
    elif shape.pool == "runs of 16":
        runs = -(-num_pages // RUN)  # the pool rounded up to whole runs; the last one's tail unused
        order = (rng.permutation(runs)[:, None] * RUN + np.arange(RUN)).ravel()[:num_pages]
        num_pages = runs * RUN
    else:
        order = rng.permutation(num_pages)
    table = order.reshape(n, per_seq).astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), 4)
    pool = (num_pages, shape.page_size, shape.heads_kv, shape.head_dim)
    k_pages = jax.random.normal(keys[0], pool, dtype)
    v_pages = jax.random.normal(keys[1], pool, dtype)
    q_lens = [shape.queries] * shape.batch + [shape.chunk] * shape.prefill
    if shape.pool == "address order":
        from jaxattn.backend import pages_in_address_order

        table = pages_in_address_order(table, np.full(n, shape.context), shape.page_size, q_lens=np.asarray(q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jax.random.normal(keys[2], (int(cu[-1]), shape.heads_q, shape.head_dim), dtype)
    out = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "page_table": jnp.asarray(table),
           "kv_lengths": jnp.full((n,), shape.context, jnp.int32), "cu_q_lens": jnp.asarray(cu),
           "num_seqs": jnp.asarray([n], jnp.int32)}
    if shape.kv_dtype is not None:
        from jaxattn.backend import quantize_kv

        # The same tokens quantized (under jit: no full-size float32 temporaries).
        quantize = jax.jit(lambda x: quantize_kv(x, shape.kv_dtype, shape.granularity))
        out["kq_pages"], out["k_scale"] = quantize(k_pages)
        out["vq_pages"], out["v_scale"] = quantize(v_pages)
    return dict(zip(out, jax.block_until_ready(tuple(out.values())), strict=True))


def _dense_cache(shape: ServingShape, arrays: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The same tokens as a contiguous dense cache ``(B, context, Hkv, D)``, and q ``(B, 1, Hq, D)``."""
    import jax

    n, ctx = shape.batch, shape.context
    table = arrays["page_table"][:n]
    k = arrays["k_pages"][table].reshape(n, -1, shape.heads_kv, shape.head_dim)[:, :ctx]
    v = arrays["v_pages"][table].reshape(n, -1, shape.heads_kv, shape.head_dim)[:, :ctx]
    q = arrays["q"].reshape(n, shape.queries, shape.heads_q, shape.head_dim)
    q, k, v = jax.block_until_ready((q, k, v))
    return q, k, v


# -- backends ------------------------------------------------------------------------------------
Runnable = tuple[Callable[..., Any], tuple[Any, ...], str]  # (fn, args, note)


def _cache(arrays: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """The arrays a paged call reads: the 16-bit cache, or the quantized one with its scales."""
    if not quantized:
        return arrays
    return {**arrays, "k_pages": arrays["kq_pages"], "v_pages": arrays["vq_pages"]}


def _scales(arrays: dict[str, Any], quantized: bool) -> dict[str, Any]:
    return {"k_scale": arrays["k_scale"], "v_scale": arrays["v_scale"]} if quantized else {}


def _paged(name: str, md: AttentionMetadata, shape: ServingShape, arrays: dict[str, Any],
           quantized: bool = False) -> Runnable:
    import jaxattn

    scales = _scales(arrays, quantized)
    a = _cache(arrays, quantized)
    if shape.mixed:
        exp = jaxattn.explain_paged(a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"],
                                    a["cu_q_lens"], a["num_seqs"], impl=name, metadata=md, **scales)
    else:
        q4 = a["q"].reshape(shape.batch, shape.queries, shape.heads_q, shape.head_dim)
        exp = jaxattn.explain_paged(q4, a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"], impl=name,
                                    metadata=md, **scales)
    if exp.chosen is None:
        row = next((c for c in exp.candidates if c.name == name and c.here), None)
        raise _Declined("; ".join(row.reasons) if row else f"no paged impl named {name!r} here")
    note = f"-> {exp.chosen}" if name == "auto" else ""
    if shape.mixed:
        def fn(q: Any, kp: Any, vp: Any, table: Any, lengths: Any, cu: Any, count: Any, *kv_scales: Any) -> Any:
            return jaxattn.ragged_paged_attention(q, kp, vp, table, lengths, cu, count, impl=name, metadata=md,
                                                  **dict(zip(scales, kv_scales, strict=True)))

        return fn, (a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"], a["cu_q_lens"],
                    a["num_seqs"], *scales.values()), note

    def decode(q: Any, kp: Any, vp: Any, table: Any, lengths: Any, *kv_scales: Any) -> Any:
        return jaxattn.paged_attention(q, kp, vp, table, lengths, impl=name, metadata=md,
                                       **dict(zip(scales, kv_scales, strict=True)))

    return decode, (q4, a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"], *scales.values()), note


def _separate(name: str, md: AttentionMetadata, shape: ServingShape, arrays: dict[str, Any],
              quantized: bool = False) -> Runnable:
    """A mixed batch as two ragged calls: the decode rows, then the prefill chunks."""
    import jax.numpy as jnp

    import jaxattn

    scales = _scales(arrays, quantized)
    a, b = _cache(arrays, quantized), shape.batch
    split = b * shape.queries
    cu = a["cu_q_lens"]
    decode_cu = cu[: b + 1]
    prefill_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), cu[b + 1:] - cu[b]])

    def fn(q: Any, kp: Any, vp: Any, table: Any, lengths: Any, *kv_scales: Any) -> Any:
        kw = dict(zip(scales, kv_scales, strict=True))
        first = jaxattn.ragged_paged_attention(q[:split], kp, vp, table[:b], lengths[:b], decode_cu, b, impl=name,
                                               metadata=md, **kw)
        second = jaxattn.ragged_paged_attention(q[split:], kp, vp, table[b:], lengths[b:], prefill_cu,
                                                shape.prefill, impl=name, metadata=md, **kw)
        return jnp.concatenate([first, second])

    _paged(name, md, shape, arrays, quantized)  # declines the same way as the mixed call
    return fn, (a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"], *scales.values()), "two calls"


def _dense(name: str, md: AttentionMetadata, shape: ServingShape, dense: tuple[Any, Any, Any]) -> Runnable:
    import jaxattn

    q, k, v = dense
    impl = jaxattn.get_impl(name, md)
    reasons = impl.supports(q, k, v, causal=True)
    if reasons:
        raise _Declined("; ".join(reasons))

    def fn(q: Any, k: Any, v: Any) -> Any:
        return jaxattn.attention(q, k, v, impl=name, causal=True, metadata=md)

    return fn, dense, "dense cache"


def _pallas_gpu(shape: ServingShape, arrays: dict[str, Any]) -> Runnable:
    from jaxattn.backend import detect_device

    device = detect_device()
    if device.platform != "gpu" or device.vendor != "cuda":
        raise _Declined(f"needs a CUDA GPU (Pallas Triton lowering); this is {device.label}")
    if shape.mixed or shape.queries != 1:
        raise _Declined("decode steps only (one query per sequence)")
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError as err:
        raise _Declined(f"not importable: {err}") from None
    import jax

    # Its layout: (Hkv, num_pages, page_size, D); built once, untimed.
    kp, vp = (jax.block_until_ready(arrays[n].transpose(2, 0, 1, 3)) for n in ("k_pages", "v_pages"))
    q3 = arrays["q"]
    pages = max(1, min(8, 128 // shape.page_size))
    while shape.pages_per_seq % pages:
        pages //= 2

    def fn(q: Any, kp: Any, vp: Any, table: Any, lengths: Any) -> Any:
        return paged_attention(q, kp, vp, table, lengths, pages_per_compute_block=pages)

    return fn, (q3, kp, vp, arrays["page_table"], arrays["kv_lengths"]), f"{pages} pages per block"


def _read_peak(arrays: dict[str, Any], quantized: bool = False) -> Runnable:
    import jax.numpy as jnp

    def fn(kp: Any, vp: Any, *kv_scales: Any) -> Any:
        total = jnp.sum(kp, dtype=jnp.float32) + jnp.sum(vp, dtype=jnp.float32)
        return total + sum((jnp.sum(s) for s in kv_scales), jnp.float32(0))

    if quantized:
        return (fn, (arrays["kq_pages"], arrays["vq_pages"], arrays["k_scale"], arrays["v_scale"]),
                "a reduction over the quantized cache (values + scales): the bandwidth bar")
    return fn, (arrays["k_pages"], arrays["v_pages"]), "a reduction over the cache: the bandwidth bar"


class _Declined(Exception):
    pass


# -- running -------------------------------------------------------------------------------------
def _compile(fn: Callable[..., Any], args: tuple[Any, ...]) -> Program:
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return Program(compiled, None, time.perf_counter() - start)


def _candidates(shape: ServingShape, md: AttentionMetadata, paged: Sequence[str], dense: Sequence[str],
                arrays: dict[str, Any]) -> list[tuple[str, Callable[[], Runnable], int]]:
    """``(row name, how to build its call, bytes of K and V it reads)`` of every row of a shape."""
    quant = shape.kv_dtype is not None
    narrow, wide = shape.kv_bytes(), shape.wide_bytes()
    out: list[tuple[str, Callable[[], Runnable], int]] = [(READ_PEAK, lambda: _read_peak(arrays, quant), narrow)]
    for name in paged:
        out.append((name, lambda name=name: _paged(name, md, shape, arrays, quant), narrow))  # type: ignore[misc]
        if shape.mixed and name != "auto":
            out.append((f"{name} separate",
                        lambda name=name: _separate(name, md, shape, arrays, quant), narrow))  # type: ignore[misc]
        if quant and name != "auto":  # the same backend over the 16-bit cache of the same tokens
            out.append((name + WIDE_SUFFIX, lambda name=name: _paged(name, md, shape, arrays), wide))  # type: ignore[misc]
    if not shape.mixed:
        cache: list[tuple[Any, Any, Any]] = []

        def dense_inputs() -> tuple[Any, Any, Any]:
            if not cache:
                cache.append(_dense_cache(shape, arrays))
            return cache[0]

        out += [(f"{name} (dense)", lambda name=name: _dense(name, md, shape, dense_inputs()), wide)  # type: ignore[misc]
                for name in dense]
        if not quant:  # JAX's Pallas GPU kernel reads 16-bit caches only: not part of a quantized run
            out.append((PALLAS_GPU_PAGED, lambda: _pallas_gpu(shape, arrays), wide))
    return out


def run_serving(shapes: Sequence[ServingShape], *, paged: Sequence[str], dense: Sequence[str],
                metadata: AttentionMetadata, repeats: int = 10, reference: str | None = None,
                min_sample_ms: float | None = None, preroll_ms: float | None = None,
                time_budget_s: float | None = None,
                on_result: Callable[[ServingResult], None] | None = None) -> list[ServingResult]:
    """Time every backend on every shape; ratios against ``reference`` (default: the first of
    ``REFERENCES`` that ran, else the first row that ran).

    After ``time_budget_s`` no new shape starts: each one left is a single ``skipped`` row.
    ``on_result`` sees every row of a shape once the shape is done (to rewrite a JSON file, so
    that a run cut short keeps what it finished).
    """
    default_sample, default_preroll = platform_defaults(platform_of(metadata))
    sample_ms = default_sample if min_sample_ms is None else min_sample_ms
    roll_ms = default_preroll if preroll_ms is None else preroll_ms
    results: list[ServingResult] = []
    start = time.perf_counter()
    for i, shape in enumerate(shapes):
        spent = time.perf_counter() - start
        if time_budget_s is not None and spent > time_budget_s:
            skipped = ServingResult(shape, "(every backend)", "skipped",
                                    f"time budget of {time_budget_s:.0f} s spent after {i} shapes ({spent:.0f} s)")
            results.append(skipped)
            if on_result is not None:
                on_result(skipped)
            continue
        arrays = _inputs(shape)
        timed: list[tuple[ServingResult, Program, tuple[Any, ...], int, int]] = []
        for name, make, nbytes in _candidates(shape, metadata, paged, dense, arrays):
            result = ServingResult(shape, name, "ok", bytes_read=nbytes)
            try:
                fn, args, result.note = make()
                program = _compile(fn, args)
                run_once(program, args)  # warm-up
                number, rolls = size_samples(program, args, run_once(program, args), sample_ms, roll_ms)
                timed.append((result, program, args, number, rolls))
            except _Declined as why:
                result.status, result.reason = "declined", str(why)
            except Exception as err:  # a backend that fails is a row, not a crash
                result.status, result.reason = "failed", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            results.append(result)
        # Samples in two rounds, the second in reverse order, so drift hits every backend alike.
        for round_ in range(2):
            for result, program, args, number, rolls in (timed if round_ == 0 else timed[::-1]):
                preroll(program, args, rolls)
                result.times_ms += [run_sample(program, args, number) for _ in range(max(1, repeats // 2))]
        _summarise(shape, [r for r in results if r.shape == shape], reference)
        for r in results:
            if r.shape == shape and on_result is not None:
                on_result(r)
    return results


def _summarise(shape: ServingShape, rows: list[ServingResult], reference: str | None) -> None:
    for r in rows:
        if r.ok and r.times_ms:
            r.median_ms = median(r.times_ms)
            r.gbps = (r.bytes_read or shape.kv_bytes()) / (r.median_ms * 1e-3) / 1e9
            r.tokens_per_s = shape.query_tokens / (r.median_ms * 1e-3)
    ran = {r.backend: r for r in rows if r.ok and r.median_ms}
    ref_name = reference or next((n for n in REFERENCES if n in ran),
                                 next((n for n in ran if n != READ_PEAK), None))
    ref = ran.get(ref_name or "")
    peak = ran.get(READ_PEAK)
    for r in ran.values():
        if ref is not None and ref.median_ms and r.backend != READ_PEAK:
            r.ratio = ref.median_ms / (r.median_ms or 1.0)
        if peak is not None and peak.gbps and r.gbps:
            r.of_read_peak = r.gbps / peak.gbps


def serving_table(results: Sequence[ServingResult], device: str, reference: str | None = None) -> Any:
    """Under each shape's heading a row per backend that ran it; the others are in
    ``serving_not_run``, once per backend."""
    from jaxattn.cli import Table

    ref = reference or ", else ".join(REFERENCES)
    table = Table(f"Serving attention on {device}: time, K/V bytes read per second, and ratios (vs {ref}: "
                  "its time / this time; vs best: the fastest paged backend's time / this time; of read: GB/s / "
                  "the memory-read GB/s)",
                  ["backend", "ms", "GB/s", "tok/s", "vs ref", "vs best", "of read", "note"])
    shape = None
    best = fastest_paged(results)
    for r in results:
        if not (r.ok and r.median_ms is not None):
            continue
        if r.shape != shape:
            shape = r.shape
            table.heading(r.shape.label)
        fastest = best.get(r.shape)
        table.add(r.backend, f"{r.median_ms:.3f}", _gbps(r.gbps), _gbps(r.tokens_per_s),
                  f"{r.ratio:.2f}x" if r.ratio else None,
                  f"{fastest.median_ms / r.median_ms:.2f}x" if fastest and fastest.median_ms else None,
                  f"{r.of_read_peak:.0%}" if r.of_read_peak else None, r.note or None)
    return table


def auto_vs_best(results: Sequence[ServingResult]) -> list[dict[str, Any]]:
    """Per shape where paged "auto" ran: its time against the fastest paged backend's."""
    best = fastest_paged(results)
    out = []
    for r in results:
        fastest = best.get(r.shape)
        if r.backend == "auto" and r.ok and r.median_ms and fastest is not None and fastest.median_ms:
            out.append({"shape": r.shape.label, "auto_ms": r.median_ms, "auto_runs": r.note.removeprefix("-> "),
                        "fastest": fastest.backend, "fastest_ms": fastest.median_ms,
                        "vs_best": fastest.median_ms / r.median_ms})
    return out


def auto_summary(results: Sequence[ServingResult]) -> list[str]:
    """One line: paged auto against the fastest paged backend, over the shapes it ran."""
    gaps = auto_vs_best(results)
    if not gaps:
        return []
    worst = min(gaps, key=lambda g: g["vs_best"])
    geomean = math.exp(sum(math.log(g["vs_best"]) for g in gaps) / len(gaps))
    return [f"paged auto vs the fastest paged backend: geomean {geomean:.3f}x, worst {worst['vs_best']:.3f}x "
            f"({worst['shape']}: ran {worst['auto_runs']}, fastest {worst['fastest']}) over {len(gaps)} shapes"]


def fastest_paged(results: Sequence[ServingResult]) -> dict[ServingShape, ServingResult]:
    """Per shape, the fastest paged backend that ran it (one call of a registered paged impl,
    "auto" left out): what paged "auto" is held to."""
    best: dict[ServingShape, ServingResult] = {}
    for r in results:
        fields = row_fields(r.backend, r.shape.kv_dtype)
        if (r.ok and r.median_ms is not None and r.backend != "auto" and fields["call"] == "paged"
                and fields["impl"] is not None
                and (r.shape not in best or r.median_ms < (best[r.shape].median_ms or math.inf))):
            best[r.shape] = r
    return best


def serving_not_run(results: Sequence[ServingResult]) -> list[str]:
    """Each backend that did not run some shape, once (``report.group_not_run``)."""
    from .report import group_not_run

    return group_not_run(results, len({r.shape for r in results}))


def _gbps(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
