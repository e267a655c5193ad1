"""What a benchmark run is asked (``BenchConfig``) and what it finds (``BenchResult``, ``BenchReport``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxattn.backend import AttentionMetadata

from .shapes import MODES, BenchShape

__all__ = ["BenchConfig", "BenchReport", "BenchResult"]


@dataclasses.dataclass
class BenchConfig:
    shapes: Sequence[BenchShape]
    backends: Sequence[str]
    reference: str | None
    modes: Sequence[str] = MODES
    warmup: int = 2
    repeats: int = 10  # timed samples per program, spread over the rounds
    rounds: int = 2  # interleaved rounds; odd rounds run the programs in reverse order
    # Each sample lasts at least this long (back-to-back calls, see timing.py); 0: one call per
    # sample. Untimed run of a program before its samples in each round, so clocks settle.
    # None: the platform's default (timing.PLATFORM_DEFAULTS).
    min_sample_ms: float | None = None
    preroll_ms: float | None = None
    max_calls_per_sample: int = 1000
    # Time programs whose optimised HLO is identical (timing.program_key) once and share the
    # result: cudnn and sdpa on NVIDIA GPUs, "auto" and the impl it picked. Timing one program
    # twice measures only noise.
    dedupe: bool = True
    metadata: AttentionMetadata = dataclasses.field(default_factory=AttentionMetadata)
    # Programs needing more compiled temp memory than this, or than the device has free, are
    # skipped (O(T*S) backends at long sequences: they would fail or take long). None: free only.
    max_temp_bytes: int | None = None
    time_budget_s: float | None = None
    compile_workers: int = 4
    # Store the impls' timings in the tuning cache after each shape, before "auto" is traced,
    # so that auto's row shows what measured ranking picks (``jaxattn bench --tune``).
    record_tuning: bool = False


@dataclasses.dataclass
class BenchResult:
    shape: BenchShape
    backend: str
    mode: str
    status: str  # "ok", "declined", "skipped", "failed"
    reason: str = ""
    note: str = ""
    times_ms: list[float] = dataclasses.field(default_factory=list)  # per call, one entry per sample
    calls_per_sample: int = 1
    preroll_calls: int = 0
    same_program_as: str | None = None  # the backend whose identical program was timed for this one
    median_ms: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # TFLOP/s relative to the reference backend on the same shape and mode
    temp_bytes: int | None = None
    compile_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def cell(self) -> str:
        """Short text for tables: TFLOP/s, or why there is no number."""
        if self.ok and self.tflops is not None:
            return f"{self.tflops:.1f}" if self.tflops >= 10 else f"{self.tflops:.3g}"
        return f"{self.status}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = self.shape.to_dict()
        return out


@dataclasses.dataclass
class BenchReport:
    config: BenchConfig
    results: list[BenchResult]
    device: str
    environment: dict[str, Any]
    elapsed_s: float
    notes: list[str] = dataclasses.field(default_factory=list)

    def rows(self, shape: BenchShape) -> list[BenchResult]:
        return [r for r in self.results if r.shape == shape]

    def get(self, shape: BenchShape, backend: str, mode: str) -> BenchResult | None:
        return next((r for r in self.results if r.shape == shape and r.backend == backend and r.mode == mode), None)
