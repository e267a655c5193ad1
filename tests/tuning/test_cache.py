"""The tuning cache: keys, where it lives, round trips, and what is ignored (with a warning)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from jaxattn.selection.tuning import TuningCacheWarning
from jaxattn_bench.keys import Environment, current_environment, problem_key, seq_bucket
from jaxattn_bench.records import default_cache_path, parse_measurement
from jaxattn_bench.store import TuningStore

from .helpers import problem, runtime, store

ENV = Environment(platform="gpu/cuda", device_kind="NVIDIA H100 80GB HBM3", jax="0.11.2", jaxlib="0.11.2")


def test_seq_bucket_rounds_up_to_a_power_of_two() -> None:
    assert [seq_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025, 16384)] == [1, 2, 4, 1024, 1024, 2048, 16384]


def test_problem_key_holds_dtype_head_dim_bucket_and_features() -> None:
    base = problem(t=1000, causal=True)
    assert problem_key(base) == "float32/D8/T1024/S1024/causal"
    # batch and head counts scale every backend alike: not in the key
    assert problem_key(dataclasses.replace(base, batch=64, heads_q=32, heads_kv=32)) == problem_key(base)
    # gradients are not in the key: one entry holds forward and forward+backward times
    assert problem_key(dataclasses.replace(base, needs_grad=True)) == problem_key(base)
    assert problem_key(dataclasses.replace(base, seq_q=1024, seq_k=1024)) == problem_key(base)
    for other in (dataclasses.replace(base, dtype="bfloat16"), dataclasses.replace(base, head_dim=64, head_dim_v=64),
                  dataclasses.replace(base, seq_q=1025, seq_k=1025), dataclasses.replace(base, causal=False),
                  dataclasses.replace(base, heads_kv=1), dataclasses.replace(base, mask_shape=(1, 1, 1000, 1000))):
        assert problem_key(other) != problem_key(base), other
    assert problem_key(problem(hkv=2, causal=False)) == "float32/D8/T16/S16/gqa"


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_path() == tmp_path / "x" / "tuning.json"
    monkeypatch.delenv("JAXATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.platform", "linux")
    assert default_cache_path() == tmp_path / "xdg" / "jaxattn" / "tuning.json"


def test_round_trip_keeps_measurements(cache_dir: Path) -> None:
    prob = problem()
    store(prob, runtime("alpha", 2.0, 6.0), runtime("beta", 1.0, None))
    again = TuningStore.load()
    entry = again.lookup(prob)
    assert entry is not None
    assert entry.results["alpha"] == runtime("alpha", 2.0, 6.0)
    assert entry.results["beta"].fwdbwd_ms is None
    assert again.lookup(problem(d=16)) is None
    # newer results for the same key replace older ones, impl by impl
    store(prob, runtime("beta", 0.5, 1.5))
    entry = TuningStore.load().lookup(prob)
    assert entry is not None
    assert entry.results["beta"].fwd_ms == 0.5 and entry.results["alpha"].fwd_ms == 2.0
    assert (cache_dir / "tuning.json").is_file()


@pytest.mark.parametrize("text", [
    "{not json",
    "[]",
    '{"format": 999, "sections": []}',
    '{"format": 1, "sections": [{"environment": {"platform": 1}, "entries": {}}]}',
    '{"format": 1, "sections": [{"environment": ENV, "entries": {"k": {"results": {"a": {"fwd_ms": -1}}}}}]}',
])
def test_corrupt_cache_is_ignored_with_a_warning(cache_dir: Path, text: str) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuning.json").write_text(text.replace("ENV", json.dumps(current_environment().to_dict())))
    with pytest.warns(TuningCacheWarning, match="corrupt"):
        cache = TuningStore.load()
    assert len(cache) == 0


def test_unreadable_cache_is_ignored_with_a_warning(cache_dir: Path) -> None:
    (cache_dir / "tuning.json").mkdir(parents=True)  # a folder where the file should be
    with pytest.warns(TuningCacheWarning, match="cannot read"):
        assert len(TuningStore.load()) == 0


def test_missing_cache_is_silent(cache_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(TuningStore.load()) == 0


def test_other_jax_version_of_this_device_is_stale(cache_dir: Path) -> None:
    old = dataclasses.replace(ENV, jax="0.10.0", jaxlib="0.10.0")
    cache = TuningStore(cache_dir / "tuning.json", old)
    cache.record(problem(), [runtime("alpha", 1.0)])
    cache.save()
    with pytest.warns(TuningCacheWarning, match=r"jax 0\.10\.0.*not used"):
        now = TuningStore.load(environment=ENV)
    assert now.lookup(problem()) is None
    # Writing this version's results drops the stale section for good.
    now.record(problem(), [runtime("beta", 2.0)])
    now.save()
    sections = json.loads((cache_dir / "tuning.json").read_text())["sections"]
    assert [s["environment"]["jax"] for s in sections] == ["0.11.2"]


def test_other_device_kinds_are_kept_but_not_used(cache_dir: Path) -> None:
    a100 = dataclasses.replace(ENV, device_kind="NVIDIA A100-SXM4-80GB")
    cache = TuningStore(cache_dir / "tuning.json", a100)
    cache.record(problem(), [runtime("alpha", 1.0)])
    cache.save()
    mine = TuningStore.load(environment=ENV)  # another machine's section: no warning, not used
    assert mine.lookup(problem()) is None
    mine.record(problem(), [runtime("beta", 3.0)])
    mine.save()
    assert TuningStore.load(environment=a100).lookup(problem()).results.keys() == {"alpha"}  # type: ignore[union-attr]
    assert TuningStore.load(environment=ENV).lookup(problem()).results.keys() == {"beta"}  # type: ignore[union-attr]


def test_measurement_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        parse_measurement("a", {"fwd_ms": "fast"})
    assert parse_measurement("a", {"fwd_ms": 1, "origin": "x", "version": "1"}).fwd_ms == 1.0
