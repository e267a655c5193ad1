"""``jaxattn bench``: every backend side by side, in one process (see docs/bench.md).

Module-level imports stay at argparse: ``jaxattn --help`` must not import jax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxattn.backend import GRANULARITIES, KV_DTYPE_FLAGS
from jaxattn.cli import (
    Choices,
    NumericArg,
    check_impl_names,
    float_dtype,
    int_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
)

from .timing import platform_of  # stdlib-only at import time, like this module

if TYPE_CHECKING:
    from jaxattn.backend import AttentionMetadata
    from jaxattn.cli import Printer

    from .shapes import BenchShape

__all__ = ["HELP", "add_arguments", "add_matrix_arguments", "add_run_arguments", "max_temp_bytes", "platform_of", "run",
           "run_options", "shape_spec", "shapes_from_args", "window_spec"]

def _shape(text: str) -> str:
    """The text itself once ``parse_shape`` (what ``bench`` and ``tune`` read it with) accepts it."""
    from .shapes import parse_shape  # standard library only at import, like this module

    parse_shape(text, dtype="float32", masks=(False,))
    return text


#: ``--shape``: checked when parsed, with the one-line errors of every numeric option.
shape_spec = NumericArg(
    "shape_spec", _shape,
    "B,S,H,D or B,S,H,D,Hkv or B,T,S,H,D,Hkv: integers >= 1, H a multiple of Hkv", "4,4096,32,128,8",
    accepts_zero=False)

def _window(text: str) -> tuple[int, int]:
    """``W`` (``(W, W)``) or ``L,R``: keys >= 0 a query sees before and after itself."""
    sides = [int(x) for x in text.split(",")]
    if len(sides) not in (1, 2) or min(sides) < 0:
        raise ValueError(text)
    return (sides[0], sides[-1])


#: ``--window``: jaxattn's ``sliding_window``, as one int or a pair.
window_spec = NumericArg("window_spec", _window, "W or L,R: keys >= 0 before and after each query", "1024,0",
                         accepts_zero=True)

HELP = "time every attention backend side by side (TFLOP/s, ratio to a reference, memory)"

#: Default --max-temp-gib on accelerators. Flash kernels need megabytes; a program that needs
#: more than this holds S x S buffers (vanilla, XLA) and would be slow or fail at that length.
ACCELERATOR_TEMP_GIB = 16.0


def _names(text: str) -> list[str]:
    return [x.strip().lower() for x in text.split(",") if x.strip()]


def add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape options ``bench`` and ``tune`` share."""
    group = parser.add_argument_group("shapes (default: the GPU matrix on accelerators, --quick on CPU)")
    group.add_argument("--quick", action="store_true",
                       help="tiny shapes that run in seconds on a CPU (S 64/128, D 32, 4 heads)")
    group.add_argument("--dtype", type=float_dtype,
                       help="bfloat16 (default on GPU/TPU), float16, float32 (default on CPU)")
    group.add_argument("--seqs", type=int_list, help="sequence lengths, e.g. 1k,2k,4k,8k,16k")
    group.add_argument("--head-dims", type=int_list, help="head dims, e.g. 64,128,256")
    group.add_argument("--heads", type=positive_int, help="query heads (default 32, 16 for D=256)")
    group.add_argument("--tokens", type=positive_int, default=16384, help="B*S for the matrix (default 16384)")
    group.add_argument("--batch", type=positive_int, help="fixed batch size instead of tokens/S")
    group.add_argument("--gqa", type=positive_int, default=4, help="GQA group size also timed (default 4; 1 = none)")
    group.add_argument("--gqa-head-dims", type=int_list, default=[128],
                       help="head dims timed with GQA too (default 128)")
    group.add_argument("--mask", choices=("both", "causal", "full"), default="both",
                       help="causal, full (no mask), or both (default)")
    group.add_argument("--shape", type=shape_spec, action="append", default=[], metavar="B,S,H,D[,Hkv]",
                       help="an explicit shape (repeatable; replaces the matrix); B,T,S,H,D,Hkv for T != S")
    group.add_argument("--window", type=window_spec, metavar="W|L,R",
                       help="every call with sliding_window=(L, R) (W: (W, W); with causal, (W, 0) is a causal "
                            "window of W keys before each query); FLOPs count the pairs it leaves")
    group.add_argument("--soft-cap", type=positive_float, metavar="CAP", help="every call with logits_soft_cap=CAP")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_matrix_arguments(parser)
    which = parser.add_argument_group("backends")
    which.add_argument("--impls", type=_names, help="comma-separated impl names (default: every impl usable here)")
    which.add_argument("--no-auto", action="store_true", help='do not time impl="auto"')
    which.add_argument("--include-pallas-mha", action="store_true",
                       help="also time jax.experimental.pallas.ops.gpu.attention.mha (CUDA GPUs)")
    which.add_argument("--reference", help="backend the ratios are relative to (default: cudnn, else vanilla)")
    which.add_argument("--tune", action="store_true",
                       help="write the impls' timings to the tuning cache as tuning records, then time auto with them")
    add_run_arguments(parser)
    parser.add_argument("--overhead", action="store_true",
                        help="instead: measure what impl='auto' adds per call over the impl it picks (eager, jit)")
    parser.add_argument("--serving", action="store_true",
                        help="instead: decode and ragged calls over a paged KV cache (GB/s of K/V read), paged "
                             "backends beside dense decode (cuDNN...) and JAX's Pallas GPU paged_attention")
    parser.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_FLAGS),
                        help="with --serving: the paged backends read a quantized cache of the same tokens (fp8 = "
                             "float8_e4m3fn), beside the 16-bit paged kernel and dense decode; bytes read count "
                             "values + scales")
    parser.add_argument("--kv-granularity", choices=GRANULARITIES, default="token",
                        help="with --kv-dtype: one scale per tensor, KV head, or token and head (default token)")
    # The shared --json flag (print JSON) gains an optional PATH: with one, the JSON goes to the file
    # and the table still goes to stdout. "resolve" lets this definition replace the shared one
    # (set before the group is made: a group copies its parser's handler).
    parser.conflict_handler = "resolve"
    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                     help="write results as JSON to PATH (or to stdout instead of the table, without PATH)")
    out.add_argument("--plot", type=Path, metavar="PATH",
                     help="write a PNG: TFLOP/s against S per backend (with --serving: GB/s per shape); "
                          "needs matplotlib (jaxattn[bench])")
    out.add_argument("--from-json", type=Path, metavar="PATH",
                     help="run nothing: draw the results a --json run saved in PATH into --plot's PNG")


