"""Measured ranking for "auto": the core's one tuning interface.

Measured timings come from plugins, two ways, in this order of precedence:

- the user's **tuning records**, through the hook ``jaxattn_tuning_records``: jaxattn-bench
  reads the tuning cache that its ``jaxattn tune`` writes (its format, place and checks live
  beside the writer, in ``jaxattn_bench.records``);
- **shipped priors**, through the hook ``jaxattn_tuning_priors``: package-data files in which
  each plugin ships what it measured about its own impls, per device generation and call
  class (:func:`parse_priors` checks them, :func:`prior_results` finds a call's), read once
  and only when a call has no usable record.

Without either, candidates keep their declared priority. This module is what selection and
the plugins use of them, and it imports no tooling:

- :func:`refine`, auto's rank refiner (``jaxattn.selection.dispatch`` calls it when its memo of choices
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
:mod:`jaxattn.api.split`). ``JAXATTN_TUNING=0`` turns measured ranking off. Importing this module
loads no jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, cast

from ..backend.capabilities import Feature
from ..backend.device import DeviceInfo, detect_device
from ..backend.environment import flag
from ..backend.metadata import AttentionMetadata
from ..backend.problem import AttentionProblem, Problem
from ..discovery.plugins import call_each, registry
from ..errors import JaxattnError
from .candidates import Candidate
from .lookup import available_here, impl_for

__all__ = [
    "PRIORS_FORMAT", "SPLIT_MARGIN", "TIE_TOLERANCE", "Measurement", "Priors", "TuningCacheWarning", "TuningRecords",
    "device_priors", "enabled", "nearest_priors", "on_reload", "package_priors", "parse_measurement", "parse_priors",
    "plugin_section", "prior_results", "problem_key", "rank_measured", "refine", "reload", "seq_bucket",
    "shipped_priors", "split_eligible", "warn_once",
]

#: Measured times within this fraction of the fastest are tied: declared priority orders them.
#: Between two full ``jaxattn bench`` runs on an H200 one figure moved by 1.1% at the median
#: (docs/bench.md); auto's target is 3%, so a tie costs at most a third of it.
TIE_TOLERANCE = 0.01

#: The gradient backend must beat the forward's own forward+backward by this fraction: within
#: timing noise, one backend for both directions is the simpler program (and keeps jvp).
SPLIT_MARGIN = 0.01


def seq_bucket(n: int) -> int:
    """The power of two at or above ``n`` (1000 and 1024 share a bucket, 1025 goes to 2048)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def problem_key(problem: AttentionProblem) -> str:
    """The key of a call's class, e.g. ``bfloat16/D128/T4096/S4096/causal+gqa``: what records
    and shipped priors are keyed by.

    dtype, head dims, a power-of-two bucket of each sequence length, and the features the call
    needs. Batch and head counts are left out on purpose: they scale every backend's time about
    alike, while sequence length, head dim and features change which kernel wins. ``grad`` is
    not part of it: one entry holds both the forward and the forward+backward timings, and
    "auto" cannot know at a forward call whether a gradient will follow.
    """
    features = sorted(str(f) for f in problem.required_features() - {Feature.GRAD})
    dims = f"D{problem.head_dim}" + (f"/Dv{problem.head_dim_v}" if problem.head_dim_v != problem.head_dim else "")
    return "/".join([
        problem.dtype, dims, f"T{seq_bucket(problem.seq_q)}", f"S{seq_bucket(problem.seq_k)}",
        "+".join(features) or "plain",
    ])


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


