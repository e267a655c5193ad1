"""The rank refiner that lets measured timings reorder "auto"'s candidates.

``jaxattn.dispatch`` ranks with :func:`refine` first among its rank refiners. It runs only
when dispatch's memo of choices misses, so its cost (a ``stat`` of the cache file and a dict
lookup) is paid once per distinct call signature.

Ranking: the candidates measured for this problem's key come first, fastest first; those
within :data:`TIE_TOLERANCE` of the fastest count as tied and keep their declared order (a
difference that small is timing noise, and a coin flip between two runs of ``jaxattn tune``
must not flip the pick), and so on for the rest (see :func:`rank_measured`). The result is
deterministic for a given cache. Candidates without a usable measurement follow in declared
order. A forward call is ranked by forward time. When another exact backend is measurably
faster for forward+backward, the first candidate carries ``grad_impl``: "auto" then runs
that backend whenever the call is differentiated (see :mod:`jaxattn.split`).
``JAXATTN_TUNING=0`` turns measured ranking off.
"""

from __future__ import annotations

import dataclasses

from ..candidates import Candidate
from ..environment import flag
from ..errors import JaxattnError
from ..lookup import available_here, impl_for
from ..metadata import AttentionMetadata
from ..problem import AttentionProblem, Problem
from .cache import Measurement, active_cache, warn_once
from .keys import problem_key

__all__ = ["SPLIT_MARGIN", "TIE_TOLERANCE", "enabled", "rank_measured", "refine", "split_eligible"]

#: Measured times within this fraction of the fastest are tied: declared priority orders them.
#: Between two full ``jaxattn bench`` runs on an H200 one figure moved by 1.1% at the median
#: (docs/bench.md); auto's target is 3%, so a tie costs at most a third of it.
TIE_TOLERANCE = 0.01

#: The gradient backend must beat the forward's own forward+backward by this fraction: within
#: timing noise, one backend for both directions is the simpler program (and keeps jvp).
SPLIT_MARGIN = 0.01


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


def _usable(pool: list[Candidate], results: dict[str, Measurement],
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

    Dense calls only: the cache keys dense problems; paged calls keep their declared order.
    """
    if not pool or not enabled() or not isinstance(problem, AttentionProblem):
        return pool
    entry = active_cache().lookup(problem)
    if entry is None:
        return pool
    usable = _usable(pool, entry.results, metadata)
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
    key = problem_key(problem)
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
