"""The one rule for every numeric command-line option: validated by its argparse ``type=``.

Every numeric option of every ``jaxattn`` subcommand (and of ``python -m jaxattn_bench.demo``) takes
one of the converters below as its ``type``, never a bare ``int`` or ``float``: zero where it
means nothing, a negative number, ``inf``/``nan`` and garbage are refused before anything
runs, with exit status 2 and one line that names the option, the constraint and a valid
example (argparse prefixes the option: ``argument --seqs: ...``). ``tests/cli`` walks every
parser and fails on an option that escapes the rule.

Names are validated the same way: ``float_dtype`` and ``Choices`` (``--modes fwd,fwdbwd``) as
``type=``, with "did you mean" for a close name, and ``check_impl_names`` for impl names once
the command runs (they depend on the installed plugins), before any work. Every parser is a
``OneLineParser``, which turns argparse's prefix matching off: ``--impl`` is no abbreviation of
``--impls``.

Standard library only: ``jaxattn --help`` must not import jax.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from jaxattn.backend._dtypes import dtype_name
from jaxattn.errors import did_you_mean

__all__ = [
    "Choices",
    "NumericArg",
    "OneLineParser",
    "check_impl_names",
    "float_dtype",
    "int_list",
    "mesh_axes",
    "nonneg_float",
    "nonneg_int",
    "nonneg_window",
    "positive_float",
    "positive_int",
    "probability",
]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2).

    argparse prints the whole usage first, dozens of lines for ``bench``; the one line keeps
    the option, the constraint and the example, and says where the usage is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Prefix matching would read a typo of one option as another (--impl as --impls).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self._close_options(message)} (`{self.prog} --help` lists "
                  "every option)\n")

    def _close_options(self, message: str) -> str:
        """``; did you mean --impls?`` for an unrecognized option close to one of this parser's."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        hints = [(word, close[0]) for word in message[len(prefix):].split()
                 if word.startswith("--") and (close := difflib.get_close_matches(word.split("=")[0], known, 1, 0.75))]
        if len(hints) == 1:
            return f"; did you mean {hints[0][1]}?"
        return f"; did you mean {', '.join(f'{close} for {word}' for word, close in hints)}?" if hints else ""


class NumericArg:
    """A converter for ``type=``: ``parse`` returns the value or raises ValueError, which
    becomes argparse's one-line error with the constraint and an example.

    ``accepts_zero`` is read by the test that walks every parser.
    """

    def __init__(self, name: str, parse: Callable[[str], Any], constraint: str, example: str,
                 accepts_zero: bool) -> None:
        self.__name__ = name  # argparse names the type in some messages
        self.parse, self.constraint, self.example, self.accepts_zero = parse, constraint, example, accepts_zero

    def __call__(self, text: str) -> Any:
        try:
            return self.parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.constraint}; e.g. {self.example}") from None

    def __repr__(self) -> str:
        return self.__name__


def _int(text: str, minimum: int) -> int:
    value = int(text.strip())
    if value < minimum:
        raise ValueError(text)
    return value


def _float(text: str, *, zero_ok: bool, below: float = math.inf) -> float:
    """A finite float > 0 (>= 0 when ``zero_ok``) and < ``below``."""
    value = float(text.strip())
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0) and value < below):
        raise ValueError(text)
    return value


