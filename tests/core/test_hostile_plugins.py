"""Throwaway plugins that are broken or hostile cost only themselves (issue 18 items 3, 4, 10-12).

Each test installs a plugin the way pip would, as far as discovery can tell: a module and a
``*.dist-info`` folder with its entry point, in a directory put on ``sys.path``. Discovery then
finds it through ``importlib.metadata`` next to the real first-party plugins of this checkout,
so every path below is the real one (entry point, import, hook, registry, lookup, dispatch).
"""

from __future__ import annotations

import builtins
import itertools
import json
import sys
import textwrap
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import PluginError
from jaxattn.cli import main as cli_main
from jaxattn.discovery import plugins
from jaxattn.discovery.plugins import PluginWarning, isolated_registry
from jaxattn.testing import oracle
from jaxattn_vanilla.paged.impl import PagedReference

from .toy_impls import PlainImpl

_serial = itertools.count()
HERE = __name__  # the throwaway plugins register the classes below by ImplRef

# What a throwaway registration module starts with.
HEADER = """
import sys
import jaxattn
from jaxattn import ImplRef
EVERYWHERE = ("cpu", "gpu", "tpu")
"""


class Installer:
    """``install(entry, source, dist=...)`` puts a plugin distribution on ``sys.path``: its
    registration module and a ``*.dist-info`` folder naming it as an entry point."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def module(self, stem: str, source: str) -> str:
        module = f"throwaway_{stem}_{next(_serial)}"
        self.modules.append(module)
        (self.root / f"{module}.py").write_text(HEADER + textwrap.dedent(source))
        return module

    def __call__(self, entry: str, source: str, *, dist: str | None = None) -> str:
        module = self.module(entry, source)
        name = dist or f"jaxattn-{entry}"
        info = self.root / f"{name.replace('-', '_')}-6.6.6.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 6.6.6\n")
        (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\n{entry} = {module}\n")
        return module


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Installer]:
    """An installer; discovery runs afresh, with every real plugin of this checkout, at the next
    use of the registry."""
    for var in ("JAXATTN_IMPL", "JAXATTN_PLUGINS", "JAXATTN_DISABLE_PLUGINS", "JAXATTN_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    installer = Installer(tmp_path)
    with isolated_registry(discover=False):
        plugins._state.discovered = False
        yield installer
    for module in installer.modules:
        sys.modules.pop(module, None)


# -- impl classes the throwaway plugins register (by ImplRef to this module, or directly) --

class Evil(PlainImpl):
    """Takes the name of jaxattn-vanilla's reference."""

    priority: ClassVar[int] = 1000

    @classmethod
    def get_impl_name(cls) -> str:
        return "vanilla"


class EvilLow(Evil):
    priority: ClassVar[int] = -5


class EvilPaged(PagedReference):
    """A paged backend under the dense built-in name."""

    priority: ClassVar[int] = 1000

    @classmethod
    def get_impl_name(cls) -> str:
        return "vanilla"


class EvilDense(Evil):
    """A dense backend under a paged built-in name."""

    @classmethod
    def get_impl_name(cls) -> str:
        return "page_attention"


class Late(Evil):
    @classmethod
    def get_impl_name(cls) -> str:
        return "late"


class Quitter(PlainImpl):
    @classmethod
    def get_impl_name(cls) -> str:
        sys.exit(3)


class Misshapen(PlainImpl):
    """First in auto's ranking, and returns one head where the call has four."""

    priority: ClassVar[int] = 1000

    @classmethod
    def get_impl_name(cls) -> str:
        return "misshapen"

    def forward_native(self, call: jaxattn.AttentionCall) -> jaxattn.AttentionOutput:
        return jaxattn.AttentionOutput(super().forward_native(call).attention_outputs[:, :, :1])

    forward_cuda = forward_native  # PlainImpl's own forward_cuda would route around this on a GPU


class MisshapenPaged(PagedReference):
    """A paged backend first in auto's ranking that drops the last query row."""

    priority: ClassVar[int] = 1000

    @classmethod
    def get_impl_name(cls) -> str:
        return "misshapen_paged"

    def forward_native(self, call: jaxattn.PagedCall) -> jaxattn.AttentionOutput:
        return jaxattn.AttentionOutput(super().forward_native(call).attention_outputs[:-1])


