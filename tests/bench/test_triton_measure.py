"""plugins/triton/benchmarks/triton_measure.py, the Triton scripts' kernel timer, samples as ``jaxattn bench`` does
(any platform: it times any jitted fn)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jaxattn_triton")


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "plugins" / "triton" / "benchmarks" / "triton_measure.py"
    spec = importlib.util.spec_from_file_location("triton_measure", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


triton_measure = _load()
attention_flops, time_jax = triton_measure.attention_flops, triton_measure.time_jax


def test_time_jax_returns_seconds_per_call_after_warmup_and_preroll() -> None:
    calls: list[int] = []

    def traced(x: jax.Array) -> jax.Array:
        return x @ x

    fn = jax.jit(traced)

    def counting(x: jax.Array) -> jax.Array:
        calls.append(1)
        return fn(x)

    seconds = time_jax(counting, jnp.ones((64, 64)), reps=3, min_sample_ms=2.0, preroll_ms=2.0)
    assert 0 < seconds < 1
    # two warm calls, a pre-roll of at least one call and three samples of at least one call each
    # (plus a sizing batch when one call is shorter than a sample)
    assert len(calls) >= 2 + 1 + 3


def test_flops_follow_gpu_md() -> None:
    assert attention_flops(1, 2, 8, 8, 4, causal=False, backward=False) == 4 * 2 * 8 * 8 * 4
    assert attention_flops(1, 2, 8, 8, 4, causal=True, backward=True) == 4 * 2 * 8 * 8 * 4 / 2 * 3.5
