"""The tuning cache: measured backend timings, in one JSON file per user.

Where: ``$JAXATTN_CACHE_DIR/tuning.json`` when set, else the platform's per-user cache folder
(``$XDG_CACHE_HOME/jaxattn`` or ``~/.cache/jaxattn`` on Linux, ``~/Library/Caches/jaxattn``
on macOS, ``%LOCALAPPDATA%\\jaxattn\\Cache`` on Windows).

The file holds one section per :class:`~jaxattn.tuning.keys.Environment`, so a home folder
shared by machines with different GPUs keeps each one's results; only the section of this
process's environment is ever used. A file that cannot be read, or that has results only for
other jax versions of this device, is ignored with a :class:`TuningCacheWarning`, never an
error: a cache can make "auto" faster, never make a call fail.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import JaxattnError
from .keys import Environment, current_environment, problem_key

if TYPE_CHECKING:
    from ..problem import AttentionProblem

__all__ = [
    "FORMAT",
    "Measurement",
    "TuningCache",
    "TuningCacheError",
    "TuningCacheWarning",
    "active_cache",
    "check_writable",
    "default_cache_path",
    "on_reload",
    "reload",
]

FORMAT = 1
FILENAME = "tuning.json"


class TuningCacheWarning(UserWarning):
    """The tuning cache (or part of it) was ignored; "auto" falls back to declared priorities."""


class TuningCacheError(JaxattnError, OSError):
    """The tuning cache cannot be written where it lives (only ``save`` raises it: reading never does)."""


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, TuningCacheWarning, stacklevel=3)


def default_cache_path() -> Path:
    """The tuning file for this user (see the module docstring for the search order)."""
    override = os.environ.get("JAXATTN_CACHE_DIR", "").strip()
    if override:
        return Path(override).expanduser() / FILENAME
    home = Path.home()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local") / "jaxattn" / "Cache"
    elif sys.platform == "darwin":
        base = home / "Library" / "Caches" / "jaxattn"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "jaxattn"
    return base / FILENAME


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One backend's median times for one problem key, and the plugin version that ran."""

    impl: str
    origin: str | None = None  # distribution (or plugin) that provided the impl
    version: str | None = None  # its version; a different installed version makes this stale
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None  # None: not measured, or the impl has no backward here

    def time(self, grad: bool) -> float | None:
        return self.fwdbwd_ms if grad else self.fwd_ms

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "impl"}

    @classmethod
    def from_dict(cls, impl: str, data: Any) -> Measurement:
        """Validate one stored record field by field; ValueError names the first bad field."""
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
        return cls(impl=impl, origin=origin, version=version, **times)


@dataclasses.dataclass
class Entry:
    """The measurements of one problem key."""

    problem: str  # human description of the shape that was timed
    measured_at: str
    results: dict[str, Measurement]

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem, "measured_at": self.measured_at,
                "results": {name: m.to_dict() for name, m in sorted(self.results.items())}}

    @classmethod
    def from_dict(cls, data: Any, dropped: list[str]) -> Entry:
        """An entry from its JSON; a record that fails validation is left out and described in ``dropped``."""
        if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
            raise ValueError("an entry must be an object with 'results'")
        problem, measured_at = data.get("problem", ""), data.get("measured_at", "")
        if type(problem) is not str or type(measured_at) is not str:
            raise ValueError("an entry's 'problem' and 'measured_at' must be strings")
        results = {}
        for name, m in data["results"].items():
            try:
                results[name] = Measurement.from_dict(name, m)
            except ValueError as err:
                dropped.append(str(err))
        return cls(problem=problem, measured_at=measured_at, results=results)


def _parse_sections(raw: Any, dropped: list[str]) -> dict[str, tuple[Environment, dict[str, Entry]]]:
    """Validate the file: a structural problem raises ValueError (the whole file is ignored);
    an invalid entry or record is left out and described in ``dropped`` (the rest is used)."""
    if not isinstance(raw, dict):
        raise ValueError("the top level must be an object")
    if type(raw.get("format")) is not int or raw.get("format") != FORMAT:
        raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
    sections = raw.get("sections")
    if not isinstance(sections, list):
        raise ValueError("'sections' must be a list")
    parsed: dict[str, tuple[Environment, dict[str, Entry]]] = {}
    for section in sections:
        if not isinstance(section, dict) or not isinstance(section.get("entries"), dict):
            raise ValueError("each section must be an object with 'environment' and 'entries'")
        env = Environment.from_dict(section.get("environment"))
        entries = {}
        for key, value in section["entries"].items():
            try:
                entry = Entry.from_dict(value, dropped)
            except ValueError as err:
                dropped.append(f"{key}: {err}")
                continue
            if entry.results:  # an entry whose every record was dropped says nothing
                entries[key] = entry
        parsed[env.fingerprint] = (env, entries)
    return parsed


def _read(path: Path) -> Any:
    """The parsed JSON of ``path``; any failure to read or decode it raises (see ``load``)."""
    return json.loads(path.read_bytes().decode("utf-8"))