def add_run_arguments(parser: argparse.ArgumentParser, *, repeats: int = 10, rounds: int = 2) -> None:
    """How programs are timed (shared by ``bench`` and ``tune``; ``tune`` takes more rounds)."""
    run_ = parser.add_argument_group("running")
    run_.add_argument("--modes", type=Choices("modes", ("fwd", "fwdbwd"), many=True), default=["fwd", "fwdbwd"],
                      help="fwd, fwdbwd (default both)")
    run_.add_argument("--warmup", type=nonneg_int, default=2, help="untimed runs per program (default 2)")
    run_.add_argument("--repeats", type=positive_int, default=repeats,
                      help=f"timed samples per program (default {repeats}); the median is reported")
    run_.add_argument("--rounds", type=positive_int, default=rounds,
                      help=f"interleaved rounds the samples are spread over (default {rounds}; order reversed every "
                           "other)")
    run_.add_argument("--min-sample-ms", type=nonneg_float, metavar="MS",
                      help="a sample is as many back-to-back calls as last this long, so dispatch latency "
                           "and timer jitter stay out of the figures (default 10 on GPU/TPU, 1 on CPU; "
                           "0 = one call per sample)")
    run_.add_argument("--no-dedupe", dest="dedupe", action="store_false",
                      help="time every backend's program, even where two compile to the identical program "
                           "(by default such programs are timed once and share the timing)")
    run_.add_argument("--preroll-ms", type=nonneg_float, metavar="MS",
                      help="untimed run of each program before its samples in a round, so the device's clocks "
                           "settle to that program's power draw (default 100 on GPU/TPU, 0 on CPU)")
    run_.add_argument("--max-temp-gib", type=positive_float,
                      help="skip programs whose compiled temp memory exceeds this, e.g. O(S^2) backends at "
                           f"long S (default {ACCELERATOR_TEMP_GIB:g} on GPU/TPU, none on CPU; always: free memory)")
    run_.add_argument("--time-budget", type=nonneg_float, metavar="SECONDS",
                      help="start no new shape after this many seconds (the rest is reported as skipped)")
    run_.add_argument("--compile-workers", type=positive_int, default=min(8, os.cpu_count() or 1),
                      help="programs compiled in parallel, while none is timed (default: CPUs, at most 8)")
    run_.add_argument("--progress", choices=("auto", "rich", "plain", "none"), default="auto",
                      help="progress display on stderr (default: rich on a terminal, else plain lines)")


