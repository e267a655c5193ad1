"""Several processes saving tuning records at once keep every record: ``TuningStore.save`` merges
into the file as it is under a lock (plugins/bench's store), instead of replacing it with what
the process loaded (19-26 of 64 entries survived four writers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WRITER = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jaxattn import AttentionProblem
    from jaxattn.discovery.plugins import RUNTIME_PLUGIN
    from jaxattn.selection.tuning import Measurement
    from jaxattn_bench.store import TuningStore

    worker, count = int(sys.argv[1]), int(sys.argv[2])
    for n in range(count):
        # One problem key per (worker, n): its own head dim and sequence bucket.
        q = jax.ShapeDtypeStruct((2, 16 * 2 ** n, 4, 8 * (worker + 1)), jnp.float32)
        problem = AttentionProblem.from_inputs(q, q, q, causal=True)
        store = TuningStore.load()
        store.record(problem, [Measurement(impl=f"toy{worker}", origin=RUNTIME_PLUGIN, version=None,
                                           fwd_ms=1.0 + n, fwdbwd_ms=None)])
        store.update_plugin("toys", {f"w{worker}n{n}": n})
        store.save()
""")


def test_concurrent_writers_keep_every_entry(tmp_path: Path) -> None:
    workers, count = 4, 16
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "JAXATTN_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    env.pop("JAXATTN_TUNING", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(w), str(count)], env=env, stderr=subprocess.PIPE,
                              text=True) for w in range(workers)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    files = list((tmp_path / "cache").rglob("*.json"))
    assert len(files) == 1, files
    data = json.loads(files[0].read_text())
    (section,) = data["sections"]
    assert len(section["entries"]) == workers * count
    impls = sorted(name for entry in section["entries"].values() for name in entry["results"])
    assert impls == sorted(f"toy{w}" for w in range(workers) for _ in range(count))
    assert len(section["plugins"]["toys"]) == workers * count
    assert not [p for p in files[0].parent.iterdir() if p.name.startswith(".tuning-")]  # no temp file left


def test_a_store_merges_what_another_saved_meanwhile() -> None:
    from jaxattn_bench.keys import problem_key
    from jaxattn_bench.store import TuningStore

    from .helpers import problem, runtime

    first, second = TuningStore.load(), TuningStore.load()  # both loaded before either saves
    first.record(problem(t=16), [runtime("a", 1.0)])
    first.update_plugin("p", {"x": 1})
    first.save()
    second.record(problem(t=64), [runtime("b", 2.0)])
    second.record(problem(t=16), [runtime("c", 3.0)])
    second.update_plugin("p", {"y": 2})
    second.save()
    back = TuningStore.load()
    short, long = problem_key(problem(t=16)), problem_key(problem(t=64))
    assert {k: sorted(e.results) for k, e in back.entries.items()} == {short: ["a", "c"], long: ["b"]}
    assert back.entries[short].results["c"].fwd_ms == 3.0
    assert back.plugins["p"] == {"x": 1, "y": 2}


def test_clear_forgets_what_is_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``clear()`` then ``save()`` empties this device's section: saves merge with the file as it
    is, so a cleared store must not take the file's records back."""
    from jaxattn_bench.store import TuningStore

    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    first = TuningStore.load()
    first.update_plugin("probe", {"x": 1})
    first.save()
    assert TuningStore.load().plugins == {"probe": {"x": 1}}
    cleared = TuningStore.load()
    cleared.clear()
    cleared.save()
    assert TuningStore.load().plugins == {}
    assert TuningStore.load().entries == {}
