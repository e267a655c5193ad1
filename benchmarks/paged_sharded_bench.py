"""Head-sharded paged decode: tokens/s on 1 device against N devices that each hold their KV heads' pages.

The serving measurement of the issue "Context parallelism measured on 2 and 4 GPUs" (target:
at least 1.9x tokens/s at 2 GPUs). On a machine with 2 (or 4) GPUs and the jaxattn wheels:

    python3 benchmarks/paged_sharded_bench.py --devices 1,2,4 --batch 64 --context 4096,16384 \\
        --heads-q 32 --heads-kv 8 --json paged_sharded.json

For every context length it builds a paged cache (``--page-size`` tokens per page, each
sequence's pages scattered over the pool, every sequence at the full context), then times one
jitted decode step (``jaxattn.paged_attention``, one query per sequence, bf16) with the cache on
one device and with ``AttentionMetadata(mesh, head_axis="model")`` over n devices: the pages
sharded on their KV-head axis, the queries on theirs, page table and lengths replicated.
``--ragged`` times ``ragged_paged_attention`` instead, with ``--prefill`` query tokens for the
first sequence (a prefill chunk) and one for every other. Tokens/s counts query tokens per
second; the table gives the speed-up of n devices over one, after checking each sharded output
against the one-device output.

``--layers L`` times a program of L decode calls, as a model's step holds one per layer: each
layer has its own cache (same page table and lengths, its own pages) and takes the previous
layer's output as its queries, so no call can be skipped or merged. The figures are then per
call (the step's time over L), without the host's dispatch of one program per call, which a
step of a few tenths of a millisecond over several devices can show.

The same script runs on the CPU host mesh with tiny shapes::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 benchmarks/paged_sharded_bench.py \\
        --devices 1,2,4 --batch 4 --context 64 --heads-q 8 --heads-kv 4 --dim 16 --dtype float32 --reps 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn_bench.timing import seconds_per_call


def log(*args: Any) -> None:
    print(*args, flush=True)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def cache(context: int, args: argparse.Namespace) -> dict[str, Any]:
    """A decode (or ragged) call over a cache whose sequences all hold ``context`` tokens (``--layers``
    caches: ``k_pages``/``v_pages`` are lists, one per layer)."""
    rng = np.random.default_rng(0)
    per_seq = -(-context // args.page_size)
    num_pages = args.batch * per_seq + 1
    table = rng.permutation(num_pages - 1)[: args.batch * per_seq].reshape(args.batch, per_seq).astype(np.int32)
    q_lens = [args.prefill] + [1] * (args.batch - 1) if args.ragged else [1] * args.batch
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 1 + 2 * args.layers)
    shape = (num_pages, args.page_size, args.heads_kv, args.dim)
    return {
        "q": jax.random.normal(keys[0], (sum(q_lens), args.heads_q, args.dim), dtype),
        "k_pages": [jax.random.normal(key, shape, dtype) for key in keys[1::2]],
        "v_pages": [jax.random.normal(key, shape, dtype) for key in keys[2::2]],
        "page_table": jnp.asarray(table),
        "kv_lengths": jnp.full((args.batch,), context, jnp.int32),
        "cu_q_lens": jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        "num_seqs": jnp.array([args.batch], jnp.int32),
    }


def step(md: jaxattn.AttentionMetadata, args: argparse.Namespace) -> Callable[..., Any]:
    def run(c: dict[str, Any]) -> Any:
        q = c["q"]
        for k_pages, v_pages in zip(c["k_pages"], c["v_pages"], strict=True):  # one call per layer
            cached = (q, k_pages, v_pages, c["page_table"], c["kv_lengths"])
            if args.ragged:
                q = jaxattn.ragged_paged_attention(*cached, c["cu_q_lens"], c["num_seqs"], impl=args.impl,
                                                   metadata=md)
            else:
                q = jaxattn.paged_attention(*cached, impl=args.impl, metadata=md)
        return q

    return jax.jit(run)


def placed(c: dict[str, Any], mesh: Mesh | None) -> dict[str, Any]:
    """The cache as each device holds it: pages and queries sharded on their heads, the rest replicated."""
    if mesh is None:
        return c
    heads = {"q": P(None, "model"), "k_pages": P(None, None, "model"), "v_pages": P(None, None, "model")}
    return {k: jax.device_put(x, NamedSharding(mesh, heads.get(k, P()))) for k, x in c.items()}  # lists: leafwise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=parse_ints, default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--context", type=parse_ints, default=[4096, 16384], help="tokens cached per sequence")
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impl", default=None, help="paged backend (default: auto)")
    parser.add_argument("--ragged", action="store_true", help="ragged_paged_attention with a prefill chunk")
    parser.add_argument("--prefill", type=int, default=64, help="query tokens of the first sequence with --ragged")
    parser.add_argument("--layers", type=int, default=1,
                        help="decode calls per program, each over its own cache, chained as a model's layers")
    parser.add_argument("--reps", type=int, default=10, help="timed samples of back-to-back calls (median)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    devices = jax.devices()
    log(f"jax {jax.__version__}; {len(devices)} devices: {sorted({d.device_kind for d in devices})}")
    records: list[dict[str, Any]] = []
    failed = False
    for context in args.context:
        c = cache(context, args)
        tokens = int(c["q"].shape[0])
        base = None
        for n in args.devices:
            rec: dict[str, Any] = {"context": context, "devices": n, "tokens": tokens}
            if n > len(devices):
                rec.update(status="skipped", detail=f"{len(devices)} devices here")
                records.append(rec)
                continue
            mesh = None if n == 1 else Mesh(np.array(devices[:n]), ("model",))
            md = jaxattn.AttentionMetadata() if mesh is None else jaxattn.AttentionMetadata(mesh=mesh,
                                                                                           head_axis="model")
            try:
                fn, data = step(md, args), placed(c, mesh)
                out = fn(data)
                if base is None:
                    base = np.asarray(out, np.float32)
                err = float(np.abs(np.asarray(out, np.float32) - base).max())
                seconds = seconds_per_call(fn, (data,), args.reps) / args.layers
                rec.update(status="ok", ms=1e3 * seconds, tokens_per_s=tokens / seconds, max_abs_diff_vs_1=err)
            except Exception as err:  # a decline names every reason; report it and go on
                failed = True
                rec.update(status="error", detail=(str(err).splitlines() or [type(err).__name__])[0][:300])
            records.append(rec)
            log(f"  context={context:>7} devices={n} {rec}")
    log(f"\n{'paged_attention' if not args.ragged else 'ragged_paged_attention'}: B={args.batch} "
        f"Hq={args.heads_q} Hkv={args.heads_kv} D={args.dim} page={args.page_size} {args.dtype}"
        + (f", {args.layers} calls per program (figures per call)" if args.layers > 1 else ""))
    log(f"{'context':>9}{'devices':>9}{'ms/call':>12}{'tokens/s':>14}{'x vs 1':>9}{'|diff| vs 1':>14}")
    for context in args.context:
        one = next((r for r in records if r["context"] == context and r["devices"] == 1 and "ms" in r), None)
        for r in (r for r in records if r["context"] == context):
            if "ms" not in r:
                log(f"{context:>9}{r['devices']:>9}  {r['status']}: {r.get('detail', '')}")
                continue
            speedup = f"{one['ms'] / r['ms']:.2f}x" if one else "?"
            log(f"{context:>9}{r['devices']:>9}{r['ms']:>12.3f}{r['tokens_per_s']:>14.0f}{speedup:>9}"
                f"{r['max_abs_diff_vs_1']:>14.2e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "devices": [d.device_kind for d in devices], "records": records}, fh,
                      indent=2)
        log(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
