"""The ``jaxattn`` command: ``info``, ``list``, ``explain``, and the commands plugins add.

Startup stays cheap: this package imports only argparse and the command modules, which in
turn import jax/jaxattn machinery inside their ``run`` functions, so ``jaxattn --help`` or a
typo costs milliseconds, not a jax import.

A command is a name, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
(``jaxattn.discovery.commands.Command``). The core's own are modules named in ``CORE_COMMANDS``; plugins
add theirs through the ``jaxattn_register_commands`` hook (``jaxattn bench``, ``tune`` and
``demo`` come from jaxattn-bench), collected in isolation: a plugin whose hook or whose
commands' ``add_arguments`` raise loses its commands, is reported broken, and costs the
others nothing.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TextIO, cast

# What a plugin that adds commands uses (public API, standard library only, so `jaxattn --help`
# stays cheap): ``Command`` / ``Commands`` (what the ``jaxattn_register_commands`` hook fills),
# the numeric argument types every option takes, and the tables and JSON every command prints.
from jaxattn.discovery.commands import Command, Commands

from ._args import (
    Choices,
    NumericArg,
    OneLineParser,
    check_impl_names,
    float_dtype,
    int_list,
    mesh_axes,
    nonneg_float,
    nonneg_int,
    nonneg_window,
    positive_float,
    positive_int,
    probability,
)
from ._output import Printer, Table, dump_json, output_width, wrap

__all__ = [
    "CORE_COMMANDS", "Choices", "Command", "Commands", "NumericArg", "OneLineParser", "Printer", "Table",
    "build_parser", "check_impl_names", "commands", "dump_json", "float_dtype", "int_list", "main",
    "mesh_axes", "nonneg_float", "nonneg_int", "nonneg_window", "output_width", "positive_float", "positive_int",
    "probability", "wrap",
]

#: The core's commands: name -> module implementing it. Order is the order of ``jaxattn --help``;
#: plugins' commands follow, by plugin name.
CORE_COMMANDS: dict[str, str] = {
    "info": "jaxattn.cli.info",
    "list": "jaxattn.cli.listing",
    "explain": "jaxattn.cli.explain",
}


def _plugin_commands() -> list[tuple[str, Command]]:
    """(plugin, command) for every command the installed plugins add, each plugin isolated."""
    from jaxattn.discovery.plugins import call_each

    def collect(hook: Callable[..., None]) -> list[Command]:
        added = Commands()
        hook(commands=added)
        for command in added:
            # Building its parser is part of registering: one that fails costs only its plugin.
            command.add_arguments(argparse.ArgumentParser(prog=f"jaxattn {command.name}", add_help=False))
        return list(added)

    return [(plugin, command) for plugin, added in call_each("jaxattn_register_commands", collect)
            for command in added]


def commands(plugins: bool = True) -> list[Command]:
    """Every command of the program: the core's, then the plugins' (a name already taken is refused
    with a ``PluginWarning``, the core's and the first plugin's keep it). ``plugins=False``: the
    core's only, without discovering plugins."""
    from jaxattn.discovery.plugins import PluginWarning

    found = [Command.from_module(name, module) for name, module in CORE_COMMANDS.items()]
    taken = {c.name: "jaxattn" for c in found}
    for plugin, command in _plugin_commands() if plugins else []:
        if command.name in taken:
            warnings.warn(f"jaxattn: plugin {plugin!r} adds a command {command.name!r}, which {taken[command.name]!r} "
                          "already has; it is left out", PluginWarning, stacklevel=2)
            continue
        taken[command.name] = plugin
        found.append(command)
    return found


def _version() -> str:
    from jaxattn import __version__

    return __version__


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every subcommand has, after its name. Added per parser, not through a shared
    parent parser, so a subcommand may redefine one (conflict_handler="resolve") without
    altering the others' (a parent's actions are shared objects)."""
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The program's parser, with every command (``plugins=False``: the core's only)."""
    parser = OneLineParser(
        prog="jaxattn",
        description="Attention backends for JAX: what is installed, what runs here, and why.",
    )
    parser.add_argument("--version", action="version", version=f"jaxattn {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands(plugins):
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        _add_common_arguments(sub)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)  # the top level has no option with a value
    prog = " ".join(["jaxattn", *([name] if name else [])])
    from jaxattn.errors import JaxattnError

    try:
        # A core command runs as if no plugin added commands: discovery happens where it did,
        # inside the command (info reports its warnings). Otherwise discovery runs while the
        # parser is built (--help, a plugin's command): its warnings are one line too.
        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.showwarning = functools.partial(_one_line_warning, prog, warnings.showwarning)
            parser = build_parser(plugins=name not in CORE_COMMANDS)
    except JaxattnError as err:  # JAXATTN_STRICT_PLUGINS and a broken plugin, say
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, which knows its options (did you mean ...)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    run = cast("Callable[[argparse.Namespace], int]", args._run)
    try:
        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.showwarning = functools.partial(_one_line_warning, f"jaxattn {args.command}",
                                                     warnings.showwarning)
            return run(args)
    except JaxattnError as err:
        # The library's errors already say what went wrong and what to do: no traceback.
        print(f"jaxattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jaxattn list | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
