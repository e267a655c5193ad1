"""Running the benchmark: every backend, every shape, forward and forward+backward, one process.

Per shape: ask every backend (declines become result rows, never exceptions), compile what
runs (in a small thread pool: XLA and Triton compile outside the GIL, and compiling dominates
a large matrix), skip programs whose compiled temp memory exceeds what the device has left
(or ``max_temp_bytes``), then time the programs one at a time, so they never compete for the
device, in ``rounds`` interleaved rounds, so drift hits them alike. In a round each program
runs untimed for ``preroll_ms``, then gives its share of the ``repeats`` samples, each a
batch of back-to-back calls lasting at least ``min_sample_ms`` (see :mod:`jaxattn_bench.timing`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from .backends import Verdict, make_backend
from .progress import Progress
from .record import record_results
from .results import BenchConfig, BenchReport, BenchResult
from .shapes import BenchShape
from .timing import (
    Program,
    compile_program,
    device_memory_limit,
    input_structs,
    make_inputs,
    median,
    platform_defaults,
    platform_of,
    preroll,
    run_once,
    run_sample,
    samples_per_round,
    size_samples,
)

__all__ = ["run_bench"]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _set_ratios(results: list[BenchResult], reference: str | None) -> None:
    refs = {(r.shape, r.mode): r.tflops for r in results if r.backend == reference and r.ok}
    for r in results:
        ref = refs.get((r.shape, r.mode))
        if r.ok and r.tflops is not None and ref:
            r.ratio = r.tflops / ref


def _share(result: BenchResult, leader: BenchResult) -> None:
    """``result`` runs the very program ``leader`` timed: it takes the timing (see ``dedupe``)."""
    result.status, result.reason = leader.status, leader.reason
    result.times_ms = list(leader.times_ms)
    result.calls_per_sample, result.preroll_calls = leader.calls_per_sample, leader.preroll_calls
    result.median_ms, result.tflops = leader.median_ms, leader.tflops
    result.same_program_as = leader.backend


def _split_by_program(pairs: list[tuple[BenchResult, Program]], leaders: dict[str, BenchResult],
                      ) -> tuple[list[tuple[BenchResult, Program]], list[tuple[BenchResult, BenchResult]]]:
    """Programs to time, and (result, leader) pairs whose program a leader already has.

    ``leaders`` maps program keys to the result that times them; the first program of each
    new key becomes its leader. Programs without a key are always timed.
    """
    timed, followers = [], []
    for result, program in pairs:
        leader = leaders.get(program.key) if program.key else None
        if leader is None:
            if program.key:
                leaders[program.key] = result
            timed.append((result, program))
        else:
            followers.append((result, leader))
    return timed, followers


class _ShapeRun:
    """Everything for one shape: verdicts, compiled programs, timings."""

    def __init__(self, config: BenchConfig, shape: BenchShape, progress: Progress) -> None:
        self.config, self.shape, self.progress = config, shape, progress
        self.results: list[BenchResult] = []

    def run(self) -> list[BenchResult]:
        backends = list(self.config.backends)
        args: tuple[Any, ...] | None = None
        if self.config.record_tuning:
            # Time the impls and store their timings. Then, if auto is benchmarked, trace it (it
            # now ranks by them). Where auto's program is one already timed, that timing is
            # auto's; a new program (a forward from one impl and gradients from another) is
            # timed in a new round with the impls of its mode, so it is compared in one round.
            runnable = self._prepare([b for b in backends if b != "auto"])
            if runnable:
                args = make_inputs(self.shape.structs())
                self._time(runnable, args)
            record_results(self.shape, [r for r, _ in runnable], self.config.metadata)
            auto = self._prepare(["auto"]) if "auto" in backends else []
            known: dict[str, BenchResult] = {}
            for result, program in runnable if self.config.dedupe else []:
                if result.ok and program.key and result.same_program_as is None:
                    known.setdefault(program.key, result)  # the program's first (timed) backend
            fresh, shared = _split_by_program(auto, known)
            for result, leader in shared:
                _share(result, leader)
            if fresh:
                modes = {r.mode for r, _ in fresh}
                again = [(r, p) for r, p in runnable if r.ok and r.mode in modes]
                for result, _ in again:
                    result.times_ms, result.median_ms, result.tflops = [], None, None
                self._time(again + fresh, args or make_inputs(self.shape.structs()))
            runnable += auto
        else:
            runnable = self._prepare(backends)
            if runnable:
                self._time(runnable, make_inputs(self.shape.structs()))
        for result, _ in runnable:
            self._done(result)
        return self.results

    def _prepare(self, backends: list[str]) -> list[tuple[BenchResult, Program]]:
        """Ask, compile and size-check; declined, failed and skipped results are done at once."""
        jobs: list[tuple[str, str, Verdict]] = []
        for name in backends:
            backend = make_backend(name, self.config.metadata)
            for mode in self.config.modes:
                try:
                    verdict = backend.verdict(self.shape, mode)
                except Exception as err:  # a backend's bug must not stop the benchmark
                    verdict = Verdict(reasons=(_first_line(err),))
                if verdict.runs:
                    jobs.append((name, mode, verdict))
                else:
                    self._done(BenchResult(self.shape, name, mode, "declined", "; ".join(verdict.reasons)))
        runnable: list[tuple[BenchResult, Program]] = []
        if not jobs:
            return runnable
        programs = self._compile(jobs, input_structs(self.shape.structs()))
        for (name, mode, verdict), program in zip(jobs, programs, strict=True):
            result = BenchResult(self.shape, name, mode, "ok", note=verdict.note)
            if isinstance(program, BaseException):
                result.status, result.reason = "failed", f"compile: {_first_line(program)}"
                self._done(result)
                continue
            result.temp_bytes, result.compile_s = program.temp_bytes, round(program.compile_s, 3)
            too_big = self._too_big(program.temp_bytes)
            if too_big:
                result.status, result.reason = "skipped", too_big
                self._done(result)
                continue
            runnable.append((result, program))
        return runnable

    def _time(self, runnable: list[tuple[BenchResult, Program]], args: tuple[Any, ...]) -> None:
        """Warm every program up, then time them in interleaved rounds (a b c, c b a, a b c, ...).

        Interleaving makes drift during the shape (clocks, temperature, other load) hit every
        backend alike, so ratios between backends of one shape stay honest; the pre-roll keeps
        the program that ran before out of a sample (see :mod:`jaxattn_bench.timing`).
        """
        followers: list[tuple[BenchResult, BenchResult]] = []
        if self.config.dedupe:
            runnable, followers = _split_by_program(runnable, {})
        self.progress.status(f"{self.shape.label}: timing {len(runnable)} programs")
        default_sample, default_preroll = platform_defaults(platform_of(self.config.metadata))
        sample_ms = default_sample if self.config.min_sample_ms is None else self.config.min_sample_ms
        preroll_ms = default_preroll if self.config.preroll_ms is None else self.config.preroll_ms
        cap = self.config.max_calls_per_sample

        for result, program in runnable:
            if not result.ok:  # failed in an earlier round (--tune times twice)
                continue
            try:
                for _ in range(max(1, self.config.warmup)):
                    one_call = run_once(program, args)
                result.calls_per_sample, result.preroll_calls = size_samples(program, args, one_call, sample_ms,
                                                                             preroll_ms, cap)
            except Exception as err:  # OOM or a kernel failure is a result, not a crash
                result.status, result.reason = "failed", _first_line(err)
                continue
        for round_, count in enumerate(samples_per_round(self.config.repeats, self.config.rounds)):
            for result, program in runnable if round_ % 2 == 0 else runnable[::-1]:
                if not result.ok:
                    continue
                try:
                    preroll(program, args, result.preroll_calls)
                    for _ in range(count):
                        result.times_ms.append(round(run_sample(program, args, result.calls_per_sample), 5))
                except Exception as err:  # as above
                    result.status, result.reason = "failed", _first_line(err)
        for result, _ in runnable:
            if result.ok:
                result.median_ms = median(result.times_ms)
                result.tflops = self.shape.flops(result.mode) / (result.median_ms * 1e-3) / 1e12
        for result, leader in followers:
            _share(result, leader)

    def _too_big(self, temp: int | None) -> str:
        """Why a program with ``temp`` bytes of compiled temp memory is not run, or ""."""
        if temp is None:
            return ""
        gib = temp / 2**30
        free = device_memory_limit()
        if free is not None and temp > 0.9 * free:
            return f"needs {gib:.1f} GiB of temporary memory, the device has {free / 2**30:.1f} GiB free"
        limit = self.config.max_temp_bytes
        if limit is not None and temp > limit:
            return (f"needs {gib:.1f} GiB of temporary memory (an S x S buffer), over the "
                    f"{limit / 2**30:.3g} GiB limit (--max-temp-gib)")
        return ""

    def _compile(self, jobs: list[tuple[str, str, Verdict]],
                 args: tuple[Any, ...]) -> list[Program | BaseException]:
        def one(job: tuple[str, str, Verdict]) -> Program | BaseException:
            _, mode, verdict = job
            assert verdict.fn is not None
            try:
                return compile_program(verdict.fn, mode, args)
            except Exception as err:  # reported as a "failed" cell
                return err

        self.progress.status(f"{self.shape.label}: compiling {len(jobs)} programs")
        workers = max(1, min(self.config.compile_workers, len(jobs)))
        if workers == 1:
            return [one(job) for job in jobs]
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxattn-compile") as pool:
            programs = list(pool.map(one, jobs))
        # A kernel library that is not safe to compile from several threads fails here and not
        # alone: what failed in the pool is compiled again, alone, before it counts as failed.
        return [one(job) if isinstance(p, BaseException) else p for job, p in zip(jobs, programs, strict=True)]

    def _done(self, result: BenchResult) -> None:
        self.results.append(result)
        self.progress.result(result)


def _environment() -> dict[str, Any]:
    import importlib.metadata

    import jaxattn
    from jaxattn.backend import detect_device

    versions = {}
    for dist in ("jax", "jaxlib", "jaxattn", "jaxattn-vanilla", "jaxattn-sdpa", "jaxattn-triton",
                 "jaxattn-mosaic", "jaxattn-pallas", "jaxattn-splash", "jax-triton", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"device": detect_device().to_dict(), "versions": versions, "jaxattn": jaxattn.__version__}


def run_bench(config: BenchConfig, progress: Progress | None = None,
              on_shape: Callable[[list[BenchResult]], None] | None = None) -> BenchReport:
    """Time every backend on every shape (see the module docstring).

    ``on_shape`` gets the results so far after each shape (the CLI writes its JSON there, so
    a run that is cut short still leaves every finished shape behind).
    """
    from jaxattn.backend import detect_device

    progress = progress or Progress.none()
    start = time.perf_counter()
    results: list[BenchResult] = []
    notes: list[str] = []
    progress.start(len(config.shapes) * len(config.backends) * len(config.modes))
    try:
        for i, shape in enumerate(config.shapes):
            spent = time.perf_counter() - start
            if config.time_budget_s is not None and spent > config.time_budget_s:
                rest = config.shapes[i:]
                notes.append(f"time budget of {config.time_budget_s:.0f} s spent after {i} shapes; not timed: "
                             + ", ".join(s.label for s in rest))
                for s in rest:
                    for name in config.backends:
                        for mode in config.modes:
                            r = BenchResult(s, name, mode, "skipped", "time budget spent")
                            results.append(r)
                            progress.result(r)
                break
            results.extend(_ShapeRun(config, shape, progress).run())
            _set_ratios(results, config.reference)
            if on_shape is not None:
                on_shape(results)
    finally:
        progress.stop()
    return BenchReport(config, results, detect_device().label, _environment(),
                       round(time.perf_counter() - start, 2), notes)
