"""Everything the ``jaxattn`` command and the demo print fits 80 columns, and no word is cut.

The commands run as a user runs them, piped (plain text), with ``COLUMNS=80``, against the
backends installed here; the renderer's rules (wrap at spaces, stack what does not fit,
columns as wide as their longest name) are checked on tables made to be awkward.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxattn.cli._output import Printer, Table, fit_columns

WIDTH = 80
LONG = "a_backend_name_far_longer_than_any_column_expects"


def _run(*args: str, tmp: Path) -> str:
    env = {**os.environ, "COLUMNS": str(WIDTH), "JAXATTN_CACHE_DIR": str(tmp / "cache")}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # explain exits 1 when nothing runs
    return done.stdout


def _assert_fits(text: str, what: str) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide, f"{what}: {len(too_wide)} lines over {WIDTH} columns, e.g. {too_wide[0]!r}"


CLI = ["-c", "import sys; from jaxattn.cli import main; sys.exit(main())"]
COMMANDS = {
    "list": ["list"],
    "list --here": ["list", "--here"],
    "list --kind paged": ["list", "--kind", "paged"],
    "info": ["info"],
    "info --check": ["info", "--check"],
    "explain": ["explain", "--seq-q", "4096", "--causal", "--heads-q", "32", "--heads-kv", "8"],
    "explain --impl": ["explain", "--impl", "vanilla", "--window", "8", "--soft-cap", "30"],
    "explain --paged": ["explain", "--paged"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_fits_80_columns(name: str, tmp_path: Path) -> None:
    out = _run(*CLI, *COMMANDS[name], tmp=tmp_path)
    assert out.strip(), f"jaxattn {name} printed nothing"
    _assert_fits(out, f"jaxattn {name}")


@pytest.mark.slow
def test_demo_fits_80_columns(tmp_path: Path) -> None:
    out = _run(*CLI, "demo", "--batch", "1", "--seq", "16", tmp=tmp_path)
    assert "ran " in out
    _assert_fits(out, "jaxattn demo")


@pytest.mark.slow
def test_bench_fits_80_columns_and_says_each_decline_once(tmp_path: Path) -> None:
    # Two shapes, forward only: enough for a decline to repeat per shape in the old layout. The
    # JSON path is the user's text, printed as given: kept short here (xdist's tmp paths are long).
    out = _run(*CLI, "bench", "--shape", "1,32,2,16", "--shape", "1,48,2,16", "--modes", "fwd", "--warmup", "0",
               "--repeats", "1", "--progress", "none", "--json", "b.json", tmp=tmp_path)  # relative: cwd is tmp_path
    _assert_fits(out, "jaxattn bench")
    data = json.loads((tmp_path / "b.json").read_text())
    declined = {r["backend"] for r in data["results"] if r["status"] == "declined"}
    for backend in declined:  # once per backend, not once per shape
        assert out.count(f"- {backend} declined on") == 1, out
    assert "B1 S32 H2 D16 causal" in out.splitlines()  # the shape is a heading of its rows


@pytest.mark.slow
def test_bench_serving_fits_80_columns(tmp_path: Path) -> None:
    out = _run(*CLI, "bench", "--serving", "--quick", "--repeats", "1", "--impls", "vanilla_paged,vanilla",
               "--no-auto", "--progress", "none", tmp=tmp_path)
    assert "GB/s" in out
    _assert_fits(out, "jaxattn bench --serving")


# -- the renderer ------------------------------------------------------------------------------
def _render(table: Table, width: int = WIDTH) -> str:
    stream = io.StringIO()
    Printer(plain=True, stream=stream, width=width).table(table)
    return stream.getvalue()


def _words(text: str) -> set[str]:
    return set(text.replace(",", " ").replace(";", " ").split())


def test_wide_table_wraps_at_spaces_and_keeps_every_word() -> None:
    table = Table("Implementations of a deliberately awkward registry", ["name", "kind", "aliases", "note"])
    prose = "declines every call on this platform because the kernel library it needs is not installed here"
    table.add(LONG, "dense", ["alias_one", "another_alias_name", "third"], prose)
    table.add("short", "paged", None, None)
    out = _render(table)
    _assert_fits(out, "table")
    # No word is cut: every word of every cell appears whole in the output.
    assert _words(prose) | {LONG, "alias_one", "another_alias_name", "third"} <= _words(out)


def test_columns_align_after_a_long_name() -> None:
    table = Table("T", ["name", "status", "priority"])
    table.add(LONG, "ok", 5)
    table.add("x", "declined", 10)
    lines = _render(table).splitlines()
    rows = [line for line in lines if line.startswith((LONG, "x "))]
    assert [line.index("ok") for line in rows[:1]] == [line.index("declined") for line in rows[1:]]


def test_columns_that_cannot_fit_go_below_each_row() -> None:
    table = Table("T", ["name", "a", "b", "c", "d"])
    table.add(LONG, "x" * 30, "y" * 30, "z" * 30, "w")
    out = _render(table)
    _assert_fits(out, "table")
    assert fit_columns(table, WIDTH) is None  # too wide side by side, even wrapped
    assert LONG in out and "x" * 30 in out and "z" * 30 in out  # stacked, whole


def test_headings_group_rows() -> None:
    table = Table("T", ["backend", "ms"])
    table.heading("B1 S64 H4 D32 causal")
    table.add("vanilla", "0.1")
    table.heading("B1 S128 H4 D32 causal")
    table.add("vanilla", "0.2")
    lines = _render(table).splitlines()
    assert lines.index("B1 S64 H4 D32 causal") < lines.index("B1 S128 H4 D32 causal")
    assert sum(line.startswith("vanilla") for line in lines) == 2


def test_key_value_lines_wrap_under_their_value() -> None:
    stream = io.StringIO()
    Printer(plain=True, stream=stream, width=40).pairs([("auto picks", "sdpa in float32 for a long call shape here")])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(len(line) <= 40 for line in lines)
    assert lines[1].startswith(" " * len("auto picks: "))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rich_on_a_terminal_fits_too_and_cuts_no_word() -> None:
    pytest.importorskip("rich")
    import re

    table = Table("Plugins", ["plugin", "status", "distribution", "version", "install", "impls"])
    impls = ("autoregressive_decodeattn, blockwise, vanilla, vanilla_paged (ragged_page_attention_v3, "
             "ragged_page_attention_v2, page_attention)")
    table.add("vanilla", "ok", "jaxattn-vanilla", "0.1.0", "editable", impls)
    terminal = _Terminal()
    printer = Printer(stream=terminal, width=WIDTH)
    assert printer.rich
    printer.table(table)
    out = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue())  # rich's styles
    _assert_fits(out, "rich table")
    assert _words(impls) <= _words(out)  # rich's own tables fold words; these lines do not
