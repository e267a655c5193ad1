#!/usr/bin/env python3
"""Bootstrap for a fresh machine: only Python 3.11+ and pip are needed.

    python3 run.py demo              # attention through the registry: which backend ran, and why
    python3 run.py test              # the whole test suite (extra arguments go to pytest)
    python3 run.py test --no-torch   # all but the Triton-interpreter tests, without torch and triton
    python3 run.py install           # only create/refresh the environment (add --test for test deps)
    python3 run.py test --no-torch --python python3.12 --constraint .ci/jax-next.txt
                                     # the suite in .venv-py3.12, on another Python and its jax
    python3 run.py wheels            # every package's wheel into wheelhouse/, to install from:
                                     #   pip install --find-links wheelhouse "jaxattn[cpu]"

It creates ``.venv`` next to this file, installs every workspace package (``core`` and
``plugins/*``) in editable mode plus the dependency groups of the root ``pyproject.toml``,
and runs the command inside it. The install is skipped when nothing it depends on changed
(a hash of the pyprojects, this script and the venv's Python is kept in the venv), so a
second run starts at once. Standard library only: this runs before anything is installed.

``--python`` runs the same in ``.venv-pyX.Y``, made with that interpreter: jax 0.11 and newer
need Python 3.12, so this is how one checkout tests two jax releases (CI runs the newest
release that ``.ci/jax-next.txt`` pins, on Python 3.12, beside the default environment).
``--constraint`` passes a pip constraints file, hashed with the rest.

torch is needed only by the Triton-interpreter tests (pytest marker ``triton``), which
launch the kernels on torch CPU tensors. Where pip would resolve the pinned torch to a CUDA
build (several GB of nvidia wheels: Linux with only PyPI in sight), the CPU build comes from
PyTorch's CPU wheel index instead; where the pinned version resolves without nvidia wheels
(macOS, or a machine whose pip already finds a CPU build), nothing changes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP_NAME = "jaxattn-install.json"
MIN_PYTHON = (3, 11)

WHEELHOUSE = ROOT / "wheelhouse"

# Dependency groups (root pyproject) each profile installs besides the workspace packages.
PROFILES: dict[str, tuple[str, ...]] = {
    "demo": (),
    "test": ("test", "kernels-cpu"),
    "test-no-torch": ("test",),
}
#: What ``test --no-torch`` leaves out: the tests of this marker need torch and triton.
NO_TORCH_MARKER = "triton"
#: PyTorch's index of CPU-only wheels (Linux and Windows; ``+cpu`` local versions).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def venv_python(where: Path = VENV) -> Path:
    if os.name == "nt":
        return where / "Scripts" / "python.exe"
    return where / "bin" / "python"


def venv_for(python: str | None) -> Path:
    """``.venv``, or ``.venv-pyX.Y`` for another interpreter (asked for its version)."""
    if python is None:
        return VENV
    try:
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, check=False, timeout=60)
    except OSError as err:
        raise SystemExit(f"run.py: --python {python}: cannot run it ({err})") from err
    version = done.stdout.strip()
    if done.returncode != 0 or not re.fullmatch(r"\d+\.\d+", version) or tuple(
            int(x) for x in version.split(".")) < MIN_PYTHON:
        said = version or done.stderr.strip()
        raise SystemExit(f"run.py: --python {python}: needs Python {'.'.join(map(str, MIN_PYTHON))}+, "
                         f"it says {said!r}")
    return ROOT / f".venv-py{version}"


def workspace_packages() -> list[Path]:
    """The installable packages of the workspace: the core first, then every plugin."""
    plugins = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))
    return [ROOT / "core", *plugins]


def dependency_group(groups: dict[str, list[object]], name: str) -> list[str]:
    """Expand one PEP 735 dependency group, following ``include-group`` entries."""
    requirements: list[str] = []
    for entry in groups[name]:
        if isinstance(entry, str):
            requirements.append(entry)
        elif isinstance(entry, dict) and "include-group" in entry:
            requirements.extend(dependency_group(groups, str(entry["include-group"])))
        else:
            raise SystemExit(f"run.py: cannot read dependency group {name!r} entry {entry!r}")
    return requirements


def requirements_for(profile: str) -> list[str]:
    import tomllib  # here, so that Python < 3.11 gets main()'s message instead of an ImportError

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    requirements: list[str] = []
    for group in PROFILES[profile]:
        requirements.extend(dependency_group(groups, group))
    return requirements


def cpu_torch(requirements: Sequence[str], report: dict[str, object]) -> tuple[list[str], list[str]]:
    """``(requirements, extra pip arguments)`` that get torch's CPU build.

    ``report`` is pip's ``--dry-run --report`` for ``requirements``: when it would install
    nvidia wheels (the CUDA build of torch), the pinned ``torch==V`` becomes ``torch==V+cpu``
    from PyTorch's CPU index; otherwise the requirements stand as they are.
    """
    installs = report.get("install")
    names = [str(item.get("metadata", {}).get("name", "")).lower()
             for item in (installs if isinstance(installs, list) else [])]
    if not any(name.startswith("nvidia-") for name in names):
        return list(requirements), []
    pinned = [re.sub(r"^(torch==[0-9][0-9.]*)$", r"\1+cpu", r) for r in requirements]
    return pinned, ["--extra-index-url", TORCH_CPU_INDEX]


def torch_choice(python: Path, requirements: list[str]) -> tuple[list[str], list[str]]:
    """Ask pip (a dry run: metadata only) whether the requirements pull a CUDA torch."""
    if not any(r.startswith("torch") for r in requirements):
        return requirements, []
    done = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
                           "--dry-run", "--ignore-installed", "--report", "-",
                           *[r for r in requirements if r.startswith(("torch", "triton"))]],
                          capture_output=True, text=True, check=False)
    try:
        report = json.loads(done.stdout) if done.returncode == 0 else {}
    except ValueError:
        report = {}
    return cpu_torch(requirements, report)


def install_hash(profile: str, packages: list[Path], where: Path = VENV, constraint: Path | None = None) -> str:
    """Everything that changes what gets installed; source edits do not (editable installs)."""
    digest = hashlib.sha256()
    digest.update(profile.encode())
    # pyvenv.cfg names the venv's interpreter and its version: a new Python reinstalls.
    paths = [where / "pyvenv.cfg", ROOT / "pyproject.toml", Path(__file__).resolve()]
    for path in paths + [p / "pyproject.toml" for p in packages] + ([constraint] if constraint else []):
        # The name inside the checkout, so that a moved checkout keeps its stamp; a constraints
        # file may lie outside it.
        name = path.resolve()
        digest.update((name.relative_to(ROOT).as_posix() if name.is_relative_to(ROOT) else str(name)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def read_stamp(where: Path = VENV) -> dict[str, str]:
    try:
        data = json.loads((where / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def ensure_environment(profile: str, base: str | None = None, constraint: Path | None = None) -> Path:
    """Create the venv (``.venv``, or ``.venv-pyX.Y`` of the interpreter ``base``) if needed and
    install ``profile`` (under pip's ``constraint`` file) unless the stamp says it is current."""
    where = venv_for(base)
    python = venv_python(where)
    if not python.exists():
        print(f"run.py: creating {where.relative_to(ROOT)} with "
              + (f"Python {sys.version.split()[0]}" if base is None else base), flush=True)
        try:
            if base is None:
                venv.EnvBuilder(with_pip=True, clear=True).create(where)
            else:
                subprocess.run([base, "-m", "venv", "--clear", str(where)], check=True)
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(f"run.py: could not create {where} ({err}); on Debian or Ubuntu, "
                             "install the python3-venv package") from err

    packages = workspace_packages()
    wanted = install_hash(profile, packages, where, constraint)
    stamp = read_stamp(where)
    # A current install of a profile with more groups serves this one (test serves demo).
    if stamp.get(profile) == wanted or any(
        set(PROFILES[profile]) <= set(groups) and stamp.get(other) == install_hash(other, packages, where, constraint)
        for other, groups in PROFILES.items() if other != profile
    ):
        return python

    requirements, index = torch_choice(python, requirements_for(profile))
    names = ", ".join(p.relative_to(ROOT).as_posix() for p in packages)
    print(f"run.py: installing {names} (editable)"
          + (f" and {len(requirements)} {profile} requirements" if requirements else "")
          + (f" (torch's CPU build from {TORCH_CPU_INDEX})" if index else "")
          + "; the first time this downloads " + ("jax, torch and triton (about 0.5 GB)" if "kernels-cpu" in
                                                   PROFILES[profile] else "jax and friends (about 0.15 GB)"),
          flush=True)
    editable = [arg for p in packages for arg in ("-e", str(p))]
    constraints = ["--constraint", str(constraint)] if constraint else []
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check",
               "--quiet", *index, *constraints, *editable, *requirements]
    # Drop the stamp first: an interrupted install must not look complete next time.
    (where / STAMP_NAME).unlink(missing_ok=True)
    result = subprocess.run(command, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"run.py: installation failed (pip exit code {result.returncode}); "
                         f"command: {' '.join(command)}")
    stamp = {k: v for k, v in stamp.items() if k in PROFILES}
    stamp[profile] = wanted
    (where / STAMP_NAME).write_text(json.dumps(stamp, indent=2))
    return python