class Crashy(PlainImpl):
    """First in auto's ranking; its own checks raise."""

    priority: ClassVar[int] = 1000

    @classmethod
    def get_impl_name(cls) -> str:
        return "crashy"

    def not_supported_reasons(self, problem: Any) -> list[str]:
        raise RuntimeError("checks exploded")


class NanImpl(jaxattn.AttentionImpl):
    """Declares plain attention everywhere and returns NaN."""

    @classmethod
    def get_impl_name(cls) -> str:
        return "nan"

    def forward_native(self, call: jaxattn.AttentionCall) -> jaxattn.AttentionOutput:
        q = call.q
        return jaxattn.AttentionOutput(jnp.full(q.shape[:3] + call.v.shape[-1:], jnp.nan, q.dtype))


def registering(*refs: str) -> str:
    """A registration module's hook returning ``refs`` (Python expressions)."""
    return f"@jaxattn.hookimpl\ndef jaxattn_register_impls():\n    return [{', '.join(refs)}]\n"


def qkv(t: int = 3, s: int = 5, hq: int = 4, hkv: int = 2, d: int = 8) -> tuple[jax.Array, ...]:
    # NumPy draws the values: jax.random.normal compiles a program per new shape (seconds each
    # on a 2-core CI machine), for inputs any generator serves.
    rng = np.random.default_rng(1)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for shape in ((1, t, hq, d), (1, s, hkv, d), (1, s, hkv, d)))


def assert_right(out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> None:
    want = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), causal=causal).output
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def rows() -> dict[tuple[str, str], jaxattn.ImplInfo]:
    """list_impls() by (name, plugin)."""
    return {(r.name, r.plugin): r for r in jaxattn.list_impls()}


def problems(load: bool = False) -> dict[str, list[plugins.PluginProblem]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = plugins.problems(load=load)
    out: dict[str, list[plugins.PluginProblem]] = {}
    for p in found:
        out.setdefault(p.plugin, []).append(p)
    return out


def info_strict(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli_main(["info", "--strict", "--json"])
    captured = capsys.readouterr()
    json.loads(captured.out)  # still a full report
    return code, captured.err


def test_the_checkout_itself_has_no_plugin_problem(install: Installer, capsys: pytest.CaptureFixture[str]) -> None:
    """The baseline of every test below: the first-party plugins load, agree with their
    ImplRefs and clash nowhere, so `info --strict` passes (it imports every impl module)."""
    assert problems(load=True) == {}
    reg = plugins.registry()
    assert all(not list(reg.conflicting(p)) and not reg.rejections(p) for p in reg.providers)
    code, err = info_strict(capsys)
    assert code == 0, err


# -- item 10: SystemExit and other BaseExceptions ------------------------------------------

EXITS = {
    "import": "sys.exit(3)\n",
    "hook": "@jaxattn.hookimpl\ndef jaxattn_register_impls():\n    sys.exit(3)\n",
    "generator hook": "@jaxattn.hookimpl\ndef jaxattn_register_impls():\n    yield from ()\n    sys.exit(3)\n",
    "class name": "from tests.core.test_hostile_plugins import Quitter\n" + registering("Quitter"),
    "exit group": "raise BaseExceptionGroup('exits', [SystemExit(3)])\n",
}


@pytest.mark.parametrize("where", list(EXITS))
def test_a_plugin_that_exits_costs_only_itself(install: Installer, where: str) -> None:
    install("quitter", EXITS[where])
    with pytest.warns(PluginWarning, match=r"'quitter'.*(SystemExit: 3|BaseExceptionGroup)"):
        listed = rows()
    assert listed[("quitter", "quitter")].status == "broken"
    assert listed[("quitter", "quitter")].reason.startswith(("SystemExit: 3", "BaseExceptionGroup: exits"))
    assert listed[("vanilla", "vanilla")].status == "ok"
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, impl="vanilla", causal=True), q, k, v, causal=True)
    assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)
    with pytest.raises(PluginError, match=r"SystemExit|BaseExceptionGroup"):
        jaxattn.get_impl("quitter")
    assert [p.category for p in problems()["quitter"]] == ["broken"]


