"""Exceptions raised by jaxattn.

Every error a user can hit says what was wrong and what to do next; the classes also
subclass the builtin a caller would naturally catch (ValueError, LookupError, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ImplNotFoundError",
    "InvalidInputError",
    "InvalidTypeError",
    "JaxattnError",
    "PluginError",
    "UnsupportedError",
]


class JaxattnError(Exception):
    """Base class of every jaxattn error."""


class InvalidInputError(JaxattnError, ValueError):
    """An argument breaks the attention contract (shape, rank, dtype, missing companion)."""

    def __init__(self, argument: str, problem: str, hint: str | None = None) -> None:
        self.argument = argument
        self.problem = problem
        self.hint = hint
        text = f"{argument}: {problem}"
        if hint:
            text += f" ({hint})"
        super().__init__(text)


class InvalidTypeError(InvalidInputError, TypeError):
    """An argument of the wrong type (a string for a number, an int for a key...): an
    ``InvalidInputError`` that ``except TypeError`` catches too."""


class UnsupportedError(JaxattnError, ValueError):
    """A chosen implementation cannot run these inputs; ``reasons`` lists every cause.

    ``gradient`` is True when the forward runs but the backward cannot: raised when the call
    is differentiated, from JAX's tracing of the backward, never from inside a kernel.
    """

    def __init__(self, impl_name: str, reasons: Sequence[str], hint: str | None = None, *,
                 gradient: bool = False) -> None:
        self.impl_name = impl_name
        self.reasons = list(reasons)
        self.hint = hint
        self.gradient = gradient
        what = "differentiate this call" if gradient else "run these inputs"
        lines = [f"attention impl {impl_name!r} cannot {what}:"]
        lines += [f"  - {r}" for r in self.reasons]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class ImplNotFoundError(JaxattnError, LookupError):
    """No implementation of that name exists, or none runs on this platform."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class PluginError(JaxattnError, RuntimeError):
    """A plugin failed to load or registered something inconsistent."""