def build_wheels(python: str, target: Path, packages: Sequence[Path] | None = None,
                 isolation: bool | None = None) -> list[Path]:
    """Build one wheel per package (default: every workspace package) into ``target`` with
    ``python -m pip wheel``; returns the wheels. Without build isolation when ``python``
    has hatchling (no download), else pip fetches it into an isolated build environment."""
    target.mkdir(parents=True, exist_ok=True)
    if isolation is None:
        isolation = importlib.util.find_spec("hatchling") is None or python != sys.executable
    command = [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
               *([] if isolation else ["--no-build-isolation"]), "--wheel-dir", str(target),
               *map(str, packages or workspace_packages())]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run.py: building wheels failed (pip exit code {done.returncode}):\n"
                         f"{done.stdout}{done.stderr}")
    return sorted(target.glob("*.whl"))


def wheels(target: Path) -> int:
    """``run.py wheels``: a fresh wheelhouse of every workspace package, and how to install from it."""
    shutil.rmtree(target, ignore_errors=True)
    built = build_wheels(sys.executable, target)
    where = target.relative_to(Path.cwd()) if target.is_relative_to(Path.cwd()) else target
    print("\n".join(f"built {w.name}" for w in built))
    print(f"install from it (pip finds jax and the other dependencies on the index):\n"
          f'  pip install --find-links {where} "jaxattn[cpu]"    # or [gpu], [tpu], [ring], plain jaxattn')
    return 0


