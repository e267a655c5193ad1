"""Session fixtures: one wheelhouse, one dependency base, and fresh venvs built from them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from venvtools import (
    TEST_PACKAGES,
    Venv,
    build_wheelhouse,
    create_base,
    create_venv,
    third_party_requirements,
    workspace_packages,
    write_constraints,
)


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of every workspace package and of the two test plugins."""
    # Both come with the test dependencies (run.py, nox, uv sync); a bare environment such
    # as the GPU machine's, which has neither nor a network, cannot build fresh venvs.
    pytest.importorskip("hatchling", reason="building wheels without isolation needs hatchling")
    pytest.importorskip("uv", reason="fresh environments are made with uv")
    target = tmp_path_factory.mktemp("wheelhouse")
    wheels = build_wheelhouse(target, [*workspace_packages(), *TEST_PACKAGES])
    assert len(wheels) == len(workspace_packages()) + len(TEST_PACKAGES), wheels
    return target


@pytest.fixture(scope="session")
def dependency_base(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Path:
    """site-packages of a venv holding the wheels' third-party dependencies, nothing of ours."""
    constraints = write_constraints(tmp_path_factory.mktemp("constraints") / "constraints.txt")
    # pytest too: the example plugin runs jaxattn's conformance suite inside its venv.
    requirements = [*third_party_requirements(sorted(wheelhouse.glob("*.whl"))), "pytest"]
    return create_base(tmp_path_factory.mktemp("base"), requirements, constraints)


@pytest.fixture(scope="session")
def make_venv(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path,
              dependency_base: Path) -> Callable[..., Venv]:
    """``make_venv("jaxattn[cpu]", ...)``: a fresh environment; same requirements, same venv."""
    made: dict[tuple[str, ...], Venv] = {}

    def make(*requirements: str) -> Venv:
        key = tuple(sorted(requirements))
        if key not in made:
            made[key] = create_venv(tmp_path_factory.mktemp("venv"), wheelhouse, dependency_base, *requirements)
        return made[key]

    return make
