"""Every numeric option of every command refuses zero (where meaningless), negatives and garbage.

The walk below finds the options itself, so an option added later cannot escape the rule.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from jaxattn.cli import build_parser
from jaxattn.cli._args import NumericArg
from jaxattn_bench import demo


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser, list[str]]]:
    """(label, the parser to call, argv prefix) for every subcommand, and the demo."""
    root = build_parser()
    subparsers = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    for name in subparsers.choices:
        yield f"jaxattn {name}", root, [name]
    yield "python -m jaxattn_bench.demo", demo.build_parser(), []


def _options() -> list[tuple[str, argparse.ArgumentParser, list[str], argparse.Action]]:
    root = build_parser()
    subparsers = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for label, parser, prefix in _parsers():
        own = subparsers.choices[prefix[0]] if prefix else parser
        found += [(label, parser, prefix, a) for a in own._actions if a.option_strings]
    return found


OPTIONS = _options()
NUMERIC = [(label, parser, prefix, a) for label, parser, prefix, a in OPTIONS if isinstance(a.type, NumericArg)]


def test_no_numeric_option_bypasses_the_validators() -> None:
    bare = [f"{label} {a.option_strings[0]}" for label, _, _, a in OPTIONS if a.type in (int, float)]
    assert not bare, f"give these options a type from jaxattn.cli._args: {bare}"
    labels = {label for label, *_ in NUMERIC}
    # The walk really walks: every command with numeric options is in it.
    assert {"jaxattn explain", "jaxattn bench", "jaxattn tune", "jaxattn demo",
            "python -m jaxattn_bench.demo"} <= labels
    assert len(NUMERIC) >= 35


@pytest.mark.parametrize(("label", "parser", "prefix", "action"),
                         NUMERIC, ids=[f"{label.split()[-1]}{a.option_strings[0]}" for label, _, _, a in NUMERIC])
def test_numeric_option_refuses_nonsense_in_one_line(label: str, parser: argparse.ArgumentParser,
                                                     prefix: list[str], action: argparse.Action,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    option = action.option_strings[-1]  # the long form
    assert isinstance(action.type, NumericArg)
    bad = ["-5", "abc", "nan", "inf", ""] + ([] if action.type.accepts_zero else ["0"])
    for value in bad:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*prefix, f"{option}={value}"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (option, value)
        assert err.count("\n") == 1, err  # one line, no usage block
        assert f"argument {'/'.join(action.option_strings)}: " in err and "e.g. " in err, err
    if action.type.accepts_zero:
        parser.parse_args([*prefix, f"{option}=0"])  # meaningful here: accepted


def test_valid_values_still_parse() -> None:
    args = build_parser().parse_args(["bench", "--seqs", "1k,2048", "--shape", "2,16,4,8,2", "--min-sample-ms", "0",
                                      "--max-temp-gib", "0.5"])
    assert args.seqs == [1024, 2048] and args.shape == ["2,16,4,8,2"] and args.min_sample_ms == 0.0
    args = build_parser().parse_args(["explain", "--window", "4,0", "--dropout", "0.1", "--soft-cap", "30"])
    assert args.window == (4, 0) and args.dropout == 0.1 and args.soft_cap == 30.0


@pytest.mark.parametrize("argv", [["tune", "--shape", "1,2,3"], ["tune", "--shape", "2,16,3,8,2"],
                                  ["bench", "--quick", "--seqs", "0"], ["bench", "--quick", "--head-dims", "-5"],
                                  ["explain", "--paged", "--page-size", "-3"], ["explain", "--head-dim", "0"]])
def test_the_reported_commands_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and argv[-2] in err, err


def test_demo_refuses_heads_that_do_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--heads-q", "6", "--heads-kv", "4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--heads-kv" in err
    from jaxattn.cli import main

    assert main(["demo", "--heads-q", "6", "--heads-kv", "4"]) == 2  # the command: the same one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxattn demo: error: argument --heads-kv") and "e.g." in err


def test_quick_filters_that_select_nothing_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    from jaxattn.cli import main

    assert main(["bench", "--quick", "--seqs", "256", "--plain"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--seqs" in err and "S 64/128" in err


def test_the_installed_command_exits_2() -> None:
    """Through a real process: the exit status a shell sees."""
    result = subprocess.run([sys.executable, "-m", "jaxattn", "bench", "--quick", "--seqs", "0"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "argument --seqs: '0'" in result.stderr
