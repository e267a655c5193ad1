"""``jaxattn info``: this host, every plugin (broken ones with their error), every impl."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import warnings
from importlib import metadata
from typing import Any

from ._output import Printer, Table, dump_json
from ._plugins import PluginSummary, impl_label, is_plugin_row, summarize_plugins

HELP = "show the device, versions, every plugin and implementation, and what is usable here"

# Settings that change what jaxattn discovers or picks; shown when set.
ENVIRONMENT = ("JAXATTN_IMPL", "JAXATTN_PLUGINS", "JAXATTN_DISABLE_PLUGINS",
               "JAXATTN_STRICT_PLUGINS", "JAX_PLATFORMS")


#: The libraries a report names, each with what needs it, installed or not: a CPU user sees why
#: the GPU backends are missing. Versions come from the distributions' metadata (nothing is
#: imported); a library that ships under several names is the first one installed.
LIBRARIES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("jax", ("jax",), "everything"),
    ("jaxlib", ("jaxlib",), "everything"),
    ("numpy", ("numpy",), "everything"),
    ("pluggy", ("pluggy",), "plugin discovery"),
    ("flax", ("flax",), "jaxattn-flax (NNX modules)"),
    ("torch", ("torch",), "the Triton interpreter (tests on a CPU)"),
    ("triton", ("triton",), "jaxattn-triton: flash_attn2, the paged kernels"),
    ("jax-triton", ("jax-triton",), "jaxattn-triton: flash_attn2, the paged kernels"),
    ("jax-cuda-plugin", ("jax-cuda13-plugin", "jax-cuda12-plugin"), "NVIDIA GPUs (jax[cuda12])"),
    ("cuDNN", ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"), "cudnn, mosaic_flash's backward"),
    ("libtpu", ("libtpu", "libtpu-nightly"), "TPUs: jaxattn-pallas, jaxattn-splash"),
)

#: What stands for a library that is not installed in the report (None in its JSON).
NOT_INSTALLED = "not installed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 on any plugin problem a call would otherwise meet (for CI): a "
                             "broken plugin, an ImplRef whose module is missing or fails to import or whose "
                             "declarations disagree with its class, a name clash, a built-in name taken without "
                             "overrides=. Imports every impl module to compare declarations (not the kernel "
                             "libraries they load lazily); each problem is printed to stderr")
    parser.add_argument("--check", action="store_true",
                        help="also import every plugin's impl modules and kernel libraries and report what fails "
                             "(slower: triton, torch... get imported); exit status 1 when one fails")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _libraries(cuda: dict[str, str]) -> dict[str, str | None]:
    """Every library of ``LIBRARIES``, by name: its version, or None when not installed. cuDNN's
    is the one jax's CUDA plugin loaded when it reports one (on an NVIDIA GPU)."""
    out = {name: next((v for d in dists if (v := _version(d))), None) for name, dists, _ in LIBRARIES}
    if cuda.get("cudnn"):
        out["cuDNN"] = cuda["cudnn"]
    return out