def _sized_int(text: str) -> int:
    """``1024``, or ``1k`` for 1024 (sequence lengths are given in kilo-tokens often)."""
    text = text.strip().lower()
    value = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _int_list(text: str) -> list[int]:
    values = [_sized_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise ValueError(text)
    return values


def _mesh_axes(text: str) -> tuple[tuple[str, int], ...]:
    """``data=2,seq=4`` -> ``(("data", 2), ("seq", 4))``: distinct names, sizes >= 1."""
    axes = []
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name.strip().isidentifier():
            raise ValueError(text)
        axes.append((name.strip(), _int(size, 1)))
    if len({n for n, _ in axes}) != len(axes):
        raise ValueError(text)
    return tuple(axes)


def _window(text: str) -> int | tuple[int, int]:
    parts = [_int(part, 0) for part in text.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return (parts[0], parts[1])
    raise ValueError(text)


positive_int = NumericArg("positive_int", lambda t: _int(t, 1), "an integer >= 1", "8", accepts_zero=False)
nonneg_int = NumericArg("nonneg_int", lambda t: _int(t, 0), "an integer >= 0", "2", accepts_zero=True)
positive_float = NumericArg("positive_float", lambda t: _float(t, zero_ok=False), "a finite number > 0", "2.5",
                            accepts_zero=False)
nonneg_float = NumericArg("nonneg_float", lambda t: _float(t, zero_ok=True), "a finite number >= 0", "10",
                          accepts_zero=True)
probability = NumericArg("probability", lambda t: _float(t, zero_ok=True, below=1.0), "a probability in [0, 1)",
                         "0.1", accepts_zero=True)
int_list = NumericArg("int_list", _int_list, "a comma-separated list of integers >= 1 (1k = 1024)", "1k,2k,4k",
                      accepts_zero=False)
mesh_axes = NumericArg("mesh_axes", _mesh_axes, "mesh axes NAME=SIZE, comma-separated, sizes >= 1",
                       "data=2,seq=4", accepts_zero=False)
nonneg_window = NumericArg("nonneg_window", _window, "a window W or LEFT,RIGHT of integers >= 0", "128 or 128,0",
                           accepts_zero=True)



class Choices:
    """A ``type=`` for one name out of ``choices`` (``many``: a comma-separated list of them),
    case-insensitive, ``aliases`` mapping other spellings; anything else is argparse's one-line
    error with the choices and the closest one."""

    def __init__(self, name: str, choices: Sequence[str], *, many: bool = False,
                 aliases: dict[str, str] | None = None) -> None:
        self.__name__ = name
        self.choices, self.many, self.aliases = tuple(choices), many, dict(aliases or {})

    def __call__(self, text: str) -> Any:
        words = [w.strip().lower() for w in text.split(",")] if self.many else [text.strip().lower()]
        out = []
        for word in words:
            word = self.aliases.get(word, word)
            if word not in self.choices:
                raise argparse.ArgumentTypeError(
                    f"{word!r} is not one of {', '.join(self.choices)}{did_you_mean(word, self.choices)}")
            out.append(word)
        return out if self.many else out[0]

    def __repr__(self) -> str:
        return self.__name__


#: The floating dtypes a call computes in (``--dtype``, ``--runtime-dtype``), canonical names out.
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
float_dtype = Choices("float_dtype", FLOAT_DTYPES,
                      aliases={a: dtype_name(a) for a in ("bf16", "fp16", "half", "fp32", "float")})


def check_impl_names(option: str, names: Iterable[str], kind: str | None = None) -> None:
    """``InvalidInputError`` (one line: exit 2 from any command) for a name no installed plugin
    provides and no release knows (``AttentionMechanisms``), with the closest names; a command
    calls it before any work. A known name that nothing installed provides is left to the
    command, which says what to install. ``kind`` ("dense" or "paged") also refuses a name
    that only the other op kind provides."""
    from jaxattn.backend.names import AttentionMechanisms
    from jaxattn.discovery.plugins import registry
    from jaxattn.errors import InvalidInputError

    reg = registry()
    known = {n for p in reg.providers for n in p.names} | {m.value for m in AttentionMechanisms}
    for name in names:
        if name not in known:
            raise InvalidInputError(option, f"no impl is named {name!r}{did_you_mean(name, sorted(known))}",
                                    "`jaxattn list` shows every name")
        kinds = {p.kind for p in reg.providers_of(name)}
        if kind is not None and kinds and kind not in kinds:
            raise InvalidInputError(option, f"{name!r} is a {'/'.join(sorted(kinds))} impl; these calls are {kind}")
