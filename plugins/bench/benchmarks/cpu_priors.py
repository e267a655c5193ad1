"""Measure the CPU backends per call class and write the shipped CPU priors from the figures.

For each shape of the matrix below (prefill and decode with ``kv_lengths``, float32 and
bfloat16, causal and full, GQA), every dense CPU backend that accepts it is compiled under
``jax.jit`` and timed in interleaved rounds (a b c, then c b a, ...), ``--reps`` calls per
backend per round; the median of all its calls is its figure. A backend's figures go into its
own plugin's package data (jaxattn-vanilla: vanilla, blockwise, autoregressive_decodeattn;
jaxattn-sdpa: sdpa), keyed as ``jaxattn.selection.tuning.problem_key`` keys a call, and only for shapes
where the ranking is clear: the winner's median beats the runner-up by more than
``--margin`` and wins in every round of every run, or every run has the same winner and it is
auto's declared pick anyway (otherwise the shape is left out, and "auto" ranks such calls by a
neighbouring bucket's prior or by declared priority).

    python plugins/bench/benchmarks/cpu_priors.py --json /tmp/cpu-priors.json            # measure, print, save
    python plugins/bench/benchmarks/cpu_priors.py --from-json /tmp/cpu-priors.json --write  # write package data
    python plugins/bench/benchmarks/cpu_priors.py --from-json run1.json --from-json run2.json --write  # both agree

``--write`` rewrites plugins/vanilla/src/jaxattn_vanilla/priors/cpu.json and
plugins/sdpa/src/jaxattn_sdpa/priors/cpu.json, and keeps every run's figures in
plugins/bench/benchmarks/priors/cpu-bench.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
#: The backends timed, and whose package data holds each one's figures. ``vanilla`` (the O(T*S)
#: reference, priority 0) is left out: it was slowest on every shape here (3000 ms against
#: blockwise's 760 at bf16 T2048), so "auto" never needs its figure to rank it last.
PLUGIN_OF = {"blockwise": "vanilla", "autoregressive_decodeattn": "vanilla", "sdpa": "sdpa"}
FILES = {"vanilla": ROOT / "plugins/vanilla/src/jaxattn_vanilla/priors/cpu.json",
         "sdpa": ROOT / "plugins/sdpa/src/jaxattn_sdpa/priors/cpu.json"}
RAW = ROOT / "plugins/bench/benchmarks/priors/cpu-bench.json"  # every run's figures, kept beside the priors they made

#: (B, T, S, Hq, Hkv, D, dtype, causal, kv_lengths): one shape per class and sequence bucket.
MATRIX: list[tuple[int, int, int, int, int, int, str, bool, bool]] = [
    # prefill, bf16: the call, and the buckets around it
    (1, 512, 512, 8, 2, 128, "bfloat16", True, False),
    (1, 1024, 1024, 8, 2, 128, "bfloat16", True, False),
    (1, 2048, 2048, 8, 2, 128, "bfloat16", True, False),
    (1, 4096, 4096, 8, 2, 128, "bfloat16", True, False),
    (1, 2048, 2048, 8, 8, 128, "bfloat16", True, False),
    (1, 2048, 2048, 8, 2, 128, "bfloat16", False, False),
    (1, 1024, 1024, 8, 2, 128, "bfloat16", False, False),
    # prefill, float32
    (1, 512, 512, 8, 2, 128, "float32", True, False),
    (1, 2048, 2048, 8, 2, 128, "float32", True, False),
    (1, 2048, 2048, 8, 2, 128, "float32", False, False),
    (1, 2048, 2048, 8, 8, 128, "float32", True, False),
    # decode over a dense cache with kv_lengths (every sequence full)
    (8, 1, 1024, 32, 8, 128, "float32", True, True),
    (8, 1, 4096, 32, 8, 128, "float32", True, True),
    (8, 1, 16384, 32, 8, 128, "float32", True, True),
    (8, 1, 4096, 32, 8, 128, "float32", False, True),
    (8, 1, 4096, 32, 8, 128, "bfloat16", True, True),
    (8, 1, 16384, 32, 8, 128, "bfloat16", True, True),
]


def _label(shape: tuple[Any, ...]) -> str:
    b, t, s, hq, hkv, d, dtype, causal, lengths = shape
    heads = f"H{hq}" if hq == hkv else f"H{hq}/{hkv}"
    return (f"B{b} T{t} S{s} {heads} D{d} {dtype}{' causal' if causal else ''}"
            f"{' kv_lengths' if lengths else ''}")


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxattn
    import jaxattn.selection.tuning
    from jaxattn.selection.dispatch import accepting

    rows = []
    for shape in MATRIX:
        b, t, s, hq, hkv, d, dtype, causal, lengths = shape
        if args.only and not any(o in _label(shape) for o in args.only):
            continue
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
        k = jnp.asarray(rng.normal(size=(b, s, hkv, d)), dtype)
        v = jnp.asarray(rng.normal(size=(b, s, hkv, d)), dtype)
        kw: dict[str, Any] = {"kv_lengths": jnp.full((b,), s, jnp.int32)} if lengths else {}
        problem = jaxattn.AttentionProblem.from_inputs(q, k, v, causal=causal, **kw)
        accepted = [n for n in accepting(problem, jaxattn.AttentionMetadata()) if n in PLUGIN_OF]
        auto = jaxattn.explain(q, k, v, causal=causal, **kw).chosen
        fns = {n: jax.jit(lambda q, k, v, kw, n=n, c=causal: jaxattn.attention(q, k, v, impl=n, causal=c, **kw))
               for n in accepted}
        for fn in fns.values():  # compile and warm up
            fn(q, k, v, kw).block_until_ready()
        times: dict[str, list[float]] = {n: [] for n in fns}
        per_round: dict[str, list[float]] = {n: [] for n in fns}
        order = list(fns)
        for round_ in range(args.rounds):
            for n in order if round_ % 2 == 0 else order[::-1]:
                got = []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    fns[n](q, k, v, kw).block_until_ready()
                    got.append((time.perf_counter() - start) * 1e3)
                times[n] += got
                per_round[n].append(statistics.median(got))
        medians = {n: statistics.median(ts) for n, ts in times.items()}
        row = {"shape": _label(shape), "key": jaxattn.selection.tuning.problem_key(problem), "auto_declared": auto,
               "median_ms": medians, "round_medians_ms": per_round}
        rows.append(row)
        ranked = sorted(medians, key=medians.__getitem__)
        print(f"{_label(shape):48} " + "  ".join(f"{n} {medians[n]:.1f}" for n in ranked)
              + f"   (auto declared: {auto})", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "machine": _machine(), "command": args.command},
                                                  indent=1) + "\n")
    return rows


def _machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def clear_winner(row: dict[str, Any], margin: float) -> bool:
    """Whether the fastest median beats the runner-up by more than ``margin`` in every round."""
    medians = row["median_ms"]
    if len(medians) < 2:
        return False
    first, second = sorted(medians, key=medians.__getitem__)[:2]
    rounds = zip(row["round_medians_ms"][first], row["round_medians_ms"][second], strict=True)
    return medians[second] > medians[first] * (1 + margin) and all(a < b for a, b in rounds)


def _winner(row: dict[str, Any]) -> str:
    return min(row["median_ms"], key=row["median_ms"].__getitem__)


def write(runs: list[dict[str, Any]], margin: float) -> None:
    """The plugins' priors/cpu.json from one or more runs: a shape is kept where every run that
    timed it has the same clear winner; its figures are the median over the runs."""
    import jax

    date = runs[-1].get("date") or datetime.date.today().isoformat()
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for data in runs:
        for row in data["rows"]:
            by_shape.setdefault(row["shape"], []).append(row)
    for plugin, path in FILES.items():
        entries = {}
        for rows in by_shape.values():
            winners = {_winner(r) for r in rows}
            # Shipped: the same clear winner in every run; or the same winner in every run, by less,
            # where it is the declared pick anyway (the entry then keeps a neighbour's prior away).
            if len(winners) != 1 or not (all(clear_winner(r, margin) for r in rows)
                                         or winners == {rows[0]["auto_declared"]}):
                continue
            names = [n for n in rows[0]["median_ms"] if PLUGIN_OF[n] == plugin]
            mine = {n: {"fwd_ms": round(statistics.median(r["median_ms"][n] for r in rows), 3)} for n in names}
            if mine:
                entries[rows[0]["key"]] = {"problem": rows[0]["shape"], "results": mine}
        out = {
            "format": "jaxattn-priors/1",
            "device": {"label": "cpu", "platform": "cpu"},
            "measured": {"machine": runs[-1]["machine"], "date": date, "jax": jax.__version__,
                         "command": "; ".join(dict.fromkeys(d["command"] for d in runs)),
                         "figures": "plugins/bench/benchmarks/priors/cpu-bench.json",
                         "how": f"{len(runs)} run(s); jax.jit, interleaved rounds, median of every call; a shape is "
                                f"kept where the fastest beat the runner-up by more than {margin:.0%} in every round "
                                "of every run, or every run had the same winner and it is the declared pick"},
            "entries": dict(sorted(entries.items())),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path} ({len(entries)} entries)")
    RAW.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"wrote {RAW}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2, help="calls per backend per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", action="append", help="shapes whose label contains this (repeatable)")
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument("--from-json", action="append", help="read the raw figures of a run instead of measuring "
                        "(repeatable: a shape is kept where every run agrees)")
    parser.add_argument("--write", action="store_true", help="write the plugins' priors/cpu.json")
    parser.add_argument("--margin", type=float, default=0.10, help="how much the winner must lead by (default 10%%)")
    args = parser.parse_args()
    args.command = "python plugins/bench/benchmarks/cpu_priors.py " + " ".join(
        a for a in __import__("sys").argv[1:] if a not in ("--write",))
    if args.from_json:
        runs = []
        for path in args.from_json:
            data = json.loads(Path(path).read_text())
            runs += data.get("runs", [data])
    else:
        runs = [{"rows": measure(args), "machine": _machine(), "command": args.command,
                 "date": datetime.date.today().isoformat()}]
    if args.write:
        write(runs, args.margin)


if __name__ == "__main__":
    main()
