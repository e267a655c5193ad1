"""Measured ranking for "auto": the core's one tuning interface.

Records of measured timings come from plugins, through the hook ``jaxattn_tuning_records``:
jaxattn-bench reads the tuning file that its ``jaxattn tune`` writes (its format, place and
checks live beside the writer, in ``jaxattn_bench.records``). This module is what selection
and the plugins use of them, and it imports no tooling:

- :func:`refine`, auto's rank refiner (``jaxattn.dispatch`` calls it when its memo of choices
  misses, so its cost is paid once per distinct call signature);
- :func:`plugin_section`, a plugin's own tuned object (the Triton plugin's kernel tiles);
- :func:`on_reload` / :func:`reload`, so that new records change the next choice.

Ranking: the candidates measured for this problem come first, fastest first; those within
:data:`TIE_TOLERANCE` of the fastest count as tied and keep their declared order (a difference
that small is timing noise, and a coin flip between two runs of ``jaxattn tune`` must not flip
the pick), and so on for the rest (see :func:`rank_measured`). Candidates without a usable
measurement follow in declared order. A forward call is ranked by forward time. When another
exact backend is measurably faster for forward+backward, the first candidate carries
``grad_impl``: "auto" then runs that backend whenever the call is differentiated (see
:mod:`jaxattn.split`). ``JAXATTN_TUNING=0`` turns measured ranking off. Importing this module
loads no jax.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from .candidates import Candidate
from .environment import flag
from .errors import JaxattnError
from .lookup import available_here, impl_for
from .metadata import AttentionMetadata
from .plugins import call_each, registry
from .problem import AttentionProblem, Problem

__all__ = [
    "SPLIT_MARGIN", "TIE_TOLERANCE", "Measurement", "TuningCacheWarning", "TuningRecords", "enabled",
    "on_reload", "plugin_section", "rank_measured", "refine", "reload", "split_eligible", "warn_once",
]

#: Measured times within this fraction of the fastest are tied: declared priority orders them.
#: Between two full ``jaxattn bench`` runs on an H200 one figure moved by 1.1% at the median
#: (docs/bench.md); auto's target is 3%, so a tie costs at most a third of it.
TIE_TOLERANCE = 0.01

#: The gradient backend must beat the forward's own forward+backward by this fraction: within
#: timing noise, one backend for both directions is the simpler program (and keeps jvp).
SPLIT_MARGIN = 0.01


class TuningCacheWarning(UserWarning):
    """Tuning records (or part of them) were ignored; "auto" falls back to declared priorities."""


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, TuningCacheWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One backend's median times for one kind of call, and the plugin version that ran."""

    impl: str
    origin: str | None = None  # distribution (or plugin) that provided the impl
    version: str | None = None  # its version; a different installed version makes this stale
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None  # None: not measured, or the impl has no backward here

    def time(self, grad: bool) -> float | None:
        return self.fwdbwd_ms if grad else self.fwd_ms


class TuningRecords(Protocol):
    """What a ``jaxattn_tuning_records`` hook returns: measurements for this environment."""

    def results(self, problem: AttentionProblem) -> tuple[str, Mapping[str, Measurement]] | None:
        """``(the records' key for calls like problem, measurements by impl name)``, or None."""

    def plugin_section(self, plugin: str) -> Mapping[str, Any]:
        """The object ``plugin`` stored for this environment (empty when none)."""


_sources: tuple[int, list[TuningRecords]] | None = None


def _records() -> list[TuningRecords]:
    # Asked once per registry state: a plugin registered later may bring records.
    global _sources
    generation = registry().generation
    if _sources is None or _sources[0] != generation:
        found = call_each("jaxattn_tuning_records", lambda hook: hook())
        _sources = (generation, [records for _, records in found if records is not None])
    return _sources[1]


def plugin_section(plugin: str) -> Mapping[str, Any]:
    """What the records hold for ``plugin`` in this environment (empty when nothing), read-only;
    its contents are the plugin's to check."""
    for records in _records():
        section = records.plugin_section(plugin)
        if section:
            return MappingProxyType(dict(section))
    return MappingProxyType({})


_reload_listeners: list[Callable[[], None]] = []


