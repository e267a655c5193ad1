"""``jaxattn tune``: measures the toy impls, stores them, and auto follows; --show and --clear."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import jaxattn
from jaxattn.cli import main
from jaxattn_bench.store import TuningStore

from .helpers import FakeTimer, noisy, problem, qkv

pytestmark = [pytest.mark.usefixtures("toys"), pytest.mark.slow]

ARGS = ["--shape", "2,16,4,8", "--shape", "2,16,4,8,2", "--mask", "causal", "--warmup", "0", "--repeats", "2",
        "--progress", "plain", "--plain", "--compile-workers", "1"]


def test_tune_stores_every_candidate_and_auto_uses_it(cache_dir: Path, capsys: pytest.CaptureFixture[str],
                                                      fake_timer: FakeTimer) -> None:
    # A quiet machine (tune stores only steady timings, and this machine's real ones at 0.1 ms are not)
    fake_timer({"alpha": noisy(0.3), "beta": noisy(0.2), "nogqa": noisy(0.25)}, repeats=2, rounds=2)
    assert main(["tune", *ARGS]) == 0
    out, err = capsys.readouterr()
    assert "auto's picks after tuning" in out and "float32/D8/T16/S16/causal" in out
    assert re.search(r"\[ *1/12\] B2 S16 H4 D8 causal +alpha +fwd ", err)  # progress lines
    cache = TuningStore.load()
    mha = cache.lookup(problem())
    gqa = cache.lookup(problem(hkv=2))
    assert mha is not None and gqa is not None
    # every impl that runs here was timed, forward and forward+backward; nogqa declines GQA
    assert set(mha.results) == {"alpha", "beta", "nogqa"}
    assert set(gqa.results) == {"alpha", "beta"}
    assert all(m.fwd_ms and m.fwdbwd_ms and m.origin == "<runtime>" for m in mha.results.values())
    # auto now ranks by the stored times
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    fastest = min(mha.results.values(), key=lambda m: (m.fwd_ms, ["alpha", "beta", "nogqa"].index(m.impl)))
    assert exp.chosen == fastest.impl and exp.candidates[0].measured

    assert main(["tune", "--show", "--plain"]) == 0
    shown = capsys.readouterr().out
    assert "float32/D8/T16/S16/causal+gqa" in shown and "nogqa" in shown
    assert main(["tune", "--show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == 1

    assert main(["tune", "--clear", "--plain"]) == 0
    assert len(TuningStore.load()) == 0
    capsys.readouterr()


def test_tune_json_lists_picks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", *ARGS, "--impls", "alpha,beta", "--modes", "fwd", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in rows] == ["float32/D8/T16/S16/causal", "float32/D8/T16/S16/causal+gqa"]
    assert {r["auto"] for r in rows} <= {"alpha", "beta"}
