"""A damaged tuning cache is a warning and is ignored, whatever its bytes; bad records are dropped.

Reading never raises (auto must never fail because of the cache); writing where the cache
cannot live is one clear error, and one line from the CLI.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

import jaxattn
from jaxattn.cli import main
from jaxattn.selection.tuning import TuningCacheWarning
from jaxattn_bench import records as cache_module
from jaxattn_bench.keys import current_environment
from jaxattn_bench.store import TuningCacheError, TuningStore

from .helpers import problem, qkv, runtime, store


def _valid_file(cache_dir: Path) -> bytes:
    store(problem(), runtime("alpha", 2.0, 6.0), runtime("beta", 1.0, 3.0))
    return (cache_dir / "tuning.json").read_bytes()


DAMAGE = {
    "not utf-8": lambda good: b"\xff\xfe\x00{\x80\x81" + good,
    "nested 100000 deep": lambda good: b"[" * 100_000,
    "nested objects 100000 deep": lambda good: b'{"a":' * 100_000,
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "binary noise": lambda good: bytes(range(256)) * 4,
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_bytes_are_a_warning_and_auto_still_runs(cache_dir: Path, damage: str) -> None:
    good = _valid_file(cache_dir)
    (cache_dir / "tuning.json").write_bytes(DAMAGE[damage](good))
    cache_module.reload()
    with pytest.warns(TuningCacheWarning, match="corrupt"):
        assert len(TuningStore.load()) == 0
    # auto (through the active cache) neither raises nor uses the damaged file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningCacheWarning)
        q, k, v = qkv()
        out = jaxattn.attention(q, k, v, causal=True)
        assert out.shape == q.shape
        assert not jaxattn.explain(q, k, v, causal=True).candidates[0].measured


def test_a_folder_in_place_of_the_file(cache_dir: Path) -> None:
    (cache_dir / "tuning.json").mkdir(parents=True)
    with pytest.warns(TuningCacheWarning, match="cannot read"):
        assert len(TuningStore.load()) == 0
    cache = TuningStore(cache_dir / "tuning.json", current_environment())
    cache.record(problem(), [runtime("alpha", 1.0)])
    with pytest.raises(TuningCacheError, match=r"cannot write the tuning cache .*JAXATTN_CACHE_DIR"):
        cache.save()


def _section(results: dict[str, Any]) -> str:
    entry = {"problem": "p", "measured_at": "now", "results": results}
    return json.dumps({"format": 1, "sections": [
        {"environment": current_environment().to_dict(), "entries": {"float32/D8/T16/S16/causal": entry}}]})


@pytest.mark.parametrize("bad", [
    {"fwd_ms": math.inf}, {"fwd_ms": -math.inf}, {"fwd_ms": math.nan}, {"fwd_ms": True}, {"fwdbwd_ms": True},
    {"fwd_ms": False}, {"fwd_ms": 0}, {"fwd_ms": -1.0}, {"fwd_ms": "1.0"}, {"fwd_ms": [1.0]}, {"fwd_ms": 1e400},
    {"fwd_ms": 1.0, "origin": 3}, {"fwd_ms": 1.0, "version": True}, "fast", None,
], ids=repr)
def test_invalid_records_are_dropped_with_one_warning_naming_the_file(cache_dir: Path, bad: Any) -> None:
    good = {"origin": "<runtime>", "version": None, "fwd_ms": 2.0, "fwdbwd_ms": 6.0}
    cache_dir.mkdir(parents=True)
    path = cache_dir / "tuning.json"
    # json.dumps writes Infinity and NaN as the JSON extensions Python's json reads back
    path.write_text(_section({"alpha": good, "broken": bad, "also_broken": bad}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = TuningStore.load()
    mine = [w for w in caught if issubclass(w.category, TuningCacheWarning)]
    assert len(mine) == 1 and str(path) in str(mine[0].message) and "2 corrupt records" in str(mine[0].message)
    entry = cache.lookup(problem())
    assert entry is not None and set(entry.results) == {"alpha"}  # the valid record is still used
    assert entry.results["alpha"].fwd_ms == 2.0


def test_an_entry_with_only_invalid_records_is_dropped(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuning.json").write_text(_section({"alpha": {"fwd_ms": math.inf}}))
    with pytest.warns(TuningCacheWarning, match="1 corrupt record"):
        assert len(TuningStore.load()) == 0


def test_bool_format_is_not_format_1(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuning.json").write_text('{"format": true, "sections": []}')
    with pytest.warns(TuningCacheWarning, match="corrupt"):
        TuningStore.load()


@pytest.mark.parametrize("damage", ["not utf-8", "nested 100000 deep", "truncated"])
def test_tune_show_on_a_damaged_cache_warns_in_one_line(cache_dir: Path, damage: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    good = _valid_file(cache_dir)
    (cache_dir / "tuning.json").write_bytes(DAMAGE[damage](good))
    cache_module.reload()
    assert main(["tune", "--show", "--plain"]) == 0
    out, err = capsys.readouterr()
    assert "entries" in out
    assert [line for line in err.splitlines() if "warning" in line] == err.splitlines()
    assert err.startswith("jaxattn tune: warning: the tuning cache") and "corrupt" in err


@pytest.mark.parametrize("command", [["tune", "--clear"], ["tune", "--shape", "2,16,4,8"],
                                     ["bench", "--tune", "--shape", "2,16,4,8"]])
def test_cache_dir_under_a_regular_file_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           command: list[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(blocker / "jaxattn"))
    cache_module.reload()
    assert main([*command, "--plain"]) == 2  # before anything is measured
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"jaxattn {command[0]}: error: cannot write the tuning cache") and "JAXATTN_CACHE_DIR" in err


def test_cache_dir_under_a_regular_file_never_fails_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(blocker / "jaxattn"))
    cache_module.reload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningCacheWarning)
        q, k, v = qkv()
        assert jaxattn.attention(q, k, v, causal=True).shape == q.shape
    with pytest.raises(TuningCacheError, match="JAXATTN_CACHE_DIR"):
        store(problem(), runtime("alpha", 1.0))


@pytest.mark.parametrize("value", ["maybe", "2", "of"])
def test_a_bad_jaxattn_tuning_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("JAXATTN_TUNING", value)
    cache_module.reload()  # forget memoised choices: the next auto call ranks again
    q, k, v = qkv(t=24)
    with pytest.raises(jaxattn.InvalidInputError, match=r"\$JAXATTN_TUNING: '.*' is neither on nor off"):
        jaxattn.attention(q, k, v, causal=True)
    for ok in ("0", "off", "No", " true ", ""):
        monkeypatch.setenv("JAXATTN_TUNING", ok)
        cache_module.reload()
        assert jaxattn.attention(q, k, v, causal=True).shape == q.shape
