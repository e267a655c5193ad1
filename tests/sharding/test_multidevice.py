"""Runs the multi-device checks (``multidevice/check_*.py``) in a subprocess with 8 CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only takes effect before jax starts
its CPU backend, and it would change the device count every other test sees; so each check
module runs in its own ``python -m pytest`` with the flag set, and this test reports its
result. To run one directly::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest \\
        -o python_files='check_*.py' tests/sharding/multidevice/check_ring.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECKS = sorted(p.name for p in (HERE / "multidevice").glob("check_*.py"))
# A hung collective (or Pallas interpret-mode barrier) must fail the suite, not stall it.
TIMEOUT_S = 900


def _env() -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    # Optimisation level 0: these programs are tiny and XLA's CPU optimisations would take
    # most of the time (compiling, not running, dominates these checks).
    flags += ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_on_8_cpu_devices(check: str) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
               "-o", "faulthandler_timeout=600", str(HERE / "multidevice" / check)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as err:
        partial = "".join(x.decode() if isinstance(x, bytes) else x for x in (err.stdout, err.stderr) if x)
        pytest.fail(f"{check} did not finish in {TIMEOUT_S}s:\n{partial}")
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"{check} failed (exit code {done.returncode}):\n{report}"
    # Every check skips itself without 8 devices: make sure the flag reached jax.
    assert "needs 8 devices" not in report, report
    assert re.search(r"\d+ passed", report), report