def test_an_impl_module_that_exits_when_imported_costs_only_itself(install: Installer) -> None:
    """The lazy ImplRef's module exits when first imported: auto declines that backend with
    the reason and runs the next one; asking for it by name raises a PluginError."""
    impl_module = install.module("late_impl", "from tests.core.test_hostile_plugins import Late\nsys.exit(4)\n")
    install("late", registering(f"ImplRef('{impl_module}:Late', names=('late',), platforms=EVERYWHERE, "
                                "priority=1000)"))
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)
    late = next(c for c in jaxattn.explain(q, k, v, causal=True).candidates if c.name == "late")
    assert late.status == "declined" and any("SystemExit: 4" in r for r in late.reasons)
    with pytest.raises(PluginError, match="SystemExit: 4"):
        jaxattn.get_impl("late")
    assert [p.category for p in problems(load=True)["late"]] == ["load"]


@pytest.mark.parametrize("signal", ["KeyboardInterrupt", "GeneratorExit"])
def test_interrupts_are_never_swallowed(install: Installer, signal: str) -> None:
    install("interrupter", f"raise {signal}\n")
    with pytest.raises(getattr(builtins, signal)):
        jaxattn.list_impls()


# -- items 3 and 11: a name a first-party distribution provides ---------------------------

def evil(cls: str = "Evil", **declared: str) -> str:
    fields = {"names": "('vanilla',)", "platforms": "EVERYWHERE", "priority": "1000", **declared}
    return f"from {HERE} import {cls}\n" + registering(
        f"ImplRef('{HERE}:{cls}', {', '.join(f'{k}={v}' for k, v in fields.items())})")


def test_a_builtin_dense_name_is_not_taken_silently(install: Installer, capsys: pytest.CaptureFixture[str]) -> None:
    install("evil", evil())
    with pytest.warns(PluginWarning, match=r"jaxattn-evil.*jaxattn-vanilla"):
        listed = rows()
    assert listed[("vanilla", "evil")].status == "conflict"
    assert "overrides=" in listed[("vanilla", "evil")].reason
    assert listed[("vanilla", "vanilla")].status == "ok" and listed[("vanilla", "vanilla")].usable_here
    assert type(jaxattn.get_impl("vanilla")).__module__ == "jaxattn_vanilla.vanilla.impl"
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, impl="vanilla", causal=True), q, k, v, causal=True)
    found = problems()
    assert set(found) == {"evil"} and [p.category for p in found["evil"]] == ["built-in name"]
    assert "jaxattn-vanilla" in found["evil"][0].message
    code, err = info_strict(capsys)
    assert code == 1 and "jaxattn-evil" in err and "jaxattn-vanilla" in err


def test_a_declared_override_takes_the_name(install: Installer, capsys: pytest.CaptureFixture[str]) -> None:
    install("evil", evil(overrides="('vanilla',)"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deliberate, declared replacement is no warning
        listed = rows()
    assert listed[("vanilla", "evil")].status == "ok" and listed[("vanilla", "evil")].usable_here
    assert "overrides jaxattn-vanilla" in listed[("vanilla", "evil")].reason
    assert type(jaxattn.get_impl("vanilla")) is Evil
    assert problems(load=True) == {}
    assert info_strict(capsys)[0] == 0


def test_the_strict_setting_fails_on_the_clash_naming_the_offender(install: Installer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    install("evil", evil())
    monkeypatch.setenv("JAXATTN_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"jaxattn-evil.*jaxattn-vanilla"):
        jaxattn.list_impls()


@pytest.mark.filterwarnings("ignore::jaxattn.discovery.plugins.PluginWarning")
def test_a_paged_provider_of_a_dense_builtin_name_costs_only_itself(install: Installer) -> None:
    install("evil", evil("EvilPaged", kind="'paged'"))
    listed = rows()
    assert listed[("vanilla", "evil")].status == "conflict"
    assert listed[("vanilla", "vanilla")].status == "ok"
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, impl="vanilla", causal=True), q, k, v, causal=True)
    with jaxattn.use_impl("vanilla"):
        assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)
    assert [p.category for p in problems()["evil"]] == ["built-in name"]


@pytest.mark.filterwarnings("ignore::jaxattn.discovery.plugins.PluginWarning")
def test_a_dense_provider_of_a_paged_builtin_name_costs_only_itself(install: Installer) -> None:
    install("evil", evil("EvilDense", names="('page_attention',)"))
    assert rows()[("page_attention", "evil")].status == "conflict"
    served_by = type(jaxattn.get_impl("page_attention", kind="paged")).__name__  # a built-in, never the evil one
    assert served_by == "PagedReference" if jaxattn.detect_device().platform == "cpu" else served_by != "EvilDense"
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)  # auto never picks it
    found = problems()["evil"]  # one per provider of the paged name (vanilla, triton, pallas)
    assert {p.category for p in found} == {"built-in name"} and len(found) == 3


