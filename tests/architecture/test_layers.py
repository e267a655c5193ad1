"""The core reads top-down: each module imports only from its own layer or below, and nothing
imports in a circle, in the core or in any plugin (docs/architecture.md draws the layers).

The graph counts every ``import`` statement of a package's own modules: at module level, inside
functions and under ``TYPE_CHECKING``. So a cycle cannot hide behind an import placed in a
function, and a type-only import from a higher layer is still an upward dependency. Imports of
other packages (jax, kernel libraries, the core from a plugin) are not edges here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src" / "jaxattn"

#: The core's layers, bottom to top. A module is in the layer of the longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The SDK (what a plugin imports: jaxattn.backend) is the contract, with the errors and the
    # mask programs users build.
    ("contract", ("jaxattn.backend", "jaxattn.errors", "jaxattn.masks")),
    ("discovery", ("jaxattn.discovery",)),
    ("selection", ("jaxattn.selection",)),
    ("composition", ("jaxattn.api", "jaxattn.sharding")),
    ("tools", ("jaxattn.cli", "jaxattn.flax", "jaxattn.testing", "jaxattn.__main__")),
)
# The package itself and the SDK (``jaxattn.backend``) only map public names to modules, lazily
# (module __getattr__); no core module imports either.
UNLAYERED = ("jaxattn", "jaxattn.backend")


def modules_of(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under a ``src`` package folder."""
    out: dict[str, Path] = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module of the same package set, line) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            # `from pkg import mod` imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target, node.lineno


def graph_of(src: Path) -> dict[str, set[str]]:
    mods = modules_of(src)
    known = set(mods)
    return {m: {t for t, _ in imports_of(m, p, known)} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


PLUGIN_SRCS = sorted(p for p in (ROOT / "plugins").glob("*/src/jaxattn_*") if p.is_dir())


def test_every_core_module_has_a_layer() -> None:
    unlayered = [m for m in modules_of(CORE) if m not in UNLAYERED and layer_of(m) is None]
    assert not unlayered, f"give these modules a layer in LAYERS (and docs/architecture.md): {unlayered}"


def test_core_imports_only_downwards() -> None:
    mods = modules_of(CORE)
    known = set(mods)
    upward = []
    for module, path in mods.items():
        if module in UNLAYERED:
            continue
        mine = layer_of(module)
        assert mine is not None
        for target, line in imports_of(module, path, known):
            theirs = layer_of(target)
            if target not in UNLAYERED and theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[mine][0]}) imports "
                              f"{target} ({LAYERS[theirs][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_core_modules_do_not_import_the_package_root() -> None:
    """``import jaxattn`` (or the SDK, ``jaxattn.backend``) inside the core would reach every
    layer through the lazy exports."""
    mods = modules_of(CORE)
    known = set(mods)
    offenders = [f"{p.relative_to(ROOT)}:{line}: {t}" for m, p in mods.items() if layer_of(m) is not None
                 for t, line in imports_of(m, p, known)
                 if t == "jaxattn.backend" or (t == "jaxattn" and LAYERS[layer_of(m) or 0][0] != "tools")]
    assert not offenders, f"in the core, import modules, not the package or the SDK: {offenders}"


def test_the_core_imports_no_plugin() -> None:
    """The core names no plugin distribution: selection takes tuning records through the hook
    of ``jaxattn.selection.tuning``; the tuning cache, its reading and writing, are jaxattn-bench's."""
    offenders = []
    for path in modules_of(CORE).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                          if name.split(".")[0].startswith("jaxattn_")]
    assert not offenders, f"the core imports plugins: {offenders}"


@pytest.mark.parametrize("src", [CORE, *PLUGIN_SRCS], ids=lambda p: p.name)
def test_no_import_cycles(src: Path) -> None:
    found = cycles(graph_of(src))
    assert not found, f"import cycles in {src.name}: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The check itself: a function-level import that closes a circle is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = graph_of(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.c"] == {"pkg.a"}