def run_options(args: argparse.Namespace, metadata: AttentionMetadata) -> dict[str, Any]:
    """The ``BenchConfig`` fields that ``add_run_arguments`` sets (shared by ``bench`` and ``tune``)."""
    return {"modes": tuple(args.modes), "warmup": args.warmup, "repeats": args.repeats, "rounds": args.rounds,
            "min_sample_ms": args.min_sample_ms, "preroll_ms": args.preroll_ms, "dedupe": args.dedupe,
            "metadata": metadata, "max_temp_bytes": max_temp_bytes(args, platform_of(metadata)),
            "time_budget_s": args.time_budget, "compile_workers": args.compile_workers}


def shapes_from_args(args: argparse.Namespace, platform: str) -> list[BenchShape]:
    """The shapes the options select, each with ``--window`` and ``--soft-cap``."""
    import dataclasses

    return [dataclasses.replace(s, sliding_window=args.window, soft_cap=args.soft_cap)
            for s in _matrix_from_args(args, platform)]


def _matrix_from_args(args: argparse.Namespace, platform: str) -> list[BenchShape]:
    from .shapes import default_matrix, parse_shape, quick_matrix

    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[args.mask]
    dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
    if args.shape:
        return [s for text in args.shape for s in parse_shape(text, dtype=dtype, masks=masks)]
    if args.quick or (platform == "cpu" and not (args.seqs or args.head_dims)):
        shapes = quick_matrix(dtype=dtype, masks=masks)
        if args.seqs or args.head_dims:
            shapes = [s for s in shapes if (not args.seqs or s.seq_k in args.seqs)
                      and (not args.head_dims or s.head_dim in args.head_dims)]
        if not shapes:  # an empty table would read as "nothing runs here"
            quick = quick_matrix(dtype=dtype, masks=masks)
            raise ValueError(f"--quick times S {'/'.join(str(n) for n in sorted({s.seq_k for s in quick}))} and D "
                             f"{'/'.join(str(n) for n in sorted({s.head_dim for s in quick}))}: --seqs and --head-dims "
                             "select none of them; drop --quick to time other sizes, or use --shape B,S,H,D")
        return shapes
    kwargs: dict[str, Any] = {"dtype": dtype, "tokens": args.tokens, "heads": args.heads, "gqa": args.gqa,
                              "gqa_head_dims": args.gqa_head_dims, "masks": masks, "batch": args.batch}
    if args.seqs:
        kwargs["seqs"] = args.seqs
    if args.head_dims:
        kwargs["head_dims"] = args.head_dims
    return default_matrix(**kwargs)


def max_temp_bytes(args: argparse.Namespace, platform: str) -> int | None:
    gib = args.max_temp_gib if args.max_temp_gib is not None else (None if platform == "cpu" else ACCELERATOR_TEMP_GIB)
    return None if gib is None else int(gib * 2**30)


def _backends(args: argparse.Namespace, metadata: AttentionMetadata) -> list[str]:
    from .backends import PALLAS_MHA, available_backends

    names = list(args.impls) if args.impls else available_backends(metadata)
    if "auto" in names:
        names.remove("auto")
    if args.include_pallas_mha and PALLAS_MHA not in names:
        names.append(PALLAS_MHA)
    if not args.no_auto:
        names.append("auto")  # last: with --tune it runs after the others were measured
    return names


def _reference(args: argparse.Namespace, backends: list[str]) -> str | None:
    if args.reference:
        return str(args.reference).lower()
    return next((n for n in ("cudnn", "vanilla") if n in backends), backends[0] if backends else None)


def check_impls(args: argparse.Namespace) -> None:
    """``--impls`` (and ``--reference``) name impls that exist, before anything is measured
    (``InvalidInputError``: one line, exit 2, with the closest names)."""
    if args.impls:
        check_impl_names("--impls", [n for n in args.impls if n != "auto"])
    if getattr(args, "reference", None):
        check_impl_names("--reference", [args.reference.strip().lower()])