@pytest.mark.filterwarnings("ignore::jaxattn.discovery.plugins.PluginWarning")
def test_a_lower_priority_provider_of_a_builtin_name_costs_only_itself(install: Installer) -> None:
    install("evil", evil("EvilLow", priority="-5"))
    listed = rows()
    assert listed[("vanilla", "evil")].status == "conflict"
    assert listed[("vanilla", "vanilla")].status == "ok" and listed[("vanilla", "vanilla")].usable_here


@pytest.mark.filterwarnings("ignore::jaxattn.discovery.plugins.PluginWarning")
def test_two_third_parties_sharing_a_name_undeclared_both_conflict(install: Installer) -> None:
    for entry, priority in (("first", 5), ("second", 7)):
        install(entry, registering(f"ImplRef('tests.core.toy_impls:PlainImpl', names=('plain',), "
                                   f"platforms=EVERYWHERE, priority={priority})"))
    listed = rows()
    assert listed[("plain", "first")].status == listed[("plain", "second")].status == "conflict"
    with pytest.raises(PluginError, match=r"jaxattn-second.*jaxattn-first.*overrides="):
        jaxattn.get_impl("plain")
    assert {p.category for ps in problems().values() for p in ps} == {"clash"}


# -- item 4: the module is missing, or the declarations disagree with the class ------------

def test_a_missing_module_is_found_without_importing(install: Installer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    install("ghostly", registering("ImplRef('throwaway_no_such_module:Impl', names=('ghost',), "
                                   "platforms=EVERYWHERE)"))
    row = rows()[("ghost", "ghostly")]
    assert row.status == "broken" and "throwaway_no_such_module" in row.reason
    assert [p.category for p in problems()["ghostly"]] == ["missing module"]
    assert info_strict(capsys)[0] == 1
    with pytest.raises(PluginError, match="throwaway_no_such_module"):
        jaxattn.get_impl("ghost")


@pytest.mark.parametrize(("field", "declared"), [
    ("priority", "7"), ("names", "('liar',)"), ("platforms", "('cpu',)"), ("kind", "'paged'"),
])
def test_declarations_that_disagree_with_the_class_fail_strict(
    install: Installer, capsys: pytest.CaptureFixture[str], field: str, declared: str,
) -> None:
    fields = {"names": "('plain',)", "platforms": "EVERYWHERE", "priority": "0", field: declared}
    install("liar", registering(f"ImplRef('tests.core.toy_impls:PlainImpl', "
                                f"{', '.join(f'{k}={v}' for k, v in fields.items())})"))
    assert "liar" not in problems(load=False)  # the cheap checks cannot see it ...
    found = problems(load=True)["liar"]  # ... importing the class does
    assert [p.category for p in found] == ["declaration"]
    assert field in found[0].message
    name = "liar" if field == "names" else "plain"
    assert rows()[(name, "liar")].status == "broken"
    code, err = info_strict(capsys)
    assert code == 1 and field in err


# -- item 12: a backend returning the wrong shape ------------------------------------------

MISSHAPEN = f"from {HERE} import Misshapen\n" + registering(
    f"ImplRef('{HERE}:Misshapen', names=('misshapen',), platforms=EVERYWHERE, priority=1000)")


@pytest.mark.parametrize("jit", [False, True])
def test_auto_skips_a_backend_returning_the_wrong_shape(install: Installer, jit: bool) -> None:
    install("misshapen", MISSHAPEN)
    q, k, v = qkv()
    assert jaxattn.explain(q, k, v, causal=True).chosen == "misshapen"  # nothing can know before it runs
    call = jax.jit(partial(jaxattn.attention, causal=True)) if jit else partial(jaxattn.attention, causal=True)
    assert_right(call(q, k, v), q, k, v, causal=True)
    after = jaxattn.explain(q, k, v, causal=True)
    assert after.chosen not in (None, "misshapen")
    row = next(c for c in after.candidates if c.name == "misshapen")
    assert row.status == "declined" and any("shape (1, 3, 1, 8)" in r for r in row.reasons)
    assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)  # memoised: the good one
    with pytest.raises(PluginError, match=r"shape \(1, 3, 1, 8\), expected \(1, 3, 4, 8\)"):
        jaxattn.attention(q, k, v, causal=True, impl="misshapen")


