"""Progress while the benchmark or the tuner runs: a rich progress bar, plain lines, or nothing.

A rich bar is used on a terminal; logs and CI (no terminal) get one plain line per result on
stderr, which also survives in a captured log when a run is cut short.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .results import BenchResult

__all__ = ["Progress"]


def describe(result: BenchResult) -> str:
    if result.ok and result.median_ms is not None:
        tflops = result.cell()
        text = f"{result.median_ms:9.3f} ms {tflops:>8} TFLOP/s"
        if result.ratio is not None:
            text += f" {result.ratio:5.2f}x ref"
        notes = [result.note, f"{result.same_program_as}'s program" if result.same_program_as else ""]
        return text + "".join(f"  {n}" for n in notes if n)
    return f"{result.status}: {result.reason}"


class Progress:
    """Plain-line progress (also the base of the rich one); ``Progress.none()`` is silent."""

    def __init__(self, stream: TextIO | None = sys.stderr) -> None:
        self.stream = stream
        self.total = 0
        self.count = 0

    @classmethod
    def none(cls) -> Progress:
        return cls(stream=None)

    @classmethod
    def choose(cls, kind: str = "auto", stream: TextIO | None = None) -> Progress:
        """``auto``: rich on a terminal when rich is installed, else plain; or ``rich``/``plain``/``none``."""
        stream = stream or sys.stderr
        if kind == "none":
            return cls.none()
        if kind in ("auto", "rich") and (kind == "rich" or stream.isatty()):
            try:
                return RichProgress(stream)
            except ImportError:
                pass
        return cls(stream)

    def start(self, total: int) -> None:
        self.total, self.count = total, 0

    def status(self, text: str) -> None:
        self._line(f"... {text}")

    def result(self, result: BenchResult) -> None:
        self.count += 1
        width = len(str(self.total))
        self._line(f"[{self.count:>{width}}/{self.total}] {result.shape.label:<28} {result.backend:<12} "
                   f"{result.mode:<6} {describe(result)}")

    def line(self, text: str) -> None:
        self._line(text)

    def stop(self) -> None:
        pass

    def _line(self, text: str) -> None:
        if self.stream is not None:
            print(text, file=self.stream, flush=True)


class RichProgress(Progress):
    """A live bar with the current step; finished results scroll above it."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichBar

        super().__init__(stream)
        self._bar: Any = RichBar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=stream), transient=True)
        self._task: Any = None

    def start(self, total: int) -> None:
        super().start(total)
        self._bar.start()
        self._task = self._bar.add_task("starting", total=total)

    def status(self, text: str) -> None:
        self._bar.update(self._task, description=text)

    def result(self, result: BenchResult) -> None:
        self.count += 1
        self._bar.console.print(f"{result.shape.label:<28} {result.backend:<12} {result.mode:<6} "
                                f"{describe(result)}", markup=False, highlight=False)
        self._bar.update(self._task, advance=1, description=f"{result.shape.label} {result.backend}")

    def line(self, text: str) -> None:
        self._bar.console.print(text, markup=False, highlight=False)

    def stop(self) -> None:
        self._bar.stop()
