"""Every command-line value is validated before work starts: exit status 2, one line on stderr,
"did you mean" where a name is close, and no prefix matching of options (``--impl`` is not
``--impls``). The shared checks live in ``jaxattn.cli`` (``float_dtype``, ``Choices``,
``check_impl_names``), which the core's commands and jaxattn-bench's use alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxattn.cli import main

CASES = [  # argv, what the one line says
    (["explain", "--runtime-dtype", "bogus"], "argument --runtime-dtype: 'bogus' is not one of bfloat16"),
    (["explain", "--dtype", "flaot32"], "did you mean 'float32'?"),
    (["explain", "--extra", "ring_comm=nonsense"], "metadata.extra['ring_comm']: 'nonsense' is not one of"),
    (["tune", "--dtype", "bogus"], "argument --dtype: 'bogus' is not one of"),
    (["bench", "--serving", "--dtype", "bogus"], "argument --dtype: 'bogus' is not one of"),
    (["bench", "--dtype", "bogus"], "argument --dtype: 'bogus' is not one of"),
    (["bench", "--impls", "ghost"], "--impls: no impl is named 'ghost'"),
    (["bench", "--impls", "flash_atn2"], "did you mean 'flash_attn2'"),
    (["bench", "--impl", "flash_atn2"], "unrecognized arguments: --impl flash_atn2; did you mean --impls?"),
    (["bench", "--serving", "--impls", "ghost"], "--impls: no impl is named 'ghost'"),
    (["tune", "--impls", "ghost"], "--impls: no impl is named 'ghost'"),
    (["tune", "--modes", "nonsense"], "argument --modes: 'nonsense' is not one of fwd, fwdbwd"),
    (["bench", "--modes", "fwd,bwd"], "argument --modes: 'bwd' is not one of fwd, fwdbwd"),
    (["demo", "--impl", "ghost"], "--impl: no impl is named 'ghost'"),
    (["demo", "--impl", "vanilla_paged"], "'vanilla_paged' is a paged impl"),
    (["explain", "--caus"], "unrecognized arguments: --caus; did you mean --causal?"),
    (["explain", "--causl", "--wndow", "4"], "did you mean --causal for --causl, --window for --wndow?"),
    (["explain", "--bogus-option"], "unrecognized arguments: --bogus-option (`jaxattn explain --help`"),
    (["explain", "--mask-mod", "causal+docs=4"], "argument --mask-mod: 'docs' is not one of causal, window"),
    (["explain", "--mask-mod", "window=2,-1"], "argument --mask-mod: 'window=2,-1': window=L[,R] with L, R >= 0"),
    (["explain", "--mask-mod", "chunked"], "argument --mask-mod: 'chunked': chunked=C with C >= 1"),
    (["explain", "--score-mod", "relative"], "argument --score-mod: invalid choice: 'relative'"),
    (["explain", "--ragged", "--mask-mod", "causal"], "--mask-mod, --score-mod: describe dense calls only"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "said"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_value_is_one_line_and_exit_2(argv: list[str], said: str, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "cache"))
    code = _status(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert said in err, err
    assert not (tmp_path / "cache").exists()  # nothing measured, nothing stored


def test_a_named_impl_that_declines_is_not_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # The decode backend takes T <= 16: it cannot run T = 64, but other impls can.
    code = main(["explain", "--plain", "--impl", "autoregressive_decodeattn", "-t", "64", "--window", "64"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1
    assert "nothing can run this call" not in out, out
    assert "runs: autoregressive_decodeattn cannot run this call (these can: " in out and "vanilla" in out, out


def _status(argv: list[str]) -> int | str | None:
    """The exit status: argparse exits (SystemExit), a command returns it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code
