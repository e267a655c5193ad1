"""Development sessions: ``nox -l`` lists them, ``nox -s NAME`` runs one.

tests              the whole test suite against the checkout (editable installs)
isolated-<target>  a fresh environment that installs one target from the built wheels only,
                   the way a user installs from PyPI, then imports, discovers and computes
lint, typecheck    ruff and mypy over every package
docs               the documentation site (mkdocs build --strict)
build              every distribution's wheel into wheelhouse/
bench              `jaxattn bench` (arguments after -- go to it)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).resolve().parent
WHEELHOUSE = ROOT / "wheelhouse"
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
SMOKE = ROOT / "tests" / "packaging" / "smoke_install.py"

nox.options.default_venv_backend = "venv"  # pip: it finds the on-disk CPU torch build
nox.options.sessions = ["lint", "typecheck", "tests", "docs", "build"]


def workspace_packages() -> list[Path]:
    """Distributable packages: the core, then every plugin."""
    return [ROOT / "core", *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]


def install_workspace(session: nox.Session, *groups: str) -> None:
    editable = [arg for p in workspace_packages() for arg in ("-e", str(p))]
    requirements, index = list(nox.project.dependency_groups(PYPROJECT, *groups)), []
    if "kernels-cpu" in groups:  # torch's CPU build where pip would take the CUDA one, as run.py does
        session.install("pip>=22.2")  # pip install --dry-run --report
        requirements, index = _load("run", ROOT / "run.py").torch_choice(Path(session.bin) / "python", requirements)
    session.install(*index, *editable, *requirements)


@nox.session
def tests(session: nox.Session) -> None:
    """The full test suite; arguments after -- go to pytest."""
    install_workspace(session, "test", "kernels-cpu")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", *(session.posargs or ["."]))


# Test folders whose modules are typed too (module basenames are unique across them).
TYPED_TESTS = ("tests/packaging", "tests/cli")


@nox.session
def typecheck(session: nox.Session) -> None:
    install_workspace(session, "typecheck", "test")
    sources = [p / "src" for p in workspace_packages()]
    sources += [ROOT / f"tests/{name}/src" for name in ("example_plugin", "seed_plugin")]
    # Each package's src/ is a search root, so `jaxattn_vanilla.vanilla.impl` resolves by its own
    # name and the plugins resolve `jaxattn` to the checkout rather than an installed copy.
    session.env["MYPYPATH"] = os.pathsep.join([*map(str, sources), str(ROOT / "tests/packaging")])
    session.run("mypy", "--explicit-package-bases", *map(str, sources), *TYPED_TESTS,
                "noxfile.py", "run.py", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))


def build_wheels(session: nox.Session) -> list[Path]:
    """Build every workspace package's wheel into a clean wheelhouse/ (``run.py wheels``)."""
    session.run("python", str(ROOT / "run.py"), "wheels", "--out", str(WHEELHOUSE))
    return sorted(WHEELHOUSE.glob("*.whl"))


@nox.session
def build(session: nox.Session) -> None:
    """Wheels of the core and every plugin, in wheelhouse/."""
    session.install("pip>=23")
    build_wheels(session)


def _load(name: str, path: Path) -> Any:
    """A script of the repository as a module (run.py, the smoke script)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install_targets() -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """The smoke script's TARGETS: one table of what each install must bring, for nox and pytest."""
    return dict(_load("smoke_install", SMOKE).TARGETS)


TARGETS = _install_targets()


@nox.session(venv_backend="venv", reuse_venv=False)
@nox.parametrize("target", list(TARGETS), ids=list(TARGETS))
def isolated(session: nox.Session, target: str) -> None:
    """Fresh venv, install one target from the built wheels (as from PyPI), import and run it."""
    build_wheels(session)
    # --find-links: our distributions come from the wheelhouse; third-party ones (jax,
    # pluggy, triton...) from the index, as for a user.
    session.install("--find-links", str(WHEELHOUSE), TARGETS[target][0])
    session.run("python", str(SMOKE), target)


@nox.session
def bench(session: nox.Session) -> None:
    """`jaxattn bench` against the checkout; arguments after -- go to it."""
    install_workspace(session)
    session.run("jaxattn", "bench", *session.posargs)
