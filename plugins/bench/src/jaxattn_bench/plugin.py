"""Entry-point module of jaxattn-bench: adds ``jaxattn bench``, ``tune`` and ``demo``, and hands "auto"
the tuning cache's records (imports no jax)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxattn.backend import hookimpl
from jaxattn.cli import Command, Commands

if TYPE_CHECKING:
    from jaxattn.backend import TuningRecords

__all__ = ["COMMANDS", "jaxattn_register_commands", "jaxattn_tuning_records"]

#: name -> module holding the command's HELP, add_arguments and run (argparse only at import).
COMMANDS = {
    "bench": "jaxattn_bench.cli",
    "tune": "jaxattn_bench.tune",
    "demo": "jaxattn_bench.demo",
}


@hookimpl
def jaxattn_register_commands(commands: Commands) -> None:
    for name, module in COMMANDS.items():
        commands.add(Command.from_module(name, module))


@hookimpl
def jaxattn_tuning_records() -> TuningRecords:
    from .records import FileRecords

    return FileRecords()