def run(args: argparse.Namespace) -> int:
    from jaxattn.backend import AttentionMetadata

    if args.from_json is not None:
        return _plot_saved(args)
    check_impls(args)
    metadata = AttentionMetadata()
    platform = platform_of(metadata)
    try:
        shapes = shapes_from_args(args, platform)
    except ValueError as err:
        print(f"jaxattn bench: error: {err}", file=sys.stderr)
        return 2
    if args.overhead:
        return _run_overhead(args, shapes, metadata)
    if args.serving:
        return _run_serving(args, metadata, platform)
    return _run_bench(args, shapes, metadata)


def _run_serving(args: argparse.Namespace, metadata: AttentionMetadata, platform: str) -> int:
    import jaxattn
    from jaxattn.backend import available_here, detect_device
    from jaxattn.cli import Printer, dump_json

    from .serving import (
        ServingResult,
        auto_summary,
        auto_vs_best,
        run_serving,
        serving_matrix,
        serving_not_run,
        serving_table,
    )

    dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")

    kv_dtype = KV_DTYPE_FLAGS[args.kv_dtype] if args.kv_dtype else None
    shapes = serving_matrix(quick=args.quick or platform == "cpu", dtype=dtype, kv_dtype=kv_dtype,
                            granularity=args.kv_granularity)
    if args.impls:
        # Names as given, aliases included (on a CPU page_attention is vanilla_paged's alias),
        # each a row of its own; its op kind says which calls time it.
        listed = [row for row in jaxattn.list_impls() if row.platforms and row.status != "conflict"]
        kinds = {n: {row.kind for row in listed if n in (row.name, *row.aliases)} for n in args.impls if n != "auto"}
        unknown = sorted(n for n, k in kinds.items() if not k)
        if unknown:
            print(f"jaxattn bench: error: --impls: no impl named {', '.join(unknown)} is registered "
                  "(jaxattn list shows every name)", file=sys.stderr)
            return 2
        paged = [n for n, k in kinds.items() if "paged" in k]
        dense = [n for n, k in kinds.items() if "dense" in k]
    else:
        paged = [p.name for p in available_here(metadata, kind="paged")]
        dense = [p.name for p in available_here(metadata, kind="dense") if p.name != "ring"]
    paged += [] if args.no_auto else ["auto"]
    printer = Printer.from_args(args)
    if args.json != "-":
        printer.line(f"jaxattn bench --serving: {len(shapes)} shapes; paged {', '.join(paged)}; dense decode "
                     f"{', '.join(dense)}")
    start = time.perf_counter()
    device = detect_device().label
    done: list[ServingResult] = []

    def report(rows: list[ServingResult], *notes: str) -> dict[str, Any]:
        out = {"device": device, "kind": "serving", "results": [r.to_dict() for r in rows],
               "summary": {"auto_vs_best": auto_vs_best(rows)}, "elapsed_s": time.perf_counter() - start}
        return {**out, "notes": list(notes)} if notes else out

    def write(data: dict[str, Any]) -> None:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")

    def on_result(result: ServingResult) -> None:
        # One progress line per row (stderr), and the JSON so far: a run cut short keeps its shapes.
        done.append(result)
        if args.progress != "none":
            figure = (f"{result.median_ms:.3f} ms, {result.gbps:.0f} GB/s" if result.ok and result.median_ms
                      and result.gbps else f"{result.status}: {result.reason}"[:120])
            print(f"[{time.perf_counter() - start:6.0f} s] {result.shape.label} | {result.backend}: {figure}",
                  file=sys.stderr, flush=True)
        if args.json not in (None, "-"):
            write(report(done, "partial: run in progress"))

    results = run_serving(shapes, paged=paged, dense=dense, metadata=metadata, repeats=args.repeats,
                          reference=args.reference, min_sample_ms=args.min_sample_ms, preroll_ms=args.preroll_ms,
                          time_budget_s=args.time_budget, on_result=on_result)
    final = report(results)
    if args.json == "-":
        dump_json(final)
        _plot(args, final, None)
        return 0
    printer.table(serving_table(results, device, args.reference))
    _print_not_run(printer, serving_not_run(results))
    for line in auto_summary(results):
        printer.line(line)
    if args.json is not None:
        write(final)
        printer.line(f"JSON written to {args.json}")
    _plot(args, final, printer)
    printer.line(f"took {final['elapsed_s']:.1f} s")
    return 0


def _print_not_run(printer: Printer, lines: list[str]) -> None:
    """The backends that did not run some shapes, once per backend and outcome, after the tables."""
    if lines:
        printer.line("Not run (once per backend):")
        for line in lines:
            printer.line(f"- {line}")
        printer.line()


