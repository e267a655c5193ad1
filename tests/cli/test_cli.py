"""The ``jaxattn`` command against a registry holding only this file's impls."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from jaxattn import AttentionImpl, Feature
from jaxattn.cli import CORE_COMMANDS, build_parser, main
from jaxattn.cli._output import Printer, Table
from jaxattn.discovery.commands import Command, Commands
from jaxattn.discovery.hookspecs import hookimpl
from jaxattn.discovery.plugins import PluginWarning, isolated_registry, plugin_records, register_plugin


class Wide(AttentionImpl):
    """Everywhere; causal, GQA, windows."""

    features: ClassVar = frozenset({Feature.CAUSAL, Feature.GQA, Feature.CROSS, Feature.SLIDING_WINDOW})
    priority: ClassVar[int] = 5

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("wide", "wide_alias")


class Narrow(AttentionImpl):
    """Preferred, but causal only: declines GQA and windows."""

    features: ClassVar = frozenset({Feature.CAUSAL})
    priority: ClassVar[int] = 10

    @classmethod
    def get_impl_name(cls) -> str:
        return "narrow"


class TpuOnly(AttentionImpl):
    platforms: ClassVar = frozenset({"tpu"})
    features: ClassVar = Wide.features
    priority: ClassVar[int] = 50

    @classmethod
    def get_impl_name(cls) -> str:
        return "tpu_only"


@pytest.fixture(autouse=True)
def toy_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("JAXATTN_IMPL", "JAXATTN_PLUGINS", "JAXATTN_DISABLE_PLUGINS", "JAXATTN_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    with isolated_registry(discover=False):
        for impl in (Wide, Narrow, TpuOnly):
            jaxattn.register_impl(impl)
        yield


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# -- list ------------------------------------------------------------------------------------
def test_list_json_has_every_impl_with_aliases_and_status(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["name"]: r for r in run_json(capsys, "list")}
    assert set(rows) == {"wide", "narrow", "tpu_only"}
    assert rows["wide"]["aliases"] == ["wide_alias"]
    assert rows["wide"]["platforms"] == ["cpu", "gpu", "tpu"]
    assert rows["narrow"]["priority"] == 10
    assert rows["wide"]["usable_here"] and rows["narrow"]["usable_here"]
    assert not rows["tpu_only"]["usable_here"]
    assert "tpu" in rows["tpu_only"]["reason"]


def test_list_here_keeps_only_usable_impls(capsys: pytest.CaptureFixture[str]) -> None:
    assert {r["name"] for r in run_json(capsys, "list", "--here")} == {"wide", "narrow"}


def test_list_plain_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for every column side by side
    code, out, _ = run_cli(capsys, "list", "--plain")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("name"))
    # Short columns first (at 80 columns the long ones go below each row; tests/cli/test_widths.py)
    assert header.split() == ["name", "kind", "here", "status", "priority", "plugin", "version", "aliases", "platforms",
                              "note"]
    wide = next(line for line in lines if line.startswith("wide "))
    assert "wide_alias" in wide and "cpu, gpu, tpu" in wide
    tpu = next(line for line in lines if line.startswith("tpu_only "))
    assert " no " in tpu and " ok " in tpu and "runs on tpu" in tpu


def _register_paged() -> None:
    from jaxattn_vanilla.paged.impl import PagedReference

    class DecodeOnly(PagedReference):
        """A paged backend that takes T queries per sequence, no ragged batch."""

        features: ClassVar = PagedReference.features - {Feature.RAGGED}
        priority: ClassVar[int] = 5

        @classmethod
        def get_impl_name(cls) -> str:
            return "decode_only"

    jaxattn.register_impl(PagedReference)
    jaxattn.register_impl(DecodeOnly)


def test_list_kind_filters_dense_and_paged(capsys: pytest.CaptureFixture[str]) -> None:
    _register_paged()
    rows = {r["name"]: r for r in run_json(capsys, "list")}
    assert rows["vanilla_paged"]["kind"] == "paged" and rows["wide"]["kind"] == "dense"
    aliases = ["ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention", "page_attention"]
    assert rows["vanilla_paged"]["aliases"] == aliases
    paged = {r["name"] for r in run_json(capsys, "list", "--kind", "paged")}
    assert paged == {"vanilla_paged", "decode_only"}
    assert {r["name"] for r in run_json(capsys, "list", "--kind", "dense")} == {"wide", "narrow", "tpu_only"}


def test_explain_paged_and_ragged_rank_only_paged_impls(capsys: pytest.CaptureFixture[str]) -> None:
    _register_paged()
    decode = run_json(capsys, "explain", "--paged", "-b", "4", "-t", "1", "-s", "300", "--heads-q", "8",
                      "--heads-kv", "2", "--page-size", "16", "--window", "64")
    assert decode["problem"]["queries_per_seq"] == 1 and decode["problem"]["pages_per_seq"] == 19
    assert decode["problem"]["sliding_window"] == [64, 0]  # the dense problem's (left, right)
    assert {c["name"] for c in decode["candidates"]} == {"vanilla_paged", "decode_only"}
    assert decode["chosen"] == "decode_only"  # the higher priority
    code, out, _ = run_cli(capsys, "explain", "--ragged", "-b", "3", "-t", "40", "-s", "128", "--combined",
                           "--impl", "decode_only", "--json")
    ragged = json.loads(out)
    assert code == 1  # nothing runs the call as asked
    assert ragged["problem"]["queries_per_seq"] is None and ragged["problem"]["kv_layout"] == "combined"
    assert ragged["chosen"] is None  # decode_only takes T queries per sequence, not a ragged batch
    row = next(c for c in ragged["candidates"] if c["name"] == "decode_only")
    assert any("ragged batches" in r for r in row["reasons"])
    code, _, err = run_cli(capsys, "explain", "--paged", "--causal", "--grad")
    assert code != 0 and "--causal, --grad" in err and "paged calls" in err


def test_explain_a_quantized_cache(capsys: pytest.CaptureFixture[str]) -> None:
    # --kv-dtype makes the cache narrow with float32 scales (one per token and head): paged and
    # dense calls; the reference says it dequantizes into a full-size copy.
    _register_paged()
    decode = run_json(capsys, "explain", "--paged", "-b", "4", "-t", "1", "-s", "300", "--heads-q", "8",
                      "--heads-kv", "2", "--kv-dtype", "int8")
    assert decode["problem"]["kv_dtype"] == "int8"
    assert decode["chosen"] == "decode_only"  # the higher priority; both read quantized caches
    reference = next(c for c in decode["candidates"] if c["name"] == "vanilla_paged")
    assert any("dequantizes the int8 pages" in n for n in reference["notes"]), reference
    ragged = run_json(capsys, "explain", "--ragged", "-b", "3", "-t", "40", "-s", "128", "--combined",
                      "--kv-dtype", "fp8_e5m2")
    assert ragged["problem"]["kv_dtype"] == "float8_e5m2" and ragged["problem"]["kv_layout"] == "combined"
    _, out, _ = run_cli(capsys, "explain", "-t", "1", "-s", "64", "--causal", "--kv-lengths", "--kv-dtype", "fp8",
                           "--json")
    dense = json.loads(out)["problem"]
    assert dense["kv_dtype"] == "float8_e4m3fn" and dense["kv_lengths"] is True


def test_explain_kv_lengths_is_a_feature_of_the_call(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "explain", "-t", "1", "-s", "64", "--causal", "--kv-lengths", "--json")
    exp = json.loads(out)
    assert code == 1
    assert exp["problem"]["kv_lengths"] is True
    assert exp["chosen"] is None  # no toy impl declares Feature.KV_LENGTHS
    wide = next(c for c in exp["candidates"] if c["name"] == "wide")
    assert any("kv_lengths" in r for r in wide["reasons"])


# -- info ------------------------------------------------------------------------------------
def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    info = run_json(capsys, "info")
    assert info["jaxattn"] == jaxattn.__version__
    assert info["jax"] == metadata.version("jax") and info["jaxlib"] == metadata.version("jaxlib")
    assert info["device"]["platform"] == jaxattn.detect_device().platform
    assert info["default"]["impl"] == "narrow"  # MHA causal: the highest priority that accepts
    (plugin,) = info["plugins"]
    assert plugin["status"] == "ok"
    assert sorted(plugin["impls"], key=lambda i: i["name"]) == [
        {"name": "narrow", "aliases": [], "kind": "dense"}, {"name": "tpu_only", "aliases": [], "kind": "dense"},
        {"name": "wide", "aliases": ["wide_alias"], "kind": "dense"}]
    assert {r["name"] for r in info["impls"]} == {"wide", "narrow", "tpu_only"}
    assert info["warnings"] == []


def test_info_plain_sections(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "info", "--plain")
    assert code == 0
    for needle in ("jaxattn:", "device:", "auto picks: narrow", "Plugins", "Implementations", "usable here"):
        assert needle in out
    # No paged impl in this registry: the paged line says why nothing runs.
    assert "paged auto: none: no paged impl is installed here" in out


def test_info_strict_passes_when_healthy(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "info", "--strict", "--json")[0] == 0


# -- explain ---------------------------------------------------------------------------------
def test_explain_picks_and_gives_every_reason(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "explain", "--causal", "--heads-q", "8", "--heads-kv", "2", "--window", "16")
    assert data["requested"] == "auto" and data["chosen"] == "wide"
    rows = {c["name"]: c for c in data["candidates"]}
    assert rows["wide"]["chosen"] and rows["wide"]["accepted"]
    narrow = " ".join(rows["narrow"]["reasons"])
    assert "grouped" in narrow and "sliding window" in narrow  # both reasons, not the first only
    assert rows["tpu_only"]["status"] == "other platform"


def test_explain_exit_status_when_nothing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "explain", "--impl", "narrow", "--window", "8", "--plain")
    assert code == 1
    # Other impls accept the call: "nothing can run" would be false; the line names them.
    flat = " ".join(out.split())
    assert "narrow cannot run this call (these can: " in flat and "sliding window" in out, out
    assert "nothing can run this call" not in out


def test_explain_alias_and_scoped_choice(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_json(capsys, "explain", "--impl", "wide_alias")["chosen"] == "wide"
    monkeypatch.setenv("JAXATTN_IMPL", "wide")  # same precedence as jaxattn.attention
    assert run_json(capsys, "explain")["requested"] == "wide"


def test_explain_passes_every_feature_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "explain", "-b", "2", "-t", "1", "-s", "64", "--heads-q", "4", "--head-dim", "32",
        "--head-dim-v", "16", "--dtype", "float16", "--mask", "b11s", "--bias", "1hts", "--segment-ids",
        "--soft-cap", "30", "--sinks", "--dropout", "0.1", "--grad", "--window", "4,0", "--causal", "--json")
    data = json.loads(out)
    problem = data["problem"]
    assert (problem["batch"], problem["seq_q"], problem["seq_k"]) == (2, 1, 64)
    assert (problem["heads_q"], problem["heads_kv"], problem["head_dim"], problem["head_dim_v"]) == (4, 4, 32, 16)
    assert problem["dtype"] == "float16" and problem["causal"]
    assert problem["mask_shape"] == [2, 1, 1, 64] and problem["bias_shape"] == [1, 4, 1, 64]
    assert problem["segment_ids"] and problem["sinks"] and problem["needs_grad"]
    assert problem["logits_soft_cap"] == 30.0 and problem["dropout_prob"] == 0.1
    assert problem["sliding_window"] == [4, 0]
    assert data["chosen"] is None and code == 1  # no toy impl has soft cap, sinks, dropout...


def test_explain_mask_mod_and_score_mod_terms(capsys: pytest.CaptureFixture[str]) -> None:
    # The terms become jaxattn.masks constructors (documents of equal length), ANDed: the call
    # line shows the tiles they leave, the problem the flags; no toy impl runs either.
    code, out, _ = run_cli(capsys, "explain", "-t", "256", "--mask-mod", "causal+documents=4", "--score-mod",
                           "alibi", "--plain")
    assert code == 1 and "mask_mod tiles 128x128: 2 empty, 2 partial, 0 full" in out, out
    problem = run_cli(capsys, "explain", "-t", "256", "--mask-mod", "window=8,0+chunked=64+prefix=16",
                      "--score-mod", "alibi", "--json")[1]
    flags = json.loads(problem)["problem"]
    assert flags["mask_mod"] and flags["score_mod"] and flags["score_mod_alibi"] and not flags["mask_mod_documents"]
    data = json.loads(run_cli(capsys, "explain", "-t", "256", "--mask-mod", "documents=2", "--json")[1])
    assert data["problem"]["mask_mod_documents"] and data["problem"]["block_sparsity"] == [128, 128, 2, 0, 2]


def test_explain_unknown_impl_lists_installed_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "explain", "--impl", "nope")
    assert code == 2
    assert "'nope'" in err and "wide_alias" in err and "narrow" in err


def test_explain_invalid_shapes_name_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "explain", "--heads-q", "6", "--heads-kv", "4")
    assert code == 2 and out == ""
    assert "Hq=6" in err and "multiple" in err


@pytest.mark.parametrize("argv", [["--mask", "bhxs"], ["--bias", "b1t"], ["--window", "a,b"], ["--dropout", "x"]])
def test_explain_rejects_malformed_flags(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", *argv])
    assert exit_info.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


# -- rendering -------------------------------------------------------------------------------
def test_plain_table_aligns_multiline_cells() -> None:
    stream = io.StringIO()
    table = Table("T", ["a", "bb", "reasons"])
    table.add("x", None, "first\nsecond")
    table.add("longer", True, ["p", "q"])
    Printer(plain=True, stream=stream).table(table)
    lines = stream.getvalue().splitlines()
    assert lines[:3] == ["T", "a       bb   reasons", "------  ---  -------"]
    assert lines[3:6] == ["x       -    first", "             second", "longer  yes  p, q"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rich_only_on_a_terminal_and_not_when_plain() -> None:
    pytest.importorskip("rich")
    assert not Printer(stream=io.StringIO()).rich
    assert not Printer(stream=_Terminal(), plain=True).rich
    terminal = _Terminal()
    printer = Printer(stream=terminal)
    assert printer.rich
    table = Table("Impls", ["name"])
    table.add("wide")
    printer.table(table)
    assert "Impls" in terminal.getvalue() and "wide" in terminal.getvalue()


# -- the command itself ----------------------------------------------------------------------
def _hello_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="world")


def _hello(args: argparse.Namespace) -> int:
    print("json" if args.json else f"hello {args.name}")
    return 7


class HelloPlugin:
    """A third-party plugin adding one command, registered in-process as an entry point would be."""

    @hookimpl
    def jaxattn_register_commands(self, commands: Commands) -> None:
        commands.add(Command("hello", "say hello", _hello_arguments, _hello))


class RaisingPlugin:
    @hookimpl
    def jaxattn_register_commands(self, commands: Commands) -> None:
        commands.add(Command("never", "added before the hook failed", _hello_arguments, _hello))
        raise RuntimeError("boom in the hook")


class BadArgumentsPlugin:
    @hookimpl
    def jaxattn_register_commands(self, commands: Commands) -> None:
        def add_arguments(parser: argparse.ArgumentParser) -> None:
            raise SystemExit("a plugin that exits while its parser is built")

        commands.add(Command("badargs", "its arguments fail", add_arguments, _hello))


class ClashingPlugin:
    @hookimpl
    def jaxattn_register_commands(self, commands: Commands) -> None:
        commands.add(Command("list", "takes the core's name", _hello_arguments, _hello))


def _choices() -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices)


def test_a_plugin_adds_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert _choices() == set(CORE_COMMANDS)  # this registry holds no plugin with commands
    register_plugin(HelloPlugin(), name="hello")
    assert _choices() == {*CORE_COMMANDS, "hello"}
    assert run_cli(capsys, "hello", "--name", "jax") == (7, "hello jax\n", "")
    assert run_cli(capsys, "hello", "--json") == (7, "json\n", "")


def test_a_plugin_whose_commands_fail_costs_only_itself(capsys: pytest.CaptureFixture[str]) -> None:
    register_plugin(RaisingPlugin(), name="raising")
    register_plugin(HelloPlugin(), name="hello")
    register_plugin(BadArgumentsPlugin(), name="badargs")
    register_plugin(ClashingPlugin(), name="clashing")
    with pytest.warns(PluginWarning) as caught:
        choices = _choices()
    # The others' commands are all there; the failing plugins' are not, not even the one
    # added before its hook raised; the core keeps its name.
    assert choices == {*CORE_COMMANDS, "hello"}
    messages = " | ".join(str(w.message) for w in caught)
    assert "'raising'" in messages and "boom in the hook" in messages
    assert "'badargs'" in messages and "a plugin that exits" in messages
    assert "plugin 'clashing' adds a command 'list', which 'jaxattn' already has" in messages
    status = {r.name: r.status for r in plugin_records()}
    assert status["raising"] == status["badargs"] == "broken" and status["hello"] == "ok"
    # Through the program: the others run, list is still the core's.
    code, out, err = run_cli(capsys, "hello", "--name", "jax")
    assert (code, out) == (7, "hello jax\n")
    assert all(line.startswith("jaxattn hello: warning: ") for line in err.splitlines()), err
    assert run_cli(capsys, "list", "--json")[0] == 0


def test_a_failing_plugin_is_fatal_under_strict_plugins(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    register_plugin(RaisingPlugin(), name="raising")
    register_plugin(HelloPlugin(), name="hello")
    monkeypatch.setenv("JAXATTN_STRICT_PLUGINS", "1")
    code, out, err = run_cli(capsys, "hello")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("jaxattn hello: error: plugin 'raising'") and "boom in the hook" in err
    # A core command parses without the plugins' commands, as before they could add any.
    assert run_cli(capsys, "list", "--json")[0] == 0


def test_help_and_version_import_no_jax() -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxattn", "--help"],
                            capture_output=True, text=True, check=True)
    for name in (*CORE_COMMANDS, "bench", "tune", "demo"):  # the core's, and jaxattn-bench's
        assert name in result.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "jaxattn.cli" in imported
    assert "jax" not in imported and "numpy" not in imported
    version = subprocess.run([sys.executable, "-m", "jaxattn", "--version"], capture_output=True, text=True,
                             check=True)
    assert version.stdout.strip() == f"jaxattn {jaxattn.__version__}"


# -- explain: a name of the other op kind, and names from the environment ---------------------
def test_explain_points_a_paged_name_to_paged(capsys: pytest.CaptureFixture[str]) -> None:
    """A paged impl asked of a dense call: not "nothing can run this call", but --paged."""
    _register_paged()
    code, out, err = run_cli(capsys, "explain", "--impl", "vanilla_paged")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "'vanilla_paged' is a paged impl and this is a dense call" in err and "--paged" in err
    code, out, err = run_cli(capsys, "explain", "--paged", "--impl", "wide_alias")
    assert code == 2 and "'wide_alias' is a dense impl and this is a paged call" in err and "drop --paged" in err
    assert run_cli(capsys, "explain", "--paged", "--impl", "vanilla_paged", "--plain")[0] == 0


def test_explain_api_points_a_paged_name_to_paged_attention() -> None:
    _register_paged()
    x = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)
    with pytest.raises(jaxattn.InvalidInputError, match=r"'vanilla_paged' is a paged impl.*paged_attention"):
        jaxattn.explain(x, x, x, impl="vanilla_paged")


def test_explain_names_jaxattn_impl_when_it_names_nothing(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_IMPL", "nonexistent")
    code, out, err = run_cli(capsys, "explain", "--plain")
    assert code == 2 and out == "" and err.count("\n") == 1  # not "nothing can run this call"
    assert err.startswith("jaxattn explain: error: $JAXATTN_IMPL='nonexistent'") and "unknown" in err, err


@pytest.mark.parametrize(("var", "value", "needle"), [("JAXATTN_TUNING", "maybe", "$JAXATTN_TUNING: 'maybe'")])
def test_bad_environment_values_are_one_line_exit_2(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                                                    needle: str) -> None:
    monkeypatch.setenv(var, value)
    code, out, err = run_cli(capsys, "explain", "--plain")
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


# -- explain on a mesh this machine does not have ---------------------------------------------
def test_explain_plans_on_an_abstract_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    # The toy impls run whole sequences: a sharded sequence axis is a reason each of them names,
    # which shows the mesh, the axes and --extra reached the call's metadata.
    code, out, _ = run_cli(capsys, "explain", "--causal", "-b", "2", "--mesh", "data=2,seq=4", "--batch-axis", "data",
                           "--sequence-axis", "seq", "--extra", "ring_comm=all_gather", "--json")
    data = json.loads(out)
    assert code == 1 and data["chosen"] is None
    assert all("sequence_axis='seq' shards the sequence" in " ".join(c["reasons"])
               for c in data["candidates"] if c["status"] == "declined"), data["candidates"]
    assert run_json(capsys, "explain", "-b", "2", "--mesh", "data=2", "--batch-axis", "data")["chosen"] == "narrow"


@pytest.mark.parametrize(("argv", "said"), [
    (["--sequence-axis", "seq"], "no --mesh gives the axes"),
    (["--mesh", "seq=4", "--head-axis", "model"], "are not axes of metadata.mesh"),
    (["--mesh", "seq=0"], "sizes >= 1"),
    (["--mesh", "seq=2,seq=2"], "NAME=SIZE"),
    (["--extra", "ring_comm"], "is not KEY=VALUE"),
])  # fmt: skip
def test_explain_mesh_options_are_checked(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    try:
        code = main(["explain", *argv])
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    assert said in capsys.readouterr().err
