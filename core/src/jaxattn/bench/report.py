"""What the benchmark writes: a table (stdout), a summary, a JSON file and a PNG plot."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .results import BenchReport, BenchResult
from .shapes import MODE_LABELS, BenchShape

__all__ = ["AUTO_TOLERANCE", "auto_gaps", "report_dict", "summary_lines", "table", "write_json", "write_plot"]

#: Issue target: "auto" within 3% of the fastest backend on every shape.
AUTO_TOLERANCE = 0.03
FORMAT = "jaxattn-bench/1"


def _ms(r: BenchResult | None) -> str:
    return f"{r.median_ms:.3f}" if r is not None and r.ok and r.median_ms is not None else "-"


def _tflops(r: BenchResult | None, width: int = 60) -> str:
    if r is None:
        return "-"
    text = r.cell()
    return text if len(text) <= width else text[: width - 3] + "..."


def _ratio(r: BenchResult | None) -> str:
    return f"{r.ratio:.2f}x" if r is not None and r.ratio is not None else "-"


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


def table(report: BenchReport) -> Any:
    """One row per shape and backend, forward and forward+backward side by side."""
    from ..cli._output import Table

    ref = report.config.reference or "-"
    columns = ["shape", "backend"]
    for mode in report.config.modes:
        short = "fwd" if mode == "fwd" else "fwd+bwd"
        columns += [f"{short} ms", f"{short} TFLOP/s", f"vs {ref}", f"{short} temp"]
    columns.append("note")
    out = Table(f"Attention benchmark on {report.device} (median of {report.config.repeats} samples)", columns)
    for shape in _shapes(report):
        for name in report.config.backends:
            cells: list[str] = [shape.label, name]
            note = ""
            shared: list[str] = []
            for mode in report.config.modes:
                r = report.get(shape, name, mode)
                cells += [_ms(r), _tflops(r), _ratio(r), _mem(r)]
                note = note or (r.note if r is not None else "")
                if r is not None and r.same_program_as:
                    shared.append(f"{mode} = {r.same_program_as}'s program")
            out.add(*cells, "; ".join([n for n in (note, *shared) if n]))
    return out


def auto_gaps(report: BenchReport) -> list[dict[str, Any]]:
    """Per shape and mode: auto's time against the fastest other backend that ran."""
    gaps = []
    for shape in _shapes(report):
        for mode in report.config.modes:
            auto = report.get(shape, "auto", mode)
            others = [r for r in report.rows(shape) if r.mode == mode and r.backend != "auto" and r.ok]
            if auto is None or not auto.ok or not others or auto.median_ms is None:
                continue
            best = min(others, key=lambda r: r.median_ms or math.inf)
            assert best.median_ms is not None
            gaps.append({"shape": shape.label, "mode": mode, "auto_ms": auto.median_ms, "auto_runs": _runs(auto),
                         "auto_program_of": auto.same_program_as, "fastest": best.backend,
                         "fastest_ms": best.median_ms, "slowdown": auto.median_ms / best.median_ms - 1.0})
    return gaps


def _runs(auto: BenchResult) -> str | None:
    """The backend an auto row ran, from its note: ``-> cudnn`` or ``-> cudnn, grad flash_attn2``."""
    if not auto.note.startswith("-> "):
        return None
    picked, _, grad = auto.note[3:].partition(", grad ")
    return grad if auto.mode == "fwdbwd" and grad else picked


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
        lines.append(f"auto vs the fastest backend: worst {worst['slowdown']:+.1%} ({worst['shape']}, "
                     f"{MODE_LABELS[worst['mode']]}, fastest {worst['fastest']})")
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


def write_plot(report: BenchReport, path: Path) -> str | None:
    """TFLOP/s against S per backend, one panel per (head dim, GQA, mask, mode).

    Returns None when written, else why not (matplotlib missing, nothing measured).
    """
    try:
        # import_module: matplotlib is optional and untyped where absent (mypy sees Any either way)
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")  # files only: no display on servers and CI
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    panels: dict[tuple[int, int, bool, str], dict[str, list[tuple[int, float]]]] = {}
    for r in report.results:
        if r.ok and r.tflops is not None:
            key = (r.shape.head_dim, r.shape.group, r.shape.causal, r.mode)
            panels.setdefault(key, {}).setdefault(r.backend, []).append((r.shape.seq_k, r.tflops))
    if not panels:
        return "no backend produced a timing; no plot written"
    keys = sorted(panels, key=lambda k: (k[3], k[0], k[1], k[2]))
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    backends = list(report.config.backends)
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(backends)}
    for ax, key in zip(axes.flat, keys, strict=False):
        d, group, causal, mode = key
        for name in backends:
            points = sorted(panels[key].get(name, []))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                        color=colors[name], linestyle="--" if name == "auto" else "-")
        ax.set_xscale("log", base=2)
        seqs = sorted({p[0] for pts in panels[key].values() for p in pts})
        ax.set_xticks(seqs, [_seq_label(n) for n in seqs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"D={d}{f' GQA {group}:1' if group > 1 else ''} {'causal' if causal else 'full'} "
                     f"{MODE_LABELS[mode]}", fontsize=9)
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(f"jaxattn bench: {report.device}, {report.config.shapes[0].dtype}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
