"""Turning benchmark results into tuning records (``jaxattn tune``, ``bench --tune``)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxattn.backend import AttentionMetadata, AttentionProblem, Measurement, available_here

from .results import BenchResult
from .shapes import BenchShape
from .store import TuningStore

__all__ = ["measurements_from", "problem_of", "record_results"]


def problem_of(shape: BenchShape) -> AttentionProblem:
    """The call ``shape`` stands for, as "auto" sees it (a forward call: no ``needs_grad``)."""
    q, k, v = shape.structs()
    return AttentionProblem.from_inputs(q, k, v, **shape.call_kwargs)


def measurements_from(shape: BenchShape, results: Sequence[BenchResult],
                      metadata: AttentionMetadata) -> list[Measurement]:
    """One measurement per registered impl with at least one timing for ``shape``."""
    providers = {p.name: p for p in available_here(metadata, kind="dense")}
    times: dict[str, dict[str, float]] = {}
    for r in results:
        if r.shape == shape and r.ok and r.median_ms is not None and r.backend in providers:
            times.setdefault(r.backend, {})[r.mode] = r.median_ms
    out = []
    for name, by_mode in sorted(times.items()):
        p = providers[name]
        out.append(Measurement(impl=name, origin=p.distribution or p.plugin, version=p.version,
                               fwd_ms=by_mode.get("fwd"), fwdbwd_ms=by_mode.get("fwdbwd")))
    return out


def record_results(shape: BenchShape, results: Sequence[BenchResult], metadata: AttentionMetadata) -> int:
    """Store ``shape``'s timings in the tuning cache and save it; returns how many impls."""
    measurements = measurements_from(shape, results, metadata)
    if not measurements:
        return 0
    store = TuningStore.load()  # the file as it is now: another process may have written it
    store.record(problem_of(shape), measurements)
    store.save()
    return len(measurements)
