"""Fresh virtual environments that install this repository's packages as users get them.

Wheels are built from the checkout into a wheelhouse (no build isolation: hatchling is a
test dependency, so no network is needed). Our distributions are then pip-installed from
that wheelhouse alone (``--no-index``) into brand-new venvs, so real entry points, extras and
dependency metadata are what gets tested, never the editable checkout.

Third-party dependencies (jax, numpy, pluggy, ...) would cost a download and a bytecode
compilation per venv, so they live in one shared *base* venv per test session, made by uv
(from its cache when warm, pinned to the versions running the tests). Each fresh venv sees
the base through a ``.pth`` file, the way ``--system-site-packages`` exposes a system
Python: the base holds no jaxattn distribution, so nothing of ours leaks in.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
TEST_PACKAGES = tuple(REPO / "tests" / name for name in ("example_plugin", "seed_plugin", "broken_plugin"))

# Variables of the calling environment that would leak into, or reconfigure, the fresh one.
# (Bytecode is written: each fresh venv compiles jax once instead of on every import.)
_SCRUB = re.compile(r"^(JAXATTN_|PYTHON(PATH|HOME|STARTUP|DONTWRITEBYTECODE)$|VIRTUAL_ENV$|UV_|PIP_)")


def workspace_packages() -> list[Path]:
    plugins = sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))
    return [REPO / "core", *plugins]


def _uv() -> str:
    from uv import find_uv_bin  # the uv wheel ships its binary and this locator

    return str(find_uv_bin())


def run_py() -> ModuleType:
    """The checkout's ``run.py`` as a module: the one place wheels are built (``run.py wheels``)."""
    spec = importlib.util.spec_from_file_location("jaxattn_run_py", REPO / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_wheelhouse(target: Path, packages: Iterable[Path]) -> list[Path]:
    """Build one wheel per package into ``target`` as ``python3 run.py wheels`` does, with the
    running interpreter's hatchling (no build isolation: no download)."""
    try:
        wheels: list[Path] = run_py().build_wheels(sys.executable, target, list(packages), isolation=False)
    except SystemExit as err:
        raise AssertionError(str(err)) from None
    return wheels


def write_constraints(path: Path, exclude_prefix: str = "jaxattn") -> Path:
    """Pin every installed third-party distribution to the version running these tests."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and not name.lower().replace("_", "-").startswith(exclude_prefix):
            pins[name.lower()] = dist.version
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    return path


def third_party_requirements(wheels: Iterable[Path], ours: str = "jaxattn") -> list[str]:
    """Third-party dependencies of ``wheels``: unconditional ones, plus those behind a
    plugin's own extras (kernel libraries such as triton for ``jaxattn-triton[gpu]``).

    JAX's accelerator runtimes (``jax[cuda12]``, ``jax[tpu]``) and whatever the core's
    extras add besides our own plugins (flax, rich) are never needed here and left out, as is
    jaxattn-flax's Flax (the flax extra's distribution; no install target here brings it).
    """
    found: set[str] = set()
    for wheel in wheels:
        if wheel.name.startswith(f"{ours}_flax-"):
            continue
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(name).decode()
        is_core = wheel.name.startswith(f"{ours}-")
        for line in text.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.name.lower().startswith(ours):
                continue
            behind_extra = requirement.marker is not None and "extra" in str(requirement.marker)
            if behind_extra and (is_core or requirement.name.lower() == "jax"):
                continue
            requirement.marker = None
            found.add(str(requirement))
    return sorted(found)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _SCRUB.match(k)}
    # CPU only: these tests are about packaging, and a GPU probe only adds noise and time.
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra or {})
    return env


@dataclasses.dataclass(frozen=True)
class Venv:
    """A fresh environment; ``run`` executes its Python, ``script`` one of its console scripts."""

    path: Path

    @property
    def bin(self) -> Path:
        return self.path / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / ("python.exe" if os.name == "nt" else "python")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = clean_env(extra)
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = str(self.bin) + os.pathsep + env.get("PATH", "")
        return env

    def run(self, *args: str, env: Mapping[str, str] | None = None,
            check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._exec([str(self.python), *args], env, check, timeout)

    def script(self, name: str, *args: str, env: Mapping[str, str] | None = None,
               check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._exec([str(self.bin / name), *args], env, check, timeout)

    def _exec(self, command: Sequence[str], env: Mapping[str, str] | None, check: bool,
              timeout: float) -> subprocess.CompletedProcess[str]:
        # A neutral working directory: the checkout's own sources must not be importable.
        result = subprocess.run(command, env=self.env(env), cwd=self.path, capture_output=True,
                                text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(command)} exited with {result.returncode}\n"
                f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
        return result

    def distributions(self) -> dict[str, str]:
        """Installed distribution name -> version, as the venv itself reports them."""
        code = ("import importlib.metadata as m, json; "
                "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        return {str(k): str(v) for k, v in json.loads(self.run("-c", code).stdout).items()}


def create_base(path: Path, requirements: Sequence[str], constraints: Path) -> Path:
    """The shared dependency layer; returns its site-packages directory."""
    uv = _uv()
    env = clean_env()
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(path)],
                   check=True, env=env, capture_output=True, text=True)
    python = Venv(path).python
    install = [uv, "pip", "install", "--quiet", "--python", str(python),
               "--constraint", str(constraints), *requirements]
    # Offline first: with a warm uv cache this needs no network at all.
    done = subprocess.run([*install, "--offline"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"installing the base dependencies {requirements} failed:\n{done.stderr}")
    # Import jax once, so its bytecode is compiled here and shared by every fresh venv.
    subprocess.run([str(python), "-c", "import jax, numpy, pluggy"], check=True, env=env)
    return _site_packages(python)


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                               text=True).stdout.strip())


def create_venv(path: Path, wheelhouse: Path, base: Path, *requirements: str) -> Venv:
    """A new venv at ``path`` with ``requirements`` installed from ``wheelhouse`` only."""
    subprocess.run([_uv(), "venv", "--quiet", "--python", sys.executable, str(path)],
                   check=True, env=clean_env(), capture_output=True, text=True)
    venv = Venv(path)
    (_site_packages(venv.python) / "_jaxattn_test_base.pth").write_text(f"{base}\n")
    # This pip runs under the venv's interpreter (--python), so it sees the base's
    # distributions as installed and --no-index resolves only our packages and their
    # extras, from the wheelhouse. The machine's pip configuration is left out.
    command = [sys.executable, "-m", "pip", "--python", str(venv.python), "install", "--quiet",
               "--no-index", "--disable-pip-version-check", "--find-links", str(wheelhouse),
               *requirements]
    done = subprocess.run(command, env=clean_env({"PIP_CONFIG_FILE": os.devnull}),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"pip install {' '.join(requirements)} failed:\n{done.stdout}\n{done.stderr}")
    return venv
