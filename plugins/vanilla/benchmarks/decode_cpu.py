"""Decode over a dense KV cache on this host: autoregressive_decodeattn against the generic paths.

Times ``jaxattn.attention(..., impl=NAME)`` under ``jax.jit`` for each backend on one decode
shape (B=8, Hq=32, Hkv=8, D=128 by default), interleaving the backends repetition by
repetition so that a noisy (shared) host disturbs them alike, and prints the fastest and the
median time of each, with the cache bandwidth that makes (K and V bytes / time). Outputs are
checked against vanilla's first.

    python plugins/vanilla/benchmarks/decode_cpu.py --seqs 4096,16384 --dtypes float32,bfloat16

``--fill 0.25`` gives every sequence ``kv_lengths = fill * S`` (a cache a quarter full);
``--no-lengths`` calls without kv_lengths; ``--decode-step-keys N`` cuts
autoregressive_decodeattn's scan into steps of N keys (steps past the lengths are skipped).
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

IMPLS = ("autoregressive_decodeattn", "sdpa", "blockwise", "vanilla")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--queries", default="1", help="T values, comma-separated")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--fill", type=float, default=1.0, help="kv_lengths = fill * S")
    parser.add_argument("--no-lengths", action="store_true", help="call without kv_lengths")
    parser.add_argument("--decode-step-keys", type=int, default=None)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {jax.device_count()} device(s)")
    for dtype in args.dtypes.split(","):
        for s in (int(x) for x in args.seqs.split(",")):
            for t in (int(x) for x in args.queries.split(",")):
                rows += bench_one(args, dtype, s, t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def bench_one(args: argparse.Namespace, dtype: str, s: int, t: int) -> list[dict[str, Any]]:
    b, hq, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, hkv, d)), dtype)
    features: dict[str, Any] = {"causal": True}
    length = max(1, round(args.fill * s))
    if not args.no_lengths:
        features["kv_lengths"] = jnp.full((b,), length, jnp.int32)
    fns = {}
    for name in args.impls.split(","):
        md = jaxattn.AttentionMetadata()
        if name == "autoregressive_decodeattn" and args.decode_step_keys:
            md = md.replace(extra={"decode_step_keys": args.decode_step_keys})
        fns[name] = jax.jit(lambda q, k, v, kw, name=name, md=md: jaxattn.attention(
            q, k, v, impl=name, causal=True, metadata=md, **kw))
    kw = {n: a for n, a in features.items() if n != "causal"}
    outs = {name: np.asarray(fn(q, k, v, kw).astype(jnp.float32)) for name, fn in fns.items()}
    ref = outs.get("vanilla", next(iter(outs.values())))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(q, k, v, kw).block_until_ready()
            times[name].append(time.perf_counter() - start)
    cache_bytes = 2 * b * s * hkv * d * jnp.dtype(dtype).itemsize
    lengths = "none" if args.no_lengths else f"{length} (fill {args.fill:g})"
    print(f"\nB={b} T={t} S={s} Hq={hq} Hkv={hkv} D={d} {dtype}, causal, kv_lengths={lengths}, "
          f"cache {cache_bytes / 2**20:.0f} MiB, {args.reps} reps")
    rows = []
    for name, ts in times.items():
        best, median = min(ts), statistics.median(ts)
        err = float(np.abs(outs[name] - ref).max())
        print(f"  {name:<26} min {best * 1e3:8.1f} ms   median {median * 1e3:8.1f} ms   "
              f"{cache_bytes / best / 1e9:6.2f} GB/s   max|diff vs vanilla| {err:.1e}")
        rows.append({"impl": name, "dtype": dtype, "b": b, "t": t, "s": s, "hq": hq, "hkv": hkv, "d": d,
                     "kv_lengths": None if args.no_lengths else length, "min_ms": best * 1e3,
                     "median_ms": median * 1e3, "max_abs_diff": err})
    return rows


if __name__ == "__main__":
    main()
