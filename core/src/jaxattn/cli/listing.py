"""``jaxattn list``: every implementation name with its aliases, origin and status here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._output import Printer, Table, dump_json
from ._plugins import is_plugin_row

HELP = "list every attention implementation (names, aliases, kind, plugin, platforms, status here)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--here", action="store_true",
                        help="only the implementations usable on this device")
    parser.add_argument("--kind", choices=["dense", "paged"],
                        help="only implementations of this op kind (dense attention, or over a paged KV cache)")


def run(args: argparse.Namespace) -> int:
    import jaxattn
    from jaxattn.discovery.plugins import problems

    # First, so that the rows show the impls whose class disagrees with its declaration as
    # broken: that needs each impl's module (never a kernel library), and fails the listing.
    disagree = [p for p in problems(load=True) if p.category == "declaration"]
    rows = jaxattn.list_impls()
    if args.here:
        rows = [r for r in rows if r.usable_here]
    if args.kind:
        rows = [r for r in rows if is_plugin_row(r) or r.kind == args.kind]
    if args.json:
        dump_json([r.to_dict() for r in rows])
        return _report(disagree)
    table = Table(f"Attention implementations ({jaxattn.detect_device().label})",
                  # Short columns first: at 80 columns the long ones go under each row (_output).
                  ["name", "kind", "here", "status", "priority", "plugin", "version", "aliases", "platforms",
                   "note"])
    for r in rows:
        if is_plugin_row(r):  # a broken or disabled plugin, which registered no impl
            table.add(f"[{r.name}]", None, False, r.status, None, r.distribution or r.plugin, r.version, None,
                      None, r.reason or None)
        else:
            table.add(r.name, r.kind, r.usable_here, r.status, r.priority, r.distribution or r.plugin, r.version,
                      r.aliases, r.platforms, r.reason or None)
    Printer.from_args(args).table(table)
    return _report(disagree)


def _report(disagree: Sequence[object]) -> int:
    for problem in disagree:
        print(f"jaxattn list: {problem}", file=sys.stderr)
    return 1 if disagree else 0
