"""Turn the JSON of ``plugins/bench/benchmarks/gpu_priors.sh`` (``jaxattn bench`` runs on an H200) into the
shipped Hopper priors, and say how untuned auto would do with them.

    python plugins/bench/benchmarks/gpu_priors.py OUT/plain.json OUT/window.json ... --write

Each backend's median forward and forward+backward times go into its own plugin's
``priors/hopper.json`` (cudnn: jaxattn-sdpa, flash_attn2: jaxattn-triton, mosaic_flash:
jaxattn-mosaic), keyed by ``jaxattn.selection.tuning.problem_key``; ``--write`` also writes the condensed
figures (every shape, backend and mode: median ms) to ``plugins/bench/benchmarks/priors/h200-bench.json``, so
they can be checked. Without ``--write`` it prints, per shape and mode, the backend the priors
make auto pick and its time against the fastest of the same run.

    python plugins/bench/benchmarks/gpu_priors.py OUT/gaps-*.json --merge --write

``--merge`` adds a later run's figures (``gpu_priors.sh --gaps``, or any ``jaxattn bench`` run
of the matrix) to those already shipped (``h200-bench.json``): a key, backend and mode measured
again takes the mean of its runs (``runs`` counts them), every other shipped figure stays, and
the priors files are written from the union.

    python plugins/bench/benchmarks/gpu_priors.py OUT/h100.json --device h100 --write --measured-by "..."

``--device h100``: the runs were on an H100 SXM; its figures go into each plugin's
``priors/h100.json`` (that device kind only: on an H100 they answer before the Hopper priors
measured on the H200) and ``priors/h100-bench.json``; ``--measured-by`` says the command that ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = {"cudnn": ("sdpa", "jaxattn_sdpa"), "flash_attn2": ("triton", "jaxattn_triton"),
           "mosaic_flash": ("mosaic", "jaxattn_mosaic")}
#: Per ``--device``: the priors' device (what a GPU must match), their file in each plugin, the
#: raw figures behind them and the device the check ranks for. The H200's are every Hopper
#: GPU's; an H100's own file answers before them there (``jaxattn.selection.tuning.prior_results``).
DEVICES: dict[str, tuple[dict[str, str], str, str, dict[str, str]]] = {
    "h200": ({"label": "Hopper, measured on an H200", "platform": "gpu", "vendor": "cuda",
              "compute_capability": "9.0"}, "hopper.json", "h200-bench.json", {"device_kind": "NVIDIA H200"}),
    "h100": ({"label": "H100 SXM", "platform": "gpu", "vendor": "cuda", "device_kind": "NVIDIA H100 80GB HBM3"},
             "h100.json", "h100-bench.json", {"device_kind": "NVIDIA H100 80GB HBM3"}),
}
FIGURES = ROOT / "plugins/bench/benchmarks/priors"


def _shape(data: dict[str, Any]) -> Any:
    from jaxattn_bench.shapes import BenchShape

    fields = {f.name for f in dataclasses.fields(BenchShape)}
    kw = {k: v for k, v in data.items() if k in fields}
    if kw.get("sliding_window") is not None:
        kw["sliding_window"] = tuple(kw["sliding_window"])
    return BenchShape(**kw)


def load(paths: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The runs' environment, and one row per shape, backend and mode that ran."""
    from jaxattn.selection.tuning import problem_key
    from jaxattn_bench.record import problem_of

    rows, env = [], {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        env = {"device": data.get("device"), "versions": data.get("environment", {}).get("versions", {})}
        for r in data["results"]:
            if r["status"] != "ok" or r.get("median_ms") is None:
                continue
            shape = _shape(r["shape"])
            rows.append({"run": Path(path).stem, "shape": shape.label, "key": problem_key(problem_of(shape)),
                         "backend": r["backend"], "mode": r["mode"], "median_ms": round(r["median_ms"], 5),
                         "note": r.get("note", ""), "_shape": shape})
    return env, rows


def priors(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """key -> {"problem": label, "results": {backend: {fwd_ms, fwdbwd_ms}}} over the priors' backends."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["backend"] not in PLUGINS:
            continue
        entry = out.setdefault(r["key"], {"problem": r["shape"], "results": {}})
        times = entry["results"].setdefault(r["backend"], {"fwd_ms": None, "fwdbwd_ms": None})
        times["fwd_ms" if r["mode"] == "fwd" else "fwdbwd_ms"] = r["median_ms"]
    return out


#: Declared priorities (the plugins' ImplRefs): ties within 1% keep this order.
PRIORITY = {"cudnn": 100, "flash_attn2": 90, "mosaic_flash": 80}


@dataclasses.dataclass(frozen=True)
class _Named:
    name: str


def check(rows: list[dict[str, Any]], device: str) -> None:
    """Per shape and mode: what the shipped priors make auto pick on ``device``, against the fastest."""
    from jaxattn.backend.device import DeviceInfo
    from jaxattn.selection.tuning import device_priors, nearest_priors, rank_measured

    gpu = DeviceInfo(platform="gpu", vendor="cuda", compute_capability="9.0", **DEVICES[device][3])
    ratios = []
    seen: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        seen.setdefault((r["run"], r["shape"], r["mode"]), {})[r["backend"]] = r
    for (run, label, mode), by_backend in seen.items():
        timed = {b: x["median_ms"] for b, x in by_backend.items() if b != "auto"}
        fastest = min(timed, key=timed.__getitem__)
        any_row = next(iter(by_backend.values()))
        found = nearest_priors(any_row["key"], device_priors(gpu))
        auto = by_backend.get("auto")
        before = f"(auto untuned before: {auto['note']}, {timed[fastest] / auto['median_ms']:.3f}x)" if auto else ""
        if found is None:
            print(f"{run:9} {label:44} {mode:6} no prior for {any_row['key']} {before}")
            continue
        grad = mode == "fwdbwd"
        times = {b: m.time(grad) for b, (m, _) in found[1].items() if b in timed and m.time(grad) is not None}
        order = [_Named(b) for b in sorted(times, key=lambda b: -PRIORITY[b])]
        pick = rank_measured(order, {b: t or 0.0 for b, t in times.items()})[0].name  # type: ignore[arg-type]
        ratios.append(timed[fastest] / timed[pick])
        print(f"{run:9} {label:44} {mode:6} pick {pick:12} {ratios[-1]:.3f}x the fastest ({fastest}) {before}")
    if ratios:
        print(f"untuned auto with the priors: worst {min(ratios):.3f}x the fastest, below 0.98x on "
              f"{sum(x < 0.98 for x in ratios)} of {len(ratios)} shape/mode pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--date", default="2026-12-01")
    parser.add_argument("--into", type=Path, help="with --write: write the priors into the packages under this "
                        "folder (an installed site, to time auto with them), not into the repository")
    parser.add_argument("--merge", action="store_true", help="add these figures to the shipped ones "
                        "(priors/h200-bench.json); a key, backend and mode measured again takes the mean of its runs")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200",
                        help="the GPU the runs measured: h200 writes every Hopper GPU's priors (hopper.json), "
                             "h100 an H100 SXM's own (h100.json)")
    parser.add_argument("--measured-by", help="with --write: the command that measured the runs (default: "
                        "gpu_priors.sh's)")
    args = parser.parse_args()
    device, name, raw_name, _ = DEVICES[args.device]
    raw = FIGURES / raw_name
    env, rows = load(args.json)
    if args.merge:
        shipped = json.loads(raw.read_text())
        before = {(r["key"], r["backend"], r["mode"]): r for r in shipped["rows"]}
        again = {(r["key"], r["backend"], r["mode"]) for r in rows}
        for r in rows:  # measured again: the mean of the runs, so one run's noise does not flip a near tie
            old = before.get((r["key"], r["backend"], r["mode"]))
            if old is not None:
                runs = old.get("runs", 1)
                r["median_ms"] = round((old["median_ms"] * runs + r["median_ms"]) / (runs + 1), 5)
                r["runs"] = runs + 1
        rows = [r for r in shipped["rows"] if (r["key"], r["backend"], r["mode"]) not in again] + rows
        env = env or shipped["environment"]
    entries = priors(rows)
    if args.write:
        versions = env.get("versions", {})
        command = args.measured_by or (
            "bash plugins/bench/benchmarks/gpu_priors.sh (jaxattn bench --impls cudnn,flash_attn2,mosaic_flash "
            "over one shape per bucket; docs/tuning.md), then python plugins/bench/benchmarks/gpu_priors.py "
            "OUT/*.json --write; the gaps: gpu_priors.sh --gaps, then gpu_priors.py OUT/gaps-*.json --merge --write")
        for backend, (plugin, package) in PLUGINS.items():
            mine = {k: {"problem": e["problem"], "results": {backend: e["results"][backend]}}
                    for k, e in sorted(entries.items()) if backend in e["results"]}
            out = {"format": "jaxattn-priors/1", "device": device,
                   "measured": {"machine": str(env.get("device")), "date": args.date,
                                "jax": versions.get("jax", ""), "command": command,
                                "figures": f"plugins/bench/benchmarks/priors/{raw_name}",
                                "how": "jaxattn bench: one process, interleaved rounds, back-to-back calls after a "
                                       "100 ms pre-roll, median of the samples"},
                   "entries": mine}
            folder = args.into / package if args.into else ROOT / f"plugins/{plugin}/src/{package}"
            path = folder / "priors" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {path} ({len(mine)} entries)")
        if args.into:
            return
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps({"environment": env, "date": args.date, "rows": [
            {k: v for k, v in r.items() if k != "_shape"} for r in rows]}, indent=0) + "\n")
        print(f"wrote {raw.relative_to(ROOT)} ({len(rows)} rows)")
    else:
        check(rows, args.device)


if __name__ == "__main__":
    main()
