"""docs/sharding.md's examples run as written, in order, on 8 CPU devices."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_multidevice import ROOT, TIMEOUT_S, _env

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@pytest.mark.slow
def test_sharding_page_examples_run_in_order() -> None:
    page = (Path(ROOT) / "docs" / "sharding.md").read_text()
    # ```python blocks run (later ones use earlier names); ```py ones need several hosts.
    code = "\n\n".join(body for lang, body in FENCE.findall(page) if lang == "python")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.split("\n")
    # The output stays sharded like q (PartitionSpec's repr differs across jax versions).
    assert lines[0].startswith("(4, 256, 8, 64) ") and "'data', None, 'model'" in lines[0], done.stdout
    assert float(lines[1]) < 1e-3, done.stdout  # ring's gradients vs vanilla on one device
    assert lines[2] == "True", done.stdout  # ring over inputs in zigzag order, put back, vs vanilla
    assert lines[3] == "(2, 512, 4, 64)", done.stdout
    assert lines[4] == "(4, 32, 64) True", done.stdout  # head-sharded paged decode vs one device
