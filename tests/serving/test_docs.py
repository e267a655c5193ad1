"""docs/serving.md's decode loops (bf16, then a quantized pool) run as written and serve every request
exactly; its table of the quantized formats' error is the script's output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@pytest.mark.slow
def test_serving_page_decode_loop_runs() -> None:
    done = _run(_blocks()[:1])
    # Four requests (one arriving mid-flight), every page back in the pool, outputs = dense attention.
    assert done.startswith("requests served: 4; pages free at the end: 23;"), done


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_serving_quantized_decode_loop_runs(fmt: str) -> None:
    """The quantized loop (the page's second block, run after the first, whose ``serve`` it reuses):
    a pool of each format with a scale per token, NaN scales in slots never written."""
    first, second = _blocks()
    assert 'FMT = "int8"' in second
    done = _run([first, second.replace('FMT = "int8"', f"FMT = {fmt!r}")]).splitlines()
    assert done[0].startswith("requests served: 4; pages free at the end: 23;"), done
    assert done[1].startswith(f"{fmt} per token: requests served: 4; pages free at the end: 23;"), done


@pytest.mark.slow
def test_serving_error_table_is_the_scripts_output() -> None:
    """docs/serving.md's table of each format's error is what benchmarks/quantized_kv_error.py prints."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantized_kv_error.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    table = done.stdout.strip()
    assert table.count("\n") == 10, table  # a header, a rule, 3 formats x 3 granularities
    assert table in (ROOT / "docs" / "serving.md").read_text(), table


def _blocks() -> list[str]:
    page = (ROOT / "docs" / "serving.md").read_text()
    blocks = [body for lang, body in FENCE.findall(page) if lang == "python"]
    assert len(blocks) == 2, "docs/serving.md has two python blocks: the bf16 loop, then the quantized one"
    return blocks


def _run(blocks: list[str]) -> str:
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