class TuningCache:
    """The results of this environment, plus the other environments' sections (kept on save)."""

    def __init__(self, path: Path, environment: Environment,
                 entries: dict[str, Entry] | None = None,
                 others: Mapping[str, tuple[Environment, dict[str, Entry]]] | None = None) -> None:
        self.path = path
        self.environment = environment
        self.entries: dict[str, Entry] = dict(entries or {})
        self.others = dict(others or {})

    @classmethod
    def load(cls, path: Path | None = None, environment: Environment | None = None) -> TuningCache:
        """Read ``path``; unreadable or foreign contents give an empty cache and a warning."""
        path = path or default_cache_path()
        env = environment or current_environment()
        dropped: list[str] = []
        try:
            raw = _read(path)
        except FileNotFoundError:
            return cls(path, env)
        except OSError as err:  # a folder in its place, no permission, a parent that is a file...
            warn_once(f"jaxattn: cannot read the tuning cache {path} ({err}); using declared priorities")
            return cls(path, env)
        except (ValueError, RecursionError, MemoryError) as err:
            # Whatever its bytes (not UTF-8, cut short, nested too deep to parse), a damaged cache
            # is ignored: it may make "auto" faster, never make a call fail.
            warn_once(f"jaxattn: the tuning cache {path} is corrupt ({type(err).__name__}: {str(err)[:200]}); "
                      "ignoring it. `jaxattn tune` writes a fresh one.")
            return cls(path, env)
        try:
            sections = _parse_sections(raw, dropped)
        except (ValueError, TypeError, RecursionError) as err:
            warn_once(f"jaxattn: the tuning cache {path} is corrupt ({err}); ignoring it. "
                      "`jaxattn tune` writes a fresh one.")
            return cls(path, env)
        if dropped:
            warn_once(f"jaxattn: the tuning cache {path} holds {len(dropped)} corrupt record"
                      f"{'s' if len(dropped) > 1 else ''} ({dropped[0]}{'; ...' if len(dropped) > 1 else ''}); "
                      "ignoring them, the rest is used. `jaxattn tune` writes them again.")
        mine = sections.pop(env.fingerprint, None)
        if mine is None:
            same_device = [e for e, _ in sections.values() if e.device_kind == env.device_kind]
            if same_device:
                warn_once(f"jaxattn: the tuning cache {path} was written with "
                          f"{', '.join(sorted(e.describe() for e in same_device))}; this is {env.describe()}, "
                          "so its measurements are not used. Run `jaxattn tune` to measure again.")
            return cls(path, env, others=sections)
        return cls(path, env, mine[1], sections)

    # -- reading ------------------------------------------------------------------------------
    def lookup(self, problem: AttentionProblem) -> Entry | None:
        return self.entries.get(problem_key(problem))

    def __len__(self) -> int:
        return len(self.entries)

    # -- writing ------------------------------------------------------------------------------
    def record(self, problem: AttentionProblem, measurements: Iterable[Measurement]) -> Entry:
        """Store (merge) ``measurements`` for ``problem``'s key; newer results replace older ones."""
        key = problem_key(problem)
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        entry = self.entries.get(key) or Entry(problem=problem.describe(), measured_at=now, results={})
        entry.results.update({m.impl: m for m in measurements})
        entry.problem, entry.measured_at = problem.describe(), now
        self.entries[key] = entry
        return entry

    def to_dict(self) -> dict[str, Any]:
        # Sections of this device under other versions are stale for good: drop them.
        keep = {fp: s for fp, s in self.others.items() if s[0].device_kind != self.environment.device_kind}
        keep[self.environment.fingerprint] = (self.environment, self.entries)
        return {
            "format": FORMAT,
            "sections": [
                {"environment": env.to_dict(), "entries": {k: e.to_dict() for k, e in sorted(entries.items())}}
                for env, entries in (keep[fp] for fp in sorted(keep))
            ],
        }

    def save(self) -> Path:
        """Write atomically (a reader never sees half a file), then let "auto" see the new results.

        Raises :class:`TuningCacheError` (one line: the path, the cause, what to do) when the
        file cannot be written there.
        """
        self.check_writable()
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=self.path.parent)
        except OSError as err:
            raise _cannot_write(self.path, err) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=1, sort_keys=False)
                f.write("\n")
            os.replace(tmp, self.path)
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            raise _cannot_write(self.path, err) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        reload()
        return self.path

    def check_writable(self) -> None:
        """See :func:`check_writable`."""
        check_writable(self.path)


def check_writable(path: Path) -> None:
    """Create the folder of the cache file ``path``; :class:`TuningCacheError` when that is
    impossible or the file's place is taken by a folder. ``jaxattn tune`` asks before it reads
    or measures anything."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
    except OSError as err:
        raise _cannot_write(path, err) from None


def _cannot_write(path: Path, err: OSError) -> TuningCacheError:
    where = ("$JAXATTN_CACHE_DIR" if os.environ.get("JAXATTN_CACHE_DIR", "").strip()
             else "the per-user cache folder")
    return TuningCacheError(
        f"cannot write the tuning cache {path} ({err.strerror or err}); {where} must be a folder that "
        "can be created and written: set JAXATTN_CACHE_DIR to one (e.g. JAXATTN_CACHE_DIR=~/.cache/jaxattn)")


# One cache per (file state, environment), so "auto" reads the file once, not per call.
_active: tuple[tuple[Any, ...], TuningCache] | None = None


def active_cache() -> TuningCache:
    """The cache "auto" consults: the default file, re-read only when it changes on disk."""
    global _active
    path = default_cache_path()
    try:
        st = path.stat()
        state: tuple[Any, ...] = (str(path), st.st_mtime_ns, st.st_size)
    except OSError:
        state = (str(path), None, None)
    env = current_environment()
    key = (*state, env)
    if _active is None or _active[0] != key:
        _active = (key, TuningCache.load(path, env))
    return _active[1]


_reload_listeners: list[Callable[[], None]] = []


def on_reload(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever the cache is reloaded (the selection layer forgets its choices)."""
    if listener not in _reload_listeners:
        _reload_listeners.append(listener)


def reload() -> None:
    """Forget what was read, so the next "auto" choice reads the cache file again."""
    global _active
    _active = None
    for listener in _reload_listeners:
        listener()
