"""Commands of the ``jaxattn`` program: the core's own, and those plugins add through a hook.

A command is a name, one line of help, ``add_arguments(parser)`` and ``run(args) -> int``.
A plugin adds commands from its registration module::

    @jaxattn.hookimpl
    def jaxattn_register_commands(commands: Commands) -> None:
        commands.add(Command.from_module("bench", "my_plugin.bench_command"))

``jaxattn --help`` builds every command's parser, so a command's module imports argparse at
its top and jax (and the rest of jaxattn) inside ``run``: the help stays instant.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ["Command", "Commands"]


@dataclasses.dataclass(frozen=True)
class Command:
    """One command: ``jaxattn NAME [options]`` runs ``run(args)``; its exit status is what it returns."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or self.name.startswith("-"):
            raise ValueError(f"a command name is letters, digits and dashes, got {self.name!r}")
        if not callable(self.add_arguments) or not callable(self.run):
            raise TypeError(f"command {self.name!r}: add_arguments and run must be callable")

    @classmethod
    def from_module(cls, name: str, module: str) -> Command:
        """The command whose ``HELP``, ``add_arguments`` and ``run`` are attributes of ``module``
        (imported now, so its top level must stay cheap)."""
        loaded = importlib.import_module(module)
        missing = [a for a in ("HELP", "add_arguments", "run") if not hasattr(loaded, a)]
        if missing:
            raise TypeError(f"jaxattn command module {module} lacks {', '.join(missing)}")
        return cls(name, str(loaded.HELP), loaded.add_arguments, loaded.run)


class Commands:
    """What a ``jaxattn_register_commands`` hook receives: it calls :meth:`add` once per command."""

    def __init__(self) -> None:
        self._added: list[Command] = []

    def add(self, command: Command) -> None:
        if not isinstance(command, Command):
            raise TypeError(f"Commands.add takes a jaxattn.discovery.commands.Command, got {type(command).__name__}")
        self._added.append(command)

    def __iter__(self) -> Iterator[Command]:
        return iter(self._added)

    def __len__(self) -> int:
        return len(self._added)
