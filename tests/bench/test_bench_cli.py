"""``jaxattn bench --quick`` on the CPU: the installed backends, a table, JSON and a PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import jaxattn
from jaxattn.cli import main

pytestmark = pytest.mark.slow

# vanilla as the reference everywhere (the default is cudnn where it runs), so the test holds on a GPU too
QUICK = ["bench", "--quick", "--mask", "causal", "--warmup", "1", "--repeats", "2", "--progress", "plain", "--plain",
         "--reference", "vanilla"]


def test_quick_bench_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = [i.name for i in jaxattn.list_impls() if i.usable_here and i.kind == "dense"]
    assert "vanilla" in here, "the test environment installs jaxattn-vanilla"
    json_path, png = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    assert main([*QUICK, "--json", str(json_path), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()

    # a table per mode, a heading per shape, a row per backend that ran, ratios against vanilla
    # (the CPU reference); a backend that declined every shape is said once, after the tables
    assert "Forward on cpu" in out and "Forward+backward on cpu" in out
    for column in ("TFLOP/s", "vs vanilla", "vs best", "temp"):
        assert column in out
    assert out.count("\nB2 S64 H4 D32 causal\n") == 2
    lines = out.splitlines()
    for name in [*here, "auto"]:
        assert any(line.startswith(f"{name} ") for line in lines) or f"- {name} declined on" in out, name
    assert "1.00x" in out  # the reference against itself
    assert "[ 1/" in err or "[1/" in err  # progress while it ran

    report = json.loads(json_path.read_text())
    assert report["format"] == "jaxattn-bench/1" and report["config"]["reference"] == "vanilla"
    assert {s["label"] for s in report["config"]["shapes"]} == {
        "B2 S64 H4 D32 causal",
        "B1 S128 H4 D32 causal",
        "B2 S64 H4/1 D32 causal",
        "B1 S128 H4/1 D32 causal",
    }
    ok = [r for r in report["results"] if r["status"] == "ok"]
    assert {(r["backend"], r["mode"]) for r in ok} >= {
        ("vanilla", "fwd"),
        ("vanilla", "fwdbwd"),
        ("auto", "fwd"),
        ("auto", "fwdbwd"),
    }
    for r in ok:
        shape = r["shape"]
        flops = 4 * shape["batch"] * shape["heads_q"] * shape["seq_q"] * shape["seq_k"] * shape["head_dim"] / 2
        flops *= 3.5 if r["mode"] == "fwdbwd" else 1
        assert r["tflops"] == pytest.approx(flops / (r["median_ms"] * 1e-3) / 1e12)
        assert len(r["times_ms"]) == 2 and r["temp_bytes"] is not None
    assert all(r["ratio"] == pytest.approx(1.0) for r in ok if r["backend"] == "vanilla")
    assert all(r["note"].startswith("-> ") for r in ok if r["backend"] == "auto")
    # auto beside the fastest backend of the same run: its ratio, and what ranked its pick
    gaps = report["summary"]["auto_gaps"]
    assert gaps and all(0 < g["vs_best"] <= 1.0 + 1e-9 and g["vs_best"] == pytest.approx(
        g["fastest_ms"] / g["auto_ms"]) for g in gaps)
    assert all(g["auto_ranked_by"] in ("shipped prior", "your tuning record", "declared priority") for g in gaps)
    assert "auto vs the fastest backend: geomean" in " ".join(out.split())

    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot written to {png}" in " ".join(out.split())  # a long path wraps to the width


def test_json_to_stdout_and_impl_selection(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*QUICK, "--impls", "vanilla", "--no-auto", "--modes", "fwd", "--seqs", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(r["backend"], r["mode"]) for r in report["results"]} == {("vanilla", "fwd")}
    assert len(report["results"]) == 2  # S=64, MHA and GQA


def test_overhead_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--overhead", "--shape", "1,16,2,8", "--mask", "causal", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "eager: attention(impl='auto')" in out and "choose(): memo hit" in out
    assert "identical to the chosen impl's" in out


def test_a_window_and_a_soft_cap_reach_every_call_and_the_tuning_key(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # bench and tune time the call with the features, FLOPs count the window's pairs, and the
    # tuning cache keys them apart from plain calls.
    assert main([*QUICK, "--impls", "vanilla", "--no-auto", "--modes", "fwd", "--seqs", "64", "--window", "8,0",
                 "--soft-cap", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {s["label"] for s in report["config"]["shapes"]} == {"B2 S64 H4 D32 causal window 8,0 cap 5",
                                                                 "B2 S64 H4/1 D32 causal window 8,0 cap 5"}
    for r in report["results"]:
        assert r["status"] == "ok", r
        pairs = sum(min(i, 63) - max(0, i - 8) + 1 for i in range(64))
        assert r["tflops"] == pytest.approx(4 * 2 * 4 * pairs * 32 / (r["median_ms"] * 1e-3) / 1e12)
    from jaxattn_bench.keys import problem_key
    from jaxattn_bench.record import problem_of
    from jaxattn_bench.shapes import BenchShape

    key = problem_key(problem_of(BenchShape(2, 64, 64, 4, 4, 32, True, "float32", sliding_window=(8, 0),
                                            soft_cap=5.0)))
    assert "sliding_window" in key and "soft_cap" in key, key


def test_bad_arguments_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # refused while parsing, before anything runs
        main(["bench", "--shape", "1,2,3", "--plain"])
    assert exit_info.value.code == 2 and "--shape" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # names too: refused while parsing
        main(["bench", "--quick", "--modes", "sideways", "--plain"])
    assert exit_info.value.code == 2
    assert "argument --modes: 'sideways' is not one of fwd, fwdbwd" in capsys.readouterr().err


def test_serving_bench_reports_bandwidth_for_paged_and_dense_decode(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--serving``: every paged backend, dense decode on the same tokens and the memory-read bar,
    with GB/s from the bytes of K and V; mixed batches also as separate calls."""
    path = tmp_path / "serving.json"
    png = tmp_path / "serving.png"
    assert main(["bench", "--serving", "--quick", "--repeats", "2", "--json", str(path), "--plain",
                 "--plot", str(png)]) == 0
    out, _ = capsys.readouterr()
    assert "GB/s" in out and "memory read" in out and "vs best" in out
    assert "paged auto vs the fastest paged backend: geomean" in " ".join(out.split())
    if importlib.util.find_spec("matplotlib") is None:  # --plot is never ignored: drawn, or why not
        assert "matplotlib is not installed" in out and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in " ".join(out.split())
    report = json.loads(path.read_text())
    rows = {(r["shape"]["label"], r["backend"]): r for r in report["results"]}
    decode = "B4 ctx96 H4/2 D32 page16"
    # On a CPU the one paged backend is jaxattn-vanilla's reference (the mechanism names are its aliases).
    for backend in ("vanilla_paged", "auto", "vanilla (dense)", "autoregressive_decodeattn (dense)", "memory read"):
        row = rows[(decode, backend)]
        assert row["status"] == "ok" and row["median_ms"] > 0, row
        # bytes of K and V: 4 sequences x 96 tokens x 2 heads x (K + V) x 32 dims x 4 bytes
        assert row["gbps"] == pytest.approx(4 * 96 * 2 * 2 * 32 * 4 / (row["median_ms"] * 1e-3) / 1e9)
    assert rows[(decode, "vanilla_paged")]["ratio"] == pytest.approx(1.0)  # the CPU reference
    assert rows[(decode, "auto")]["note"] == "-> vanilla_paged"
    gap = next(g for g in report["summary"]["auto_vs_best"] if g["shape"] == decode)
    assert gap["fastest"] == "vanilla_paged" and gap["vs_best"] == pytest.approx(
        rows[(decode, "vanilla_paged")]["median_ms"] / rows[(decode, "auto")]["median_ms"])
    assert rows[(decode, "pallas_gpu_paged")]["status"] == "declined"
    assert "needs a CUDA GPU" in rows[(decode, "pallas_gpu_paged")]["reason"]
    mixed = next(label for label, _ in rows if "prefill" in label)
    for backend in ("vanilla_paged", "vanilla_paged separate", "auto"):
        assert rows[(mixed, backend)]["status"] == "ok", rows[(mixed, backend)]
    assert rows[(mixed, "vanilla_paged separate")]["note"] == "two calls"
    assert (mixed, "vanilla (dense)") not in rows  # dense decode only beside decode shapes


