"""The docs are pages a user reads, not a lab notebook: each fits a reader's attention, and none
narrates the project's own work history (that is git's log)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Every docs page and plugin README at most this many lines; the benchmark results page less,
#: so that "how fast is each backend, and which should I use?" stays answerable at a glance.
MAX_LINES = 700
MAX_BENCH_LINES = 600

#: Phrases that narrate work history: numbered work sessions or rounds, and defaults "until".
HISTORY = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|\d+(?:st|nd|rd|th)|later|earlier|previous|next)(?: [\w-]+)? session\b"
    r"|\bthe default until\b|\bround \d+ of (?:the )?work\b",
    re.IGNORECASE,
)


def pages() -> list[Path]:
    found = sorted((ROOT / "docs").rglob("*.md")) + sorted(ROOT.glob("plugins/*/README.md"))
    found += [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    return [p for p in found if p.is_file()]


def test_there_are_pages_to_check() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"docs/bench.md", "docs/architecture.md", "plugins/triton/README.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_length(page: Path) -> None:
    limit = MAX_BENCH_LINES if page == ROOT / "docs" / "bench.md" else MAX_LINES
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= limit, (
        f"{page.relative_to(ROOT)} has {lines} lines (at most {limit}): keep current figures and "
        "what a user needs; work history belongs in git's log"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_narrates_no_work_history(page: Path) -> None:
    hits = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not hits, "work history in a docs page (say what is true now, with its command):\n" + "\n".join(hits)


def test_the_history_pattern_catches_what_it_is_for() -> None:
    # The check above can fail: these are the phrases it exists to catch, and plain prose passes.
    for phrase in ("a thirteenth session", "an earlier H200 session", "the default until 2026-11-27",
                   "the 9th session", "round 3 of the work"):
        assert HISTORY.search(phrase), phrase
    plain = ("`benchmarks/gpu_session.sh`", "a serving session's steps", "one XLA cache for the session")
    for phrase in plain:
        assert not HISTORY.search(phrase), phrase


#: benchmarks/ holds what a user runs; kernel-development probes live beside their plugin
#: (plugins/<name>/benchmarks/).
MAX_BENCHMARKS = 6


def test_benchmarks_holds_only_what_a_user_runs() -> None:
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file() and not p.name.startswith("."))
    assert len(scripts) <= MAX_BENCHMARKS, (
        f"benchmarks/ holds {len(scripts)} files (at most {MAX_BENCHMARKS}): {scripts}; move a kernel-development "
        "probe beside its plugin (plugins/<name>/benchmarks/)"
    )


def test_shipped_code_reads_only_documented_settings() -> None:
    # No experiment switches in shipped code: a JAXATTN_* variable that a package reads is a
    # setting a user may set, so a docs page (or the README) says what it does. A measured
    # winner becomes the code; the other variants go (git's log keeps them).
    shipped = [*(ROOT / "core" / "src").rglob("*.py"), *ROOT.glob("plugins/*/src/**/*.py")]
    setting = re.compile(r"\bJAXATTN_[A-Z0-9_]+\b")
    read = {name for path in shipped for name in setting.findall(path.read_text(encoding="utf-8"))}
    documented = "\n".join(p.read_text(encoding="utf-8") for p in pages())
    undocumented = sorted(name for name in read if name not in documented)
    assert not undocumented, f"shipped code reads settings no docs page names (an experiment switch?): {undocumented}"


#: A repository path a page cites: a file under one of the repository's top folders.
CITED_PATH = re.compile(
    r"(?<![\w/.$-])((?:benchmarks|plugins|tests|core|docs|\.ci)/[\w./-]+\.(?:py|sh|md|png|toml|json|yml))"
)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_a_page_cites_exists(page: Path) -> None:
    # Scripts move (kernel probes beside their plugin) and pages must follow.
    cited = {m.group(1) for m in CITED_PATH.finditer(page.read_text(encoding="utf-8"))}
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"{page.relative_to(ROOT)} cites files that do not exist: {missing}"
