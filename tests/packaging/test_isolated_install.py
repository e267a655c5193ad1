"""Each install target, from wheels into a fresh environment, brings exactly its backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from smoke_install import TARGETS, TOOLS
from venvtools import Venv

SMOKE = Path(__file__).with_name("smoke_install.py")

# One xdist worker runs every fresh-venv test, so the wheelhouse and the dependency base
# (session fixtures) are built once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fresh_venvs")]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_install_target_from_wheels(make_venv: Callable[..., Venv], target: str) -> None:
    requirement, dists, _ = TARGETS[target]
    venv = make_venv(requirement)
    installed = venv.distributions()
    ours = {name for name in installed if name.startswith("jaxattn")}
    assert ours == {"jaxattn", *dists, *TOOLS.get(target, ())}, f"{requirement} installed {sorted(ours)}"
    result = venv.run(str(SMOKE), target)
    assert "ok: discovery and listing imported no kernel library" in result.stdout
