"""Compiling and timing one attention program: forward, or forward+backward through ``jax.vjp``.

Programs are compiled ahead of time (``jit(...).lower(...).compile()``), which gives the
compiled temp memory (``memory_analysis``) before anything runs and keeps compilation out of
the timings.

A sample is ``number`` calls issued back to back, then a wait until they are done (see
``_run``); its time divided by ``number`` is the time per call. One call per sample would add
the host's dispatch and synchronisation latency (tens of microseconds, and jittery) to every
figure: on sub-millisecond kernels that is tens of percent of noise, and it penalises fast
kernels most. Back to back, the host enqueues call i+1 while the device runs call i, so a
sample measures the device's time. The runner sizes ``number`` so that a sample lasts at
least ``min_sample_ms``.

Before a program's samples the runner runs it, untimed, for ``preroll_ms``: a GPU's clocks
follow its power draw over the last ~100 ms, so without that a sample measures the program
that ran before it as much as itself. Measured on an H200 (cuDNN forward, B1 S16384 H32
D128, ms per call): 6.78 right after an idle moment, 7.03 after 20 ms of the Triton kernel,
7.47 after 20 ms of cuDNN itself; after 100 ms of pre-roll 7.71-7.76 in all three cases, the
sustained speed a training loop sees. The default pre-roll is 100 ms on accelerators.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxattn.backend import AttentionMetadata

__all__ = [
    "PLATFORM_DEFAULTS",
    "Program",
    "calls_lasting",
    "compile_program",
    "device_memory_limit",
    "input_structs",
    "make_inputs",
    "platform_defaults",
    "platform_of",
    "preroll",
    "program_key",
    "run_once",
    "run_sample",
    "samples_per_round",
    "seconds_per_call",
    "size_samples",
    "split_rounds",
]

AttentionFn = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass
class Program:
    compiled: Any
    temp_bytes: int | None
    compile_s: float
    key: str | None = None  # program_key(compiled): equal keys, identical device work


_METADATA = re.compile(r",? ?metadata=\{[^{}]*\}")
#: Mosaic GPU names each kernel it lowers after a per-process counter (``entry_0``,
#: ``entry_1``, ...: the name of its dump files) inside the serialised module, and hashes the
#: module with that name in it. The same kernel lowered twice in one process (by name and
#: through auto) differs in both; the name is replaced and the hash, a function of the module
#: kept beside it, dropped.
_MOSAIC_NAME = re.compile(r"(dump_basename\\00)entry_\d+")
_KERNEL_HASH = re.compile(r'kernel_hash = "(?:[^"\\]|\\.)*",? ?')
#: XLA's fingerprint of the module before scheduling: a function of the text kept, names included.
_FINGERPRINT = re.compile(r'fingerprint_before_lhs="[0-9a-f]*"')
_STACK_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_TABLE_ROW = re.compile(r"^\d+ ")


def program_key(compiled: Any) -> str | None:
    """A hash of the optimised program, source locations, the module's name and Mosaic GPU's
    per-process kernel names left out.

    Two programs with the same key run the same kernels with the same configurations (the
    text holds every instruction, fusion, custom call and its backend config, autotuned
    choices included); they differ only in which Python lines produced them. The benchmark
    times such programs once (timing them twice measures nothing but noise). None when the
    runtime gives no text: such programs are never taken as identical.
    """
    try:
        text = compiled.as_text()
    except Exception:  # a runtime without HLO text: never deduplicated
        return None
    if not text:
        return None
    kept: list[str] = []
    in_table = False
    for line in text.splitlines():
        if line.startswith("HloModule "):
            line = line.partition(",")[2]  # the module is named after the Python function
        if line.strip() in _STACK_TABLES:  # tables of file names and line numbers: `N "..."`, `N {...}`
            in_table = True
            continue
        if in_table and _TABLE_ROW.match(line):
            continue
        in_table = False
        kept.append(line)
    text = _METADATA.sub("", "\n".join(kept))
    text = _FINGERPRINT.sub("", _KERNEL_HASH.sub("", _MOSAIC_NAME.sub(r"\1entry", text)))
    return hashlib.sha256(text.encode()).hexdigest()


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
    return Program(compiled, temp, elapsed, program_key(compiled))


def run_once(program: Program, args: tuple[Any, ...]) -> float:
    """Wall time in milliseconds of one run, until its results are ready."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(program.compiled(*args))
    return (time.perf_counter() - start) * 1e3


def run_sample(program: Program, args: tuple[Any, ...], number: int) -> float:
    """Milliseconds per call of ``number`` calls issued back to back (see the module docstring)."""
    if number <= 1:
        return run_once(program, args)
    in_order = _runs_in_order()  # asked before the clock starts
    start = time.perf_counter()
    _run(program, args, number, in_order)
    return (time.perf_counter() - start) * 1e3 / number


