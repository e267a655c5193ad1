"""Exceptions raised by jaxattn.

Every error a user can hit says what was wrong and what to do next; the classes also
subclass the builtin a caller would naturally catch (ValueError, LookupError, ...).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "ImplNotFoundError",
    "InvalidInputError",
    "InvalidTypeError",
    "JaxattnError",
    "PluginError",
    "UnsupportedError",
    "checked_keywords",
    "did_you_mean",
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


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choices closest to ``word``, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    if not close and len(word) > 2:  # a prefix ("flash" for "flash_attn2") is close too
        close = [c for c in choices if c.startswith(word) or word.startswith(c)][:3]
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


_P = ParamSpec("_P")
_R = TypeVar("_R")


def checked_keywords(label: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Make an unknown keyword argument of the decorated function an ``InvalidInputError`` naming
    it, with the closest names (Python's own ``TypeError`` names neither jaxattn's rules nor a fix).
    ``label`` says what was called (``"attention()"``)."""
    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        params = inspect.signature(fn).parameters
        names = frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

        @functools.wraps(fn)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            for key in kwargs:
                if key not in names:
                    _unknown_keyword(label, key, names)
            return fn(*args, **kwargs)
        return checked
    return decorate


def _unknown_keyword(label: str, key: str, names: frozenset[str]) -> Any:
    raise InvalidInputError(key, f"is not an argument of {label}{did_you_mean(key, sorted(names))}",
                            "the arguments are in docs/contract.md and help(jaxattn.attention)")
