"""docs/bench.md and docs/tuning.md say what the commands do: every option, a runnable example."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from jaxattn.cli import build_parser
from jaxattn_bench.store import TuningStore

DOCS = Path(__file__).resolve().parents[2] / "docs"


def options(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices[command]
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize(("command", "page", "shared"), [("bench", "bench.md", False), ("tune", "tuning.md", True)])
def test_every_option_is_documented(command: str, page: str, shared: bool) -> None:
    text = (DOCS / page).read_text()
    # tune shares bench's shape and timing options, documented once, in bench.md
    own = options(command) - (options("bench") if shared else set()) | ({"--json"} if shared else set())
    missing = sorted(o for o in own if f"`{o}" not in text)
    assert not missing, f"docs/{page} lacks jaxattn {command} {missing}"


def test_tuning_api_example_runs(cache_dir: Path) -> None:
    block = re.search(r"```python\n(.*?)```", (DOCS / "tuning.md").read_text(), re.S)
    assert block is not None
    exec(compile(block.group(1), "docs/tuning.md", "exec"), {})
    entries = TuningStore.load().entries
    assert list(entries) == ["bfloat16/D128/T4096/S4096/causal"]
    assert entries["bfloat16/D128/T4096/S4096/causal"].results["vanilla"].fwd_ms == 9.5
