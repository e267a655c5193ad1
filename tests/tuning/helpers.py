"""Building calls and tuning caches for the tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import AttentionProblem
from jaxattn.discovery.plugins import RUNTIME_PLUGIN
from jaxattn.selection.tuning import Measurement
from jaxattn_bench.store import TuningStore

Timer = Callable[[str, int, random.Random], float]  # (impl, round, rng) -> ms per call, for fake_timer
FakeTimer = Callable[[dict[str, Timer], int, int], None]  # the fake_timer fixture: (timers, repeats, rounds)


def qkv(t: int = 16, hq: int = 4, hkv: int = 4, d: int = 8, b: int = 2, dtype: Any = jnp.float32) -> tuple[Any, ...]:
    # NumPy draws the values: jax.random.normal compiles a program per new shape (seconds each
    # on a 2-core CI machine), for inputs any generator serves.
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((b, t, h, d)), dtype) for h in (hq, hkv, hkv))


def problem(t: int = 16, hq: int = 4, hkv: int = 4, d: int = 8, causal: bool = True, **kw: Any) -> AttentionProblem:
    # Shapes only: no arrays (and no program to make them) are needed to describe the call.
    q, k, v = (jax.ShapeDtypeStruct((2, t, h, d), jnp.float32) for h in (hq, hkv, hkv))
    return AttentionProblem.from_inputs(q, k, v, causal=causal, **kw)


def runtime(name: str, fwd: float | None, fwdbwd: float | None = None) -> Measurement:
    """A measurement of an impl registered with ``register_impl`` (no distribution, no version)."""
    return Measurement(impl=name, origin=RUNTIME_PLUGIN, version=None, fwd_ms=fwd, fwdbwd_ms=fwdbwd)


def store(prob: AttentionProblem, *measurements: Measurement) -> TuningStore:
    """Record ``measurements`` for ``prob`` in the default cache file and save it."""
    cache = TuningStore.load()
    cache.record(prob, measurements)
    cache.save()
    return cache


def noisy(ms: float, jitter: float = 0.03) -> Timer:
    """A fake timer: ``ms`` per call, give or take ``jitter`` (a quiet machine)."""
    return lambda name, round_, rng: ms * (1 + rng.uniform(-jitter, jitter))