def test_serving_pools_lay_pages_out_in_a_random_order_or_in_order() -> None:
    """A fragmented pool (every table a random permutation of the pages) is the default; the GPU
    matrix also runs two decode shapes on a fresh pool, each sequence's pages consecutive."""
    from jaxattn_bench.serving import ServingShape, _inputs, serving_matrix

    fresh = ServingShape(3, 40, 4, 2, 16, 16, "float32", pool="in order")
    in_order = np.asarray(_inputs(fresh)["page_table"])
    np.testing.assert_array_equal(in_order, np.arange(9).reshape(3, 3))
    shuffled = np.asarray(_inputs(dataclasses.replace(fresh, pool="random"))["page_table"])
    assert sorted(shuffled.ravel().tolist()) == list(range(9)) and not np.array_equal(shuffled, in_order)
    assert fresh.label == "B3 ctx40 H4/2 D16 page16 pages in order"
    assert [s.label for s in serving_matrix() if s.pool == "in order"] == [
        "B16 ctx8192 H32/8 D128 page16 pages in order", "B16 ctx32768 H32/8 D128 page16 pages in order"]
    with pytest.raises(ValueError, match="pool='sorted' must be one of"):
        ServingShape(3, 40, 4, 2, 16, 16, "float32", pool="sorted")