@pytest.mark.usefixtures("empty_registry")
def test_auto_with_nothing_else_left_raises_every_reason() -> None:
    jaxattn.register_impl(Misshapen)
    q, k, v = qkv()
    with pytest.raises(jaxattn.UnsupportedError, match=r"misshapen: .*shape \(1, 3, 1, 8\)"):
        jaxattn.attention(q, k, v, causal=True)


@pytest.mark.usefixtures("empty_registry")
def test_auto_skips_a_paged_backend_returning_the_wrong_shape() -> None:
    jaxattn.register_impl(PagedReference)
    jaxattn.register_impl(MisshapenPaged)
    rng = np.random.default_rng(0)
    pages = [jnp.asarray(rng.standard_normal((6, 4, 2, 8)), jnp.float32) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)
    table, lengths = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.asarray([9, 5], jnp.int32)
    got = jaxattn.paged_attention(q, *pages, table, lengths)
    want = jaxattn.paged_attention(q, *pages, table, lengths, impl="vanilla_paged")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(PluginError, match="misshapen_paged"):
        jaxattn.paged_attention(q, *pages, table, lengths, impl="misshapen_paged")


@pytest.mark.usefixtures("empty_registry")
def test_auto_declines_a_backend_whose_checks_raise() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(Crashy)
    q, k, v = qkv()
    assert_right(jaxattn.attention(q, k, v, causal=True), q, k, v, causal=True)
    row = next(c for c in jaxattn.explain(q, k, v, causal=True).candidates if c.name == "crashy")
    assert row.reasons == ("raised RuntimeError while checking the call: checks exploded",)


# -- NaN: the conformance kit flags it -----------------------------------------------------

def test_the_conformance_kit_flags_nan_output() -> None:
    from jaxattn.testing.cases import cases_for
    from jaxattn.testing.conformance import ConformanceSuite

    class Suite(ConformanceSuite):
        impl_class = NanImpl

    with pytest.raises(AssertionError, match="non-finite"):
        Suite().test_forward(cases_for("default")[0], "float32")


@pytest.mark.parametrize("variable", ["JAXATTN_STRICT_PLUGINS", "JAXATTN_TUNING"])
def test_an_on_off_variable_with_a_typo_is_an_error_naming_it(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxattn.backend.environment import flag

    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(jaxattn.InvalidInputError, match=f"\\${variable}.*'maybe' is neither on nor off"):
        flag(variable, default=False, meaning="test")
    for on in ("1", "on", "TRUE", " yes "):
        monkeypatch.setenv(variable, on)
        assert flag(variable, default=False, meaning="test")
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv(variable, off)
        assert not flag(variable, default=True, meaning="test")
    monkeypatch.setenv(variable, "")
    assert flag(variable, default=True, meaning="test")


def test_strict_plugins_with_a_typo_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_STRICT_PLUGINS", "maybe")
    with pytest.raises(jaxattn.InvalidInputError, match="JAXATTN_STRICT_PLUGINS"):
        plugins._strict()