def short_path(path: str, width: int = 0) -> str:
    """``path`` as a report shows it: relative to the site-packages folder that holds it, else to
    the working directory, else with the home folder as ``~``; then, when ``width`` is given and
    it is still longer, its middle elided (the JSON keeps the whole path)."""
    import site

    full = os.path.abspath(path)
    roots = sorted((os.path.abspath(s) for s in (*site.getsitepackages(), site.getusersitepackages())
                    if os.path.basename(s) in ("site-packages", "dist-packages")), key=len, reverse=True)
    bases = [(r, os.path.basename(r)) for r in roots] + [(os.getcwd(), ""), (os.path.expanduser("~"), "~")]
    shown = next((os.path.join(label, os.path.relpath(full, base)) for base, label in bases
                  if base not in ("", os.sep) and full.startswith(os.path.abspath(base) + os.sep)), full)
    if width and len(shown) > width:
        keep = max(2, width - 3)
        shown = shown[: keep // 3] + "..." + shown[len(shown) - (keep - keep // 3):]
    return shown


def _plugin_summaries(rows: list[Any]) -> list[PluginSummary]:
    """Every plugin: those with impls (from the rows), then those that register none (jaxattn-bench
    adds commands only)."""
    from jaxattn.discovery.plugins import RUNTIME_PLUGIN, plugin_records

    summaries = summarize_plugins(rows)
    known = {s.name for s in summaries}
    return summaries + [PluginSummary(r.name, r.distribution, r.version, r.status, r.reason)
                        for r in plugin_records() if r.name not in known and r.name != RUNTIME_PLUGIN]


def collect() -> dict[str, Any]:
    import jaxattn

    # Discovery warns (once) about broken plugins; here they are part of the report instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = jaxattn.list_impls()
        device = jaxattn.detect_device()
        default: dict[str, Any] | None
        if not any(r.usable_here and r.kind == "dense" for r in rows if not is_plugin_row(r)):
            # The core has no backend of its own: say so, and which extra brings some.
            default = {"impl": None, "error": f"nothing can run attention here: no backend for {device.platform} "
                                              f"is installed (pip install 'jaxattn[{device.platform}]')"}
        else:
            try:
                best, dtype = jaxattn.get_optimal_config()
                default = {"impl": best, "dtype": str(getattr(dtype, "__name__", dtype))}
            except jaxattn.JaxattnError as err:
                default = {"impl": None, "error": " ".join(str(err).split())}
        paged = _paged_default((default or {}).get("dtype") or "float32")
    cuda = _cuda_versions() if device.platform == "gpu" else {}
    return {
        "jaxattn": jaxattn.__version__,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "os": platform.platform(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "libraries": _libraries(cuda),
        "cuda": cuda,
        "device": {"label": device.label, **device.to_dict()},
        "default": default,
        "paged_default": paged,
        "environment": {k: os.environ[k] for k in ENVIRONMENT if k in os.environ},
        "plugins": [{**p.to_dict(), **_origin(p.name)} for p in _plugin_summaries(rows)],
        "impls": [r.to_dict() for r in rows if not is_plugin_row(r)],
        "warnings": [str(w.message) for w in caught],
    }


def _cuda_versions() -> dict[str, str]:
    """The CUDA runtime, driver and cuDNN versions jax's CUDA plugin reports (empty without one)."""
    try:
        from jax._src.lib import cuda_versions  # private, but the one place jax exposes these
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    out = {}
    for key, getter in (("cuda runtime", "cuda_runtime_get_version"), ("cuda driver", "cuda_driver_get_version"),
                        ("cudnn", "cudnn_get_version")):
        try:
            number = int(getattr(cuda_versions, getter)())
        except Exception:  # an old plugin without the getter, or no driver: leave it out
            continue
        # CUDA encodes 1000*major + 10*minor; cuDNN 9 10000*major + 100*minor + patch.
        out[key] = (f"{number // 10000}.{number // 100 % 100}.{number % 100}" if key == "cudnn"
                    else f"{number // 1000}.{number // 10 % 100}")
    return out


def _origin(plugin: str) -> dict[str, Any]:
    """Where ``plugin`` was loaded from: its entry point's module and file, and whether its
    distribution is an editable install (pip's direct_url.json says so) or a wheel."""
    from ..discovery.plugins import ENTRY_POINT_GROUP

    ep = next((e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name.lower() == plugin), None)
    if ep is None:  # registered in code (jaxattn.register_impl), not by a distribution
        return {"module": None, "path": None, "install": "registered in code"}
    module = ep.value.partition(":")[0]
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None)
    install = "installed"
    dist = getattr(ep, "dist", None)
    if dist is not None:
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            direct = {}
        if direct.get("dir_info", {}).get("editable"):
            install = "editable"
        elif direct.get("url", "").endswith(".whl") or not direct:
            install = "wheel"
        else:
            install = "from " + str(direct.get("url"))
    return {"module": module, "path": path, "install": install}


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def check_plugins(plugins: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Import every plugin's impl modules and the third-party libraries its distribution
    requires (those behind its own extras too: the kernel libraries); one row per import."""
    from ..discovery.plugins import registry

    modules_of = _modules_by_distribution()
    rows: list[dict[str, str]] = []
    for plugin in plugins:
        name, dist = plugin["name"], plugin["distribution"]
        # (what, module): the impl modules first (an ImplRef names its module without importing it)
        wanted = [(f"impl {p.name}", p.source.target.partition(":")[0]) for p in registry().providers
                  if p.plugin == name and not isinstance(p.source, type)]
        for requirement in (metadata.requires(dist) or []) if dist else []:
            match = _REQUIREMENT.match(requirement)
            req = match.group(1) if match else requirement
            if _normal(req).startswith("jaxattn"):
                continue
            mods = modules_of.get(_normal(req))
            if not mods:
                extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", requirement)
                rows.append({"plugin": name, "what": req, "status": "not installed",
                             "detail": f"pip install '{dist}[{extra.group(1)}]'" if extra
                             else f"pip install '{requirement.split(';')[0].strip()}'"})
                continue
            wanted += [(req, m) for m in mods]
        seen: set[str] = set()
        for what, module in wanted:
            if module in seen:
                continue
            seen.add(module)
            try:
                importlib.import_module(module)
            except Exception as err:  # any failure is the finding: ImportError, a CUDA init error...
                rows.append({"plugin": name, "what": what, "status": "fails",
                             "detail": f"import {module}: {type(err).__name__}: {err}"})
            else:
                rows.append({"plugin": name, "what": what, "status": "ok", "detail": f"import {module}"})
    return rows


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _modules_by_distribution() -> dict[str, list[str]]:
    """Normalised distribution name -> its top-level import names (public ones)."""
    out: dict[str, list[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        if module.startswith("_") or not module.isidentifier():
            continue
        for dist in dists:
            out.setdefault(_normal(dist), []).append(module)
    return {k: sorted(v) for k, v in out.items()}


PAGED_DEFAULT = "8 sequences, T=1, Hq=32 Hkv=8 D=128, pages of 16, 4096 tokens each"


def _paged_default(dtype: str) -> dict[str, Any]:
    """What "auto" runs for a decode step over a paged cache (``PAGED_DEFAULT``) here."""
    import jax

    import jaxattn

    spec = jax.ShapeDtypeStruct
    pages = (8 * 256, 16, 8, 128)
    try:
        explanation = jaxattn.explain_paged(spec((8, 32, 128), dtype), spec(pages, dtype), spec(pages, dtype),
                                            spec((8, 256), "int32"), spec((8,), "int32"))
    except jaxattn.JaxattnError as err:
        return {"impl": None, "error": str(err)}
    if explanation.chosen is None:
        here = [c for c in explanation.candidates if c.here]
        why = ("; ".join(f"{c.name}: {' / '.join(c.reasons)}" for c in here) if here else
               "no paged impl is installed here (pip install 'jaxattn[cpu]' brings page_attention)")
        return {"impl": None, "error": f"none: {why}"}
    return {"impl": explanation.chosen, "dtype": dtype}


def render(info: dict[str, Any], out: Printer) -> None:
    default = info["default"] or {}
    # A path is one word: shortened so that it fits beside its key ("python:     ") or under a
    # table row ("    module: ").
    room = max(20, out.width - 12)
    out.pairs([
        ("jaxattn", info["jaxattn"]),
        ("python", f"{info['python']} ({short_path(info['executable'], room - 2)})"),
        ("os", info["os"]),
        ("jax", f"{info['jax']} (jaxlib {info['jaxlib']})"),
        *([("cuda", ", ".join(f"{k} {v}" for k, v in info["cuda"].items()))] if info["cuda"] else []),
        ("device", info["device"]["label"]),
        ("auto picks", f"{default.get('impl')} in {default.get('dtype')} "
                       "for B=1 T=S=2048 Hq=Hkv=32 D=128 causal"
         if default.get("impl") else default.get("error", "nothing")),
        ("paged auto", f"{info['paged_default'].get('impl')} in {info['paged_default'].get('dtype')} for "
                        f"{PAGED_DEFAULT}" if info["paged_default"].get("impl")
         else info["paged_default"].get("error", "nothing")),
        *((f"${k}", v) for k, v in info["environment"].items()),
    ])
    out.line()

    libraries = Table("Libraries", ["library", "version", "needed by"])
    for name, _, needed_by in LIBRARIES:
        libraries.add(name, info["libraries"].get(name) or NOT_INSTALLED, needed_by)
    out.table(libraries)

    plugins = Table("Plugins", ["plugin", "status", "distribution", "version", "install", "impls", "module",
                                "error"])
    for p in info["plugins"]:
        plugins.add(p["name"], p["status"], p["distribution"], p["version"], p["install"],
                    [impl_label(i) for i in p["impls"]], short_path(p["path"], room) if p["path"] else p["module"],
                    p["reason"] or None)
    out.table(plugins)

    impls = Table("Implementations",
                  ["name", "kind", "usable here", "status", "priority", "plugin", "aliases", "platforms", "note"])
    for r in info["impls"]:
        impls.add(r["name"], r["kind"], r["usable_here"], r["status"], r["priority"], r["distribution"] or r["plugin"],
                  r["aliases"], r["platforms"], r["reason"] or None)
    out.table(impls)

    if "check" in info:
        check = Table("Imports (--check)", ["plugin", "what", "status", "detail"])
        for row in info["check"]:
            check.add(row["plugin"], row["what"], row["status"], row["detail"])
        out.table(check)

    for message in info["warnings"]:
        out.line(f"warning: {message}")


def run(args: argparse.Namespace) -> int:
    # First, so that the report shows what importing the impl modules found.
    found, warned = _plugin_problems() if args.strict else ([], [])
    info = collect()
    if args.strict:
        info["problems"] = [p.to_dict() for p in found]
        info["warnings"] = warned + info["warnings"]
    if args.check:
        info["check"] = check_plugins(info["plugins"])
    if args.json:
        dump_json(info)
    else:
        render(info, Printer.from_args(args))
    # Problems are reported, not fatal, unless --strict: info is the tool one runs to find them.
    for problem in found:
        print(f"jaxattn info: {problem}", file=sys.stderr)
    failed = [r for r in info.get("check", []) if r["status"] == "fails"]
    return 1 if found or failed else 0


def _plugin_problems() -> tuple[list[Any], list[str]]:
    """``jaxattn.discovery.plugins.problems(load=True)``, and the warnings discovery issued meanwhile."""
    from jaxattn.discovery.plugins import problems

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = problems(load=True)
    return found, [str(w.message) for w in caught]
