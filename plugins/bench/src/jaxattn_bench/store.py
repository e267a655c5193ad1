"""Writing the tuning cache: what ``jaxattn tune`` (and ``bench --tune``) store for "auto".

``jaxattn_bench.records`` reads the file (its format, its place, the checks of every record) and
hands "auto" its records; this module writes it in that format. :class:`TuningStore` is that
``TuningCache`` with the writing methods: ``record`` measurements of a problem, ``update_plugin``
a plugin's own object (the Triton plugin's kernel tiles), then ``save`` atomically, after
which "auto" in this process sees the new records at once.

Several processes may save at once (a tuning job per device, a Triton plugin storing its tiles
while ``jaxattn tune`` runs): ``save`` holds an exclusive lock on ``<file>.lock`` (``fcntl``'s,
where the platform has it) while it reads the file as it is now, merges in what this store
recorded since it was loaded, and replaces the file. No writer's records are lost; for one
problem and impl the later save wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxattn.backend import JaxattnError, Measurement

from .keys import problem_key
from .records import FORMAT, Entry, Section, TuningCache, reload

if TYPE_CHECKING:
    from jaxattn.backend import AttentionProblem

__all__ = ["TuningCacheError", "TuningStore", "check_writable"]


class TuningCacheError(JaxattnError, OSError):
    """The tuning cache cannot be written where it lives (only writing raises it: reading never does)."""


def _measurement_dict(m: Measurement) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(m).items() if k != "impl"}


def _entry_dict(entry: Entry) -> dict[str, Any]:
    return {"problem": entry.problem, "measured_at": entry.measured_at,
            "results": {name: _measurement_dict(m) for name, m in sorted(entry.results.items())}}


def _section_dict(section: Section) -> dict[str, Any]:
    out: dict[str, Any] = {"environment": section.environment.to_dict(),
                           "entries": {k: _entry_dict(e) for k, e in sorted(section.entries.items())}}
    if section.plugins:
        out["plugins"] = {name: section.plugins[name] for name in sorted(section.plugins)}
    return out


class TuningStore(TuningCache):
    """The tuning cache, writable: ``TuningStore.load()``, ``record`` / ``update_plugin``, ``save()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What this store recorded since it was loaded: what save() merges into the file as it is then.
        self._recorded: dict[str, Entry] = {}
        self._updated: dict[str, dict[str, Any]] = {}
        self._cleared = False  # clear(): save() writes this device's section anew, not merged

    def clear(self) -> None:
        """Forget this device's measurements and plugin values; ``save()`` then replaces them in
        the file (others' sections stay), rather than merging them back from it."""
        self.entries.clear()
        self.plugins.clear()
        self._recorded.clear()
        self._updated.clear()
        self._cleared = True

    def _changes(self) -> tuple[dict[str, Entry], dict[str, dict[str, Any]]]:
        return self._recorded, self._updated

    def record(self, problem: AttentionProblem, measurements: Iterable[Measurement]) -> Entry:
        """Store (merge) ``measurements`` for ``problem``'s key; newer results replace older ones."""
        key = problem_key(problem)
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        entry = self.entries.get(key) or Entry(problem=problem.describe(), measured_at=now, results={})
        new = {m.impl: m for m in measurements}
        entry.results.update(new)
        entry.problem, entry.measured_at = problem.describe(), now
        self.entries[key] = entry
        recorded = self._changes()[0]
        mine = recorded.setdefault(key, Entry(problem=entry.problem, measured_at=now, results={}))
        mine.results.update(new)
        mine.problem, mine.measured_at = entry.problem, now
        return entry

    def update_plugin(self, plugin: str, values: Mapping[str, Any]) -> None:
        """Merge ``values`` (JSON-serialisable) into ``plugin``'s object of this environment."""
        self.plugins[plugin] = {**self.plugins.get(plugin, {}), **values}
        updated = self._changes()[1]
        updated[plugin] = {**updated.get(plugin, {}), **values}

    def _merge_current_file(self) -> None:
        """Take the file as it is now (other processes may have saved since this store was
        loaded) and apply this store's own records and plugin values on top of it."""
        recorded, updated = self._changes()
        now = TuningCache.load(self.path, self.environment)
        if self._cleared:  # this device's section as cleared, then what was recorded since
            now.entries.clear()
            now.plugins.clear()
        for key, mine in recorded.items():
            entry = now.entries.get(key)
            if entry is None:
                now.entries[key] = Entry(mine.problem, mine.measured_at, dict(mine.results))
            else:
                entry.results.update(mine.results)
                entry.problem, entry.measured_at = mine.problem, mine.measured_at
        for plugin, values in updated.items():
            now.plugins[plugin] = {**now.plugins.get(plugin, {}), **values}
        self.entries, self.plugins, self.others = now.entries, now.plugins, now.others

    def to_dict(self) -> dict[str, Any]:
        # Sections of this device under other versions are stale for good: drop them.
        keep = {fp: s for fp, s in self.others.items() if s.environment.device_kind != self.environment.device_kind}
        keep[self.environment.fingerprint] = Section(self.environment, self.entries, self.plugins)
        return {"format": FORMAT, "sections": [_section_dict(keep[fp]) for fp in sorted(keep)]}

    def save(self) -> Path:
        """Write atomically (a reader never sees half a file), then let "auto" see the new results.

        Raises :class:`TuningCacheError` (one line: the path, the cause, what to do) when the
        file cannot be written there.
        """
        self.check_writable()
        with _locked(self.path):
            self._merge_current_file()
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` while saving (blocking: a save takes milliseconds).
    Where ``fcntl`` is missing (Windows) saves are not serialised: the last one wins."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _cannot_write(lock, err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