def test_serving_address_order_pool_sorts_each_rows_full_pages() -> None:
    """The random pool with every row's fully visible pages in address order: the same pages per
    row as the random pool, the band ascending, the page holding the query (and the chunk of a
    mixed shape) in place."""
    from jaxattn_bench.serving import ServingShape, _inputs, serving_matrix

    shape = ServingShape(3, 40, 4, 2, 16, 8, "float32", pool="address order", prefill=1, chunk=20)
    ordered = np.asarray(_inputs(shape)["page_table"])
    shuffled = np.asarray(_inputs(dataclasses.replace(shape, pool="random"))["page_table"])
    assert not np.array_equal(ordered, shuffled)
    # Decode rows: 40 tokens in 5 full pages; the query sits at 39, in the fifth, which stays: 4 pages
    # before it. The prefill row's first query sits at 20: 2 pages before it.
    for row, full in zip(range(4), (4, 4, 4, 2), strict=True):
        np.testing.assert_array_equal(ordered[row, :full], np.sort(shuffled[row, :full]))
        np.testing.assert_array_equal(ordered[row, full:], shuffled[row, full:])
    assert shape.label == "B3 ctx40 H4/2 D16 page8 + 1x20 prefill pages in address order"
    assert [s.label for s in serving_matrix() if s.pool == "address order"] == [
        f"B16 ctx{ctx} H32/8 D128 page16 pages in address order" for ctx in (8192, 32768, 65536)]


def test_serving_runs_pool_hands_out_sixteen_consecutive_pages_at_a_time() -> None:
    """Runs of 16 consecutive pages in a random order; a pool that is not whole runs is rounded
    up (distinct pages, all inside the pool)."""
    from jaxattn_bench.serving import RUN, ServingShape, _inputs, serving_matrix

    arrays = _inputs(ServingShape(3, 100, 4, 2, 16, 4, "float32", pool="runs of 16"))  # 75 pages: 5 runs
    flat = np.asarray(arrays["page_table"]).ravel()
    assert arrays["k_pages"].shape[0] == 5 * RUN and len(set(flat.tolist())) == 75 and flat.max() < 80
    runs = flat[: 4 * RUN].reshape(4, RUN)
    np.testing.assert_array_equal(runs - runs[:, :1], np.tile(np.arange(RUN), (4, 1)))
    assert runs[:, 0].tolist() != sorted(runs[:, 0].tolist()) and (runs[:, 0] % RUN == 0).all()
    assert [s.label for s in serving_matrix() if s.pool == "runs of 16"] == [
        f"B16 ctx{ctx} H32/8 D128 page16 pages in runs of 16" for ctx in (32768, 65536)]


def test_serving_bench_takes_mechanism_names_and_refuses_unknown_ones(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--impls`` names rows as asked, aliases included: page_attention resolves to the CPU's
    reference, under its own name; a name nothing registers is an error, not an empty table."""
    path = tmp_path / "serving.json"
    assert main(["bench", "--serving", "--quick", "--repeats", "2", "--no-auto", "--json", str(path), "--plain",
                 "--impls", "page_attention,ragged_page_attention_v3,autoregressive_decodeattn"]) == 0
    capsys.readouterr()
    report = json.loads(path.read_text())
    backends = {r["backend"] for r in report["results"]}
    assert {"page_attention", "ragged_page_attention_v3", "autoregressive_decodeattn (dense)"} <= backends
    assert not backends & {"vanilla_paged", "auto", "vanilla (dense)"}
    decode = [r for r in report["results"] if r["shape"]["label"] == "B4 ctx96 H4/2 D32 page16"]
    assert {r["backend"]: r["status"] for r in decode}["page_attention"] == "ok"
    assert next(r for r in decode if r["backend"] == "page_attention")["ratio"] == pytest.approx(1.0)

    assert main(["bench", "--serving", "--quick", "--impls", "page_atention", "--plain"]) == 2
    assert "--impls: no impl is named 'page_atention' (did you mean 'page_attention'" in capsys.readouterr().err


def test_serving_bench_keeps_to_its_time_budget_and_says_what_it_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--time-budget`` starts no new shape once spent: each one left is one ``skipped`` row, in the
    table and the JSON; progress goes to stderr, one line per row."""
    path = tmp_path / "serving.json"
    assert main(["bench", "--serving", "--quick", "--time-budget", "0", "--json", str(path), "--plain"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(path.read_text())["results"]
    assert len(rows) == 3 and {r["status"] for r in rows} == {"skipped"}, rows
    assert all(r["backend"] == "(every backend)" and "time budget of 0 s" in r["reason"] for r in rows)
    # said once after the table, not once per shape
    said = " ".join(out.split())
    assert "- (every backend) skipped on every shape (3)" in said and "time budget of 0 s" in said
    assert err.count("| (every backend): skipped") == 3