def parse_measurement(impl: str, data: Any) -> Measurement:
    """Validate one stored record (a tuning record or a shipped prior) field by field;
    ValueError names the first bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"result for {impl!r} must be an object")
    times = {}
    for name in ("fwd_ms", "fwdbwd_ms"):
        value = data.get(name)
        # Exact types: JSON's true is a Python bool, which is an int; Infinity parses as a float.
        if value is not None and not (type(value) in (int, float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{impl}.{name} must be a finite positive number or null, got {value!r}")
        times[name] = None if value is None else float(value)
    origin, version = data.get("origin"), data.get("version")
    if not all(x is None or type(x) is str for x in (origin, version)):
        raise ValueError(f"{impl}: origin and version must be strings or null")
    return Measurement(impl=impl, origin=origin, version=version, **times)


class TuningRecords(Protocol):
    """What a ``jaxattn_tuning_records`` hook returns: measurements for this environment."""

    def results(self, problem: AttentionProblem) -> tuple[str, Mapping[str, Measurement]] | None:
        """``(the records' key for calls like problem, measurements by impl name)``, or None."""

    def plugin_section(self, plugin: str) -> Mapping[str, Any]:
        """The object ``plugin`` stored for this environment (empty when none)."""


#: What the hooks gave, by hook, with the registry state it was asked in (``_per_registry``).
_asked: dict[str, tuple[int, Any]] = {}


def _per_registry(hook: str, read: Callable[[], Any]) -> Any:
    """``read()``, asked again only when the registry changed: a plugin registered later may
    bring records or priors."""
    generation = registry().generation
    if hook not in _asked or _asked[hook][0] != generation:
        _asked[hook] = (generation, read())
    return _asked[hook][1]


def _records() -> list[TuningRecords]:
    found = _per_registry("jaxattn_tuning_records", lambda: call_each("jaxattn_tuning_records", lambda hook: hook()))
    return [records for _, records in found if records is not None]


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
    _asked.clear()
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


#: The format of a shipped priors file (:func:`parse_priors`).
PRIORS_FORMAT = "jaxattn-priors/1"
#: What a priors file's "device" may require (each one it names must equal the detected device's).
DEVICE_FIELDS = ("platform", "vendor", "device_kind", "compute_capability", "tpu_generation")
#: A prior applies to calls whose T and S buckets lie within this many doublings of the ones it measured.
PRIOR_REACH = 1
_KEY = re.compile(r"[a-z0-9_]+/D\d+(/Dv\d+)?/T(\d+)/S(\d+)/[a-z_+]+")


@dataclasses.dataclass(frozen=True)
class Priors:
    """One plugin's shipped measurements on one device generation (one package-data file)."""

    plugin: str  # the plugin that shipped it (its impls are the only ones it may time)
    label: str  # the device generation, as explain names it: "cpu", "H200"
    device: Mapping[str, str]
    entries: Mapping[str, Mapping[str, Measurement]]  # problem_key -> impl -> its figures

    def matches(self, device: DeviceInfo) -> bool:
        return all(str(getattr(device, name) or "") == value for name, value in self.device.items())


#: What a prior lookup finds: (the measured key(s), {impl: (its figures, the file)}), or None.
_Found = tuple[str, dict[str, tuple[Measurement, Priors]]] | None


def parse_priors(data: Any, plugin: str) -> Priors:
    """Check a priors file's JSON (see docs/tuning.md) field by field; ValueError names the first bad one."""
    if not isinstance(data, dict) or data.get("format") != PRIORS_FORMAT:
        raise ValueError(f"'format' must be {PRIORS_FORMAT!r}")
    device, measured, entries = data.get("device"), data.get("measured"), data.get("entries")
    if not isinstance(device, dict) or not all(type(device.get(k)) is str for k in ("label", "platform")):
        raise ValueError("'device' must be an object with string 'label' and 'platform'")
    match = {k: v for k, v in device.items() if k != "label"}
    if not set(match) <= set(DEVICE_FIELDS) or not all(type(v) is str for v in match.values()):
        raise ValueError(f"'device' may hold only strings: 'label', {', '.join(map(repr, DEVICE_FIELDS))}")
    if not isinstance(measured, dict) or not all(type(measured.get(k)) is str for k in ("machine", "date", "command")):
        raise ValueError("'measured' must be an object with string 'machine', 'date' and 'command'")
    if not isinstance(entries, dict):
        raise ValueError("'entries' must be an object")
    parsed: dict[str, Mapping[str, Measurement]] = {}
    for key, entry in entries.items():
        keyed = _KEY.fullmatch(key)
        if not keyed or any(n & (n - 1) for n in map(int, keyed.group(2, 3))):
            raise ValueError(f"entry {key!r}: not a problem key (dtype/D<d>/T<2^n>/S<2^n>/features)")
        if not isinstance(entry, dict) or type(entry.get("problem")) is not str or not isinstance(
                entry.get("results"), dict) or not entry["results"]:
            raise ValueError(f"entry {key!r} must be an object with a string 'problem' and non-empty 'results'")
        results = {impl: parse_measurement(impl, m) for impl, m in entry["results"].items()}
        if any(m.fwd_ms is None and m.fwdbwd_ms is None for m in results.values()):
            raise ValueError(f"entry {key!r}: every result needs fwd_ms or fwdbwd_ms")
        parsed[key] = {impl: dataclasses.replace(m, origin=plugin) for impl, m in results.items()}
    return Priors(plugin, device["label"], MappingProxyType(match), MappingProxyType(parsed))


def package_priors(package: str) -> list[Any]:
    """The priors files a plugin ships as package data: ``<package>/priors/*.json``, by name
    (what its ``jaxattn_tuning_priors`` hook returns; nothing is read yet)."""
    from importlib.resources import files

    folder = files(package).joinpath("priors")
    return sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name) \
        if folder.is_dir() else []


