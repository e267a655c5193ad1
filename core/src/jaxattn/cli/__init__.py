"""The ``jaxattn`` command: ``info``, ``list``, ``explain`` (and whatever registers below).

Startup stays cheap: this package imports only argparse and the subcommand modules, which in
turn import jax/jaxattn machinery inside their ``run`` functions, so ``jaxattn --help`` or a
typo costs milliseconds, not a jax import.

A subcommand is a module with ``HELP: str``, ``add_arguments(parser)`` and
``run(args) -> int``; adding one is one line in ``SUBCOMMANDS`` (or a call to
``register_subcommand`` before ``main`` runs).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol, TextIO, cast

__all__ = ["SUBCOMMANDS", "build_parser", "main", "register_subcommand"]

#: name -> module implementing it. Order is the order of ``jaxattn --help``.
SUBCOMMANDS: dict[str, str] = {
    "info": "jaxattn.cli.info",
    "list": "jaxattn.cli.listing",
    "explain": "jaxattn.cli.explain",
    "bench": "jaxattn.bench.cli",
    "tune": "jaxattn.bench.tune",
}


class Subcommand(Protocol):
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def register_subcommand(name: str, module: str) -> None:
    """Add (or replace) subcommand ``name``, implemented by importable ``module``."""
    SUBCOMMANDS[name] = module


def _load(module: str) -> Subcommand:
    loaded: ModuleType = importlib.import_module(module)
    for attr in ("HELP", "add_arguments", "run"):
        if not hasattr(loaded, attr):
            raise TypeError(f"jaxattn subcommand module {module} lacks {attr}")
    return cast(Subcommand, loaded)


def _version() -> str:
    from jaxattn import __version__

    return __version__


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every subcommand has, after its name. Added per parser, not through a shared
    parent parser, so a subcommand may redefine one (conflict_handler="resolve") without
    altering the others' (a parent's actions are shared objects)."""
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def build_parser() -> argparse.ArgumentParser:
    from ._args import OneLineParser  # subcommand parsers inherit its one-line errors

    parser = OneLineParser(
        prog="jaxattn",
        description="Attention backends for JAX: what is installed, what runs here, and why.",
    )
    parser.add_argument("--version", action="version", version=f"jaxattn {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        command = _load(module)
        sub = commands.add_parser(name, help=command.HELP, description=command.HELP)
        _add_common_arguments(sub)
        command.add_arguments(sub)
        sub.set_defaults(_subcommand=command)
    return parser


def _one_line_warning(prog: str, default: Callable[..., None], message: Warning | str, category: type[Warning],
                      filename: str, lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
    """jaxattn's own warnings (a damaged tuning cache, a broken plugin) as one line, without the
    source line Python prints under a warning; other libraries' warnings keep Python's format."""
    if not category.__module__.startswith("jaxattn"):
        default(message, category, filename, lineno, file, line)
        return
    text = str(message).removeprefix("jaxattn: ")
    print(f"{prog}: warning: {text}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = cast(Subcommand, args._subcommand)
    from jaxattn.errors import JaxattnError

    try:
        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.showwarning = functools.partial(_one_line_warning, f"jaxattn {args.command}",
                                                     warnings.showwarning)
            return command.run(args)
    except JaxattnError as err:
        # The library's errors already say what went wrong and what to do: no traceback.
        print(f"jaxattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jaxattn list | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