def _plot(args: argparse.Namespace, data: dict[str, Any], printer: Printer | None) -> None:
    """Write ``--plot``'s PNG of ``data`` (a run's JSON dictionary) and say so, or why not
    (on stderr when stdout carries the JSON)."""
    from .plot import write_plot

    if args.plot is None:
        return
    why_not = write_plot(data, args.plot)
    message = f"plot written to {args.plot}" if why_not is None else f"note: {why_not}"
    if printer is None:
        print(message, file=sys.stderr)
    else:
        printer.line(message)


def _plot_saved(args: argparse.Namespace) -> int:
    """``--from-json PATH --plot PNG``: a picture of saved results, nothing run."""
    from .plot import plot_results

    if args.plot is None:
        print("jaxattn bench: error: --from-json draws a picture: give --plot PNG too "
              "(e.g. jaxattn bench --from-json results.json --plot results.png)", file=sys.stderr)
        return 2
    why_not = plot_results(args.from_json, args.plot)
    if why_not is not None:
        print(f"jaxattn bench: error: {why_not}", file=sys.stderr)
        return 1
    print(f"plot written to {args.plot}")
    return 0


def _run_bench(args: argparse.Namespace, shapes: list[BenchShape], metadata: AttentionMetadata) -> int:
    from jaxattn.cli import Printer, dump_json

    from .progress import Progress
    from .report import not_run_lines, report_dict, summary_lines, tables, write_json
    from .results import BenchConfig, BenchReport, BenchResult
    from .runner import run_bench

    if args.tune:
        from .records import default_cache_path
        from .store import check_writable


        check_writable(default_cache_path())  # before anything is measured (TuningCacheError: one line, exit 2)
    backends = _backends(args, metadata)
    config = BenchConfig(shapes=shapes, backends=backends, reference=_reference(args, backends),
                         record_tuning=args.tune, **run_options(args, metadata))
    to_stdout = args.json == "-"
    progress = Progress.choose("none" if args.progress == "none" else args.progress)
    json_path = None if args.json in (None, "-") else Path(args.json)
    progress.line(f"jaxattn bench: {len(shapes)} shapes x {len(backends)} backends ({', '.join(backends)}) "
                  f"x {len(config.modes)} modes, reference {config.reference}")

    def checkpoint(results: list[BenchResult]) -> None:
        if json_path is not None:
            from jaxattn.backend import detect_device

            partial = BenchReport(config, list(results), detect_device().label, {}, 0.0, ["partial: run in progress"])
            write_json(partial, json_path)

    report = run_bench(config, progress, on_shape=checkpoint)
    if to_stdout:
        dump_json(report_dict(report))
        _plot(args, report_dict(report), None)
        return 0
    printer = Printer.from_args(args)
    for mode_table in tables(report):
        printer.table(mode_table)
    _print_not_run(printer, not_run_lines(report))
    for line in summary_lines(report):
        printer.line(line)
    if json_path is not None:
        write_json(report, json_path)
        printer.line(f"JSON written to {json_path}")
    _plot(args, report_dict(report), printer)
    printer.line(f"took {report.elapsed_s:.1f} s")
    return 0


def _run_overhead(args: argparse.Namespace, shapes: list[BenchShape], metadata: AttentionMetadata) -> int:
    from jaxattn.cli import Printer, Table, dump_json

    from .overhead import measure_overhead

    shape = shapes[0] if args.shape else min(shapes, key=lambda s: s.flops("fwd"))
    report = measure_overhead(shape, metadata)
    if args.json == "-":
        dump_json(report.to_dict())
        return 0
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    out = Table(f"Per-call cost of impl='auto' on {report.device}, {shape.label} {shape.dtype}: "
                f"auto picks {report.chosen}", ["what", "us per call"])
    for what, us in report.rows:
        out.add(what, f"{us:.1f}")
    printer = Printer.from_args(args)
    printer.table(out)
    from .overhead import AUTO_OWN

    rows = dict(report.rows)
    extra = rows["eager: attention(impl='auto')"] - rows[f"eager: attention(impl={report.chosen!r})"]
    printer.line(f"eager: impl='auto' costs {rows[AUTO_OWN]:.1f} us per repeated call on top of the impl it "
                 f"picked; the eager totals differ by {extra:+.1f} us, within their run-to-run noise")
    printer.line("jit: the compiled program of impl='auto' is "
                 + ("identical to the chosen impl's" if report.jit_identical else "NOT identical to the chosen impl's"))
    return 0
