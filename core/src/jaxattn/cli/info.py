"""``jaxattn info``: this host, every plugin (broken ones with their error), every impl."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

from ._output import Printer, Table, dump_json
from ._plugins import is_plugin_row, summarize_plugins

HELP = "show the device, versions, every plugin and implementation, and what is usable here"

# Settings that change what jaxattn discovers or picks; shown when set.
ENVIRONMENT = ("JAXATTN_IMPL", "JAXATTN_PLUGINS", "JAXATTN_DISABLE_PLUGINS",
               "JAXATTN_STRICT_PLUGINS", "JAX_PLATFORMS")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 on any plugin problem a call would otherwise meet (for CI): a "
                             "broken plugin, an ImplRef whose module is missing or fails to import or whose "
                             "declarations disagree with its class, a name clash, a built-in name taken without "
                             "overrides=. Imports every impl module to compare declarations (not the kernel "
                             "libraries they load lazily); each problem is printed to stderr")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    import jaxattn

    # Discovery warns (once) about broken plugins; here they are part of the report instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = jaxattn.list_impls()
        device = jaxattn.detect_device()
        try:
            best, dtype = jaxattn.get_optimal_config()
            default: dict[str, Any] | None = {"impl": best, "dtype": str(getattr(dtype, "__name__", dtype))}
        except jaxattn.JaxattnError as err:
            default = {"impl": None, "error": str(err)}
        paged = _paged_default((default or {}).get("dtype") or "float32")
    return {
        "jaxattn": jaxattn.__version__,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "os": platform.platform(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "device": {"label": device.label, **device.to_dict()},
        "default": default,
        "paged_default": paged,
        "environment": {k: os.environ[k] for k in ENVIRONMENT if k in os.environ},
        "plugins": [p.to_dict() for p in summarize_plugins(rows)],
        "impls": [r.to_dict() for r in rows if not is_plugin_row(r)],
        "warnings": [str(w.message) for w in caught],
    }


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
    out.pairs([
        ("jaxattn", info["jaxattn"]),
        ("python", f"{info['python']} ({info['executable']})"),
        ("os", info["os"]),
        ("jax", f"{info['jax']} (jaxlib {info['jaxlib']})"),
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

    plugins = Table("Plugins", ["plugin", "distribution", "version", "status", "impls", "error"])
    for p in info["plugins"]:
        plugins.add(p["name"], p["distribution"], p["version"], p["status"], p["impls"],
                    p["reason"] or None)
    out.table(plugins)

    impls = Table("Implementations",
                  ["name", "aliases", "kind", "plugin", "platforms", "priority", "status", "usable here", "note"])
    for r in info["impls"]:
        impls.add(r["name"], r["aliases"], r["kind"], r["distribution"] or r["plugin"], r["platforms"],
                  r["priority"], r["status"], r["usable_here"], r["reason"] or None)
    out.table(impls)

    for message in info["warnings"]:
        out.line(f"warning: {message}")


def run(args: argparse.Namespace) -> int:
    # First, so that the report shows what importing the impl modules found.
    found, warned = _plugin_problems() if args.strict else ([], [])
    info = collect()
    if args.strict:
        info["problems"] = [p.to_dict() for p in found]
        info["warnings"] = warned + info["warnings"]
    if args.json:
        dump_json(info)
    else:
        render(info, Printer.from_args(args))
    # Problems are reported, not fatal, unless --strict: info is the tool one runs to find them.
    for problem in found:
        print(f"jaxattn info: {problem}", file=sys.stderr)
    return 1 if found else 0


def _plugin_problems() -> tuple[list[Any], list[str]]:
    """``jaxattn.plugins.problems(load=True)``, and the warnings discovery issued meanwhile."""
    from jaxattn.plugins import problems

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = problems(load=True)
    return found, [str(w.message) for w in caught]
