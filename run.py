#!/usr/bin/env python3
"""Bootstrap for a fresh machine: only Python 3.11+ and pip are needed.

    python3 run.py demo      # attention through the registry: which backend ran, and why
    python3 run.py test      # the whole test suite (extra arguments go to pytest)
    python3 run.py install   # only create/refresh the environment (add --test for test deps)

It creates ``.venv`` next to this file, installs every workspace package (``core`` and
``plugins/*``) in editable mode plus the dependency groups of the root ``pyproject.toml``,
and runs the command inside it. The install is skipped when nothing it depends on changed
(a hash of the pyprojects, this script and the venv's Python is kept in the venv), so a
second run starts at once. Standard library only: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / "jaxattn-install.json"
MIN_PYTHON = (3, 11)

# Dependency groups (root pyproject) each profile installs besides the workspace packages.
PROFILES: dict[str, tuple[str, ...]] = {
    "demo": (),
    "test": ("test", "kernels-cpu"),
}


def venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


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


def install_hash(profile: str, packages: list[Path]) -> str:
    """Everything that changes what gets installed; source edits do not (editable installs)."""
    digest = hashlib.sha256()
    digest.update(profile.encode())
    # pyvenv.cfg names the venv's interpreter and its version: a new Python reinstalls.
    for path in [VENV / "pyvenv.cfg", ROOT / "pyproject.toml", Path(__file__).resolve()] + [
        p / "pyproject.toml" for p in packages
    ]:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def read_stamp() -> dict[str, str]:
    try:
        data = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def ensure_environment(profile: str) -> Path:
    """Create .venv if needed and install ``profile`` unless the stamp says it is current."""
    python = venv_python()
    if not python.exists():
        print(f"run.py: creating {VENV.relative_to(ROOT)} with Python {sys.version.split()[0]}",
              flush=True)
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(f"run.py: could not create {VENV} ({err}); on Debian or Ubuntu, "
                             "install the python3-venv package") from err

    packages = workspace_packages()
    wanted = install_hash(profile, packages)
    stamp = read_stamp()
    # The test profile includes the demo's packages, so a current test install serves both.
    if stamp.get(profile) == wanted or (profile == "demo" and stamp.get("test") == (
        install_hash("test", packages)
    )):
        return python

    requirements = requirements_for(profile)
    names = ", ".join(p.relative_to(ROOT).as_posix() for p in packages)
    print(f"run.py: installing {names} (editable)"
          + (f" and {len(requirements)} {profile} requirements" if requirements else "")
          + "; the first time this downloads jax and friends and takes a few minutes",
          flush=True)
    editable = [arg for p in packages for arg in ("-e", str(p))]
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check",
               "--quiet", *editable, *requirements]
    # Drop the stamp first: an interrupted install must not look complete next time.
    STAMP.unlink(missing_ok=True)
    result = subprocess.run(command, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SystemExit(f"run.py: installation failed (pip exit code {result.returncode}); "
                         f"command: {' '.join(command)}")
    stamp = {k: v for k, v in stamp.items() if k in PROFILES}
    stamp[profile] = wanted
    STAMP.write_text(json.dumps(stamp, indent=2))
    return python


def run_in_venv(python: Path, args: list[str]) -> int:
    env = dict(os.environ)
    # Tools installed in the venv (the `jaxattn` script, uv, pytest) come first on PATH,
    # as if the venv were activated; subprocesses started by tests find them there.
    env["PATH"] = str(python.parent) + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONHOME", None)
    return subprocess.run([str(python), *args], cwd=ROOT, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        raise SystemExit(f"run.py needs Python {wanted}+; this is {sys.version.split()[0]}")
    parser = argparse.ArgumentParser(
        prog="run.py", description="Set up .venv and run the jaxattn demo or test suite.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="compute attention through the registry (python -m jaxattn.demo)")
    commands.add_parser("test", help="run the whole test suite (extra arguments go to pytest)")
    install = commands.add_parser("install", help="only create or refresh .venv")
    install.add_argument("--test", action="store_true", help="include the test dependencies")
    args, rest = parser.parse_known_args(argv)

    if args.command == "install":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        ensure_environment("test" if args.test else "demo")
        return 0
    if args.command == "demo":
        return run_in_venv(ensure_environment("demo"), ["-m", "jaxattn.demo", *rest])
    return run_in_venv(ensure_environment("test"), ["-m", "pytest", *rest])


if __name__ == "__main__":
    sys.exit(main())
