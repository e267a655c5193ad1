"""One validated call, one straight path: what a warm eager call costs in the core (issue 19).

A second identical call of ``jaxattn.attention(q, k, v, causal=True)`` on a CPU, arrays already on
the device, is profiled with ``sys.setprofile``:

* at most 4 frames of core modules (code under core/src/jaxattn) lie on the stack between
  ``jaxattn.attention`` (counted) and the plugin's forward when it is entered;
* at most 50 Python function calls run in core modules through ``impl="vanilla"``, at most 60
  through "auto" (every installed plugin asked once, then memoised).

Paged calls take the same straight path (issue 47): a second identical ``jaxattn.paged_attention``
or ``jaxattn.ragged_paged_attention`` call, through ``impl="vanilla_paged"`` and auto, passes at
most 6 core frames (the 4, and the gradient guard's two around a forward without a backward) and
makes at most 40 calls in core modules: its checks that read no values are memoised per call
signature, as a dense call's are; the values of its concrete arrays are checked on every call.

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
MAX_PAGED_FRAMES = 6
MAX_PAGED_CALLS = 40


def _in_core(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(CORE)


def _profile(fn: Callable[[], Any], entry: str = "attention") -> tuple[list[str], list[list[str]]]:
    """The core functions ``fn`` calls (one entry per call), and the core frames on the stack each
    time a forward outside the core is entered (innermost last, from ``jaxattn.<entry>``)."""
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
                if caller.f_code.co_name == entry and caller.f_code.co_filename.endswith("jaxattn/api/calls.py"):
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


@pytest.fixture(scope="module")
def paged() -> dict[str, jax.Array]:
    """A decode step's arrays over a paged cache (2 sequences, 8 pages of 4 tokens), on the device."""
    if jaxattn.detect_device().platform != "cpu":
        pytest.skip("the targets are for a CPU host")
    rng = np.random.default_rng(0)
    arrays = {"q": rng.standard_normal((2, 4, 8)), "k_pages": rng.standard_normal((8, 4, 2, 8)),
              "v_pages": rng.standard_normal((8, 4, 2, 8))}
    out = {name: jax.device_put(jnp.asarray(x, jnp.float32)) for name, x in arrays.items()}
    out["page_table"] = jax.device_put(jnp.asarray(np.arange(8).reshape(2, 4), jnp.int32))
    out["kv_lengths"] = jax.device_put(jnp.asarray([5, 9], jnp.int32))
    out["cu_q_lens"] = jax.device_put(jnp.asarray([0, 1, 2], jnp.int32))
    return out


@pytest.mark.parametrize("entry", ["paged_attention", "ragged_paged_attention"])
@pytest.mark.parametrize("impl", ["vanilla_paged", None], ids=["vanilla_paged", "auto"])
def test_warm_eager_paged_call(entry: str, impl: str | None, paged: dict[str, jax.Array]) -> None:
    a = paged
    cache = (a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"])

    def call() -> Any:
        if entry == "paged_attention":
            return jaxattn.paged_attention(*cache, impl=impl)
        return jaxattn.ragged_paged_attention(*cache, a["cu_q_lens"], 2, impl=impl)

    jax.block_until_ready(call())  # the cold call: discovery, choice, checks, compilation
    jax.block_until_ready(call())
    calls, stacks = _profile(call, entry)
    assert stacks, "no plugin forward was entered"
    frames = stacks[0]
    assert frames[0] == f"api/calls.py:{entry}", frames
    assert len(frames) <= MAX_PAGED_FRAMES, f"{len(frames)} core frames before the plugin's forward: {frames}"
    assert len(calls) <= MAX_PAGED_CALLS, f"{len(calls)} calls in core modules: {calls}"
    # The checks that read no values ran on the cold call only; the concrete values, on this one too.
    assert not any(c.startswith(("backend/validation.py:", "backend/quantize.py:")) for c in calls), calls
    assert "backend/paged_validation.py:_check_values" in calls, calls


def test_paged_values_checked_on_every_call(paged: dict[str, jax.Array]) -> None:
    """A memoised signature still checks its arrays' values: a page index out of range raises on
    a call whose shapes and dtypes passed before."""
    a = paged
    args = (a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"])
    jax.block_until_ready(jaxattn.paged_attention(*args, impl="vanilla_paged"))
    table = a["page_table"].at[1, 2].set(8)  # sequence 1 reads 3 pages for 9 tokens: page 8 of 8
    with pytest.raises(jaxattn.InvalidInputError, match=r"page_table\[1, 2\] = 8"):
        jaxattn.paged_attention(*args[:3], table, a["kv_lengths"], impl="vanilla_paged")
    lengths = a["kv_lengths"].at[0].set(17)
    with pytest.raises(jaxattn.InvalidInputError, match=r"kv_lengths\[0\] = 17"):
        jaxattn.paged_attention(*args[:4], lengths, impl="vanilla_paged")
    with pytest.raises(jaxattn.InvalidInputError, match="cu_q_lens"):
        jaxattn.ragged_paged_attention(*args, jnp.asarray([0, 2, 1], jnp.int32), 2, impl="vanilla_paged")