def run_in_venv(python: Path, args: list[str]) -> int:
    env = dict(os.environ)
    # Tools installed in the venv (the `jaxattn` script, uv, pytest) come first on PATH,
    # as if the venv were activated; subprocesses started by tests find them there.
    env["PATH"] = str(python.parent) + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env.pop("PYTHONHOME", None)
    return subprocess.run([str(python), *args], cwd=ROOT, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        raise SystemExit(f"run.py needs Python {wanted}+; this is {sys.version.split()[0]}")
    parser = argparse.ArgumentParser(
        prog="run.py", description="Set up .venv and run the jaxattn demo or test suite.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="compute attention through the registry (jaxattn demo)")
    test = commands.add_parser("test", help="run the whole test suite (extra arguments go to pytest)")
    test.add_argument("--no-torch", action="store_true",
                      help=f"neither install torch and triton nor run the tests that need them (marker "
                           f"'{NO_TORCH_MARKER}': the Triton kernels in the interpreter)")
    install = commands.add_parser("install", help="only create or refresh .venv")
    install.add_argument("--test", action="store_true", help="include the test dependencies")
    for sub in (test, install):
        sub.add_argument("--python", metavar="PYTHON", help="another interpreter: its own .venv-pyX.Y")
        sub.add_argument("--constraint", metavar="FILE", type=Path, help="a pip constraints file for the install")
    build = commands.add_parser("wheels", help="build every package's wheel into wheelhouse/")
    build.add_argument("--out", type=Path, default=WHEELHOUSE, help="where (default: wheelhouse/)")
    args, rest = parser.parse_known_args(argv)

    if args.command in ("test", "install") and args.constraint is not None and not args.constraint.is_file():
        parser.error(f"--constraint {args.constraint}: no such file")
    if args.command == "install":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        ensure_environment("test" if args.test else "demo", args.python, args.constraint)
        return 0
    if args.command == "wheels":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return wheels(args.out.resolve())
    if args.command == "demo":
        return run_in_venv(ensure_environment("demo"), ["-m", "jaxattn", "demo", *rest])
    profile = "test-no-torch" if args.no_torch else "test"
    python = ensure_environment(profile, args.python, args.constraint)
    deselect = ["-m", f"not {NO_TORCH_MARKER}"] if args.no_torch else []
    return run_in_venv(python, ["-m", "pytest", *spread(rest), *deselect, *rest])


def spread(pytest_args: list[str]) -> list[str]:
    """pytest-xdist options that run the suite on every core (two at the most matter on the
    project's 2-core machines: compiling, not running, takes the time), unless the arguments
    choose for themselves (``-n``, ``--numprocesses``, ``-p no:xdist``). ``loadgroup`` keeps
    the tests that share fresh virtual environments in one process."""
    chosen = any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses="))
                 for a in pytest_args)
    cores = os.cpu_count() or 1
    return [] if chosen or cores < 2 else ["-n", str(min(cores, 4)), "--dist", "loadgroup"]


if __name__ == "__main__":
    sys.exit(main())
