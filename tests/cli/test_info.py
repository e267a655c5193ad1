"""``jaxattn info``: what a bug report needs (versions, where each plugin comes from), what it
says with no backend installed, and ``--check``, which imports what plain ``info`` must not."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any, ClassVar

import pytest

import jaxattn
from jaxattn import AttentionImpl
from jaxattn.cli import main
from jaxattn.discovery.plugins import isolated_registry, registry
from jaxattn.discovery.registry import ImplRef, Provider

KERNEL_MODULES = ("triton", "jax_triton", "torch", "jax.experimental.pallas")


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["info", *args])
    return code, capsys.readouterr().out


@pytest.fixture
def empty_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Only the core: no plugin, nothing registered (``pip install jaxattn`` alone)."""
    for var in ("JAXATTN_IMPL", "JAXATTN_PLUGINS", "JAXATTN_DISABLE_PLUGINS", "JAXATTN_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    with isolated_registry(discover=False):
        yield


@pytest.mark.usefixtures("empty_registry")
def test_info_with_only_the_core_says_nothing_can_run_and_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _info(capsys, "--plain")
    assert code == 0
    platform = jaxattn.detect_device().platform
    auto = next(line for line in out.splitlines() if line.startswith("auto picks:"))
    assert "vanilla" not in auto  # the core names no backend of its own
    assert "nothing can run attention here" in out and f"pip install 'jaxattn[{platform}]'" in out
    code, out = _info(capsys, "--json")
    assert json.loads(out)["default"]["impl"] is None


@pytest.mark.usefixtures("empty_registry")
def test_get_optimal_config_raises_when_no_backend_is_installed() -> None:
    with pytest.raises(jaxattn.UnsupportedError, match=r"jaxattn\[cpu\]"):
        jaxattn.get_optimal_config()


class _FallsBackWithoutATarget(AttentionImpl):
    """Says it falls back for every call, but names no impl to fall back on."""

    @classmethod
    def get_impl_name(cls) -> str:
        return "falls_back"

    def fallback_reasons(self, problem: Any) -> list[str]:
        return ["always"]


@pytest.mark.usefixtures("empty_registry")
def test_a_fallback_goes_only_to_a_declared_fallback_impl() -> None:
    import jax

    jaxattn.register_impl(_FallsBackWithoutATarget)
    q = jax.numpy.ones((1, 8, 2, 16))
    # Before: the core handed such calls to "vanilla" by name, installed or not.
    with pytest.raises(jaxattn.JaxattnError, match="declares no fallback_impl"):
        jaxattn.attention(q, q, q, impl="falls_back")


def test_info_json_names_every_library_and_each_plugins_origin(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _info(capsys, "--json")
    info = json.loads(out)
    assert code == 0
    for name in ("jax", "jaxlib", "numpy", "pluggy"):
        assert info["libraries"][name] == metadata.version(name)
    for optional in ("triton", "torch", "flax", "jax-triton", "libtpu"):
        expected = metadata.version(optional) if _installed(optional) else None
        assert info["libraries"].get(optional) == expected, optional
    assert isinstance(info["cuda"], dict)  # CUDA runtime/driver and cuDNN as jax sees them (empty on CPUs)
    vanilla = next(p for p in info["plugins"] if p["name"] == "vanilla")
    assert vanilla["distribution"] == "jaxattn-vanilla" and vanilla["module"] == "jaxattn_vanilla.plugin"
    assert vanilla["path"].endswith("plugin.py")
    # The development environment installs the workspace editable (tests/packaging: wheels say "wheel").
    assert vanilla["install"] == "editable"
    # impls as fields, not "name (alias)" strings
    aliases = ["ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention", "page_attention"]
    assert {"name": "vanilla_paged", "aliases": aliases, "kind": "paged"} in vanilla["impls"]


@pytest.mark.slow
def test_plain_info_imports_no_kernel_library_and_check_does() -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from jaxattn.cli import main\n"
        f"kernels = {KERNEL_MODULES!r}\n"
        "def loaded(): return sorted(m for m in sys.modules if any(m == k or m.startswith(k + '.') for k in kernels))\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['info'])\n"
        "plain = loaded()\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['info', '--check'])\n"
        "print(json.dumps({'plain': plain, 'check': loaded()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["plain"] == [], "plain `jaxattn info` imported kernel libraries"
    if _installed("triton"):  # jaxattn-triton[gpu]'s kernel library, when installed
        assert "triton" in result["check"], "--check imports the installed kernel libraries"


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


class _Ghost(AttentionImpl):
    @classmethod
    def get_impl_name(cls) -> str:
        return "ghost"


def test_info_check_reports_an_impl_module_that_fails_to_import(capsys: pytest.CaptureFixture[str],
                                                                 empty_registry: None) -> None:
    ref = ImplRef("jaxattn_no_such_module.impl:Ghost", names=("ghost",), platforms=("cpu",))
    registry().add(Provider.from_source(ref, "ghostly", None, None), strict=False)
    code, out = _info(capsys, "--check", "--json")
    assert code == 1  # an import that fails is what --check exists to find
    rows = json.loads(out)["check"]
    (row,) = [r for r in rows if r["plugin"] == "ghostly"]
    assert row["status"] == "fails" and "jaxattn_no_such_module" in row["detail"]
    assert row["what"] == "impl ghost"


class _Plain(AttentionImpl):
    features: ClassVar = frozenset()

    @classmethod
    def get_impl_name(cls) -> str:
        return "plain_toy"


def test_info_check_passes_when_everything_imports(capsys: pytest.CaptureFixture[str], empty_registry: None) -> None:
    jaxattn.register_impl(_Plain)  # registered in code: nothing to import
    code, out = _info(capsys, "--check", "--plain")
    assert code == 0 and "Imports (--check)" in out


def _plain_info(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                collected: dict[str, Any] | None = None) -> str:
    from jaxattn.cli import info as info_cli

    monkeypatch.setenv("COLUMNS", "80")
    if collected is not None:
        monkeypatch.setattr(info_cli, "collect", lambda: collected)
    assert main(["info", "--plain"]) == 0
    return capsys.readouterr().out


def test_info_fits_80_columns_even_with_long_paths(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxattn.cli import info as info_cli

    out = _plain_info(capsys, monkeypatch)
    assert all(len(line) <= 80 for line in out.splitlines()), [line for line in out.splitlines() if len(line) > 80]
    # The same report from a deep install: every path is one word, so wrapping at spaces cannot
    # help; the report shortens it, and the JSON keeps it whole.
    deep = "/opt/" + "a_rather_long_folder_name/" * 6
    collected = info_cli.collect()
    collected["executable"] = deep + "bin/python"
    for plugin in collected["plugins"]:
        plugin["path"] = deep + f"src/{plugin['module'] or 'x'}/plugin.py"
    out = _plain_info(capsys, monkeypatch, collected)
    wide = [line for line in out.splitlines() if len(line) > 80]
    assert not wide, wide
    assert "..." in out and "plugin.py" in out  # elided in the middle, the file's name kept


def test_short_path_is_relative_to_site_packages_or_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import site

    from jaxattn.cli.info import short_path

    sites = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    sites.mkdir(parents=True)
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(sites)])
    assert short_path(str(sites / "jaxattn_triton" / "plugin.py")) == "site-packages/jaxattn_triton/plugin.py"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert short_path(str(tmp_path / "home" / "src" / "plugin.py")) == "home/src/plugin.py"  # under the cwd first
    monkeypatch.chdir(sites)
    assert short_path(str(tmp_path / "home" / "src" / "plugin.py")) == "~/src/plugin.py"
    long = "/" + "x" * 100 + "/plugin.py"
    assert len(short_path(long, 40)) == 40 and short_path(long, 40).endswith("/plugin.py")


def test_info_names_every_library_installed_or_not(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxattn.cli.info import LIBRARIES, NOT_INSTALLED

    names = [name for name, _, _ in LIBRARIES]
    for needed in ("jax", "jaxlib", "triton", "jax-triton", "libtpu", "cuDNN", "flax", "torch", "pluggy"):
        assert needed in names, needed
    out = _plain_info(capsys, monkeypatch)
    table = out.split("\nLibraries\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # past the header and rule
    shown = {line.split()[0]: line.split()[1:] for line in table if line and not line.startswith(" ")}
    assert list(shown) == names
    for name, dists, _ in LIBRARIES:
        version = next((v for d in dists if _installed(d) and (v := metadata.version(d))), None)
        want = version.split() if version else NOT_INSTALLED.split()
        assert shown[name][: len(want)] == want, (name, shown[name])
    assert main(["info", "--json"]) == 0
    libraries = json.loads(capsys.readouterr().out)["libraries"]
    assert set(libraries) == set(names)  # not installed: null, never left out