def shipped_priors() -> list[Priors]:
    """Every plugin's shipped priors that passed :func:`parse_priors`, read once per registry state."""
    return cast("list[Priors]", _per_registry("jaxattn_tuning_priors", _read_priors))


def _read_priors() -> list[Priors]:
    parsed = []
    for plugin, files in call_each("jaxattn_tuning_priors", lambda hook: list(hook() or ())):
        for file in files:
            try:
                parsed.append(parse_priors(json.loads(file.read_text(encoding="utf-8")), plugin))
            except (OSError, ValueError, TypeError, RecursionError) as err:
                warn_once(f"jaxattn: plugin {plugin!r} ships priors that cannot be used "
                          f"({getattr(file, 'name', file)}: {str(err)[:200]}); auto ranks without them")
    return parsed


def _split(key: str) -> tuple[str, int, int, str]:
    """A problem key's class (dtype and dims), T and S buckets as exponents, and features."""
    *head, t, s, features = key.split("/")
    return "/".join(head), int(t[1:]).bit_length() - 1, int(s[1:]).bit_length() - 1, features


def prior_results(problem: AttentionProblem, device: DeviceInfo | None = None, reach: int = PRIOR_REACH) -> _Found:
    """The shipped priors for calls like ``problem`` on ``device`` (default: this one):
    ``(where they were measured, {impl: (its figures, the file)})``, or None
    (:func:`nearest_priors` on :func:`device_priors`)."""
    return nearest_priors(problem_key(problem), device_priors(device), reach)


def device_priors(device: DeviceInfo | None = None) -> list[Priors]:
    """The shipped priors that match ``device`` (default: this one), the one that answers first
    first: a file measured on this device kind (naming ``device_kind``: an H100's) before one of
    its generation (a ``compute_capability``: every Hopper GPU's), then the file naming more of it."""
    device = device or detect_device()
    return sorted((p for p in shipped_priors() if p.matches(device)),
                  key=lambda p: ("device_kind" not in p.device, -len(p.device)))


