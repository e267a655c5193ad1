"""The multi-device benchmarks run end to end on the 8-device host mesh with tiny shapes.

``benchmarks/ring_bench.py`` (ring on 1/2/4 devices against the best single-device backend and
all-gathered K/V) and ``benchmarks/paged_sharded_bench.py`` (head-sharded paged decode, 1 vs N
devices) are meant for multi-GPU machines; this keeps them runnable between such runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ._util import requires_8_devices

pytestmark = requires_8_devices

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_ring_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ring.json"
    bench = load("ring_bench")
    from jaxattn_ring.comm import COMMS

    # Every comm ring takes has rows of its own ("auto" runs ppermute's code on CPUs: not timed here).
    assert set(bench.COMM_TAGS) == set(COMMS)
    assert len(set(bench.COMM_TAGS.values())) == len(COMMS)
    code = bench.main(["--devices", "2", "--seqs", "32", "--modes", "causal", "--passes", "fwd,fwdbwd",
                       "--heads", "2", "--kv-heads", "1", "--dim", "8", "--dtype", "float32",
                       "--reps", "1", "--check-seq", "32", "--ring-inputs", "natural,zigzag",
                       "--ring-comms", "ppermute,all_gather", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert {r["config"] for r in report["records"]} == {"1dev:blockwise", "ring2:auto", "ring2z:auto",
                                                        "ring2ag:auto", "ring2zag:auto", "gather2:blockwise"}
    assert all(r["status"] == "ok" for r in report["records"]), report["records"]
    for key, errs in report["check"].items():  # ring and gather against the baseline on one device
        assert "error" not in errs and max(errs.values()) < 1e-4, (key, errs)
    assert "causal, fwdbwd" in printed and "x gather]" in printed, printed


def test_paged_sharded_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "paged.json"
    code = load("paged_sharded_bench").main(["--devices", "1,2", "--batch", "3", "--context", "32", "--heads-q", "4",
                                             "--heads-kv", "2", "--dim", "8", "--dtype", "float32", "--reps", "1",
                                             "--ragged", "--prefill", "5", "--layers", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    records = json.loads(out.read_text())["records"]
    assert [r["devices"] for r in records] == [1, 2]
    assert all(r["status"] == "ok" and r["max_abs_diff_vs_1"] < 1e-5 for r in records), records
