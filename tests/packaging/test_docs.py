"""The documentation says what the code does: quoted files are verbatim, examples run."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from venvtools import REPO, clean_env

from jaxattn.cli import build_parser

DOCS = REPO / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(page: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall((DOCS / page).read_text()) if lang == language]


def test_quoted_example_plugin_files_are_verbatim() -> None:
    quoted = [b for lang in ("python", "toml") for b in _blocks("write-a-backend.md", lang)
              if b.startswith("# file: ")]
    assert len(quoted) == 5  # the example plugin (pyproject, plugin, impl) and the seed-style one (plugin, impl)
    for block in quoted:
        header, body = block.split("\n", 1)
        path = REPO / header.removeprefix("# file: ").strip()
        assert body == path.read_text(), f"docs/write-a-backend.md quotes an outdated {path.relative_to(REPO)}"


@pytest.mark.slow
def test_getting_started_examples_run_in_order() -> None:
    # One process, blocks in order (later ones use earlier names), as a reader would paste them.
    code = "\n\n".join(_blocks("getting-started.md", "python"))
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "auto ->" in result.stdout  # the explain() example printed its explanation


@pytest.mark.slow
def test_flax_page_examples_run_in_order() -> None:
    pytest.importorskip("jaxattn_flax", reason="docs/flax.md's examples need jaxattn-flax (jaxattn[flax])")
    code = "\n\n".join(_blocks("flax.md", "python"))
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "auto ->" in result.stdout  # the module's explain() printed its choice


def test_flax_module_has_its_docstring() -> None:
    pytest.importorskip("jaxattn_flax")
    from jaxattn_flax import FlexibleAttentionModule

    assert FlexibleAttentionModule.__doc__ and FlexibleAttentionModule.__doc__.startswith("Attention over BTHD")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings
            if s.startswith("--") and s != "--help"}


def test_cli_reference_documents_every_option_of_info_list_explain() -> None:
    text = (DOCS / "cli.md").read_text()
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("info", "list", "explain"):
        assert f"## `jaxattn {name}`" in text
        missing = sorted(o for o in _options(subparsers.choices[name]) if f"`{o}" not in text)
        assert not missing, f"docs/cli.md lacks jaxattn {name} {missing}"
