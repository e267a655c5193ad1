"""The repository cites nothing outside itself: its contract is docs/contract.md, and what a
contributor needs for GPU work is in CONTRIBUTING.md and docs/. A file that points to notes
beside the checkout sends a reader of a clone or a wheel to something they do not have."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Spelled in pieces so that this file does not match itself.
OUTSIDE = ("DESIGN" + ".md", "GPU" + ".md", "../" + "shared", "shared" + " folder", "shared" + " notes")


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.decode().split("\0") if name]
    return [f for f in files if f.suffix not in {".png", ".whl"} and f.is_file()]


def test_no_file_cites_anything_outside_the_repository() -> None:
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {word}" for word in OUTSIDE if word in line]
    assert not hits, "cites files outside the repository:\n" + "\n".join(hits)
