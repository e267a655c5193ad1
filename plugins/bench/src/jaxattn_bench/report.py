"""What the benchmark writes: tables (stdout), a summary and a JSON file (``plot`` draws the PNG)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .results import BenchReport, BenchResult
from .shapes import MODE_LABELS, BenchShape

__all__ = ["AUTO_TOLERANCE", "auto_gaps", "fastest_other", "group_not_run", "not_run_lines", "report_dict",
           "summary_lines", "tables", "write_json"]

#: Issue target: "auto" within 3% of the fastest backend on every shape.
AUTO_TOLERANCE = 0.03
FORMAT = "jaxattn-bench/1"


def _ms(r: BenchResult | None) -> str:
    return f"{r.median_ms:.3f}" if r is not None and r.ok and r.median_ms is not None else "-"


def _tflops(r: BenchResult | None) -> str:
    return "-" if r is None else r.cell()


def _ratio(r: BenchResult | None) -> str:
    return f"{r.ratio:.2f}x" if r is not None and r.ratio is not None else "-"


def fastest_other(report: BenchReport, shape: BenchShape, mode: str) -> BenchResult | None:
    """The fastest backend other than ``auto`` that ran ``shape`` in ``mode``."""
    others = [r for r in report.rows(shape) if r.mode == mode and r.backend != "auto" and r.ok
              and r.median_ms is not None]
    return min(others, key=lambda r: r.median_ms or math.inf, default=None)


def _vs_best(report: BenchReport, r: BenchResult) -> str:
    """The fastest other backend's time over this row's (1.00x: the fastest; auto's ratio to it)."""
    best = fastest_other(report, r.shape, r.mode)
    if best is None or best.median_ms is None or r.median_ms is None:
        return "-"
    return f"{best.median_ms / r.median_ms:.2f}x"


def _mem(r: BenchResult | None) -> str:
    if r is None or r.temp_bytes is None:
        return "-"
    n = r.temp_bytes
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _shapes(report: BenchReport) -> list[BenchShape]:
    seen: dict[BenchShape, None] = {}
    for r in report.results:
        seen.setdefault(r.shape, None)
    return list(seen)


def tables(report: BenchReport) -> list[Any]:
    """One table per mode: under each shape's heading a row per backend that ran it; backends
    that did not run a shape are in ``not_run_lines`` instead, once each."""
    from jaxattn.cli import Table

    ref = report.config.reference or "-"
    out = []
    for mode in report.config.modes:
        table = Table(f"{MODE_LABELS[mode].capitalize()} on {report.device}, {_dtype(report)} "
                      f"(median of {report.config.repeats} samples; vs {ref}: TFLOP/s ratio)",
                      ["backend", "ms", "TFLOP/s", f"vs {ref}", "vs best", "temp", "note"])
        for shape in _shapes(report):
            rows = [r for name in report.config.backends if (r := report.get(shape, name, mode)) is not None and r.ok]
            if rows:
                table.heading(shape.label)
            for r in rows:
                shared = f"{r.same_program_as}'s program" if r.same_program_as else ""
                table.add(r.backend, _ms(r), _tflops(r), _ratio(r), _vs_best(report, r), _mem(r),
                          "; ".join(n for n in (r.note, shared) if n) or None)
        out.append(table)
    return out


def not_run_lines(report: BenchReport) -> list[str]:
    """Every backend that did not run some shape, once per outcome (see ``group_not_run``)."""
    return group_not_run(report.results, len(_shapes(report)), report.config.modes)


def group_not_run(results: Sequence[Any], total: int, modes: Sequence[str] = ()) -> list[str]:
    """Per backend and outcome (declined, skipped, failed) of ``results`` (bench or serving
    rows): on how many of the ``total`` shapes, and why (the reason once when every shape gives
    the same one, else the first shape's as an example)."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in results:
        if not r.ok:
            groups.setdefault((r.backend, r.status), []).append(r)
    lines = []
    for (name, status), rows in groups.items():
        shapes = list(dict.fromkeys(r.shape.label for r in rows))
        where = f"every shape ({total})" if len(shapes) == total else f"{len(shapes)} of {total} shapes"
        seen = sorted({getattr(r, "mode", "") for r in rows} - {""}, key=list(modes).index)
        if modes and len(seen) < len(modes):
            where += f", {' and '.join(MODE_LABELS[m] for m in seen)} only"
        reasons = list(dict.fromkeys(r.reason for r in rows))
        why = reasons[0] if len(reasons) == 1 else f"e.g. {rows[0].shape.label}: {reasons[0]}"
        lines.append(f"{name} {status} on {where}: {why}")
    return lines


def _dtype(report: BenchReport) -> str:
    return ", ".join(dict.fromkeys(s.dtype for s in report.config.shapes)) or "-"


def auto_gaps(report: BenchReport) -> list[dict[str, Any]]:
    """Per shape and mode: auto's time against the fastest other backend that ran."""
    gaps = []
    for shape in _shapes(report):
        for mode in report.config.modes:
            auto = report.get(shape, "auto", mode)
            best = fastest_other(report, shape, mode)
            if auto is None or not auto.ok or best is None or auto.median_ms is None or best.median_ms is None:
                continue
            gaps.append({"shape": shape.label, "mode": mode, "auto_ms": auto.median_ms, "auto_runs": _runs(auto),
                         "auto_ranked_by": _ranked_by(auto), "auto_program_of": auto.same_program_as,
                         "fastest": best.backend, "fastest_ms": best.median_ms,
                         "vs_best": best.median_ms / auto.median_ms, "slowdown": auto.median_ms / best.median_ms - 1.0})
    return gaps


def _runs(auto: BenchResult) -> str | None:
    """The backend an auto row ran, from its note: ``-> cudnn (declared priority)`` or
    ``-> cudnn, grad flash_attn2 (your tuning record)``."""
    if not auto.note.startswith("-> "):
        return None
    picked, _, grad = auto.note[3:].partition(" (")[0].partition(", grad ")
    return grad if auto.mode == "fwdbwd" and grad else picked


def _ranked_by(auto: BenchResult) -> str | None:
    """What placed auto's pick first, from its note: "shipped prior", "your tuning record", ..."""
    _, paren, source = auto.note.partition(" (")
    return source.rstrip(")") if paren else None


def _geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def ratio_summary(report: BenchReport) -> dict[str, dict[str, dict[str, float]]]:
    """Per backend and mode: geometric mean, min and max of the ratio to the reference."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in report.config.backends:
        if name == report.config.reference:
            continue
        for mode in report.config.modes:
            ratios = [r.ratio for r in report.results if r.backend == name and r.mode == mode and r.ratio is not None]
            gm = _geomean(ratios)
            if gm is not None:
                out.setdefault(name, {})[mode] = {"geomean": gm, "min": min(ratios), "max": max(ratios),
                                                  "shapes": len(ratios)}
    return out


def summary_lines(report: BenchReport) -> list[str]:
    lines = []
    ref = report.config.reference
    for name, modes in ratio_summary(report).items():
        for mode, s in modes.items():
            lines.append(f"{name} vs {ref}, {MODE_LABELS[mode]}: geomean {s['geomean']:.2f}x "
                         f"(min {s['min']:.2f}x, max {s['max']:.2f}x over {s['shapes']:.0f} shapes)")
    gaps = auto_gaps(report)
    if gaps:
        worst = max(gaps, key=lambda g: g["slowdown"])
        slow = [g for g in gaps if g["slowdown"] > AUTO_TOLERANCE]
        sources = ", ".join(f"{k} on {n}" for k, n in sorted(
            {k: sum(g["auto_ranked_by"] == k for g in gaps) for k in {g["auto_ranked_by"] for g in gaps}}.items(),
            key=lambda kv: -kv[1]) if k)
        lines.append(f"auto vs the fastest backend: geomean {_geomean(g['vs_best'] for g in gaps) or 0:.3f}x, worst "
                     f"{1 / (1 + worst['slowdown']):.3f}x, {worst['slowdown']:+.1%} ({worst['shape']}, "
                     f"{MODE_LABELS[worst['mode']]}, fastest {worst['fastest']})"
                     + (f"; auto's pick came from {sources} of {len(gaps)}" if sources else ""))
        if slow:
            lines.append(f"auto is more than {AUTO_TOLERANCE:.0%} slower than the fastest on {len(slow)} of "
                         f"{len(gaps)}: " + "; ".join(f"{g['shape']} {g['mode']} ({g['slowdown']:+.1%}, ran "
                                                      f"{g['auto_runs']}, fastest {g['fastest']})"
                                                      for g in slow[:10]))
            same = [g for g in slow if g["auto_runs"] == g["fastest"]]
            if same:
                lines.append(f"  on {len(same)} of these auto ran the fastest backend itself: the gap is run-to-run "
                             "noise between two timings of one kernel")
            if not report.config.record_tuning:
                lines.append("  `jaxattn tune` (or `jaxattn bench --tune`) measures these shapes for auto")
        else:
            lines.append(f"auto is within {AUTO_TOLERANCE:.0%} of the fastest backend on all {len(gaps)} "
                         "shape/mode pairs")
        shared = [g for g in gaps if g["auto_program_of"]]
        if shared:
            lines.append(f"  on {len(shared)} of {len(gaps)} auto compiled to the very program of the backend it "
                         "picked (identical optimised HLO), timed once; on the others it was timed in its own round")
    lines += report.notes
    return lines


def report_dict(report: BenchReport) -> dict[str, Any]:
    cfg = report.config
    return {
        "format": FORMAT,
        "device": report.device,
        "environment": report.environment,
        "config": {"backends": list(cfg.backends), "reference": cfg.reference, "modes": list(cfg.modes),
                   "warmup": cfg.warmup, "repeats": cfg.repeats, "rounds": cfg.rounds,
                   "min_sample_ms": cfg.min_sample_ms, "preroll_ms": cfg.preroll_ms, "dedupe": cfg.dedupe,
                   "shapes": [s.to_dict() for s in cfg.shapes],
                   "flops": "4*B*H*T*S*D forward, halved for causal; forward+backward = 3.5x forward"},
        "elapsed_s": report.elapsed_s,
        "notes": report.notes,
        "results": [r.to_dict() for r in report.results],
        "summary": {"vs_reference": ratio_summary(report), "auto_gaps": auto_gaps(report),
                    "auto_tolerance": AUTO_TOLERANCE},
    }


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report_dict(report), indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)  # a run killed mid-write leaves the previous checkpoint intact