def nearest_priors(key: str, sources: list[Priors], reach: int = PRIOR_REACH) -> _Found:
    """The figures that rank a call of class ``key``: ``(the measured key(s), {impl: (figures, file)})``.

    The call's own key when one was measured; otherwise the measured keys of the same dtype,
    dims and features whose T and S buckets each lie within ``reach`` doublings, the nearest
    ones (fewest doublings in all). One nearest key is taken as it is. Several (a call between
    measured buckets, e.g. S 2048 between S 1024 and S 4096) are blended: each impl measured
    in every one of them gets the geometric mean of its times there (the midpoint of a line in
    log-time over log-length), which ranks impls as the geometric mean of their ratios to the
    fastest of each bucket does; an impl missing from one of them is left unranked, as it
    cannot be compared fairly. The first element then names the keys, joined by " and ".
    Every plugin's figures for a key are merged, so backends are compared as they were timed.
    """
    head, t, s, features = _split(key)
    near = {k: abs(t - t2) + abs(s - s2) for k in {k for p in sources for k in p.entries}
            for head2, t2, s2, features2 in [_split(k)]
            if head2 == head and features2 == features and max(abs(t - t2), abs(s - s2)) <= reach}
    if not near:
        return None
    closest = min(near.values())
    keys = sorted((k for k, d in near.items() if d == closest), key=lambda k: (_split(k)[1:3], k))  # shortest first
    # the first file that times an impl for a key answers for it
    per_key = [{impl: (m, p) for p in reversed(sources) for impl, m in p.entries.get(k, {}).items()} for k in keys]
    if len(keys) == 1:
        return keys[0], per_key[0]
    blended: dict[str, tuple[Measurement, Priors]] = {}
    for impl in set.intersection(*(set(f) for f in per_key)):
        fwd, both = (None if None in v else math.exp(sum(map(math.log, v)) / len(v))
                     for v in ([getattr(f[impl][0], name) for f in per_key] for name in ("fwd_ms", "fwdbwd_ms")))
        if fwd is not None or both is not None:
            blended[impl] = (dataclasses.replace(per_key[0][impl][0], fwd_ms=fwd, fwdbwd_ms=both), per_key[0][impl][1])
    return " and ".join(keys), blended


def refine(pool: list[Candidate], problem: Problem, metadata: AttentionMetadata) -> list[Candidate]:
    """Reorder auto's accepted candidates by measured time (see the module docstring).

    The user's tuning records for the call's key come first; without a usable one, the
    plugins' shipped priors for this device; without those, declared order. The two are never
    mixed: times from the user's machine and from the machine a plugin was measured on do not
    compare. Dense calls only: records key dense problems; paged calls keep their declared order.
    """
    if not pool or not enabled() or not isinstance(problem, AttentionProblem):
        return pool
    found = next((r for r in (records.results(problem) for records in _records()) if r), None)
    if found is not None:
        key, results = found
        ranked = _rank(pool, _usable(pool, results, metadata), problem, metadata,
                       {c.name: "your tuning record" for c in pool}, f"no usable measurement for {key}")
        if ranked is not None:
            return ranked
    prior = prior_results(problem)
    if prior is None:
        return pool
    key, shipped = prior
    # Where the figures come from, when not from the call's own bucket: explain says so.
    buckets = " and ".join("/".join(k.split("/")[-3:-1]) for k in key.split(" and "))
    where = "" if key == problem_key(problem) else f"; measured at {buckets}{', geometric mean' * (' and ' in key)}"
    plugins = {p.name: p.plugin for p in available_here(metadata, kind="dense")}
    # A plugin's figures count only for the impls it provides here: each ships what it measured about itself.
    usable = {c.name: shipped[c.name][0] for c in pool
              if c.name in shipped and plugins.get(c.name) == shipped[c.name][1].plugin}
    sources = {c.name: f"shipped prior ({c.origin}, {shipped[c.name][1].label}{where})"
               for c in pool if c.name in usable}
    return _rank(pool, usable, problem, metadata, sources, f"no shipped prior for {key}") or pool


def _rank(pool: list[Candidate], usable: Mapping[str, Measurement], problem: AttentionProblem,
          metadata: AttentionMetadata, sources: Mapping[str, str], missing: str) -> list[Candidate] | None:
    """``pool`` ranked by ``usable``'s times (each reason opened by its ``sources`` entry), or
    None when none of them times this kind of call."""
    grad = problem.needs_grad
    metric = "fwd+bwd" if grad else "fwd"
    timed = [c for c in pool if c.name in usable and usable[c.name].time(grad) is not None]
    if not timed:
        return None
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
                                          rank_reason=f"{sources[c.name]}: measured {metric} {t:.3f} ms ({why})"))
    rest = [dataclasses.replace(c, rank_reason=f"declared priority {c.priority}; {missing}")
            for c in pool if c.name not in times]
    if not grad and split_eligible(problem):
        ranked[0] = _with_grad_impl(ranked[0], dict(usable), problem, metadata)
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
