"""Compiling and timing one attention program: forward, or forward+backward through ``jax.vjp``.

Programs are compiled ahead of time (``jit(...).lower(...).compile()``), which gives the
compiled temp memory (``memory_analysis``) before anything runs and keeps compilation out of
the timings. Each timed run ends with ``block_until_ready``; the runner reports the median of
the runs after the warm-up.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Program", "compile_program", "device_memory_limit", "input_structs", "make_inputs", "run_once"]

AttentionFn = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass
class Program:
    compiled: Any
    temp_bytes: int | None
    compile_s: float


def input_structs(shapes: tuple[Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
    """q, k, v and the output cotangent as ShapeDtypeStructs: what programs are compiled for."""
    import jax

    q, k, v = shapes
    return q, k, v, jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype)


def make_inputs(shapes: tuple[Any, Any, Any], seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Random q, k, v and an output cotangent for the given ShapeDtypeStructs, on the device."""
    import jax

    q_s, k_s, v_s = shapes
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], q_s.shape, q_s.dtype)
    k = jax.random.normal(keys[1], k_s.shape, k_s.dtype)
    v = jax.random.normal(keys[2], v_s.shape, v_s.dtype)
    do = jax.random.normal(keys[3], (*q_s.shape[:-1], v_s.shape[-1]), q_s.dtype)
    q, k, v, do = jax.block_until_ready((q, k, v, do))
    return q, k, v, do


def program_fn(fn: AttentionFn, mode: str) -> Callable[..., Any]:
    """The function to jit: ``fn`` itself, or q, k, v, do -> (dq, dk, dv) through ``jax.vjp``."""
    import jax

    if mode == "fwd":
        return lambda q, k, v, do: fn(q, k, v)

    def fwdbwd(q: Any, k: Any, v: Any, do: Any) -> Any:
        _, pullback = jax.vjp(fn, q, k, v)
        return pullback(do)

    return fwdbwd


def compile_program(fn: AttentionFn, mode: str, args: tuple[Any, ...]) -> Program:
    import jax

    start = time.perf_counter()
    compiled = jax.jit(program_fn(fn, mode)).lower(*args).compile()
    elapsed = time.perf_counter() - start
    temp: int | None = None
    try:
        stats = compiled.memory_analysis()
        temp = None if stats is None else int(stats.temp_size_in_bytes)
    except Exception:  # some backends do not report memory; it is informative only
        temp = None
    return Program(compiled, temp, elapsed)


def run_once(program: Program, args: tuple[Any, ...]) -> float:
    """Wall time in milliseconds of one run, until its results are ready."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(program.compiled(*args))
    return (time.perf_counter() - start) * 1e3


def median(times: list[float]) -> float:
    return float(statistics.median(times))


def device_memory_limit() -> int | None:
    """Bytes a program may still allocate on the default device, when the runtime says."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # CPU and some plugins have no memory stats
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
