"""Discovery and listing import no kernel library (docs/contract.md: lazy ImplRefs)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from venvtools import clean_env, workspace_packages

# Kernel libraries: only building a kernel may import them.
FORBIDDEN = ("triton", "jax_triton", "torch", "jax.experimental.pallas")


def _imported_modules(code: str) -> tuple[list[str], str]:
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=clean_env(),
                            capture_output=True, text=True, check=True, timeout=300)
    # Lines look like "import time:   self [us] | cumulative | imported package".
    modules = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
               if line.startswith("import time:") and "|" in line]
    return modules, result.stdout


@pytest.mark.slow
def test_import_and_list_impls_import_no_kernel_library() -> None:
    # Every plugin, those that register no impl too (jaxattn-bench adds commands only).
    code = ("import jaxattn, jaxattn.discovery.plugins; jaxattn.list_impls(); "
            "print('\\n'.join(sorted({r.distribution or '' for r in jaxattn.discovery.plugins.plugin_records()})))")
    modules, stdout = _imported_modules(code)
    # The check means something only if every installed plugin was really discovered.
    listed = set(stdout.split())
    # Those with an entry point: jaxattn-flax is a library that models import, not discovered.
    installed = {p.name for p in workspace_packages() if "jaxattn.plugins" in tomllib.loads(
        (p / "pyproject.toml").read_text())["project"].get("entry-points", {})}
    assert {f"jaxattn-{name}" for name in installed} <= listed, listed
    assert "jaxattn.discovery.plugins" in modules
    kernels = sorted({m for m in modules if any(m == k or m.startswith(k + ".") for k in FORBIDDEN)})
    assert not kernels, f"`import jaxattn; jaxattn.list_impls()` imported {kernels}"


def test_import_jaxattn_imports_no_jax() -> None:
    modules, _ = _imported_modules("import jaxattn")
    assert "jaxattn" in modules
    assert "jax" not in modules, "import jaxattn should be cheap: jax loads on first use"