def preroll(program: Program, args: tuple[Any, ...], number: int) -> None:
    """Run ``program`` ``number`` times, untimed, and wait: the device reaches its steady state."""
    if number > 0:
        _run(program, args, number, _runs_in_order())


def _runs_in_order() -> bool:
    """Whether the default device runs programs in the order they were issued (accelerators).

    A CPU client may run independent calls at once.
    """
    import jax

    return bool(jax.devices()[0].platform != "cpu")


def _run(program: Program, args: tuple[Any, ...], number: int, in_order: bool) -> None:
    """``number`` calls back to back; returns when all are done.

    In order, only the last result is kept and waited for: the last one done means all are.
    Keeping every result would hold ``number`` outputs (gigabytes at long sequences) and make
    the allocator part of the timing. Otherwise each call is waited for in turn.
    """
    import jax

    out = None
    for _ in range(number):
        out = program.compiled(*args)
        if not in_order:
            jax.block_until_ready(out)
    jax.block_until_ready(out)


#: Per platform: (``min_sample_ms``, ``preroll_ms``). Accelerators: samples long enough to hide
#: dispatch latency, and a pre-roll long enough for clocks to settle (see the module
#: docstring). CPUs: calls are slow and synchronous, there is no boost clock to settle, and
#: CI runs the benchmark's tests.
PLATFORM_DEFAULTS: dict[str, tuple[float, float]] = {"gpu": (10.0, 100.0), "tpu": (10.0, 100.0), "cpu": (1.0, 0.0)}


def platform_of(metadata: AttentionMetadata) -> str:
    """The platform runs go to: the metadata's override, else the detected device."""
    from jaxattn.backend import detect_device, resolve_platform

    return resolve_platform(metadata, detect_device())[0]


def platform_defaults(platform: str) -> tuple[float, float]:
    """``(min_sample_ms, preroll_ms)`` for ``platform``."""
    return PLATFORM_DEFAULTS.get(platform, PLATFORM_DEFAULTS["gpu"])


def size_samples(program: Program, args: tuple[Any, ...], one_call_ms: float, min_sample_ms: float,
                 preroll_ms: float, max_calls: int = 1000) -> tuple[int, int]:
    """``(calls per sample, pre-roll calls)`` for ``program``, from one warm call's time.

    A single call's time includes dispatch and sync latency, so a batch sized by it is run
    once to measure the time per call that the sizes come from.
    """
    number = calls_lasting(min_sample_ms, one_call_ms, max_calls)
    if number > 1:
        one_call_ms = run_sample(program, args, number)
    return max(1, calls_lasting(min_sample_ms, one_call_ms, max_calls)), calls_lasting(preroll_ms, one_call_ms,
                                                                                          max_calls)


def seconds_per_call(fn: Callable[..., Any], args: tuple[Any, ...], samples: int) -> float:
    """Median seconds per call of ``fn(*args)``, timed as the benchmark times a program.

    For scripts that time their own jitted functions (``benchmarks/ring_bench.py``,
    ``benchmarks/paged_sharded_bench.py``): a first call (compilation and warm-up), the
    platform's pre-roll, then ``samples`` samples of back-to-back calls (see the module
    docstring). Timing one blocked call at a time would add the host's dispatch and sync
    latency, larger for a program over several devices, to every figure.
    """
    import jax

    jax.block_until_ready(fn(*args))
    program = Program(fn, None, 0.0)
    min_sample_ms, preroll_ms = platform_defaults(jax.devices()[0].platform)
    number, warm = size_samples(program, args, run_once(program, args), min_sample_ms, preroll_ms)
    preroll(program, args, warm)
    return median([run_sample(program, args, number) for _ in range(max(1, samples))]) / 1e3


def calls_lasting(ms: float, one_call_ms: float, max_calls: int) -> int:
    """How many back-to-back calls last at least ``ms`` (0 when ``ms`` <= 0), from one call's time."""
    if ms <= 0:
        return 0
    return max(1, min(max_calls, math.ceil(ms / max(one_call_ms, 1e-3))))


def samples_per_round(repeats: int, rounds: int) -> list[int]:
    """How ``repeats`` timed samples are spread over interleaved rounds (at most one round per
    sample): as evenly as possible, the earlier rounds taking the remainder."""
    repeats = max(1, repeats)
    rounds = max(1, min(rounds, repeats))
    return [repeats // rounds + (r < repeats % rounds) for r in range(rounds)]


def split_rounds(times: list[float], repeats: int, rounds: int) -> list[list[float]]:
    """A program's samples, in the order they were taken, grouped by round (see ``samples_per_round``)."""
    out, start = [], 0
    for count in samples_per_round(repeats, rounds):
        out.append(times[start:start + count])
        start += count
    return out


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
