"""``jaxattn explain --mesh``: ring and head-sharded paged calls planned from the command line,
on a machine without the mesh's devices (an abstract mesh: nothing runs)."""

from __future__ import annotations

import pytest

from jaxattn.cli import main


def explain(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["explain", "--plain", *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return " ".join(out.split())


@pytest.mark.parametrize(("extra", "said"), [
    ([], "K/V passed around the ring"),
    (["--extra", "ring_comm=all_gather"], "K/V all-gathered (every device holds all S keys during the call)"),
    (["--extra", "ring_inputs=zigzag"], "inputs and outputs in zigzag order: no relayout"),
])  # fmt: skip
def test_ring_from_the_command_line(capsys: pytest.CaptureFixture[str], extra: list[str], said: str) -> None:
    out = explain(capsys, "-t", "131072", "--heads-q", "16", "--causal", "--grad", "--mesh", "data=2,seq=4",
                  "--batch-axis", "data", "--sequence-axis", "seq", "-b", "2", *extra)
    assert "runs: ring" in out and "zigzag layout" in out and said in out, out


@pytest.mark.parametrize("impl", ["ring", "auto"])
def test_an_invalid_ring_option_is_an_error(capsys: pytest.CaptureFixture[str], impl: str) -> None:
    # The caller's option is wrong whoever would run the call: one line, exit 2, not a table.
    code = main(["explain", "--impl", impl, "--causal", "--mesh", "seq=4", "--sequence-axis", "seq",
                 "--extra", "ring_comm=broadcast"])
    assert code == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1, err
    assert "metadata.extra['ring_comm']: 'broadcast' is not one of ['auto', 'ppermute', 'all_gather']" in err, err


def test_head_sharded_paged_decode_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    out = explain(capsys, "--paged", "-b", "64", "-t", "1", "-s", "4096", "--heads-q", "32", "--heads-kv", "8",
                  "--mesh", "model=2", "--head-axis", "model")
    assert "runs:" in out and "nothing can run" not in out, out


@pytest.mark.parametrize(("argv", "said"), [
    (["--impl", "ring", "-t", "30", "--causal", "--mesh", "seq=4", "--sequence-axis", "seq"],
     "query length T 30 does not split into 8 = 2 x 4 chunks"),
    (["-b", "3", "-t", "1", "-s", "64", "--mesh", "data=2", "--batch-axis", "data"],
     "batch size B 3 is not divisible by mesh axis 'data' of size 2"),
])  # fmt: skip
def test_explain_on_a_mesh_raises_what_the_call_raises(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                        said: str) -> None:
    # The call raises InvalidInputError before its kernel (multidevice/check_explain_agrees.py runs
    # both on 8 host devices): explain names no backend, it says why in one line.
    code = main(["explain", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and not out, out
    assert said in err and len(err.strip().splitlines()) == 1, err
