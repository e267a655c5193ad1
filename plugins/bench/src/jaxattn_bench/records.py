"""The tuning cache: tuning records (measured timings), one JSON file per user, read for "auto" and written by
``jaxattn tune`` (``jaxattn_bench.store``). Its format, place and checks live here, beside the
writer; the core sees it only through the hook ``jaxattn_tuning_records`` (:class:`FileRecords`).

Where: ``$JAXATTN_CACHE_DIR/tuning.json`` when set, else the platform's per-user cache folder
(``$XDG_CACHE_HOME/jaxattn`` or ``~/.cache/jaxattn`` on Linux, ``~/Library/Caches/jaxattn``
on macOS, ``%LOCALAPPDATA%\\jaxattn\\Cache`` on Windows).

The file holds one section per :class:`~jaxattn_bench.keys.Environment`, so a home folder
shared by machines with different GPUs keeps each one's records; only the section of this
process's environment is ever used. A file that cannot be read, or that has records only for
other jax versions of this device, is ignored with a ``jaxattn.backend.TuningCacheWarning``,
never an error: a cache can make "auto" faster, never make a call fail.

Each section also holds one object per plugin that tunes something of its own (kernel tiles,
say), which the plugin reads through ``jaxattn.backend.plugin_section``; its contents are the
plugin's to define and check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from jaxattn.backend import Measurement, parse_measurement, reload_tuning, warn_once

from .keys import Environment, current_environment, problem_key

if TYPE_CHECKING:
    from jaxattn.backend import AttentionProblem

__all__ = [
    "FORMAT",
    "Entry",
    "FileRecords",
    "Section",
    "TuningCache",
    "active_cache",
    "default_cache_path",
    "parse_measurement",
    "reload",
]

FORMAT = 1
FILENAME = "tuning.json"


def default_cache_path() -> Path:
    """The tuning cache for this user (see the module docstring for the search order)."""
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


@dataclasses.dataclass
class Entry:
    """The measurements of one problem key."""

    problem: str  # human description of the shape that was timed
    measured_at: str
    results: dict[str, Measurement]

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
                results[name] = parse_measurement(name, m)
            except ValueError as err:
                dropped.append(str(err))
        return cls(problem=problem, measured_at=measured_at, results=results)


@dataclasses.dataclass
class Section:
    """What the file holds for one environment: measurements by problem key, and each plugin's object."""

    environment: Environment
    entries: dict[str, Entry] = dataclasses.field(default_factory=dict)
    plugins: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _parse_plugins(raw: Any) -> dict[str, dict[str, Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(type(k) is str and isinstance(v, dict) for k, v in raw.items()):
        raise ValueError("a section's 'plugins' must map plugin names to objects")
    return raw


def _parse_sections(raw: Any, dropped: list[str]) -> dict[str, Section]:
    """Validate the file: a structural problem raises ValueError (the whole file is ignored);
    an invalid entry or record is left out and described in ``dropped`` (the rest is used)."""
    if not isinstance(raw, dict):
        raise ValueError("the top level must be an object")
    if type(raw.get("format")) is not int or raw.get("format") != FORMAT:
        raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
    sections = raw.get("sections")
    if not isinstance(sections, list):
        raise ValueError("'sections' must be a list")
    parsed: dict[str, Section] = {}
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
        parsed[env.fingerprint] = Section(env, entries, _parse_plugins(section.get("plugins")))
    return parsed


def _read(path: Path) -> Any:
    """The parsed JSON of ``path``; any failure to read or decode it raises (see ``load``)."""
    return json.loads(path.read_bytes().decode("utf-8"))


class TuningCache:
    """The results of this environment, plus the other environments' sections (kept on save)."""

    def __init__(self, path: Path, environment: Environment, entries: dict[str, Entry] | None = None,
                 others: Mapping[str, Section] | None = None,
                 plugins: dict[str, dict[str, Any]] | None = None) -> None:
        self.path = path
        self.environment = environment
        self.entries: dict[str, Entry] = dict(entries or {})
        self.plugins: dict[str, dict[str, Any]] = dict(plugins or {})
        self.others = dict(others or {})

    @classmethod
    def load(cls, path: Path | None = None, environment: Environment | None = None) -> Self:
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
            same_device = [s.environment for s in sections.values() if s.environment.device_kind == env.device_kind]
            if same_device:
                warn_once(f"jaxattn: the tuning cache {path} was written with "
                          f"{', '.join(sorted(e.describe() for e in same_device))}; this is {env.describe()}, "
                          "so its measurements are not used. Run `jaxattn tune` to measure again.")
            return cls(path, env, others=sections)
        return cls(path, env, mine.entries, sections, mine.plugins)

    def lookup(self, problem: AttentionProblem) -> Entry | None:
        return self.entries.get(problem_key(problem))

    def __len__(self) -> int:
        return len(self.entries)


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


class FileRecords:
    """What the hook hands the core (``jaxattn.backend.TuningRecords``): the active cache's records."""

    def results(self, problem: AttentionProblem) -> tuple[str, Mapping[str, Measurement]] | None:
        entry = active_cache().lookup(problem)
        return None if entry is None else (problem_key(problem), entry.results)

    def plugin_section(self, plugin: str) -> Mapping[str, Any]:
        return active_cache().plugins.get(plugin, {})


def reload() -> None:
    """Forget what was read, so the next "auto" choice reads the file again (and forgets its choices)."""
    global _active
    _active = None
    reload_tuning()
