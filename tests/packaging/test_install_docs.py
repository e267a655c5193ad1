"""What the docs tell a newcomer to type is what is tested and what the packages declare.

* the README's install table gives, per install target, the command from a checkout and the
  one once published; they are the requirements the fresh-venv tests install
  (``smoke_install.TARGETS``, from wheels that ``run.py wheels``'s code builds);
* docs/getting-started.md holds the one table of what each extra brings; its distributions
  are core/pyproject.toml's extras, and the other pages link to it instead of repeating it;
* ``run.py``: the CPU build of torch where pip would take the CUDA one, ``test --no-torch``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from smoke_install import TARGETS
from venvtools import REPO, run_py

ROW = re.compile(r"^\|(.+)\|\s*$", re.M)


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with ``| header |``."""
    start = text.index(f"| {header} |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        match = ROW.match(line)
        if not match:
            break
        rows.append([cell.strip() for cell in match.group(1).split("|")])
    return rows


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_readme_install_table_is_what_the_fresh_venv_tests_install() -> None:
    rows = _table((REPO / "README.md").read_text(), "target")
    checkout = {row[0]: _code(row[1]) for row in rows}
    published = {row[0]: _code(row[2]) for row in rows}
    tested = {TARGETS[t][0] for t in ("core", "cpu", "gpu", "tpu", "ring")}
    documented = set()
    for target, (command,) in checkout.items():
        match = re.fullmatch(r'pip install --find-links wheelhouse "([^"]+)"', command)
        assert match, f"README, {target}: {command!r} is not a wheelhouse install"
        documented.add(match.group(1))
        assert published[target] == [f'pip install "{match.group(1)}"'], target
    assert documented == tested
    readme = (REPO / "README.md").read_text()
    assert "python3 run.py wheels" in readme  # the step before the table's commands


def _extras() -> dict[str, set[str]]:
    project = tomllib.loads((REPO / "core" / "pyproject.toml").read_text())["project"]
    return {name: {re.split(r"[<>=;\s]", r, maxsplit=1)[0] for r in reqs}
            for name, reqs in project["optional-dependencies"].items()}


def test_getting_started_extras_table_matches_core_pyproject() -> None:
    rows = _table((REPO / "docs" / "getting-started.md").read_text(), "extra")
    documented: dict[str, set[str]] = {}
    for row in rows:
        for extra in _code(row[0]) or ["(none)"]:
            documented[extra] = set(_code(row[1]))
    extras = _extras()
    assert set(documented) - {"(none)"} == set(extras), "every extra of core/pyproject.toml, and only those"
    for name, requirements in extras.items():
        if name in ("cuda12", "cuda13", "libtpu"):  # one row for the three runtimes, in order
            continue
        assert documented[name] == requirements, f"[{name}]: the docs say {documented[name]}, pyproject {requirements}"
    runtimes = next(row for row in rows if "`cuda12`" in row[0])
    assert _code(runtimes[1]) == [next(iter(extras[n])) for n in ("cuda12", "cuda13", "libtpu")]
    # The backend names the fresh-venv tests require of an extra are named in its row ("gpu"
    # brings "the above": the cpu row's too).
    named = {target: set(_code(next(row for row in rows if _code(row[0]) == [target])[2]))
             for target in ("cpu", "gpu", "tpu", "ring")}
    named["gpu"] |= named["cpu"]
    for target, names in named.items():
        assert TARGETS[target][2] <= names, f"[{target}]: the table does not name {TARGETS[target][2] - names}"


@pytest.mark.parametrize("page", ["README.md", "core/README.md"])
def test_other_pages_link_to_the_one_extras_table(page: str) -> None:
    text = (REPO / page).read_text()
    assert "getting-started.md" in text
    assert "| install | backends |" not in text, f"{page} repeats what each extra brings"


# -- run.py ------------------------------------------------------------------------------------
def _report(*names: str) -> dict[str, Any]:
    return {"install": [{"metadata": {"name": n, "version": "1"}} for n in names]}


def test_run_py_takes_torchs_cpu_build_where_pip_would_take_the_cuda_one() -> None:
    run = run_py()
    requirements = ["pytest>=8", "torch==2.13.0", "triton>=3.1"]
    cuda = _report("torch", "triton", "nvidia-cublas-cu12", "nvidia-cudnn-cu12")
    assert run.cpu_torch(requirements, cuda) == (["pytest>=8", "torch==2.13.0+cpu", "triton>=3.1"],
                                                 ["--extra-index-url", run.TORCH_CPU_INDEX])
    # A CPU build already in reach (this project's machines, macOS): nothing changes.
    assert run.cpu_torch(requirements, _report("torch", "triton", "sympy")) == (requirements, [])
    assert run.cpu_torch(requirements, {}) == (requirements, [])  # pip could not say: as before


def test_run_py_test_no_torch_installs_without_torch_and_deselects_the_triton_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_py()
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(run, "ensure_environment", lambda profile, base=None, constraint=None: Path(profile))
    def run_in_venv(python: Path, args: list[str]) -> int:
        calls.append((str(python), args))
        return 0

    monkeypatch.setattr(run, "run_in_venv", run_in_venv)
    assert run.main(["test", "--no-torch", "tests/cli", "-x"]) == 0
    assert calls == [("test-no-torch", ["-m", "pytest", *run.spread([]), "-m", "not triton", "tests/cli", "-x"])]
    assert "kernels-cpu" not in run.PROFILES["test-no-torch"] and "kernels-cpu" in run.PROFILES["test"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    groups = pyproject["dependency-groups"]
    assert any(r.startswith("torch") for r in groups["kernels-cpu"])
    assert not any(isinstance(r, str) and r.startswith(("torch", "triton")) for r in groups["test"])
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith(f"{run.NO_TORCH_MARKER}:") for m in markers)


def test_run_py_test_python_takes_its_own_venv_and_constraints(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    # How CI runs the suite on a second jax (.ci/run, .ci/jax-next.txt): another interpreter
    # gets its own .venv-pyX.Y, and the constraints reach pip and the install's hash.
    import sys

    run = run_py()
    assert run.venv_for(None) == REPO / ".venv"
    assert run.venv_for(sys.executable) == REPO / f".venv-py{sys.version_info[0]}.{sys.version_info[1]}"
    with pytest.raises(SystemExit, match="--python no-such-python: cannot run it"):
        run.venv_for("no-such-python")
    calls: list[tuple[str, str | None, Path | None]] = []

    def ensure(profile: str, base: str | None = None, constraint: Path | None = None) -> Path:
        calls.append((profile, base, constraint))
        return Path(profile)

    monkeypatch.setattr(run, "ensure_environment", ensure)
    monkeypatch.setattr(run, "run_in_venv", lambda python, args: 0)
    pins = REPO / ".ci" / "jax-next.txt"
    assert run.main(["test", "--no-torch", "--python", sys.executable, "--constraint", str(pins), "tests/cli"]) == 0
    assert calls == [("test-no-torch", sys.executable, pins)]
    pinned = [line.removeprefix("jax==") for line in pins.read_text().splitlines() if line.startswith("jax==")]
    assert len(pinned) == 1 and f"jax {pinned[0]}" in (REPO / "docs" / "getting-started.md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        run.main(["test", "--constraint", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2 and len(calls) == 1
    packages = run.workspace_packages()
    other = tmp_path / "other.txt"
    other.write_text("jax==0.0.0\n")
    here = Path(sys.prefix)  # the venv running this (CI's second run has no .venv)
    assert run.install_hash("test", packages, here, pins) != run.install_hash("test", packages, here, other)


@pytest.mark.slow
def test_triton_group_is_marked_and_the_rest_collects_without_it() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", "triton",
                           "tests/triton", "tests/cli/test_widths.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/triton/") for line in collected)


def test_run_py_test_spreads_over_the_cores_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_py()
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    assert run.spread(["tests/cli", "-x"]) == ["-n", "2", "--dist", "loadgroup"]
    monkeypatch.setattr(run.os, "cpu_count", lambda: 64)
    assert run.spread([]) == ["-n", "4", "--dist", "loadgroup"]
    for chosen in (["-n", "1"], ["-n3"], ["--numprocesses=2"], ["-p", "no:xdist"]):
        assert run.spread(chosen) == []
    monkeypatch.setattr(run.os, "cpu_count", lambda: 1)
    assert run.spread([]) == []
