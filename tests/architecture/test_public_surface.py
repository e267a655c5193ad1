"""A distribution uses only the public names of another: the core's SDK, never its insides.

From the core a plugin imports the user API (``jaxattn``'s ``__all__``), the SDK
(``jaxattn.backend``'s ``__all__``), what command plugins use (``jaxattn.cli``'s ``__all__``)
and the conformance kit (``jaxattn.testing`` and its public modules): nothing else, so the core's
modules can move and change behind those names. From another plugin it imports no underscore
module or name. Every ``import`` counts (module level, in functions, under ``TYPE_CHECKING``),
and so does an attribute read off the package (``jaxattn.selection.tuning.reload()``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src" / "jaxattn"

#: The core's public modules: those whose ``__all__`` is the surface, and the kit.
SURFACES = ("jaxattn", "jaxattn.backend", "jaxattn.cli")
KIT = "jaxattn.testing"


def _all_of(path: Path) -> set[str]:
    """The literal ``__all__`` of a module file."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return set(ast.literal_eval(node.value))  # type: ignore[union-attr]
    raise AssertionError(f"{path} has no literal __all__")


def public_names() -> dict[str, set[str]]:
    return {name: _all_of(CORE.parent / name.replace(".", "/") / "__init__.py") for name in SURFACES}


def packages() -> dict[str, Path]:
    """Import package -> its folder, for the core and every distribution in the repository."""
    found = {"jaxattn": CORE}
    for src in [*ROOT.glob("plugins/*/src/jaxattn_*"), *ROOT.glob("tests/*/src/jaxattn_*")]:
        if src.is_dir():
            found[src.name] = src
    return found


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def violations(package: str, folder: Path, public: dict[str, set[str]]) -> Iterator[str]:
    """Every use in ``package`` of a name another package does not make public."""
    for path in sorted(folder.rglob("*.py")):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
        tree = ast.parse(path.read_text(), str(path))
        for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            uses: list[tuple[str, str | None]] = []  # (module, name imported from it)
            if isinstance(node, ast.Import):
                uses = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                uses = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jaxattn":
                uses = [("jaxattn", node.attr)]
            for module, name in uses:
                top = module.split(".")[0]
                if top == package or not top.startswith("jaxattn"):
                    continue
                line = f"{where}:{node.lineno}: {module}{'.' + name if name else ''}"
                if top != "jaxattn":  # another plugin: anything without an underscore
                    if _private(module) or (name is not None and name.startswith("_")):
                        yield line
                    continue
                if module == KIT or module.startswith(KIT + "."):
                    if _private(module) or (name is not None and name.startswith("_")):
                        yield line
                    continue
                exported = public.get(module, set()) | {s.rpartition(".")[2] for s in (*SURFACES, KIT)
                                                        if s.rpartition(".")[0] == module}
                if module not in public or (name is not None and name not in exported):
                    yield line


def test_no_distribution_uses_private_names_of_another() -> None:
    public = public_names()
    found = [v for package, folder in packages().items() if package != "jaxattn"
             for v in violations(package, folder, public)]
    assert not found, ("import only jaxattn, jaxattn.backend, jaxattn.cli and jaxattn.testing's public names "
                       "(and no underscore name of another plugin):\n" + "\n".join(found))


def test_every_public_name_resolves() -> None:
    """What the surfaces promise exists (their exports are lazy: a typo would show only on use)."""
    import importlib

    for module, names in public_names().items():
        mod = importlib.import_module(module)
        missing = [n for n in sorted(names) if n != "__version__" and not hasattr(mod, n)]
        assert not missing, f"{module} lists names it does not have: {missing}"


def test_the_check_sees_private_uses(tmp_path: Path) -> None:
    pkg = tmp_path / "jaxattn_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import jaxattn\n"
        "from jaxattn.backend import AttentionImpl\n"           # public
        "from jaxattn.discovery.registry import ImplRef\n"                # a core module outside the surface
        "from jaxattn.cli import _args\n"                       # an underscore name
        "from jaxattn_other._kernels import run\n"              # another plugin's private module
        "def f():\n"
        "    from jaxattn.selection.dispatch import choose\n"             # in a function: counts too
        "    return jaxattn.selection.tuning.reload()\n"                  # an attribute off the package
    )
    found = list(violations("jaxattn_fake", pkg, public_names()))
    assert [f.split(": ", 1)[1] for f in found] == [
        "jaxattn.discovery.registry.ImplRef", "jaxattn.cli._args", "jaxattn_other._kernels.run",
        "jaxattn.selection.dispatch.choose", "jaxattn.selection"], found


@pytest.mark.parametrize("module", SURFACES)
def test_surfaces_import_no_jax(module: str) -> None:
    """The surfaces are lazy: importing one costs no jax (a plugin's registration module imports
    ``jaxattn.backend`` during discovery)."""
    import subprocess
    import sys

    code = f"import sys, {module}; assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_basic_backend_needs_at_most_eight_names() -> None:
    """The example plugin (docs/write-a-backend.md builds it) is a basic backend: the names it
    takes from the core, plus the hook and the method it defines, are the eight the page lists."""
    used: set[str] = set()
    for path in sorted((ROOT / "tests" / "example_plugin" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxattn":
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.FunctionDef) and node.name in ("jaxattn_register_impls", "forward"):
                used.add(node.name)
    assert len(used) <= 8, sorted(used)
    page = (ROOT / "docs" / "write-a-backend.md").read_text()
    table = page.split("| name | what it is |", 1)[1].split("\n\n", 1)[0]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == used, (sorted(listed), sorted(used))
