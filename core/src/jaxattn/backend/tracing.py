"""Tracing a kernel, and its VJP, under JAX configuration contexts: for plugin authors.

Pallas kernels are traced twice when a call is differentiated: the forward when the call is
traced, the backward kernels later, when JAX transposes it, long after the plugin's own code
has returned. A context entered around the call therefore does not cover the backward.
:func:`traced_under` wraps a function in a ``jax.custom_vjp`` that re-enters the contexts in
its primal, its forward rule and its backward rule, whose residual is the function's own VJP
closure, so every trace of the kernel sees them. Two uses:

* :func:`x64_off`: JAX's Pallas TPU kernels index with int32 and mix it with Python ints,
  which become int64 under ``jax_enable_x64`` (``lax.select requires arguments to have the
  same dtypes``). Inside the kernel nothing needs 64 bits: the plugin casts index arrays
  (segment ids) to int32 before the call, and floats stay float32/bfloat16.
* Pallas TPU interpret mode (``pltpu.force_tpu_interpret_mode``), to run TPU kernels on a
  CPU in tests.

jax is imported when a wrapper is built, not when this module is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["traced_under", "x64_off"]

ContextFactory = Callable[[], AbstractContextManager[Any]]


def x64_off() -> AbstractContextManager[Any]:
    """``jax_enable_x64`` off for the extent of the context (a no-op when it is off already)."""
    import jax

    return jax.enable_x64(False)  # type: ignore[no-any-return]


@contextlib.contextmanager
def _entered(contexts: tuple[ContextFactory, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for factory in contexts:
            stack.enter_context(factory())
        yield


def traced_under(fn: Callable[..., Any], *contexts: ContextFactory) -> Callable[..., Any]:
    """``fn`` with its forward and backward traced inside ``contexts`` (fresh ones each time).

    ``fn`` takes positional arrays (or pytrees, ``None`` allowed) and returns a pytree of
    arrays; integer inputs get no cotangent.
    """
    import jax

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        with _entered(contexts):
            return fn(*args)

    def run_fwd(*args: Any) -> tuple[Any, Any]:
        with _entered(contexts):
            out, vjp = jax.vjp(fn, *args)
        return out, vjp

    def run_bwd(vjp: Any, cotangent: Any) -> Any:
        with _entered(contexts):
            return vjp(cotangent)

    run.defvjp(run_fwd, run_bwd)
    return run