def on_reload(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever records change (the selection layer forgets its choices)."""
    if listener not in _reload_listeners:
        _reload_listeners.append(listener)


def reload() -> None:
    """Records changed (a provider calls this after writing): forget what depends on them."""
    global _sources
    _sources = None
    for listener in _reload_listeners:
        listener()


def enabled() -> bool:
    """``$JAXATTN_TUNING``: unset or on (1, on, true, yes), or off (0, off, false, no); anything else is refused."""
    # A typo must not leave the user believing measured ranking is off (or on).
    return flag("JAXATTN_TUNING", default=True, meaning="rank by the tuning cache's measurements")


def split_eligible(problem: AttentionProblem) -> bool:
    """Whether forward and gradient may come from different backends for this call.

    Only calls whose arrays are q, k and v: the split wraps them in a ``custom_vjp``, and
    masks, biases, segment ids, sinks and dropout keys would need cotangent rules of their own.
    """
    return (problem.mask_shape is None and problem.bias_shape is None and not problem.segment_ids
            and not problem.sinks and problem.dropout_prob == 0)


def _installed(metadata: AttentionMetadata) -> dict[str, tuple[str | None, str | None]]:
    return {p.name: (p.distribution or p.plugin, p.version) for p in available_here(metadata, kind="dense")}


def _accepts_grad(name: str, problem: AttentionProblem, metadata: AttentionMetadata) -> bool:
    try:
        impl = impl_for(name, metadata)
        return not impl.reasons_to_decline(dataclasses.replace(problem, needs_grad=True))
    except (JaxattnError, ImportError):
        return False


def _usable(pool: list[Candidate], results: Mapping[str, Measurement],
            metadata: AttentionMetadata) -> dict[str, Measurement]:
    installed = _installed(metadata)
    usable: dict[str, Measurement] = {}
    for c in pool:
        m = results.get(c.name)
        if m is None:
            continue
        origin, version = installed.get(c.name, (None, None))
        if (m.origin, m.version) != (origin, version):
            warn_once(f"jaxattn: the tuning cache timed {c.name} from {m.origin} {m.version}, but {origin} "
                      f"{version} is installed; that measurement is not used (run `jaxattn tune`)")
            continue
        usable[c.name] = m
    return usable


def refine(pool: list[Candidate], problem: Problem, metadata: AttentionMetadata) -> list[Candidate]:
    """Reorder auto's accepted candidates by measured time (see the module docstring).

    Dense calls only: records key dense problems; paged calls keep their declared order.
    """
    if not pool or not enabled() or not isinstance(problem, AttentionProblem):
        return pool
    found = next((r for r in (records.results(problem) for records in _records()) if r), None)
    if found is None:
        return pool
    key, results = found
    usable = _usable(pool, results, metadata)
    grad = problem.needs_grad
    metric = "fwd+bwd" if grad else "fwd"
    timed = [c for c in pool if c.name in usable and usable[c.name].time(grad) is not None]
    if not timed:
        return pool
    times = {c.name: usable[c.name].time(grad) or 0.0 for c in timed}
    fastest = min(times.values()) or 1.0
    ranked: list[Candidate] = []
    for c in rank_measured(timed, times):
        t = times[c.name]
        if t == fastest:
            why = "fastest"
        elif t <= fastest * (1 + TIE_TOLERANCE):
            why = f"{t / fastest:.3f}x the fastest: within {TIE_TOLERANCE:.0%}, a tie, declared priority {c.priority}"
        else:
            why = f"{t / fastest:.2f}x the fastest"
        ranked.append(dataclasses.replace(c, measured=True,
                                          rank_reason=f"measured {metric} {t:.3f} ms ({why})"))
    rest = [dataclasses.replace(c, rank_reason=f"declared priority {c.priority}; no usable measurement for {key}")
            for c in pool if c.name not in usable or usable[c.name].time(grad) is None]
    if not grad and split_eligible(problem):
        ranked[0] = _with_grad_impl(ranked[0], usable, problem, metadata)
    return ranked + rest


def rank_measured(timed: list[Candidate], times: dict[str, float]) -> list[Candidate]:
    """``timed`` (in declared order) fastest first; ties keep declared order.

    Repeatedly: the fastest remaining candidate and every one within :data:`TIE_TOLERANCE` of
    it form a group, which is placed in declared order.
    """
    remaining = list(timed)
    ranked: list[Candidate] = []
    while remaining:
        fastest = min(times[c.name] for c in remaining)
        group = [c for c in remaining if times[c.name] <= fastest * (1 + TIE_TOLERANCE)]
        ranked += group
        grouped = {c.name for c in group}
        remaining = [c for c in remaining if c.name not in grouped]
    return ranked


def _with_grad_impl(first: Candidate, usable: dict[str, Measurement], problem: AttentionProblem,
                    metadata: AttentionMetadata) -> Candidate:
    """``first`` with ``grad_impl`` set when another backend is faster for forward+backward."""
    both = sorted((m.fwdbwd_ms, name) for name, m in usable.items() if m.fwdbwd_ms is not None)
    if not both:
        return first
    best_time, best = both[0]
    own = usable[first.name].fwdbwd_ms if first.name in usable else None
    if best == first.name or (own is not None and best_time > own * (1 - SPLIT_MARGIN)):
        return first
    if not _accepts_grad(best, problem, metadata):
        return first
    versus = f"{own:.3f} ms with {first.name}" if own is not None else f"{first.name} has no measured backward"
    return dataclasses.replace(
        first, grad_impl=best,
        rank_reason=f"{first.rank_reason}; differentiated calls run {best} (measured fwd+bwd {best_time:.3f} ms, "
                    f"{versus})",
    )
