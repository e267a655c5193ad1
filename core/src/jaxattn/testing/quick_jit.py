"""``quick_jit``: ``jax.jit`` tuned for tests, where compiling, not running, takes the time.

On a CPU, XLA spends most of a small program's compile time in LLVM optimisations that buy
nothing for the tiny shapes tests use (3-5x faster compiles without them). Eager calls are
worse still: every primitive is compiled on its own. Elsewhere this is plain ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = ["CPU_TEST_COMPILER_OPTIONS", "compiler_options_for_tests", "quick_jit"]

F = TypeVar("F", bound=Callable[..., Any])

CPU_TEST_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def compiler_options_for_tests() -> dict[str, Any] | None:
    """The options ``quick_jit`` uses on this backend (None: XLA's defaults)."""
    return dict(CPU_TEST_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else None


def quick_jit(fn: F, **jit_kwargs: Any) -> F:
    """``jax.jit(fn, **jit_kwargs)`` with ``compiler_options_for_tests()`` unless given."""
    jit_kwargs.setdefault("compiler_options", compiler_options_for_tests())
    return jax.jit(fn, **jit_kwargs)  # type: ignore[return-value]
