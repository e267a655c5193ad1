"""``quick_jit``: ``jax.jit`` tuned for tests, where compiling, not running, takes the time.

On a CPU, XLA spends most of a small program's compile time in LLVM optimisations that buy
nothing for the tiny shapes tests use (3-5x faster compiles without them). Eager calls are
worse still: every primitive is compiled on its own. Elsewhere this is plain ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np

__all__ = [
    "CPU_TEST_COMPILER_OPTIONS",
    "CPU_TEST_COMPILER_OPTIONS_IF_KNOWN",
    "compiler_options_for_tests",
    "default_compiler_options",
    "eager_test_options",
    "quick_jit",
    "xla_flags_for_tests",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The options every test compile on a CPU takes, as (the tests' value, XLA's default: its
#: ``DefaultDebugOptionsIgnoringFlags``): LLVM's optimisations off.
_CPU_TEST_OPTIONS_AND_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "xla_backend_optimization_level": (0, 3),
    "xla_llvm_disable_expensive_passes": (True, False),
}
CPU_TEST_COMPILER_OPTIONS: dict[str, Any] = {name: test for name, (test, _) in _CPU_TEST_OPTIONS_AND_DEFAULTS.items()}

#: Options added where this jaxlib's XLA:CPU knows them (an unknown one fails every compile),
#: each as (the tests' value, XLA's default).
#: XLA:CPU's fusion emitters cost about 3x the compile time of its elemental ones on a
#: conformance program (forward and gradients of 25 cases: 3.0 s against 1.0 s, jax 0.10.2);
#: both are XLA's own code paths, and the default one stays checked by the suites'
#: forward-only ``jax.jit`` runs at XLA's default options.
CPU_TEST_COMPILER_OPTIONS_IF_KNOWN: dict[str, tuple[Any, Any]] = {
    "xla_cpu_use_fusion_emitters": (False, True),
}


def xla_flags_for_tests() -> list[str]:
    """Every test option's test value as an ``XLA_FLAGS`` entry: a test process may set them for
    every compile, eager ops and plain ``jax.jit`` included (as this project's suite does), and
    ``default_compiler_options`` then asks for XLA's defaults back. Whether the jaxlib knows
    the optional ones is the caller's to find out, in a child process: XLA aborts on an
    unknown flag, and reads ``XLA_FLAGS`` once, at the first compile."""
    table = {**_CPU_TEST_OPTIONS_AND_DEFAULTS, **CPU_TEST_COMPILER_OPTIONS_IF_KNOWN}
    return [f"--{name}={str(test).lower()}" for name, (test, _) in table.items()]


@functools.cache
def _cpu_options() -> dict[str, tuple[Any, Any]]:
    """(the tests' value, XLA's default) of every test option this jaxlib knows."""
    known = dict(_CPU_TEST_OPTIONS_AND_DEFAULTS)
    for name, (test, default) in CPU_TEST_COMPILER_OPTIONS_IF_KNOWN.items():
        try:
            jax.jit(lambda x: x + 1).lower(np.zeros(2, np.float32)).compile(compiler_options={name: test})
        except Exception:  # jaxlib raises XlaRuntimeError (INVALID_ARGUMENT) for an unknown option
            continue
        known[name] = (test, default)
    return known


def compiler_options_for_tests() -> dict[str, Any] | None:
    """The options ``quick_jit`` uses on this backend (None: XLA's defaults)."""
    if jax.default_backend() != "cpu":
        return None
    return {name: test for name, (test, _) in _cpu_options().items()}


def default_compiler_options() -> dict[str, Any] | None:
    """Options that compile with XLA's defaults even in a process whose ``XLA_FLAGS`` set the
    test options above for every compile (None: nothing to restore on this backend)."""
    if jax.default_backend() != "cpu":
        return None
    return {name: default for name, (_, default) in _cpu_options().items()}


def quick_jit(fn: F, **jit_kwargs: Any) -> F:
    """``jax.jit(fn, **jit_kwargs)`` with ``compiler_options_for_tests()`` unless given."""
    jit_kwargs.setdefault("compiler_options", compiler_options_for_tests())
    return jax.jit(fn, **jit_kwargs)  # type: ignore[return-value]


#: jax's switch for the options above in every compile (eager calls take no compiler options).
_FAST_COMPILE_FLAG = "jax_disable_most_optimizations"


@contextlib.contextmanager
def eager_test_options() -> Iterator[None]:
    """Eager calls inside compile each op with ``CPU_TEST_COMPILER_OPTIONS`` on a CPU.

    An eager call compiles every op it meets on its own, with XLA's default options (no
    ``compiler_options`` reach them); jax's ``jax_disable_most_optimizations`` flag turns
    LLVM's optimisations off for those compiles as the options above do for a jitted test
    program: about a sixth less time in a conformance suite's eager runs. The ops and their
    order (what an eager run checks) are the same; XLA's default options stay checked by the
    suites' forward-only ``jax.jit`` runs. Elsewhere, or on a jax without the flag, a no-op.
    """
    if jax.default_backend() != "cpu":
        yield
        return
    try:
        before = bool(jax.config.read(_FAST_COMPILE_FLAG))
        jax.config.update(_FAST_COMPILE_FLAG, True)
    except AttributeError:  # a jax without the flag
        yield
        return
    try:
        yield
    finally:
        jax.config.update(_FAST_COMPILE_FLAG, before)
