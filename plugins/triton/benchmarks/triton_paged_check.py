"""GPU check of the Triton serving kernels: paged decode, ragged paged attention, dense decode.

Run on a CUDA machine (H100/H200, jax-triton importable) from the repository root:

    python3 plugins/triton/benchmarks/triton_paged_check.py --json OUT.json  # --check --bench --ragged --sweep
    python3 plugins/triton/benchmarks/triton_paged_check.py --check --bench --json OUT.json
    python3 plugins/triton/benchmarks/triton_paged_check.py --smoke     # CPU: tiny shapes, Triton interpreter
    python3 plugins/triton/benchmarks/triton_paged_check.py --compile   # CPU ok: sm_90 registers/smem per config

``--check`` compares ``paged_decode``, ``ragged_paged`` and ``dense_decode`` with a float32
jnp reference (gathered pages, masks, softmax with sinks) on GPU-sized shapes: ragged
lengths, empty sequences, permuted and shared pages, both cache layouts, window, soft cap,
sinks, several splits. ``--bench`` times paged decode (bf16, D=128, Hq=32, Hkv=8, page size
16 and 64, batch 16 and 64, context 2k-64k where memory allows) back to back, with the bytes
of K and V read per call, against cuDNN dense decode over the same tokens
(``jax.nn.dot_product_attention(implementation="cudnn")``, T=1) and JAX's Pallas GPU
``paged_attention`` in this process, and ``dense_decode`` on the dense cache. ``--ragged``
times a mixed batch (prefill chunks + decode rows) against its two parts run separately.
``--sweep`` times other tiles and split counts on a few decode shapes. ``--quant-sweep`` times
paged decode over int8 and float8_e4m3fn caches (scales per token, and per head) with the
default tiles and a few others, beside cuDNN's bf16 dense decode and the bf16 paged kernel
over the same tokens (bytes read: values + scales); ``--quant-mixed`` a mixed ragged batch
over int8 and e4m3 caches as one call and as two, beside the bf16 cache's one call
(``--quant-mixed-all``: per-token scales and every tile variant too; ``--quant-mixed-prefill``:
prefill blocks of twice the query tokens). ``--quant-shapes``, ``--quant-grans``,
``--quant-formats`` and ``--quant-variants`` narrow or widen the quantized sweep.
``--layers N`` times N calls in one ``jax.jit`` program, each on the previous one's output (a
model's layers in one step: the host dispatches once per N calls), and reports a call's share;
without it, back-to-back calls of one program, where a short call can measure the host's dispatch.
``--warm-workers N`` compiles a section's
variants in N threads before timing them (the ragged kernel takes tens of seconds each). The registered
backends are measured too, through jaxattn's dispatch (validation, support checks, the
ragged-form call, the kernel choice): ``--check`` runs ``jaxattn.paged_attention(...,
impl="page_attention")``, ``jaxattn.ragged_paged_attention(..., impl="ragged_page_attention_v3")``
and ``jaxattn.attention(..., kv_lengths=..., impl="autoregressive_decodeattn")`` against the
reference, ``--bench`` times the first and the last beside the raw kernels (columns
"page_attn" and "decodeattn", and their ratio to the kernel), ``--ragged`` the mixed batch
through ``ragged_paged_attention``. Where the jaxattn-triton entry point is not installed, the
classes are registered at runtime (``RESULTS["dispatch_impls"]`` says which class each name
resolved to). Every measurement is
in its own try/except: an error is printed and recorded, and the script goes on; after
``--deadline-s`` seconds (default 540) the remaining measurements are skipped, and the JSON
is rewritten after every section, so a run under a 10-minute limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:
    # Before triton is imported anywhere: the kernels run in the interpreter on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "core" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "bench" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "triton" / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxattn_triton.decode.ops import dense_decode  # noqa: E402
from jaxattn_triton.paged import launch as LP  # noqa: E402
from jaxattn_triton.paged.ops import paged_decode, ragged_paged  # noqa: E402

RESULTS: dict[str, Any] = {}
Array = jax.Array
# time.monotonic() after which measurements are skipped (--deadline-s): the run ends, with its
# JSON written, inside a per-command time limit.
DEADLINE = math.inf


def out_of_time(section: str, name: str) -> dict[str, Any] | None:
    """A "skipped" record once the deadline has passed, else None."""
    if time.monotonic() < DEADLINE:
        return None
    log(f"{section} {name}: skipped (--deadline-s reached)")
    return {"name": name, "skipped": "deadline"}


def log(*args: Any) -> None:
    print(*args, flush=True)


def record_error(section: str, name: str, err: BaseException) -> dict[str, Any]:
    log(f"{section} {name}: ERROR {type(err).__name__}: {str(err)[:400]}")
    traceback.print_exc()
    return {"name": name, "error": f"{type(err).__name__}: {str(err)[:2000]}"}


# -- setup ----------------------------------------------------------------------------------


def dtype_under_test() -> Any:
    # The interpreter multiplies bf16 bits as integers in tl.dot (triton 3.9); float32 there.
    return jnp.float32 if SMOKE else jnp.bfloat16


def peak_bandwidth() -> float | None:
    """HBM bytes/s of the device, from its name (None when unknown)."""
    kind = jax.devices()[0].device_kind
    if "H200" in kind:
        return 4.8e12
    if "H100" in kind:
        return 2.0e12 if "PCIe" in kind else 3.35e12
    if "A100" in kind:
        return 2.0e12
    return None


def memory_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


#: --layers N: N calls chained in one program (the module docstring); 1: one call a program.
LAYERS = 1


def time_fn(fn: Callable[..., Any], *args: Any) -> float:
    """Median seconds per call of ``fn`` (jitted), back-to-back calls as ``jaxattn bench`` times;
    with ``--layers N``, a call's share of N chained in one program (``args[0]`` is the query,
    each call's output, cast to its shape and dtype, the next one's)."""
    import triton_measure as bench_util  # beside this script

    if LAYERS > 1:
        inner = fn

        def chained(q: Array, *rest: Any) -> Array:
            for _ in range(LAYERS):
                q = inner(q, *rest).reshape(q.shape).astype(q.dtype)
            return q

        fn = jax.jit(chained)
    if SMOKE:
        return bench_util.time_jax(fn, *args, reps=1, min_sample_ms=0.0, preroll_ms=0.0) / LAYERS
    return bench_util.time_jax(fn, *args, reps=10) / LAYERS


#: --warm-workers: threads that compile (and run once) a section's variants before any is timed.
WARM_WORKERS = 1


def warm_parallel(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    """Run each ``fn(*args)`` once, ``WARM_WORKERS`` at a time: the Triton lowering and the
    driver's PTX compilation of a variant (tens of seconds for the ragged kernel) overlap the
    others'. Errors are left to the timed call, which records them."""
    if WARM_WORKERS <= 1 or len(calls) <= 1 or SMOKE:
        return
    from concurrent.futures import ThreadPoolExecutor

    def one(call: tuple[Callable[..., Any], tuple[Any, ...]]) -> None:
        with contextlib.suppress(Exception):
            jax.block_until_ready(call[0](*call[1]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(WARM_WORKERS) as pool:
        list(pool.map(one, calls))
    log(f"warmed {len(calls)} programs in {time.perf_counter() - t0:.1f} s ({WARM_WORKERS} threads)")


def filled(shape: tuple[int, ...], dtype: Any, seed: int) -> Array:
    """Random values of ``shape`` without a full-size float32 temporary: one random block of at
    most 2^24 elements, repeated along the first axis (values only matter for NaN-freedom here)."""
    inner = math.prod(shape[1:])
    chunk = max(1, min(shape[0], (1 << 24) // max(inner, 1)))
    block = jax.random.normal(jax.random.PRNGKey(seed), (chunk, *shape[1:]), jnp.float32).astype(dtype)
    reps = -(-shape[0] // chunk)

    @jax.jit
    def tile(b: Array) -> Array:
        return jnp.tile(b, (reps,) + (1,) * (len(shape) - 1))[: shape[0]]

    out: Array = tile(block)
    return out


def free(*arrays: Any) -> None:
    for a in arrays:
        if isinstance(a, jax.Array):
            with contextlib.suppress(Exception):
                a.delete()


# -- reference ------------------------------------------------------------------------------


def reference(
    q: Array, k_pages: Array, v_pages: Array, table: np.ndarray, kv_lens: np.ndarray, cu: np.ndarray,
    num_seqs: int, *, scale: float, softcap: float | None = None, left: int | None = None,
    sinks: Array | None = None,
) -> Array:  # fmt: skip
    """float32 ragged paged attention (token-major q, separate cache layout), one sequence at a time."""
    n, hq, _ = q.shape
    page_size, hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    group = hq // hkv
    out = jnp.zeros((n, hq, dv), jnp.float32)
    for s in range(num_seqs):
        length, q0, q1 = int(kv_lens[s]), int(cu[s]), int(cu[s + 1])
        if q1 == q0:
            continue
        j = np.arange(max(length, 1))
        pages = jnp.asarray(table[s, j // page_size])
        k = jnp.repeat(k_pages[pages, j % page_size].astype(jnp.float32), group, axis=1)
        v = jnp.repeat(v_pages[pages, j % page_size].astype(jnp.float32), group, axis=1)
        qs = q[q0:q1].astype(jnp.float32)
        x = jnp.einsum("thd,lhd->htl", qs, k) * scale
        if softcap:
            x = softcap * jnp.tanh(x / softcap)
        pos = length - (q1 - q0) + np.arange(q1 - q0)
        keep = (j[None, :] <= pos[:, None]) & (j[None, :] < length)
        if left is not None:
            keep &= j[None, :] >= pos[:, None] - left
        x = jnp.where(jnp.asarray(keep)[None], x, -jnp.inf)
        m = jnp.max(x, axis=-1, keepdims=True)
        if sinks is not None:
            m = jnp.maximum(m, sinks[:, None, None])
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(x - m)
        den = jnp.sum(p, axis=-1, keepdims=True)
        if sinks is not None:
            den = den + jnp.exp(sinks[:, None, None] - m)
        o = jnp.einsum("htl,lhd->thd", p / jnp.where(den == 0, 1.0, den), v)
        out = out.at[q0:q1].set(jnp.where(jnp.asarray(keep.any(axis=1))[:, None, None], o, 0.0))
    return out


def rel_err(got: Any, want: Any) -> float:
    a: np.ndarray = np.asarray(got, np.float64)
    b: np.ndarray = np.asarray(want, np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


# -- the registered backends ------------------------------------------------------------------

DISPATCH_NAMES = {
    "page_attention": ("paged", "TritonPagedDecode"),
    "ragged_page_attention_v3": ("paged", "TritonRaggedPagedAttention"),
    "autoregressive_decodeattn": ("dense", "TritonDecodeAttention"),
}


def _backend_classes() -> dict[str, Any]:
    """The Triton serving classes by name (on --smoke: CPU subclasses that run the interpreter)."""
    from jaxattn_triton.decode.impl import TritonDecodeAttention
    from jaxattn_triton.paged.impl import TritonPagedDecode, TritonRaggedPagedAttention

    classes: dict[str, Any] = {
        "page_attention": TritonPagedDecode, "ragged_page_attention_v3": TritonRaggedPagedAttention,
        "autoregressive_decodeattn": TritonDecodeAttention,
    }  # fmt: skip
    if not SMOKE:
        return classes

    def on_cpu(cls: Any) -> Any:
        def forward_cpu(self: Any, call: Any) -> Any:
            return self.forward_cuda(call)

        body = {"platforms": frozenset({"cpu"}), "dtypes": frozenset({"float32", "bfloat16", "float16"}),
                "interpret": True, "forward_cpu": forward_cpu}  # fmt: skip
        return type("Interpreted" + cls.__name__, (cls,), body)

    return {name: on_cpu(cls) for name, cls in classes.items()}


@functools.cache
def ensure_registered() -> dict[str, str]:
    """Make the serving names resolve to the Triton classes here; returns name -> resolved class.

    With jaxattn-triton installed the entry point registers them (nothing to do); run from a
    checkout, they are registered at runtime. On --smoke the CPU subclasses are (interpreter).
    """
    import jaxattn

    resolved: dict[str, str] = {}
    for name, cls in _backend_classes().items():
        kind = DISPATCH_NAMES[name][0]
        try:
            current = jaxattn.get_impl(name, kind=kind)
        except Exception:
            current = None
        if not isinstance(current, cls):
            try:
                jaxattn.register_impl(cls)
                current = jaxattn.get_impl(name, kind=kind)
            except Exception as err:
                record_error("dispatch", f"register {name}", err)
        resolved[name] = type(current).__qualname__ if current is not None else "none"
        log(f"dispatch {name} -> {resolved[name]}")
    RESULTS["dispatch_impls"] = resolved
    return resolved


# -- check ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckCase:
    name: str
    kind: str  # "decode", "ragged", "dense"
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None  # ragged
    t: int = 1
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page_size: int = 16
    capacity: int = 4096
    layout: str = LP.SEPARATE
    shared: bool = False
    softcap: float | None = None
    left: int | None = None
    sinks: bool = False
    num_splits: int | None = None
    dtype: str = "bfloat16"
    pad_tokens: int = 0
    causal: bool = True
    via: str = "kernel"  # "kernel" (paged_ops) or "dispatch" (jaxattn's entry points, registered impls)


def check_cases() -> list[CheckCase]:
    if SMOKE:
        small = CheckCase("", "decode", (37, 0, 64), hq=4, hkv=2, d=16, page_size=8, capacity=64, dtype="float32")
        rep = dataclasses.replace
        return [
            rep(small, name="decode gqa"),
            rep(
                small,
                name="decode splits3 sinks combined",
                kv_lens=(37, 5, 60),
                num_splits=3,
                sinks=True,
                layout=LP.COMBINED,
            ),
            rep(
                small,
                name="ragged mixed window softcap",
                kind="ragged",
                kv_lens=(40, 9, 0, 17),
                q_lens=(5, 1, 0, 3),
                left=7,
                softcap=2.0,
                pad_tokens=2,
                num_splits=2,
            ),
            rep(small, name="dense decode t2 lengths", kind="dense", kv_lens=(64, 20, 3), t=2),
            rep(
                small,
                name="dispatch page_attention sinks combined",
                kv_lens=(37, 5, 60),
                sinks=True,
                layout=LP.COMBINED,
                via="dispatch",
            ),
            rep(
                small,
                name="dispatch ragged_page_attention_v3 window",
                kind="ragged",
                kv_lens=(40, 9, 0, 17),
                q_lens=(5, 1, 0, 3),
                left=7,
                softcap=2.0,
                pad_tokens=2,
                via="dispatch",
            ),
            rep(
                small,
                name="dispatch autoregressive_decodeattn t2",
                kind="dense",
                kv_lens=(64, 20, 3),
                t=2,
                via="dispatch",
            ),
        ]
    rng = np.random.default_rng(0)
    lens8 = tuple(int(x) for x in rng.integers(1, 4096, 8))
    return [
        CheckCase("decode bf16 ragged lengths ps16", "decode", lens8),
        CheckCase("decode bf16 one split", "decode", lens8, num_splits=1),
        CheckCase("decode bf16 empty seqs, len 1, full", "decode", (0, 1, 4096, 17, 0, 4095, 16, 33), num_splits=4),
        CheckCase("decode bf16 ps64 combined layout", "decode", lens8, page_size=64, layout=LP.COMBINED),
        CheckCase("decode bf16 shared pages ps16", "decode", lens8, shared=True),
        CheckCase("decode bf16 window+softcap+sinks", "decode", lens8, left=300, softcap=30.0, sinks=True),
        CheckCase("decode bf16 T=4 speculative", "decode", lens8, t=4),
        CheckCase("decode fp16 ps32 gqa8", "decode", lens8, hq=64, hkv=8, page_size=32, dtype="float16"),
        CheckCase("decode bf16 mha ps16", "decode", lens8, hq=8, hkv=8),
        CheckCase(
            "ragged bf16 mixed prefill+decode",
            "ragged",
            (2048, 700, 4000, 1, 0, 3000, 129, 64),
            q_lens=(300, 1, 1, 1, 0, 77, 1, 64),
            pad_tokens=5,
        ),
        CheckCase(
            "ragged bf16 combined window sinks splits4",
            "ragged",
            (2048, 700, 4000, 1, 9, 3000),
            q_lens=(200, 1, 33, 1, 9, 1),
            layout=LP.COMBINED,
            left=256,
            sinks=True,
            num_splits=4,
        ),
        CheckCase("dense decode bf16 T=1 lengths", "dense", lens8, capacity=4096),
        CheckCase("dense decode bf16 T=3 window", "dense", lens8, t=3, left=500, capacity=4096),
        CheckCase("dense decode bf16 non-causal", "dense", lens8, capacity=4096, causal=False),
        # The registered backends, through jaxattn's dispatch.
        CheckCase(
            "dispatch page_attention bf16 window+softcap+sinks",
            "decode",
            lens8,
            left=300,
            softcap=30.0,
            sinks=True,
            via="dispatch",
        ),
        CheckCase(
            "dispatch page_attention bf16 T=4 combined", "decode", lens8, t=4, layout=LP.COMBINED, via="dispatch"
        ),
        CheckCase(
            "dispatch ragged_page_attention_v3 bf16 mixed",
            "ragged",
            (2048, 700, 4000, 1, 0, 3000, 129, 64),
            q_lens=(300, 1, 1, 1, 0, 77, 1, 64),
            pad_tokens=5,
            sinks=True,
            via="dispatch",
        ),
        CheckCase("dispatch autoregressive_decodeattn bf16 T=1 lengths", "dense", lens8, via="dispatch"),
        CheckCase(
            "dispatch autoregressive_decodeattn fp16 T=3 window",
            "dense",
            lens8,
            t=3,
            left=500,
            dtype="float16",
            via="dispatch",
        ),
    ]


def _table(rng: np.random.Generator, seqs: int, pages_per_seq: int, shared: bool) -> np.ndarray:
    num_pages = seqs * pages_per_seq
    table = rng.permutation(num_pages).reshape(seqs, pages_per_seq)
    if shared and seqs > 1:
        table[1, : pages_per_seq // 2] = table[0, : pages_per_seq // 2]
    return table.astype(np.int32)


def run_check_case(c: CheckCase, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(c.dtype)
    seqs = len(c.kv_lens)
    q_lens = c.q_lens if c.q_lens is not None else (c.t,) * seqs
    lens = np.array(c.kv_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(cu[-1]) + c.pad_tokens
    scale = c.d**-0.5
    sinks = jnp.asarray(rng.standard_normal(c.hq), jnp.float32) if c.sinks else None
    q_tok = jnp.asarray(rng.standard_normal((n, c.hq, c.d)), dt)
    if c.kind == "dense":
        k = jnp.asarray(rng.standard_normal((seqs, c.capacity, c.hkv, c.d)), dt)
        v = jnp.asarray(rng.standard_normal((seqs, c.capacity, c.hkv, c.d)), dt)
        q = q_tok.reshape(seqs, c.t, c.hq, c.d)
        window = None if c.left is None else (c.left, 0)
        t0 = time.perf_counter()
        if c.via == "dispatch":
            import jaxattn

            out = jaxattn.attention(
                q, k, v, kv_lengths=jnp.asarray(lens), causal=c.causal, sliding_window=window,
                logits_soft_cap=c.softcap, softmax_aux=sinks, impl="autoregressive_decodeattn",
            )  # fmt: skip
        else:
            out = dense_decode(
                q, k, v, jnp.asarray(lens), causal=c.causal, window=window, logits_soft_cap=c.softcap,
                sinks=sinks, num_splits=c.num_splits, interpret=SMOKE,
            )  # fmt: skip
        got = np.asarray(jnp.asarray(out).reshape(n, c.hq, c.d), np.float32)
        wall = time.perf_counter() - t0
        table = np.arange(seqs, dtype=np.int32)[:, None]
        # The dense cache is one page per sequence. Non-causal cases have T == 1 and no window:
        # the single query sees its whole length, which is what the causal reference computes.
        assert c.causal or (c.t == 1 and c.left is None)
        want = reference(q_tok, k, v, table, lens, cu, seqs, scale=scale, softcap=c.softcap, left=c.left,
                         sinks=sinks)  # fmt: skip
    else:
        pps = c.capacity // c.page_size
        table = _table(rng, len(c.kv_lens), pps, c.shared)
        num_pages = int(table.max()) + 1
        k_pages = jnp.asarray(rng.standard_normal((num_pages, c.page_size, c.hkv, c.d)), dt)
        v_pages = jnp.asarray(rng.standard_normal((num_pages, c.page_size, c.hkv, c.d)), dt)
        if c.layout == LP.COMBINED:
            kv = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, c.page_size, 2 * c.hkv, c.d)
            cache: dict[str, Any] = {"kv_pages": kv}
            args: tuple[Any, Any] = (None, None)
        else:
            cache = {}
            args = (k_pages, v_pages)
        kw = dict(
            logits_soft_cap=c.softcap, window_left=c.left, sinks=sinks, num_splits=c.num_splits,
            interpret=SMOKE, **cache,
        )  # fmt: skip
        t0 = time.perf_counter()
        if c.via == "dispatch":
            import jaxattn

            common: dict[str, Any] = {
                "kv_pages": cache.get("kv_pages"), "sliding_window": c.left, "logits_soft_cap": c.softcap,
                "softmax_aux": sinks,
            }  # fmt: skip
            if c.kind == "decode":
                out = jaxattn.paged_attention(
                    q_tok.reshape(seqs, c.t, c.hq, c.d), *args, jnp.asarray(table), jnp.asarray(lens),
                    impl="page_attention", **common,
                )  # fmt: skip
            else:
                out = jaxattn.ragged_paged_attention(
                    q_tok, *args, jnp.asarray(table), jnp.asarray(lens), jnp.asarray(cu), seqs,
                    impl="ragged_page_attention_v3", **common,
                )  # fmt: skip
        elif c.kind == "decode":
            q = q_tok.reshape(seqs, c.t, c.hq, c.d)
            out = paged_decode(q, *args, jnp.asarray(table), jnp.asarray(lens), **kw)
        else:
            out = ragged_paged(
                q_tok, *args, jnp.asarray(table), jnp.asarray(lens), jnp.asarray(cu), jnp.asarray([seqs], jnp.int32),
                **kw,
            )  # fmt: skip
        got = np.asarray(jnp.asarray(out).reshape(n, c.hq, c.d), np.float32)
        wall = time.perf_counter() - t0
        want = reference(q_tok, k_pages, v_pages, table, lens, cu, seqs, scale=scale, softcap=c.softcap,
                         left=c.left, sinks=sinks)  # fmt: skip
    nan = bool(np.isnan(got).any())
    err = rel_err(got, want) if want is not None else None
    tol = 2e-2 if c.dtype == "bfloat16" else (2e-3 if c.dtype == "float16" else 1e-4)
    # Rows without keys (empty sequences, padding) must be exact zeros.
    empty_rows = [r for s in range(seqs) for r in range(cu[s], cu[s + 1]) if lens[s] == 0]
    empty_rows += list(range(int(cu[-1]), n))
    zeros_ok = bool(np.all(got[empty_rows] == 0.0)) if empty_rows else True
    ok = not nan and zeros_ok and (err is None or err < tol)
    return {"name": c.name, "ok": ok, "rel_err": err, "nan": nan, "zeros_ok": zeros_ok, "wall_s": wall}


def check() -> None:
    ensure_registered()
    rows = []
    for i, c in enumerate(check_cases()):
        late = out_of_time("check", c.name)
        if late:
            rows.append(late)
            continue
        try:
            row = run_check_case(c, i)
            err = row["rel_err"]
            shown = "n/a" if err is None else f"{err:.2e}"
            log(f"check {c.name:44s} {'OK ' if row['ok'] else 'BAD'} rel_err={shown} nan={row['nan']} "
                f"zero_rows_ok={row['zeros_ok']}")  # fmt: skip
        except Exception as err:
            row = record_error("check", c.name, err)
        rows.append(row)
    RESULTS["check"] = rows


# -- decode bandwidth -------------------------------------------------------------------------

HQ, HKV, D = (4, 2, 16) if SMOKE else (32, 8, 128)


def decode_shapes() -> list[tuple[int, int, int]]:
    """(page_size, batch, context) of the decode table."""
    if SMOKE:
        return [(8, 2, 64), (16, 3, 128)]
    return [(ps, b, ctx) for ps in (16, 64) for b in (16, 64) for ctx in (2048, 8192, 32768, 65536)]


def kv_bytes(batch: int, ctx: int, itemsize: int) -> int:
    return batch * ctx * HKV * 2 * D * itemsize


def paged_cache(batch: int, ctx: int, page_size: int, dt: Any, seed: int) -> tuple[Array, Array, Array]:
    pps = ctx // page_size
    num_pages = batch * pps
    k = filled((num_pages, page_size, HKV, D), dt, seed)
    v = filled((num_pages, page_size, HKV, D), dt, seed + 1)
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pps).astype(np.int32))
    return k, v, table


def decode_spec(batch: int, ctx: int, dt: Any, cache_lead: tuple[int, ...], fmt: str | None = None,
                scale_shapes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> LP.PagedSpec:
    """One decode step (a query per sequence) of ``batch`` sequences of ``ctx`` tokens over a
    paged cache whose shape without its last axis is ``cache_lead`` ``(num_pages, page_size,
    Hkv)``; with ``fmt``, a cache of that dtype whose K and V scales have ``scale_shapes``. The
    spec ``paged_decode`` builds for such a call (its default softmax scale included), so that
    launches made from it compute the same call."""
    num_pages, page_size = int(cache_lead[0]), int(cache_lead[1])
    quantized: dict[str, Any] = {} if fmt is None else {
        "cache_dtype": fmt, "k_scale": LP.scale_strides(scale_shapes[0], cache_lead),
        "v_scale": LP.scale_strides(scale_shapes[1], cache_lead)}
    return LP.PagedSpec(
        num_tokens=batch, max_seqs=batch, q_len=1, heads_q=HQ, heads_kv=HKV, head_dim=D, head_dim_v=D,
        dtype=jnp.dtype(dt).name, num_pages=num_pages, page_size=page_size, pages_per_seq=ctx // page_size,
        softmax_scale=D**-0.5, **quantized,
    )  # fmt: skip


def pallas_paged(q: Array, k_hpages: Array, v_hpages: Array, table: Array, lens: Array, *, ks: int, ppcb: int) -> Array:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    # Pallas takes q pre-scaled (its kernel applies no softmax scale).
    out: Array = paged_attention(
        q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k_hpages, v_hpages, table, lens,
        k_splits=ks, pages_per_compute_block=ppcb, interpret=SMOKE,
    )  # fmt: skip
    return out


def pallas_configs(pages_per_seq: int, page_size: int) -> list[tuple[int, int]]:
    """(k_splits, pages_per_compute_block) candidates that divide the table as Pallas asserts."""
    out = []
    for ks in (16, 8, 32):
        if pages_per_seq % ks:
            continue
        part = pages_per_seq // ks
        for tokens in (64, 128):
            ppcb = max(1, min(part, tokens // page_size))
            while part % ppcb:
                ppcb -= 1
            if (ks, ppcb) not in out:
                out.append((ks, ppcb))
    return out[:3] or [(1, 1)]


def timed(res: dict[str, Any], nbytes: int, peak: float | None, label: str, name: str,
          fn: Callable[..., Any], *args: Any) -> None:  # fmt: skip
    """Times ``fn(*args)`` into ``res[name]`` (us, GB/s of K and V, fraction of peak), or its error."""
    try:
        sec = time_fn(jax.jit(fn), *args)
        res[name] = {"us": sec * 1e6, "GBps": nbytes / sec / 1e9}
        if peak:
            res[name]["frac_peak"] = nbytes / sec / peak
    except Exception as err:
        res[name] = record_error("bench", f"{name} {label}", err)


def page_attention(q: Array, k: Array, v: Array, table: Array, lens: Array) -> Array:
    """paged_decode's call through jaxattn.paged_attention and the registered page_attention."""
    import jaxattn

    out: Array = jaxattn.paged_attention(q, k, v, table, lens, impl="page_attention")
    return out


def decodeattn(q: Array, k: Array, v: Array, lens: Array) -> Array:
    """dense_decode's call through jaxattn.attention and the registered autoregressive_decodeattn."""
    import jaxattn

    out: Array = jaxattn.attention(q, k, v, kv_lengths=lens, causal=True, impl="autoregressive_decodeattn")
    return out


def cudnn_decode(q: Array, k: Array, v: Array, lens: Array) -> Array:
    """cuDNN's dense decode over a contiguous cache with per-sequence lengths: the bar to meet."""
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens, implementation="cudnn")


def bench() -> None:
    ensure_registered()
    rows: list[dict[str, Any]] = []
    dt = dtype_under_test()
    itemsize = jnp.dtype(dt).itemsize
    peak = peak_bandwidth()
    limit = memory_limit()
    for page_size, batch, ctx in decode_shapes():
        res: dict[str, Any] = {"page_size": page_size, "batch": batch, "ctx": ctx}
        if out_of_time("bench", f"ps={page_size} B={batch} ctx={ctx}"):
            rows.append({**res, "skipped": "deadline"})
            continue
        nbytes = kv_bytes(batch, ctx, itemsize)
        res["kv_bytes"] = nbytes
        if limit is not None and nbytes > 0.7 * limit:
            res["skipped"] = f"K+V {nbytes / 2**30:.1f} GiB > 70% of device memory"
            log(f"bench ps={page_size} B={batch} ctx={ctx}: {res['skipped']}")
            rows.append(res)
            continue
        rng = np.random.default_rng(batch * 7 + ctx)
        q = jnp.asarray(rng.standard_normal((batch, 1, HQ, D)), dt)
        lens = jnp.full((batch,), ctx, jnp.int32)

        measure = functools.partial(timed, res, nbytes, peak, f"ps={page_size} B={batch} ctx={ctx}")

        # Ours, paged (one cache at a time on the device: the largest is 16 GiB).
        try:
            k, v, table = paged_cache(batch, ctx, page_size, dt, 1)
            spec_tiles = LP.default_tiles(decode_spec(batch, ctx, dt, k.shape[:3]), _num_sms())
            res["tiles"] = dataclasses.asdict(spec_tiles)
            measure("paged", lambda q, k, v, t, n: paged_decode(q, k, v, t, n, interpret=SMOKE), q, k, v, table, lens)
            # The same call through jaxattn's dispatch and the registered page_attention backend.
            measure("page_attention", page_attention, q, k, v, table, lens)
            free(k, v)
        except Exception as err:
            res["paged"] = record_error("bench", "paged setup", err)
        # Pallas GPU paged_attention: head-major pages (Hkv, P, page_size, D).
        try:
            pps = ctx // page_size
            kh = filled((HKV, batch * pps, page_size, D), dt, 3)
            vh = filled((HKV, batch * pps, page_size, D), dt, 4)
            table = jnp.asarray(np.random.default_rng(5).permutation(batch * pps).reshape(batch, pps).astype(np.int32))
            best: dict[str, Any] | None = None
            for ks, ppcb in pallas_configs(pps, page_size):
                name = f"pallas_ks{ks}_ppcb{ppcb}"
                measure(
                    name, lambda q, k, v, t, n, ks=ks, ppcb=ppcb: pallas_paged(q[:, 0], k, v, t, n, ks=ks, ppcb=ppcb),
                    q, kh, vh, table, lens,
                )  # fmt: skip
                got = res.pop(name)
                got["config"] = {"k_splits": ks, "pages_per_compute_block": ppcb}
                if best is None or ("us" in got and got["us"] < best.get("us", math.inf)):
                    best = got
            res["pallas"] = best
            free(kh, vh)
        except Exception as err:
            res["pallas"] = record_error("bench", "pallas setup", err)
        # cuDNN dense decode and ours on the same dense cache.
        try:
            kd = filled((batch, ctx, HKV, D), dt, 6)
            vd = filled((batch, ctx, HKV, D), dt, 7)

            def cudnn_full(q: Array, k: Array, v: Array, n: Array) -> Array:
                del n
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

            measure("cudnn", cudnn_decode, q, kd, vd, lens)
            if "error" in res["cudnn"]:
                first = res["cudnn"]["error"]
                measure("cudnn", cudnn_full, q, kd, vd, lens)
                res["cudnn"]["note"] = f"without key_value_seq_lengths (with them: {first[:300]})"
            measure(
                "dense_decode",
                lambda q, k, v, n: dense_decode(q, k, v, n, causal=True, interpret=SMOKE),
                q, kd, vd, lens,
            )  # fmt: skip
            measure("decodeattn", decodeattn, q, kd, vd, lens)
            free(kd, vd)
        except Exception as err:
            res["cudnn"] = record_error("bench", "dense setup", err)
        for other in ("cudnn", "pallas", "dense_decode"):
            o, p = res.get(other) or {}, res.get("paged") or {}
            if "us" in o and "us" in p:
                res[f"speedup_vs_{other}"] = o["us"] / p["us"]
        # Dispatch overhead: the registered backend's time over its kernel's (1.0: none).
        for via, kernel in (("page_attention", "paged"), ("decodeattn", "dense_decode")):
            o, p = res.get(via) or {}, res.get(kernel) or {}
            if "us" in o and "us" in p:
                res[f"{via}_over_kernel"] = o["us"] / p["us"]
        rows.append(res)
        log(json.dumps(res))
    RESULTS["bench"] = rows
    log(
        "\n  ps     B    ctx |  ours us   GB/s  %peak | cudnn us  ratio | pallas us  ratio | dense_decode us"
        " | page_attn us  /ours | decodeattn us  /dense"
    )
    for r in rows:
        if "skipped" in r:
            log(f"{r['page_size']:4d} {r['batch']:5d} {r['ctx']:6d} | skipped: {r['skipped']}")
            continue
        p, c, pl_, dd, pa, da = (
            r.get(x) or {} for x in ("paged", "cudnn", "pallas", "dense_decode", "page_attention", "decodeattn")
        )

        def cell(x: dict[str, Any], key: str = "us", width: int = 8) -> str:
            return f"{x[key]:{width}.1f}" if key in x else f"{'err':>{width}s}"

        frac = f"{100 * p['frac_peak']:5.1f}" if "frac_peak" in p else "  n/a"
        ratio_c = f"{r['speedup_vs_cudnn']:6.2f}" if "speedup_vs_cudnn" in r else "   n/a"
        ratio_p = f"{r['speedup_vs_pallas']:6.2f}" if "speedup_vs_pallas" in r else "   n/a"
        over_p = f"{r['page_attention_over_kernel']:5.2f}" if "page_attention_over_kernel" in r else "  n/a"
        over_d = f"{r['decodeattn_over_kernel']:6.2f}" if "decodeattn_over_kernel" in r else "   n/a"
        log(
            f"{r['page_size']:4d} {r['batch']:5d} {r['ctx']:6d} | {cell(p)} {cell(p, 'GBps', 6)} {frac} | "
            f"{cell(c)} {ratio_c} | {cell(pl_, width=9)} {ratio_p} | {cell(dd, width=15)} | "
            f"{cell(pa, width=12)} {over_p} | {cell(da, width=13)} {over_d}"
        )
    log(
        "(ratio = their time / ours: > 1 means ours is faster; /ours, /dense = through jaxattn's dispatch over the "
        "raw kernel: 1.00 means no overhead)"
    )


def _num_sms() -> int:
    from jaxattn_triton.paged.ops import _num_sms as n

    return n()


# -- ragged mixed batch ---------------------------------------------------------------------


def ragged() -> None:
    ensure_registered()
    rows = []
    dt = dtype_under_test()
    itemsize = jnp.dtype(dt).itemsize
    if SMOKE:
        setups = [(8, 2, 12, 48, 6, 96)]
    else:
        # (page size, prefill chunks, chunk length, context before the chunk, decode rows, decode context)
        setups = [(16, 4, 512, 1536, 60, 8192), (64, 4, 512, 1536, 60, 8192), (16, 2, 1024, 0, 126, 4096)]
    for ps, n_pre, chunk, pre_ctx, n_dec, dec_ctx in setups:
        name = f"ps={ps} prefill {n_pre}x{chunk}@{pre_ctx} + decode {n_dec}@{dec_ctx}"
        res: dict[str, Any] = {"name": name}
        late = out_of_time("ragged", name)
        if late:
            rows.append(late)
            continue
        try:
            cap = max(pre_ctx + chunk, dec_ctx)
            cap = -(-cap // ps) * ps
            seqs = n_pre + n_dec
            q_lens = [chunk] * n_pre + [1] * n_dec
            kv_lens = [pre_ctx + chunk] * n_pre + [dec_ctx] * n_dec
            k, v, table = paged_cache(seqs, cap, ps, dt, 11)
            rng = np.random.default_rng(3)
            n_tok = sum(q_lens)
            q = jnp.asarray(rng.standard_normal((n_tok, HQ, D)), dt)
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
            lens = jnp.asarray(kv_lens, jnp.int32)
            ns = jnp.asarray([seqs], jnp.int32)

            def run_ragged(q: Array, k: Array, v: Array, t: Array, n: Array, cu: Array, ns: Array) -> Array:
                out = ragged_paged(q, k, v, t, n, cu, ns, interpret=SMOKE)
                assert isinstance(out, jax.Array)
                return out

            mixed = time_fn(jax.jit(run_ragged), q, k, v, table, lens, cu, ns)

            def run_dispatch(q: Array, k: Array, v: Array, t: Array, n: Array, cu: Array, ns: Array) -> Array:
                import jaxattn

                out: Array = jaxattn.ragged_paged_attention(q, k, v, t, n, cu, ns, impl="ragged_page_attention_v3")
                return out

            try:
                mixed_dispatch: float | None = time_fn(jax.jit(run_dispatch), q, k, v, table, lens, cu, ns)
            except Exception as err:
                res["mixed_dispatch"] = record_error("ragged", f"{name} via ragged_page_attention_v3", err)
                mixed_dispatch = None
            pre_tok = n_pre * chunk
            prefill = time_fn(
                jax.jit(run_ragged), q[:pre_tok], k, v, table[:n_pre], lens[:n_pre], cu[: n_pre + 1],
                jnp.asarray([n_pre], jnp.int32),
            )  # fmt: skip
            qd = q[pre_tok:].reshape(n_dec, 1, HQ, D)
            decode = time_fn(
                jax.jit(lambda q, k, v, t, n: paged_decode(q, k, v, t, n, interpret=SMOKE)),
                qd, k, v, table[n_pre:], lens[n_pre:],
            )  # fmt: skip
            decode_ragged = time_fn(
                jax.jit(run_ragged), q[pre_tok:], k, v, table[n_pre:], lens[n_pre:],
                jnp.arange(n_dec + 1, dtype=jnp.int32), jnp.asarray([n_dec], jnp.int32),
            )  # fmt: skip
            pre_flops = 4.0 * HQ * D * sum(chunk * pre_ctx + chunk * (chunk + 1) / 2 for _ in range(n_pre))
            dec_bytes = n_dec * dec_ctx * HKV * 2 * D * itemsize
            res.update(
                mixed_us=mixed * 1e6, prefill_us=prefill * 1e6, decode_us=decode * 1e6,
                decode_as_ragged_us=decode_ragged * 1e6, separate_sum_us=(prefill + decode) * 1e6,
                mixed_over_separate=mixed / (prefill + decode), prefill_tflops=pre_flops / prefill / 1e12,
                decode_GBps=dec_bytes / decode / 1e9,
            )  # fmt: skip
            if mixed_dispatch is not None:
                res.update(mixed_dispatch_us=mixed_dispatch * 1e6, mixed_dispatch_over_kernel=mixed_dispatch / mixed)
            free(k, v)
            log(
                f"ragged {name}: mixed {mixed * 1e6:.1f} us | prefill {prefill * 1e6:.1f} us "
                f"({res['prefill_tflops']:.1f} TFLOP/s) + decode {decode * 1e6:.1f} us "
                f"({res['decode_GBps']:.0f} GB/s; as ragged {decode_ragged * 1e6:.1f} us) = "
                f"{(prefill + decode) * 1e6:.1f} us | mixed/separate {res['mixed_over_separate']:.2f}"
                + (f" | via ragged_page_attention_v3 {mixed_dispatch * 1e6:.1f} us" if mixed_dispatch else "")
            )
        except Exception as err:
            res.update(record_error("ragged", name, err))
        rows.append(res)
    RESULTS["ragged"] = rows


# -- tile sweep -----------------------------------------------------------------------------

SWEEP_TILES = [(32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3)]
# Key splits tried on every shape besides the default's: at 64 sequences the default is one
# split (512 programs for 132 SMs), where finer work may balance the waves better.
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8)
#: --sweep-shapes: (page_size, batch, context) to sweep instead of the default three.
SWEEP_SHAPES: list[tuple[int, int, int]] = []


def sweep() -> None:
    rows = []
    dt = dtype_under_test()
    itemsize = jnp.dtype(dt).itemsize
    shapes = SWEEP_SHAPES or ([(8, 2, 64)] if SMOKE else [(16, 64, 8192), (64, 64, 32768), (16, 16, 8192)])
    tiles = SWEEP_TILES[:2] if SMOKE else SWEEP_TILES
    for ps, batch, ctx in shapes:
        try:
            q = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 1, HQ, D)), dt)
            lens = jnp.full((batch,), ctx, jnp.int32)
            nbytes = kv_bytes(batch, ctx, itemsize)
            if not SMOKE:  # the bar, in this run: cuDNN's dense decode over the same number of tokens
                kd, vd = filled((batch, ctx, HKV, D), dt, 6), filled((batch, ctx, HKV, D), dt, 7)
                sec = time_fn(jax.jit(cudnn_decode), q, kd, vd, lens)
                free(kd, vd)
                rows.append(
                    {"name": f"ps={ps} B={batch} ctx={ctx} cudnn dense", "us": sec * 1e6, "GBps": nbytes / sec / 1e9}
                )
                log(f"sweep ps={ps} B={batch} ctx={ctx} cudnn dense: {sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s")
            k, v, table = paged_cache(batch, ctx, ps, dt, 21)
            spec = decode_spec(batch, ctx, dt, k.shape[:3])
            base = LP.default_tiles(spec, _num_sms())
        except Exception as err:
            rows.append(record_error("sweep", f"setup ps={ps} B={batch} ctx={ctx}", err))
            continue
        splits_options = sorted({base.num_splits, *(SWEEP_SPLITS[:2] if SMOKE else SWEEP_SPLITS)})
        # The swept tiles take one KV head per program; the default (which may fold several,
        # launch_paged.default_tiles) is timed as it is, first.
        swept = (
            dataclasses.replace(base, block_n=bn, num_warps=warps, num_stages=stages, num_splits=splits, kv_heads=1)
            for bn, warps, stages in tiles for splits in splits_options
        )  # fmt: skip
        for t in [base, *(c for c in swept if c != base)]:
            bn, warps, stages, splits = t.block_n, t.num_warps, t.num_stages, t.num_splits
            label = f"ps={ps} B={batch} ctx={ctx} kvh={t.kv_heads} bn={bn} w={warps} st={stages} splits={splits}"
            late = out_of_time("sweep", label)
            if late:
                rows.append(late)
                continue
            try:
                sec = time_fn(
                    jax.jit(lambda q, k, v, tb, n, t=t: paged_decode(q, k, v, tb, n, tiles=t, interpret=SMOKE)),
                    q, k, v, table, lens,
                )  # fmt: skip
                row = {"name": label, "tiles": dataclasses.asdict(t), "us": sec * 1e6, "GBps": nbytes / sec / 1e9}
                log(f"sweep {label}: {sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s"
                    + ("  (default)" if t == base else ""))  # fmt: skip
            except Exception as err:
                row = record_error("sweep", label, err)
            rows.append(row)
        free(k, v)
    RESULTS["sweep"] = rows


#: --quant-sweep: (page_size, batch, context).
QUANT_SWEEP_SHAPES = [(16, 16, 32768), (16, 64, 32768)]
QUANT_FORMATS: tuple[str, ...] = ("int8", "float8_e4m3fn")
#: --quant-fast: per-token scales only (with their tile variants).
QUANT_FAST = "--quant-fast" in sys.argv
#: --quant-grans: the scale granularities timed, each with the tile variants (default: both,
#: the variants for per-token scales only).
QUANT_GRANS: tuple[str, ...] = ()
def quantized_cache(k: Array, v: Array, fmt: str, granularity: str) -> tuple[Array, Array, Array, Array]:
    """Narrow copies of ``k``/``v`` (values only matter for NaN-freedom: scaled, cast) and
    float32 scales per token ``(P, page_size, Hkv)`` or per head ``(Hkv,)``."""
    dt = jnp.dtype(fmt)
    gain = 40.0 if fmt == "int8" else 1.0

    @jax.jit
    def narrow(x: Array) -> Array:
        return (x * gain).astype(dt)

    shape = k.shape[:3] if granularity == "token" else k.shape[2:3]
    ks = jnp.full(shape, 1.0 / gain, jnp.float32)
    return narrow(k), narrow(v), ks, ks + 0.0


#: --quant-variants: (block_n, warps, stages, splits, kv_heads) timed instead of the built-in list.
QUANT_VARIANTS: list[tuple[int, int, int, int | None, int | None]] = []
def quant_variants(base: LP.PagedTiles) -> list[LP.PagedTiles]:
    """The default tiles and a few with more bytes in flight per stage (narrow values)."""
    # (block_n, warps, stages, splits, kv_heads); None keeps the default's. Splits and fewer KV
    # heads per program make more, smaller programs: two or three per SM where registers and
    # shared memory allow (4 warps), each with its own barriers.
    options: Any
    if QUANT_VARIANTS:
        options = QUANT_VARIANTS
    elif base.kv_heads > 1:
        options = ((64, 4, 3, None, None), (32, 4, 4, None, None), (64, 8, 3, None, None),
                   (64, 4, 3, None, 2), (128, 4, 3, None, 1), (64, 4, 3, 2, None))  # fmt: skip
    else:
        options = ((256, 8, 3, None, None), (128, 8, 4, None, None), (256, 8, 2, None, None),
                   (128, 4, 3, 2, None), (128, 4, 4, 2, None), (128, 8, 3, 2, None), (256, 4, 3, None, None),
                   (64, 4, 4, 4, None), (128, 4, 3, 3, None), (128, 4, 3, 4, None), (64, 4, 3, 2, 2),
                   (64, 4, 3, 4, 2), (256, 4, 2, 2, None))  # fmt: skip
    out = [base]
    for bn, warps, stages, splits, kvh in options:
        t = dataclasses.replace(base, block_n=bn, num_warps=warps, num_stages=stages,
                                num_splits=splits or base.num_splits, kv_heads=kvh or base.kv_heads)  # fmt: skip
        if t not in out:
            out.append(t)
    return out


def quant_sweep() -> None:
    rows: list[dict[str, Any]] = []
    dt = dtype_under_test()
    shapes = [(8, 2, 64)] if SMOKE else QUANT_SWEEP_SHAPES
    for ps, batch, ctx in shapes:
        tag = f"ps={ps} B={batch} ctx={ctx}"
        try:
            q = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 1, HQ, D)), dt)
            lens = jnp.full((batch,), ctx, jnp.int32)
            wide_bytes = kv_bytes(batch, ctx, jnp.dtype(dt).itemsize)
            bar = None
            if not SMOKE:  # cuDNN's bf16 dense decode over the same tokens, in this run
                kd, vd = filled((batch, ctx, HKV, D), dt, 6), filled((batch, ctx, HKV, D), dt, 7)
                bar = time_fn(jax.jit(cudnn_decode), q, kd, vd, lens)
                free(kd, vd)
                rows.append({"name": f"{tag} cudnn dense bf16", "us": bar * 1e6, "GBps": wide_bytes / bar / 1e9})
                log(f"quant {tag} cudnn dense bf16: {bar * 1e6:.1f} us {wide_bytes / bar / 1e9:.0f} GB/s")
            k, v, table = paged_cache(batch, ctx, ps, dt, 21)
            sec = time_fn(jax.jit(lambda q, k, v, tb, n: paged_decode(q, k, v, tb, n, interpret=SMOKE)),
                          q, k, v, table, lens)  # fmt: skip
            rows.append({"name": f"{tag} paged bf16", "us": sec * 1e6, "GBps": wide_bytes / sec / 1e9,
                         "vs_cudnn": bar / sec if bar else None})  # fmt: skip
            log(f"quant {tag} paged bf16: {sec * 1e6:.1f} us" + (f" {bar / sec:.3f}x cudnn" if bar else ""))
        except Exception as err:
            rows.append(record_error("quant", f"setup {tag}", err))
            continue
        for fmt in QUANT_FORMATS:
            for gran in QUANT_GRANS or (("token",) if QUANT_FAST else ("token", "head")):
                try:
                    kq, vq, ks, vs = quantized_cache(k, v, fmt, gran)
                    nbytes = kv_bytes(batch, ctx, 1) + 2 * 4 * (int(ks.size) if gran == "token" else HKV)
                    spec = decode_spec(batch, ctx, dt, k.shape[:3], fmt, (ks.shape, vs.shape))
                    base = LP.default_tiles(spec, _num_sms())
                except Exception as err:
                    rows.append(record_error("quant", f"setup {tag} {fmt} {gran}", err))
                    continue
                variants = [base]
                if (gran in QUANT_GRANS or (gran == "token" and not QUANT_GRANS)) and not SMOKE:
                    variants += quant_variants(base)[1:]

                def decode_fn(t: LP.PagedTiles) -> Callable[..., Any]:
                    return jax.jit(lambda *a: paged_decode(*a[:5], k_scale=a[5], v_scale=a[6], tiles=t,
                                                           interpret=SMOKE))  # fmt: skip

                fns = {t: decode_fn(t) for t in variants}
                warm_parallel([(f, (q, kq, vq, table, lens, ks, vs)) for f in fns.values()])
                for t in variants:
                    label = (f"{tag} {fmt} per {gran} kvh={t.kv_heads} bn={t.block_n} w={t.num_warps} "
                             f"st={t.num_stages} splits={t.num_splits}")
                    late = out_of_time("quant", label)
                    if late:
                        rows.append(late)
                        continue
                    try:
                        sec = time_fn(fns[t], q, kq, vq, table, lens, ks, vs)
                        row = {"name": label, "tiles": dataclasses.asdict(t), "us": sec * 1e6,
                               "GBps": nbytes / sec / 1e9, "vs_cudnn": bar / sec if bar else None,
                               "default": t == base}  # fmt: skip
                        log(
                            f"quant {label}: {sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s"
                            + (f" {bar / sec:.3f}x cudnn" if bar else "")
                            + ("  (default)" if t == base else "")
                        )
                    except Exception as err:
                        row = record_error("quant", label, err)
                    rows.append(row)
                free(kq, vq)
        free(k, v)
    RESULTS["quant_sweep"] = rows


#: --quant-mixed: (page size, decode rows, context, prefill chunks, chunk length), the serving
#: benchmark's mixed shapes.
QUANT_MIXED_SHAPES = [(16, 64, 4096, 4, 512), (64, 32, 16384, 2, 2048)]
#: --quant-mixed-all: per-token scales too, the bf16 cache's two calls, and the variants for
#: every format (each timing compiles a kernel of its own: minutes in all).
QUANT_MIXED_ALL = "--quant-mixed-all" in sys.argv
#: --quant-mixed-prefill: prefill blocks of twice the query tokens too (one call and two).
QUANT_MIXED_PREFILL = "--quant-mixed-prefill" in sys.argv


def quant_mixed() -> None:
    """A mixed ragged batch over int8 and e4m3 caches (per-head scales): one call with the
    default tiles (decode programs for the decode rows) against two calls (the decode rows, then
    the prefill chunks) and the bf16 cache's one call of the same tokens, all in this run; for
    int8 also one call without decode programs (every row in prefill blocks: the tiles before)
    and with 64-token decode tiles. ``--quant-mixed-all``: per-token scales, the bf16 cache's two
    calls and those variants for every cache too."""
    rows: list[dict[str, Any]] = []
    dt = dtype_under_test()
    shapes = [(8, 2, 48, 2, 12)] if SMOKE else QUANT_MIXED_SHAPES
    for ps, n_dec, ctx, n_pre, chunk in shapes:
        name = f"ps={ps} decode {n_dec}@{ctx} + prefill {n_pre}x{chunk}@{ctx}"
        try:
            seqs = n_dec + n_pre
            cap = -(-(ctx + chunk) // ps) * ps
            k, v, table = paged_cache(seqs, cap, ps, dt, 13)
            rng = np.random.default_rng(5)
            q_lens = [1] * n_dec + [chunk] * n_pre
            kv_lens = [ctx] * n_dec + [ctx + chunk] * n_pre
            q = jnp.asarray(rng.standard_normal((sum(q_lens), HQ, D)), dt)
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
            lens = jnp.asarray(kv_lens, jnp.int32)
            ns_all = jnp.asarray([seqs], jnp.int32)
            pre_cu = cu[n_dec:] - cu[n_dec]
        except Exception as err:
            rows.append(record_error("quant_mixed", f"setup {name}", err))
            continue
        # The bf16 cache first (its one call the reference), then each format.
        caches: list[tuple[str, tuple[Array, ...]]] = [("bf16", (k, v))]
        for fmt in QUANT_FORMATS:
            for gran in ("head", "token") if QUANT_MIXED_ALL else ("head",):
                kq, vq, ks, vs = quantized_cache(k, v, fmt, gran)
                caches.append((f"{fmt} per {gran}", (kq, vq, ks, vs)))
        for index, (cname, cache) in enumerate(caches):

            def run(
                q: Array,
                t: Array,
                n: Array,
                cu: Array,
                ns: Array,
                tiles: LP.PagedTiles | None = None,
                cache: tuple[Array, ...] = cache,
            ) -> Array:
                if len(cache) == 2:
                    out = ragged_paged(q, cache[0], cache[1], t, n, cu, ns, tiles=tiles, interpret=SMOKE)
                else:
                    k, v, a, b = cache
                    out = ragged_paged(q, k, v, t, n, cu, ns, k_scale=a, v_scale=b, tiles=tiles, interpret=SMOKE)
                assert isinstance(out, jax.Array)
                return out

            label = f"{name} {cname}"
            late = out_of_time("quant_mixed", label)
            if late:
                rows.append(late)
                continue
            try:
                kc = cache[0]
                gran_shape = cache[2].shape if len(cache) == 4 else None
                spec = LP.PagedSpec(
                    num_tokens=int(q.shape[0]), max_seqs=seqs, q_len=None, heads_q=HQ, heads_kv=HKV, head_dim=D,
                    head_dim_v=D, dtype=jnp.dtype(dt).name, num_pages=int(kc.shape[0]), page_size=ps,
                    pages_per_seq=cap // ps, cache_dtype=None if gran_shape is None else jnp.dtype(kc.dtype).name,
                    k_scale=None if gran_shape is None else LP.scale_strides(gran_shape, kc.shape[:3]),
                    v_scale=None if gran_shape is None else LP.scale_strides(gran_shape, kc.shape[:3]),
                )  # fmt: skip
                base = LP.default_tiles(spec, _num_sms())
                pre_spec = dataclasses.replace(spec, num_tokens=int(q.shape[0]) - n_dec, max_seqs=n_pre)
                pre_base = LP.default_tiles(pre_spec, _num_sms())
            except Exception as err:
                rows.append(record_error("quant_mixed", label, err))
                continue
            dec_args = (q[:n_dec], table[:n_dec], lens[:n_dec], cu[: n_dec + 1], jnp.asarray([n_dec], jnp.int32))
            pre_args = (q[n_dec:], table[n_dec:], lens[n_dec:], pre_cu, jnp.asarray([n_pre], jnp.int32))
            one_args = (q, table, lens, cu, ns_all)
            # The default; then, for the first format (or all with --quant-mixed-all), every row in
            # prefill blocks (no decode programs: the tiles before) and 64-token decode tiles;
            # with --quant-mixed-prefill, prefill blocks of twice the query tokens (128 rows, so
            # each widened K/V tile serves twice the rows), in the one call and in the prefill
            # call of the two.
            variants = [base]
            pre_variants = [pre_base]
            if cname.startswith("int8") or QUANT_MIXED_ALL:
                variants += [
                    dataclasses.replace(base, decode_q=0, decode_block_n=0),
                    dataclasses.replace(base, decode_q=max(1, 16 // base.head_chunk), decode_block_n=64),
                ]
            if QUANT_MIXED_PREFILL and index >= 1:
                for bn in (64, 32):
                    wide = {"block_q": 2 * base.block_q, "num_warps": 8, "block_n": bn}
                    variants.append(dataclasses.replace(base, **wide))
                    pre_variants.append(dataclasses.replace(pre_base, **wide))
            variants = list(dict.fromkeys(variants))
            pre_variants = list(dict.fromkeys(pre_variants))
            timed_two = gran_shape is not None or QUANT_MIXED_ALL
            calls: list[tuple[str, LP.PagedTiles | None, Callable[..., Any], tuple[Any, ...]]] = []
            if timed_two:
                calls.append(("decode", None, jax.jit(run), dec_args))
                calls += [("prefill", t, jax.jit(functools.partial(run, tiles=t)), pre_args) for t in pre_variants]
            calls += [("one", t, jax.jit(functools.partial(run, tiles=t)), one_args) for t in variants if not SMOKE]
            warm_parallel([(fn, args) for _, _, fn, args in calls])
            dec = math.nan
            two_by: dict[tuple[int, int, int], float] = {}
            for kind, t, fn, args in calls:
                tl_ = f"{label} {kind}" + ("" if t is None else (
                    f" bq={t.block_q} bn={t.block_n} w={t.num_warps} st={t.num_stages} splits={t.num_splits} "
                    f"decode_q={t.decode_q} decode_bn={t.decode_block_n}"))  # fmt: skip
                late = out_of_time("quant_mixed", tl_)
                if late:
                    rows.append(late)
                    continue
                try:
                    sec = time_fn(fn, *args)
                except Exception as err:
                    rows.append(record_error("quant_mixed", tl_, err))
                    continue
                if kind == "decode":
                    dec = sec
                    rows.append({"name": tl_, "us": sec * 1e6})
                    log(f"quant mixed {tl_}: {sec * 1e6:.1f} us")
                elif kind == "prefill":
                    assert t is not None
                    two_by[(t.block_q, t.block_n, t.num_warps)] = dec + sec
                    rows.append({"name": tl_, "us": sec * 1e6, "two_calls_us": (dec + sec) * 1e6,
                                 "default": t == pre_base, "tiles": dataclasses.asdict(t)})  # fmt: skip
                    log(f"quant mixed {tl_}: {sec * 1e6:.1f} us; two calls {(dec + sec) * 1e6:.1f} us")
                else:
                    assert t is not None
                    two = two_by.get((pre_base.block_q, pre_base.block_n, pre_base.num_warps), math.nan)
                    same = two_by.get((t.block_q, t.block_n, t.num_warps), two)
                    best = min(two_by.values(), default=math.nan)
                    rows.append({"name": tl_, "us": sec * 1e6, "one_over_two": sec / two,
                                 "one_over_same_tiles": sec / same, "one_over_best_two": sec / best,
                                 "default": t == base, "tiles": dataclasses.asdict(t)})  # fmt: skip
                    log(f"quant mixed {tl_}: {sec * 1e6:.1f} us, {sec / two:.3f}x two calls (default tiles), "
                        f"{sec / same:.3f}x two calls (same prefill tiles), {sec / best:.3f}x the best two calls"
                        + ("  (default)" if t == base else ""))  # fmt: skip
        free(*[a for _, c in caches for a in c])
    RESULTS["quant_mixed"] = rows


# -- sm_90 compile check (no GPU needed) --------------------------------------------------------


def compile_check() -> None:
    """Compile the decode and ragged launches for sm_90 as jax_triton would; report resources."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from triton_compile_check import compile_sm90, output_types

    rows = []

    def compile_one(lz: Any, types: list[str]) -> dict[str, Any]:
        compiled, usage, _ = compile_sm90(lz, types)
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        buffers = sorted(set(re.findall(r"memdesc<(\d+)x\d+x\d+x(?:bf16|f16|f32)", compiled.asm["ttgir"])))
        return {
            "reg": int(m.group(1)) if m else None, "stack": int(m.group(2)) if m else None,
            "smem": compiled.metadata.shared, "kv_buffers": buffers,
        }  # fmt: skip

    for ps, q_len, bn, warps, stages, splits in [
        (16, 1, 64, 4, 3, 1), (16, 1, 64, 4, 3, 4), (64, 1, 64, 4, 3, 4), (64, 1, 128, 4, 3, 4),
        (16, 1, 32, 4, 3, 4), (16, 4, 64, 4, 3, 2), (16, None, 64, 4, 3, 1), (64, None, 64, 4, 3, 2),
    ]:  # fmt: skip
        label = f"ps={ps} q_len={q_len} bn={bn} w={warps} st={stages} splits={splits}"
        try:
            spec = LP.PagedSpec(
                num_tokens=64 * (q_len or 16), max_seqs=64, q_len=q_len, heads_q=32, heads_kv=8, head_dim=128,
                head_dim_v=128, dtype="bfloat16", num_pages=64 * 8192 // ps, page_size=ps, pages_per_seq=8192 // ps,
                softmax_scale=128**-0.5,
            )  # fmt: skip
            t = dataclasses.replace(
                LP.default_tiles(spec, num_splits=splits), block_n=bn, num_warps=warps, num_stages=stages
            )
            types = ["*bf16"] * 3 + ["*i32"] * 4 + ["*fp32"] * 3 + ["*i32"] * 2  # ..., sinks, scales, mask_mod
            lz = LP.attention(spec, t)
            row = {"name": label, **compile_one(lz, types + output_types(lz))}
            log(f"compile {label}: {row}")
        except Exception as err:
            row = record_error("compile", label, err)
        rows.append(row)
    RESULTS["compile"] = rows


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"PS,B,CTX;..."`` (page size, sequences, context) as a list of triples."""
    shapes = []
    for part in filter(None, text.split(";")):
        ps, batch, ctx = (int(x) for x in part.split(","))
        shapes.append((ps, batch, ctx))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quant-sweep", action="store_true", help="int8/fp8 caches: tiles, vs cuDNN bf16 dense decode")
    ap.add_argument("--quant-fast", action="store_true", help="with --quant-sweep: per-token scales only")
    ap.add_argument("--quant-mixed", action="store_true", help="a mixed ragged batch over int8/e4m3 caches")
    ap.add_argument("--quant-mixed-all", action="store_true", help="with --quant-mixed: every variant")
    ap.add_argument("--quant-mixed-prefill", action="store_true",
                    help="with --quant-mixed: prefill blocks of twice the query tokens too")  # fmt: skip
    ap.add_argument("--quant-variants", default="", metavar="BN,W,ST,SPLITS,KVH;...",
                    help="--quant-sweep: these tiles beside the default")  # fmt: skip
    ap.add_argument("--quant-formats", default="", metavar="int8,float8_e4m3fn",
                    help="--quant-sweep/--quant-mixed: these cache dtypes (default int8,float8_e4m3fn)")  # fmt: skip
    ap.add_argument("--quant-shapes", default="", metavar="PS,B,CTX;...", help="shapes for --quant-sweep")
    ap.add_argument("--quant-grans", default="", metavar="token,head",
                    help="--quant-sweep: these scale granularities, each with the tile variants")  # fmt: skip
    ap.add_argument("--warm-workers", type=int, default=1,
                    help="threads compiling the variants before timing (--quant-sweep, --quant-mixed)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=1,
                    help="time N calls chained in one jax.jit program, a call's share (default 1)")  # fmt: skip
    ap.add_argument("--compile", action="store_true", help="sm_90 compile check (no GPU needed)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes in the Triton interpreter")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--deadline-s", type=float, default=540.0,
        help="skip the remaining measurements after this many seconds (default 540; 0: no limit)",
    )  # fmt: skip
    ap.add_argument(
        "--sweep-shapes",
        default="",
        metavar="PS,B,CTX;...",
        help="shapes for --sweep (page size, sequences, context), e.g. '16,16,8192;16,64,2048'",
    )
    ap.add_argument("--sweep-splits", default="", metavar="N,...", help="key splits for --sweep (default 1,2,3,4,6,8)")
    args = ap.parse_args()
    global WARM_WORKERS, QUANT_GRANS, QUANT_FORMATS, LAYERS
    if args.layers < 1:
        raise SystemExit(f"--layers: must be at least 1, got {args.layers}")
    LAYERS = args.layers
    if args.quant_formats:
        QUANT_FORMATS = tuple(args.quant_formats.split(","))
    WARM_WORKERS = args.warm_workers
    QUANT_GRANS = tuple(filter(None, args.quant_grans.split(",")))
    for part in filter(None, args.quant_variants.split(";")):
        bn, w, st, sp, kvh = (int(x) if x else None for x in part.split(","))
        if not (bn and w and st):
            raise SystemExit(f"--quant-variants: {part!r} needs block_n, warps and stages")
        QUANT_VARIANTS.append((bn, w, st, sp, kvh))
    if args.quant_shapes:
        QUANT_SWEEP_SHAPES[:] = parse_shapes(args.quant_shapes)
    if args.sweep_splits:
        global SWEEP_SPLITS
        SWEEP_SPLITS = tuple(int(x) for x in args.sweep_splits.split(","))
    SWEEP_SHAPES.extend(parse_shapes(args.sweep_shapes))
    global DEADLINE
    DEADLINE = time.monotonic() + args.deadline_s if args.deadline_s > 0 else math.inf
    sections = (args.check, args.bench, args.ragged, args.sweep, args.compile, args.quant_sweep, args.quant_mixed)
    if not any(sections):
        args.check = args.bench = args.ragged = args.sweep = True
    RESULTS["device"] = str(jax.devices()[0])
    RESULTS["device_kind"] = jax.devices()[0].device_kind
    RESULTS["versions"] = {"jax": jax.__version__, "python": sys.version.split()[0]}
    for mod in ("triton", "jax_triton", "jaxlib"):
        try:
            RESULTS["versions"][mod] = __import__(mod).__version__
        except Exception as err:
            RESULTS["versions"][mod] = repr(err)
    RESULTS["smoke"] = SMOKE
    log(f"device {RESULTS['device_kind']} ({RESULTS['device']}), versions {RESULTS['versions']}, smoke={SMOKE}")
    t0 = time.perf_counter()
    for flag, fn in (("compile", compile_check), ("check", check), ("bench", bench), ("ragged", ragged),
                     ("sweep", sweep), ("quant_sweep", quant_sweep), ("quant_mixed", quant_mixed)):  # fmt: skip
        if getattr(args, flag):
            try:
                fn()
            except Exception as err:
                RESULTS[flag + "_error"] = record_error(flag, "section", err)
            if args.json:  # written after each section: a later crash keeps what was measured
                args.json.write_text(json.dumps(RESULTS, indent=1, default=str))
    RESULTS["wall_s"] = time.perf_counter() - t0
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=1, default=str))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
