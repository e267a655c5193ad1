"""docs/architecture.md names only what exists: every path, module and module attribute it
cites in backticks, and every core module its layer drawing shows; and the drawing shows every
top-level module of the core. Read from the source tree, importing nothing."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src" / "jaxattn"
DOC = ROOT / "docs" / "architecture.md"

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
PATH = re.compile(r"^[\w.<>-]+(?:/[\w.<>-]*)+$|^[\w-]+\.(?:py|toml|md|cfg|yml|yaml|json)$")


def text() -> str:
    return DOC.read_text(encoding="utf-8")


def code_spans(doc: str) -> list[str]:
    """The contents of every inline code span outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", doc, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def package_dir(top: str) -> Path | None:
    """The source folder of an importable top-level package of this repository."""
    if top == "jaxattn":
        return CORE
    if top.startswith("jaxattn_"):
        folder = ROOT / "plugins" / top.removeprefix("jaxattn_") / "src" / top
        return folder if folder.is_dir() else None
    return None


def module_file(parts: list[str]) -> Path | None:
    """``a.b.c``'s file (a module ``c.py`` or a package ``c/__init__.py``), or None."""
    base = package_dir(parts[0])
    if base is None:
        return None
    for part in parts[1:]:
        base = base / part
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@cache
def source_of(file: Path) -> str:
    # A package's attributes may live in any of its modules (re-exported by its __init__).
    files = sorted(file.parent.rglob("*.py")) if file.name == "__init__.py" else [file]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def resolves(dotted: str, *, core_relative: bool) -> bool:
    """Whether ``dotted`` names a module of this repository, optionally followed by names that
    its source defines or assigns (``jaxattn_ring.blocks.BlockKernel.residual_backward``)."""
    parts = dotted.split(".")
    if core_relative:
        parts = ["jaxattn", *parts]
    for cut in range(len(parts), 0, -1):
        file = module_file(parts[:cut])
        if file is not None:
            rest = parts[cut:]
            src = source_of(file)
            return all(re.search(rf"\b{re.escape(name)}\b", src) for name in rest)
    return False


def core_modules() -> set[str]:
    """Top-level core modules and packages, by name (private ones and ``__main__`` left out)."""
    names = {p.stem for p in CORE.glob("*.py")} | {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    return {n for n in names if not n.startswith("_")}


def drawing() -> dict[str, list[str]]:
    """The layer drawing (the first fenced block): layer name -> the module names it shows,
    descriptions in parentheses left out."""
    block = re.search(r"^```\n(.*?)^```", text(), re.S | re.M)
    assert block is not None, "docs/architecture.md lost its layer drawing"
    layers: dict[str, list[str]] = {}
    current = None
    for line in block.group(1).splitlines():
        head = re.match(r"^ ?(\d) (\w+)\s+(.*)$", line)
        if head:
            current, line = head.group(2), head.group(3)
        elif current is None or line.strip().startswith("|"):
            continue
        words = re.sub(r"\([^)]*\)", " ", re.sub(r"\([^)]*\)", " ", line))  # nested once
        layers.setdefault(current, []).extend(re.findall(r"(?<![\w.])([a-z_]+/?)(?![\w.(])", words))
    return layers


def test_every_cited_path_exists() -> None:
    missing = []
    for span in code_spans(text()):
        token = span.strip().rstrip(":,;")
        if not PATH.match(token) or "<" in token:
            continue
        # A path from the repository root, inside the core package (`cli/`, `testing/`), or of
        # a plugin package (`plugin.py`).
        in_plugins = any((src / token).exists() for src in ROOT.glob("plugins/*/src/jaxattn_*"))
        if not ((ROOT / token).exists() or (CORE / token).exists() or in_plugins):
            missing.append(token)
    missing = [t for t in missing if t not in plugin_table_names()]  # checked per distribution below
    assert not missing, f"docs/architecture.md cites paths that do not exist: {sorted(set(missing))}"


def plugin_table() -> list[tuple[str, str]]:
    """(distribution, modules cell) of each row of the plugin modules table."""
    section = text().split("## Plugin modules", 1)[-1].split("\n## ", 1)[0]
    rows, dist = [], ""
    for first, modules in re.findall(r"^\| ([^|]*) \| ([^|]*) \|", section, re.M):
        dist = first.strip().strip("`") or dist
        if dist.startswith("jaxattn-"):
            rows.append((dist, modules))
    return rows


def plugin_table_names() -> set[str]:
    return {name for _, cell in plugin_table() for name in re.findall(r"`([^`]+)`", cell)}


def test_the_plugin_module_table_names_real_modules() -> None:
    rows = plugin_table()
    assert rows, "docs/architecture.md lost its table of plugin modules"
    missing = []
    for dist, cell in rows:
        src = ROOT / "plugins" / dist.removeprefix("jaxattn-") / "src" / ("jaxattn_" + dist.removeprefix("jaxattn-"))
        for name in re.findall(r"`([^`]+)`", cell):
            stem = name.rstrip("/")
            if not (any(src.rglob(stem + ".py")) or any(p.is_dir() for p in src.rglob(stem))):
                missing.append(f"{dist}: {name}")
    assert not missing, f"docs/architecture.md's plugin table names modules that do not exist: {missing}"


def test_every_cited_module_exists() -> None:
    missing = []
    core = core_modules() | {"sharding", "testing", "cli"}
    for span in code_spans(text()):
        token = span.strip().rstrip(":,;")
        token = re.sub(r"\(.*$", "", token)  # `choose(problem, metadata)` -> `choose`
        if not DOTTED.match(token) or token.endswith((".py", ".md", ".toml")):
            continue
        top = token.split(".")[0]
        if top == "jaxattn" or top.startswith("jaxattn_"):
            ok = resolves(token, core_relative=False)
        elif top in core:  # `registry.Provider`, `sharding.wrap.sharded_forward`
            ok = resolves(token, core_relative=True)
        else:  # `Backend.plan`, `call.problem` of a variable: not a module path
            continue
        if not ok:
            missing.append(token)
    assert not missing, f"docs/architecture.md names modules or attributes that do not exist: {sorted(set(missing))}"


def test_the_core_module_table_names_real_modules() -> None:
    rows = re.findall(r"^\| (?:contract|discovery|selection|composition|tools) \| (.*?) \|", text(), re.M)
    assert rows, "docs/architecture.md lost its table of core modules"
    names = [name for cell in rows for name in re.findall(r"`([^`]+)`", cell)]
    missing = [name for name in names if module_file(["jaxattn", *name.rstrip("/").split(".")]) is None]
    assert not missing, f"docs/architecture.md's module table names modules that do not exist: {missing}"


def test_the_drawing_shows_every_core_module_and_only_those() -> None:
    shown = {name.rstrip("/"): name for names in drawing().values() for name in names}
    modules = core_modules()
    folders = {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    wrong = sorted(n for n in shown if n not in modules)
    assert not wrong, f"the layer drawing shows modules the core does not have: {wrong}"
    drawn_as = sorted(n for n, raw in shown.items() if raw.endswith("/") != (n in folders))
    assert not drawn_as, f"the drawing marks packages with '/' and only packages: {drawn_as}"
    absent = sorted(modules - set(shown))
    assert not absent, f"the layer drawing omits core modules: {absent}"


def test_the_checks_can_fail() -> None:
    assert not resolves("jaxattn.no_such_module", core_relative=False)
    assert not resolves("discovery.registry.NoSuchName", core_relative=True)
    assert resolves("discovery.registry.Provider", core_relative=True)
    assert not PATH.match("Backend.plan") and PATH.match("tests/architecture/test_layers.py")
