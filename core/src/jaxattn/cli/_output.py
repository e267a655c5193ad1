"""Rendering for the ``jaxattn`` command: JSON, or tables and lines of text.

Everything fits the terminal's width (``$COLUMNS``, else the terminal, else 80 columns when
piped): cells and lines wrap at spaces, never inside a word; the columns that cannot fit
beside the others go under each row, as ``column: value`` text.

rich is optional (``jaxattn[rich]``) and used only on a terminal: it prints the same lines,
with bold titles and headers (its own table layout would fold words to fit). Piped or
redirected output is plain text, as is ``--plain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["Printer", "Table", "dump_json", "output_width", "wrap"]

#: Spaces between two columns of a plain table.
GAP = 2
#: A column narrower than this (and than its content) is unreadable: the table is stacked instead.
MIN_COLUMN = 12
#: The same for the last column, the one that wraps when only it does (notes, reasons: prose).
MIN_LAST_COLUMN = 24


def output_width() -> int:
    """Columns to fit: ``$COLUMNS``, else the terminal's width, else 80 (piped or redirected)."""
    return max(20, shutil.get_terminal_size((80, 24)).columns)


def wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` columns, broken at spaces only (a word longer than
    the width stays whole on its own line); continuation lines start with ``indent``."""
    lines: list[str] = []
    width = max(1, width)  # an empty column (explain's marker column when nothing is chosen) is 0 wide
    for paragraph in text.splitlines() or [""]:
        lead = paragraph[: len(paragraph) - len(paragraph.lstrip())]
        lines += textwrap.wrap(paragraph, width, subsequent_indent=lead + indent, break_long_words=False,
                               break_on_hyphens=False) or [""]
    return lines


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
    #: Row index -> a heading printed across the table before that row (a group's name, such
    #: as the shape a benchmark's rows belong to, said once instead of in a wide column).
    headings: dict[int, str] = dataclasses.field(default_factory=dict)

    def add(self, *cells: object) -> None:
        self.rows.append([_cell(c) for c in cells])

    def heading(self, text: str) -> None:
        """Start a group of rows: ``text`` is printed on its own line before the next row."""
        self.headings[len(self.rows)] = text


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

    def __init__(self, *, plain: bool = False, stream: TextIO | None = None, width: int | None = None) -> None:
        self.stream = stream or sys.stdout
        self.width = width or output_width()
        self._console: Any = None
        if not plain and self.stream.isatty():
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                self._console = Console(file=self.stream, highlight=False, soft_wrap=False, width=self.width)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Printer:
        return cls(plain=bool(getattr(args, "plain", False)))

    @property
    def rich(self) -> bool:
        return self._console is not None

    def line(self, text: str = "", style: str | None = None) -> None:
        """``text``, wrapped at spaces to the width (continuation lines indented two more)."""
        for part in wrap(text, self.width, indent="  "):
            self._emit(part, style)

    def _emit(self, text: str = "", style: str | None = None) -> None:
        if self._console is not None:
            self._console.print(text, style=style, markup=False)
        else:
            print(text, file=self.stream)

    def pairs(self, items: Iterable[tuple[str, object]]) -> None:
        """Aligned ``key: value`` lines; a long value continues under the first."""
        items = list(items)
        width = max((len(k) for k, _ in items), default=0)
        indent = " " * (width + 2)
        for key, value in items:
            lines = wrap(_cell(value), max(20, self.width - len(indent)))
            self._emit(f"{key + ':':<{width + 1}} {lines[0]}".rstrip())
            for more in lines[1:]:
                self._emit(indent + more.lstrip())

    def table(self, table: Table) -> None:
        # The most leading columns that fit side by side, only the last of them wrapping; else
        # the most that fit with several wrapping; the other columns go under each row.
        keep, widths = len(table.columns), None
        for squeeze in (False, True):
            keep = len(table.columns)
            while keep and (widths := fit_columns(_first(table, keep), self.width, squeeze=squeeze)) is None:
                keep -= 1
            if widths is not None:
                break
        if widths is None:
            keep, widths = 1, [min(self.width, max(len(r[0]) for r in [table.columns, *table.rows]))]
        self._plain_table(table, widths, keep)

    def _plain_table(self, table: Table, widths: Sequence[int], keep: int) -> None:
        """The first ``keep`` columns side by side, a cell wrapping at spaces within its column;
        the other columns as indented ``column: value`` lines under each row."""
        last = len(widths) - 1
        stacked = list(table.columns[keep:])
        indent = " " * 4

        def emit(cells: Sequence[str], style: str | None = None) -> None:
            text = (" " * GAP).join(c if i == last else c.ljust(widths[i]) for i, c in enumerate(cells))
            self._emit(text.rstrip(), style)

        def lines(row: Sequence[str]) -> list[list[str]]:
            return [wrap(cell, width) for cell, width in zip(row, widths, strict=False)]

        def emit_row(row: list[list[str]], style: str | None = None) -> None:
            for depth in range(max(len(cell) for cell in row)):
                emit([cell[depth] if depth < len(cell) else "" for cell in row], style)

        self.line(table.title, style="bold")
        emit_row(lines(table.columns), style="bold")
        if stacked:
            self._emit(indent + "; ".join(stacked) + " (below each row)")
        emit_row([["-" * w] for w in widths])
        for index, row in enumerate(table.rows):
            if index in table.headings:
                self.line(table.headings[index], style="bold")
            emit_row(lines(row))
            # One paragraph per row; a cell with nothing to say ("-") is left out.
            # A cell's lines are items of their own (one reason each): kept apart by "; ".
            said = [(key, "; ".join(" ".join(line.split()) for line in cell.splitlines() if line.strip()))
                    for key, cell in zip(stacked, row[keep:], strict=True) if cell not in ("", "-")]
            text = said[0][1] if len(stacked) == 1 and said else "; ".join(f"{k}: {c}" for k, c in said)
            if text:
                for part in wrap(text, self.width - len(indent), indent="  "):
                    self._emit(indent + part)
        self._emit()


def _words(text: str) -> list[str]:
    return text.split()


def _first(table: Table, keep: int) -> Table:
    return Table(table.title, table.columns[:keep], [row[:keep] for row in table.rows], table.headings)


def fit_columns(table: Table, width: int, *, squeeze: bool = True) -> list[int] | None:
    """Column widths that fit ``table`` in ``width`` columns, wrapping cells at spaces only
    (only the last column when not ``squeeze``); None when that would leave a column narrower
    than its longest word or ``MIN_COLUMN``."""
    cells = [list(table.columns), *table.rows]
    natural = [max(len(line) for row in cells for line in row[i].splitlines() or [""])
               for i in range(len(table.columns))]
    shortest = [max(len(word) for row in cells for word in _words(row[i]) or [""])
                for i in range(len(table.columns))]
    room = width - GAP * (len(natural) - 1)
    if sum(natural) <= room:
        return natural
    if not squeeze:
        last = room - sum(natural[:-1])
        return [*natural[:-1], last] if last >= max(shortest[-1], min(natural[-1], MIN_LAST_COLUMN)) else None
    # Cap the widest columns at one width, the largest cap that fits ("water filling").
    def capped(cap: int) -> list[int]:
        return [min(n, max(cap, s)) for n, s in zip(natural, shortest, strict=True)]

    low, high = 0, max(natural)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if sum(capped(mid)) <= room else (low, mid - 1)
    widths = capped(low)
    if sum(widths) > room or any(w < min(n, MIN_COLUMN) for w, n in zip(widths, natural, strict=True)):
        return None
    return widths
