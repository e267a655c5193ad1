"""PNG pictures of benchmark results, drawn from their JSON (``jaxattn bench --plot``).

Both kinds of run are plotted from the dictionaries their ``--json`` writes, so a picture can
be made again from saved results without running anything (``jaxattn bench --from-json
results.json --plot out.png``; the machine that measured need not be the one that draws):

* ``jaxattn bench`` (format ``jaxattn-bench/1``): TFLOP/s against the sequence length, one
  line per backend, one panel per head dim, GQA group, mask and mode, each above a strip of
  the ratio to the run's reference backend;
* ``jaxattn bench --serving`` (``"kind": "serving"``): per shape, the GB/s of K/V read by
  every backend (the memory-read bar as a black bar), beside each one's ratio to the
  reference the run names.

matplotlib is optional (``pip install 'jaxattn[bench]'``); without it nothing is written and
the caller is told why.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .shapes import MODE_LABELS

__all__ = ["BENCH_FORMAT", "plot_results", "write_plot"]

#: The ``format`` field of ``jaxattn bench --json`` results.
BENCH_FORMAT = "jaxattn-bench/1"
#: Backends drawn in every picture with the same colour and marker, so pictures compare.
_STYLE_ORDER = ("auto", "cudnn", "sdpa", "flash_attn2", "splash", "vanilla", "blockwise", "ring",
                "autoregressive_decodeattn", "pallas_mha", "page_attention", "vanilla_paged",
                "ragged_page_attention_v3", "pallas_gpu_paged", "memory read")
_MARKERS = "osD^v<>ph*X"
MISSING = "matplotlib is not installed (pip install 'jaxattn[bench]' or matplotlib); no plot written"


def write_plot(data: Mapping[str, Any], path: Path) -> str | None:
    """Draw ``data`` (a bench or serving JSON dictionary) into the PNG at ``path``.

    Returns None when written, else why not (matplotlib missing, nothing measured).
    """
    try:
        # import_module: matplotlib is optional and untyped where absent (mypy sees Any either way)
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")  # files only: no display on servers and CI
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return MISSING
    if data.get("kind") == "serving":
        fig = _serving_figure(plt, data)
    elif data.get("format") == BENCH_FORMAT:
        fig = _bench_figure(plt, data)
    else:
        return (f"not a jaxattn bench result (format {data.get('format')!r}, kind {data.get('kind')!r}); "
                "no plot written")
    if fig is None:
        return "no backend produced a timing; no plot written"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def plot_results(json_path: Path, png_path: Path) -> str | None:
    """``write_plot`` for results saved by ``--json`` (``jaxattn bench --from-json``)."""
    import json

    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"cannot read {json_path}: {err}; no plot written"
    if not isinstance(data, dict):
        return f"{json_path} holds no jaxattn bench result; no plot written"
    return write_plot(data, png_path)


def _colours(plt: Any, names: list[str]) -> dict[str, Any]:
    known = [n for n in _STYLE_ORDER if n in names] + sorted(n for n in names if n not in _STYLE_ORDER)
    cmap = plt.get_cmap("tab10")
    return {n: ("black" if n == "memory read" else cmap(i % 10)) for i, n in enumerate(known)}


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _machine(data: Mapping[str, Any]) -> str:
    env = data.get("environment") or {}
    versions = env.get("versions") or {}
    parts = [str(data.get("device", "?"))]
    if versions.get("jax"):
        parts.append(f"jax {versions['jax']}")
    if env.get("jaxattn"):
        parts.append(f"jaxattn {env['jaxattn']}")
    return ", ".join(parts)


# -- jaxattn bench ---------------------------------------------------------------------------
def _bench_figure(plt: Any, data: Mapping[str, Any]) -> Any:
    config = data.get("config") or {}
    reference = config.get("reference")
    panels: dict[tuple[int, int, bool, str], dict[str, list[tuple[int, float, float | None]]]] = {}
    dtypes: dict[str, None] = {}
    for r in data.get("results", []):
        if r.get("status") != "ok" or r.get("tflops") is None:
            continue
        shape = r["shape"]
        group = shape["heads_q"] // shape["heads_kv"]
        key = (shape["head_dim"], group, bool(shape["causal"]), r["mode"])
        panels.setdefault(key, {}).setdefault(r["backend"], []).append((shape["seq_k"], r["tflops"], r.get("ratio")))
        dtypes.setdefault(shape["dtype"], None)
    if not panels:
        return None
    keys = sorted(panels, key=lambda k: (k[3], k[0], k[1], k[2]))
    # One row per mode where that fits in three columns (forward above forward+backward).
    per_mode = len({k[:3] for k in keys})
    cols = per_mode if per_mode <= 3 else (2 if len(keys) in (2, 4) else min(3, len(keys)))
    rows = math.ceil(len(keys) / cols)
    fig = plt.figure(figsize=(4.6 * cols, 4.4 * rows + 0.9), layout="constrained")
    outer = fig.add_gridspec(rows, cols)
    names = list(dict.fromkeys(b for panel in panels.values() for b in panel))
    colours = _colours(plt, names)
    for index, key in enumerate(keys):
        d, group, causal, mode = key
        row, col = divmod(index, cols)
        cell = outer[row, col].subgridspec(2, 1, height_ratios=[3, 1.2], hspace=0.05)
        top = fig.add_subplot(cell[0])
        bottom = fig.add_subplot(cell[1], sharex=top)
        for i, name in enumerate(names):
            points = sorted(panels[key].get(name, []))
            if not points:
                continue
            style = {"color": colours[name], "marker": _MARKERS[i % len(_MARKERS)], "markersize": 4,
                     "linestyle": "--" if name == "auto" else "-", "label": name}
            top.plot([p[0] for p in points], [p[1] for p in points], **style)
            ratios = [(p[0], p[2]) for p in points if p[2] is not None]
            if ratios and name != reference:
                bottom.plot([p[0] for p in ratios], [p[1] for p in ratios], **style)
        seqs = sorted({p[0] for pts in panels[key].values() for p in pts})
        top.set_xscale("log", base=2)
        bottom.set_xticks(seqs, [_seq_label(n) for n in seqs])
        bottom.minorticks_off()
        top.tick_params(labelbottom=False)
        top.set_ylim(bottom=0)
        top.set_title(f"D={d}{f', GQA {group}:1' if group > 1 else ''}, {'causal' if causal else 'no mask'}, "
                      f"{MODE_LABELS[mode]}", fontsize=10)
        top.set_ylabel("TFLOP/s")
        bottom.axhline(1.0, color="grey", linewidth=0.8)
        bottom.set_ylabel(f"x {reference}" if reference else "ratio", fontsize=9)
        bottom.set_xlabel("sequence length S (= T)")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
        top.legend(fontsize=7, loc="best")
    fig.suptitle(f"jaxattn bench: {_machine(data)}, {', '.join(dtypes)}\n"
                 f"TFLOP/s (higher is better); below: TFLOP/s ratio to {reference or 'the reference'}",
                 fontsize=11)
    return fig


# -- jaxattn bench --serving ------------------------------------------------------------------
def _serving_figure(plt: Any, data: Mapping[str, Any]) -> Any:
    results = [r for r in data.get("results", []) if r.get("status") == "ok" and r.get("gbps")]
    if not results:
        return None
    shapes = list(dict.fromkeys(r["shape"]["label"] for r in results))
    names = list(dict.fromkeys(r["backend"] for r in results))
    # Paged backends first, then dense decode ("cudnn (dense)") and the rest, in the run's order.
    names = sorted(names, key=lambda n: ("(dense)" in n, n == "memory read"))
    colours = _colours(plt, names)
    by = {(r["shape"]["label"], r["backend"]): r for r in results}
    # A dot per backend on each shape's line (bars would need a band per backend: too tall for
    # the GPU matrix's twenty-odd shapes); the memory-read bar is a black tick.
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.34 * len(shapes) + 2.2), sharey=True,
                                       gridspec_kw={"width_ratios": [3, 2]})
    for i, name in enumerate(names):
        here = [(y, by[(s, name)]) for y, s in enumerate(shapes) if (s, name) in by]
        style = ({"marker": "|", "markersize": 14, "markeredgewidth": 2} if name == "memory read" else
                 {"marker": _MARKERS[i % len(_MARKERS)], "markersize": 6, "alpha": 0.85})
        left.plot([r["gbps"] for _, r in here], [y for y, _ in here], linestyle="none", color=colours[name],
                  label=name, **style)
        ratios = [(y, r["ratio"]) for y, r in here if r.get("ratio")]
        if ratios and name != "memory read":
            right.plot([r for _, r in ratios], [y for y, _ in ratios], linestyle="none", color=colours[name],
                       label=name, **style)
    left.set_yticks(range(len(shapes)), shapes, fontsize=8)
    left.set_ylim(len(shapes) - 0.5, -0.5)  # the run's order, top to bottom
    left.set_xlim(0, 1.06 * max(r["gbps"] for r in results))
    left.set_xlabel("GB/s of K and V read (higher is better)")
    left.grid(True, alpha=0.3)
    fig.legend(*left.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=min(4, len(names)),
               bbox_to_anchor=(0.5, 0.0))
    right.axvline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("reference time / this time (> 1: faster)")
    right.grid(True, alpha=0.3)
    reference = _serving_reference(results)
    dtype = ", ".join(dict.fromkeys(str(r["shape"].get("dtype")) for r in results))
    fig.suptitle(f"jaxattn bench --serving: {data.get('device', '?')}, {dtype}\n"
                 f"left: bandwidth per backend; right: ratio to {reference}", fontsize=11)
    rows = math.ceil(len(names) / min(4, len(names)))
    fig.tight_layout(rect=(0, (0.2 * rows + 0.2) / (0.34 * len(shapes) + 2.2), 1, 1))
    return fig


def _serving_reference(results: list[Mapping[str, Any]]) -> str:
    """The backend the ratios are relative to: the one whose ratio is 1 on every shape it ran."""
    ones = [r["backend"] for r in results if r.get("ratio") is not None and abs(r["ratio"] - 1.0) < 1e-12]
    return max(set(ones), key=ones.count) if ones else "the reference"
