"""Pictures of benchmark results: ``jaxattn bench --from-json PATH --plot PNG`` draws what a
``--json`` run saved (a bench run or a ``--serving`` run), without running anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jaxattn.cli import main
from jaxattn_bench.plot import BENCH_FORMAT, MISSING, write_plot

PNG = b"\x89PNG\r\n\x1a\n"


def _bench_json() -> dict[str, Any]:
    """Results as ``jaxattn bench --json`` writes them: two modes, three sequence lengths, a
    GQA shape, a reference and a backend that declines."""
    results = []
    for mode, factor in (("fwd", 1.0), ("fwdbwd", 3.5)):
        for seq in (1024, 2048, 4096):
            for hkv in (32, 8):
                shape = {"batch": 16384 // seq, "seq_q": seq, "seq_k": seq, "heads_q": 32, "heads_kv": hkv,
                         "head_dim": 128, "causal": True, "dtype": "bfloat16",
                         "label": f"B{16384 // seq} S{seq} H32/{hkv} D128 causal"}
                for backend, tflops in (("cudnn", 400.0), ("flash_attn2", 380.0 + seq / 100), ("auto", 401.0)):
                    results.append({"shape": shape, "backend": backend, "mode": mode, "status": "ok",
                                    "tflops": tflops * factor / 3.5 if mode == "fwdbwd" else tflops,
                                    "ratio": tflops / 400.0, "median_ms": 1.0})
                results.append({"shape": shape, "backend": "vanilla", "mode": mode, "status": "skipped",
                                "reason": "needs 40 GiB", "tflops": None, "ratio": None})
    return {"format": BENCH_FORMAT, "device": "NVIDIA H100 80GB HBM3 x1",
            "environment": {"versions": {"jax": "0.11.2"}, "jaxattn": "0.1.0"},
            "config": {"reference": "cudnn", "backends": ["cudnn", "flash_attn2", "vanilla", "auto"]},
            "results": results}


def _serving_json() -> dict[str, Any]:
    results = []
    for ctx in (8192, 32768):
        shape = {"batch": 16, "context": ctx, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "page_size": 16,
                 "dtype": "bfloat16", "label": f"B16 ctx{ctx} H32/8 D128 page16"}
        for backend, gbps, ratio in (("memory read", 3000.0, None), ("page_attention", 2800.0, 0.97),
                                     ("auto", 2790.0, 0.96), ("cudnn (dense)", 2880.0, 1.0)):
            results.append({"shape": shape, "backend": backend, "status": "ok", "gbps": gbps, "ratio": ratio,
                            "median_ms": 0.2})
        results.append({"shape": shape, "backend": "pallas_gpu_paged", "status": "declined", "reason": "x",
                        "gbps": None, "ratio": None})
    return {"device": "NVIDIA H100 80GB HBM3 x1", "kind": "serving", "results": results}


@pytest.fixture
def matplotlib() -> Any:
    return pytest.importorskip("matplotlib", reason="the pictures need matplotlib (jaxattn[bench])")


@pytest.mark.usefixtures("matplotlib")
@pytest.mark.parametrize("kind", ["bench", "serving"])
def test_from_json_draws_saved_results(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved, png = tmp_path / f"{kind}.json", tmp_path / "out" / f"{kind}.png"
    saved.write_text(json.dumps(_bench_json() if kind == "bench" else _serving_json()))
    assert main(["bench", "--from-json", str(saved), "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == PNG and len(data) > 20_000  # a picture, not an empty canvas


@pytest.mark.usefixtures("matplotlib")
def test_bench_picture_is_titled_with_the_machine_and_labelled(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    titles: list[str] = []
    real = plt.Figure.savefig

    def savefig(fig: Any, *args: Any, **kwargs: Any) -> None:
        titles.append(fig._suptitle.get_text())
        titles.extend(ax.get_ylabel() for ax in fig.axes)
        titles.extend(ax.get_title() for ax in fig.axes)
        real(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    assert write_plot(_bench_json(), tmp_path / "b.png") is None
    text = "\n".join(titles)
    assert "NVIDIA H100" in text and "bfloat16" in text and "jax 0.11.2" in text
    assert "TFLOP/s" in text and "x cudnn" in text  # the ratio strips name their peer
    assert "D=128, GQA 4:1, causal, forward+backward" in text
    titles.clear()
    assert write_plot(_serving_json(), tmp_path / "s.png") is None
    assert "ratio to cudnn (dense)" in titles[0]


def test_from_json_needs_a_plot_path_and_a_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps({"something": "else"}))
    assert main(["bench", "--from-json", str(saved)]) == 2
    assert "--plot" in capsys.readouterr().err
    assert main(["bench", "--from-json", str(tmp_path / "missing.json"), "--plot", str(tmp_path / "p.png")]) == 1
    assert "cannot read" in capsys.readouterr().err
    why = write_plot({"something": "else"}, tmp_path / "p.png")
    assert why is not None and ("not a jaxattn bench result" in why or why == MISSING)
    assert not (tmp_path / "p.png").exists()


def test_without_matplotlib_nothing_is_written_and_the_reason_names_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr("importlib.import_module", lambda name: no_matplotlib(name))
    assert write_plot(_bench_json(), tmp_path / "b.png") == MISSING
    assert "jaxattn[bench]" in MISSING and not (tmp_path / "b.png").exists()
