"""Rendering for the ``jaxattn`` command: JSON, rich tables, or plain text.

rich is optional (``jaxattn[rich]``) and used only on a terminal: piped or redirected output
is plain text (rich would wrap it at 80 columns), as is ``--plain``. Both renderers print
the same sections and columns, so nothing is lost without rich.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["Printer", "Table", "dump_json"]


def dump_json(data: Any, stream: TextIO | None = None) -> None:
    """JSON with a trailing newline; tuples become lists, anything else its str()."""
    out = stream or sys.stdout
    json.dump(data, out, indent=2, default=str)
    out.write("\n")


@dataclasses.dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = dataclasses.field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([_cell(c) for c in cells])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple | list | set | frozenset):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


class Printer:
    """Writes sections to stdout with rich when available and wanted, else plain text."""

    def __init__(self, *, plain: bool = False, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self._console: Any = None
        if not plain and self.stream.isatty():
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                self._console = Console(file=self.stream, highlight=False, soft_wrap=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Printer:
        return cls(plain=bool(getattr(args, "plain", False)))

    @property
    def rich(self) -> bool:
        return self._console is not None

    def line(self, text: str = "", style: str | None = None) -> None:
        if self._console is not None:
            self._console.print(text, style=style, markup=False)
        else:
            print(text, file=self.stream)

    def pairs(self, items: Iterable[tuple[str, object]]) -> None:
        """Aligned ``key: value`` lines."""
        items = list(items)
        width = max((len(k) for k, _ in items), default=0)
        for key, value in items:
            self.line(f"{key + ':':<{width + 1}} {_cell(value)}")

    def table(self, table: Table) -> None:
        if self._console is not None:
            self._rich_table(table)
        else:
            self._plain_table(table)

    def _rich_table(self, table: Table) -> None:
        from rich import box
        from rich.table import Table as RichTable

        rich_table = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD,
                               title_style="bold")
        for column in table.columns:
            rich_table.add_column(column, overflow="fold")
        for row in table.rows:
            rich_table.add_row(*row)
        self._console.print(rich_table)

    def _plain_table(self, table: Table) -> None:
        # Multi-line cells (lists of reasons) continue on the following lines, in their column.
        split = [[cell.splitlines() or [""] for cell in row] for row in table.rows]
        widths = [len(c) for c in table.columns]
        for row in split:
            for i, lines in enumerate(row):
                widths[i] = max(widths[i], *(len(x) for x in lines))
        last = len(widths) - 1

        def emit(cells: Sequence[str]) -> None:
            text = "  ".join(c if i == last else c.ljust(widths[i]) for i, c in enumerate(cells))
            print(text.rstrip(), file=self.stream)

        print(table.title, file=self.stream)
        emit(table.columns)
        emit(["-" * w for w in widths])
        for row in split:
            for depth in range(max(len(lines) for lines in row)):
                emit([lines[depth] if depth < len(lines) else "" for lines in row])
        print(file=self.stream)
