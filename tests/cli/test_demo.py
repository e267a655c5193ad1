"""``jaxattn demo`` (what ``python3 run.py demo`` runs) against the installed backends."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_explains_its_choice_and_matches_the_oracle() -> None:
    result = subprocess.run([sys.executable, "-m", "jaxattn", "demo", "--batch", "1", "--seq", "24"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "installed:" in out and "impl:   auto -> " in out
    chosen = out.split("impl:   auto -> ", 1)[1].split()[0]
    assert f"why: {chosen} (priority" in out
    assert f"ran {chosen}: output (1, 24, 8, 64)" in out
    assert "WRONG" not in out and out.rstrip().endswith("OK")


@pytest.mark.slow
def test_demo_with_an_explicit_impl_in_bfloat16() -> None:
    result = subprocess.run([sys.executable, "-m", "jaxattn", "demo", "--seq", "16", "--impl", "vanilla",
                             "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "why: impl='vanilla' was asked for" in result.stdout
    assert "ran vanilla: output (2, 16, 8, 64)" in result.stdout and "tolerance 0.03" in result.stdout
