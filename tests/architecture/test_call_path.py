"""One validated call, one straight path: what a warm eager call costs in the core (issue 19).

A second identical call of ``jaxattn.attention(q, k, v, causal=True)`` on a CPU, arrays already on
the device, is profiled with ``sys.setprofile``:

* at most 4 frames of core modules (code under core/src/jaxattn) lie on the stack between
  ``jaxattn.attention`` (counted) and the plugin's forward when it is entered;
* at most 50 Python function calls run in core modules through ``impl="vanilla"``, at most 60
  through "auto" (every installed plugin asked once, then memoised).

docs/architecture.md ("The path of one call") lists the frames.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn

CORE = str(Path(jaxattn.__file__).resolve().parent) + "/"
MAX_FRAMES = 4
MAX_CALLS = {"vanilla": 50, None: 60}


def _in_core(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(CORE)


def _profile(fn: Callable[[], Any]) -> tuple[list[str], list[list[str]]]:
    """The core functions ``fn`` calls (one entry per call), and the core frames on the stack each
    time a forward outside the core is entered (innermost last, from ``jaxattn.attention``)."""
    calls: list[str] = []
    stacks: list[list[str]] = []

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if _in_core(frame):
            calls.append(f"{code.co_filename[len(CORE):]}:{code.co_name}")
        elif code.co_name.startswith("forward_"):
            core: list[str] = []
            caller: FrameType | None = frame.f_back
            while caller is not None:
                if _in_core(caller):
                    core.append(f"{caller.f_code.co_filename[len(CORE):]}:{caller.f_code.co_name}")
                if caller.f_code.co_name == "attention" and caller.f_code.co_filename.endswith("jaxattn/api/calls.py"):
                    break
                caller = caller.f_back
            stacks.append(core[::-1])

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, stacks


@pytest.fixture(scope="module")
def qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    if jaxattn.detect_device().platform != "cpu":
        pytest.skip("the targets are for a CPU host")
    rng = np.random.default_rng(0)  # NumPy draws: jax.random.normal would compile a program first
    return tuple(jax.device_put(jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32))  # type: ignore[return-value]
                 for _ in range(3))


@pytest.mark.parametrize("impl", ["vanilla", None], ids=["vanilla", "auto"])
def test_warm_eager_call(impl: str | None, qkv: tuple[jax.Array, jax.Array, jax.Array]) -> None:
    q, k, v = qkv

    def call() -> Any:
        return jaxattn.attention(q, k, v, causal=True, impl=impl)

    jax.block_until_ready(call())  # the cold call: discovery, choice, checks, compilation
    jax.block_until_ready(call())
    calls, stacks = _profile(call)
    assert stacks, "no plugin forward was entered"
    frames = stacks[0]
    assert frames[0] == "api/calls.py:attention", frames
    assert len(frames) <= MAX_FRAMES, f"{len(frames)} core frames before the plugin's forward: {frames}"
    assert len(calls) <= MAX_CALLS[impl], f"{len(calls)} calls in core modules: {calls}"
