"""``jaxattn tune``: measure the backends for some shapes and store the results for "auto".

``jaxattn tune`` times every impl usable here (forward and forward+backward) on the bench
matrix or the given shapes, stores the medians in the tuning cache, and prints what "auto"
now picks for each shape. ``--show`` prints the cache, ``--clear`` forgets this device's
measurements. Module-level imports stay at argparse so ``jaxattn --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .cli import add_matrix_arguments, add_run_arguments, platform_of, run_options, shapes_from_args

if TYPE_CHECKING:
    from jaxattn.backend import AttentionMetadata
    from jaxattn.cli import Printer

    from .results import BenchConfig, BenchResult
    from .shapes import BenchShape

__all__ = ["HELP", "add_arguments", "run"]

HELP = "measure the backends for some shapes and store the timings for impl='auto'"


#: More samples and rounds than ``bench``: what ``tune`` stores steers every later call, and a
#: shape is stored only when its rounds agree (``jaxattn_bench.stability``).
TUNE_REPEATS, TUNE_ROUNDS = 15, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_matrix_arguments(parser)
    add_run_arguments(parser, repeats=TUNE_REPEATS, rounds=TUNE_ROUNDS)
    parser.add_argument("--impls", type=lambda t: [x.strip().lower() for x in t.split(",") if x.strip()],
                        help="comma-separated impls to measure (default: every impl usable here)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the tuning cache of this device, measure nothing")
    what.add_argument("--clear", action="store_true", help="forget this device's tuning records")


def run(args: argparse.Namespace) -> int:
    from jaxattn.backend import AttentionMetadata
    from jaxattn.cli import Printer

    from .cli import check_impls
    from .records import default_cache_path
    from .store import TuningStore, check_writable

    check_impls(args)  # before the cache is touched or anything measured
    printer = Printer.from_args(args)
    metadata = AttentionMetadata()
    if not args.show:
        check_writable(default_cache_path())  # before anything is measured (TuningCacheError: one line, exit 2)
    if args.clear:
        cache = TuningStore.load()
        cache.clear()
        cache.save()
        printer.line(f"cleared the measurements of {cache.environment.describe()} in {cache.path}")
        return 0
    if args.show:
        return _show(args, printer)
    try:
        shapes = shapes_from_args(args, platform_of(metadata))
    except ValueError as err:
        print(f"jaxattn tune: error: {err}", file=sys.stderr)
        return 2
    return _tune(args, shapes, metadata, printer)


def _tune(args: argparse.Namespace, shapes: list[BenchShape], metadata: AttentionMetadata,
          printer: Printer) -> int:
    from .backends import available_backends
    from .progress import Progress
    from .record import record_results
    from .records import active_cache
    from .results import BenchConfig
    from .runner import run_bench

    backends = [n for n in (args.impls or available_backends(metadata)) if n != "auto"]
    config = BenchConfig(shapes=shapes, backends=backends, reference=None, **run_options(args, metadata))
    progress = Progress.choose(args.progress)
    progress.line(f"jaxattn tune: {len(shapes)} shapes x {', '.join(backends)}, {config.repeats} samples in "
                  f"{config.rounds} rounds; cache {active_cache().path}")
    unstable: dict[BenchShape, list[str]] = {}
    done = iter(shapes)  # run_bench calls store once per shape it ran, in order

    def store(results: list[BenchResult]) -> None:
        # Shape by shape, so an interrupted run keeps what it measured; only steady timings.
        shape = next(done)
        reasons = unstable_shape(config, [r for r in results if r.shape == shape])
        if reasons:
            unstable[shape] = reasons
            progress.line(f"not stored: {shape.label}: {'; '.join(reasons)}")
        else:
            record_results(shape, [r for r in results if r.shape == shape], metadata)

    report = run_bench(config, progress, on_shape=store)
    if args.json:
        from jaxattn.cli import dump_json

        dump_json([{**row, "stored": shape not in unstable, "unstable": unstable.get(shape, [])}
                   for shape, row in zip(shapes, _picks(shapes, metadata), strict=True)])
        return 0
    _print_picks(printer, shapes, metadata, f"auto's picks after tuning ({report.elapsed_s:.0f} s)")
    for note in report.notes:
        printer.line(f"note: {note}")
    for shape, reasons in unstable.items():
        printer.line(f"not stored (timings too noisy, nothing written): {shape.label}: {'; '.join(reasons)}")
    if unstable:
        printer.line("measure those shapes again on a quieter machine, or with more --rounds and --repeats")
    printer.line(f"tuning cache: {active_cache().path}")
    return 0


def unstable_shape(config: BenchConfig, results: list[BenchResult]) -> list[str]:
    """Why one shape's timings should not be stored (``jaxattn_bench.stability``), per mode."""
    from .stability import unstable_reasons
    from .timing import split_rounds

    reasons = []
    for mode in config.modes:
        rounds = {r.backend: split_rounds(r.times_ms, config.repeats, config.rounds)
                  for r in results if r.mode == mode and r.ok and r.same_program_as is None}
        reasons += [f"{mode}: {why}" for why in unstable_reasons(rounds)]
    return reasons


def _picks(shapes: list[BenchShape], metadata: AttentionMetadata) -> list[dict[str, str | None]]:
    import jaxattn

    from .keys import problem_key
    from .record import problem_of

    rows = []
    for shape in shapes:
        q, k, v = shape.structs()
        exp = jaxattn.explain(q, k, v, impl="auto", metadata=metadata, **shape.call_kwargs)
        chosen = next((c for c in exp.candidates if c.chosen), None)
        rows.append({"shape": shape.label, "key": problem_key(problem_of(shape)), "auto": exp.chosen,
                     "grad": (chosen.grad_impl if chosen else None) or exp.chosen,
                     "why": chosen.rank_reason if chosen else "nothing accepts this call"})
    return rows


def _print_picks(printer: Printer, shapes: list[BenchShape], metadata: AttentionMetadata, title: str) -> None:
    from jaxattn.cli import Table

    table = Table(title, ["shape", "cache key", "auto", "differentiated", "why"])
    for row in _picks(shapes, metadata):
        table.add(row["shape"], row["key"], row["auto"], row["grad"], row["why"])
    printer.table(table)


def _show(args: argparse.Namespace, printer: Printer) -> int:
    from jaxattn.cli import Table, dump_json

    from .store import TuningStore

    cache = TuningStore.load()
    if args.json:
        dump_json(cache.to_dict())
        return 0
    printer.pairs([("file", cache.path), ("environment", cache.environment.describe()),
                   ("entries", len(cache)), ("other environments", len(cache.others))])
    table = Table("Measurements (median ms; fwd / fwd+bwd)", ["cache key", "measured on", "impl", "fwd", "fwd+bwd",
                                                                "from"])
    for key, entry in sorted(cache.entries.items()):
        for name, m in sorted(entry.results.items(), key=lambda kv: kv[1].fwd_ms or float("inf")):
            table.add(key, entry.problem, name, _ms(m.fwd_ms), _ms(m.fwdbwd_ms), f"{m.origin} {m.version}")
    printer.table(table)
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
