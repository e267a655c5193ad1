"""Discovery through entry points: isolation of broken plugins, strict mode, allow/deny lists.

These build real ``EntryPoint`` objects for modules in this folder; installing real
distributions into fresh environments is covered by tests/packaging.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings
from collections.abc import Iterator

import pytest

import jaxattn
from jaxattn import PluginError
from jaxattn.discovery import plugins
from jaxattn.discovery.plugins import PluginWarning, isolated_registry

GROUP = plugins.ENTRY_POINT_GROUP


def eps(*names: str) -> list[importlib.metadata.EntryPoint]:
    return [importlib.metadata.EntryPoint(n, f"tests.core.fake_plugins.{n}", GROUP) for n in names]


@pytest.fixture
def discover(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    def run(*names: str) -> None:
        monkeypatch.setattr(plugins, "_entry_points", lambda: eps(*names))
        for name in names:  # import errors must happen at discovery, every time
            sys.modules.pop(f"tests.core.fake_plugins.{name}", None)

    with isolated_registry(discover=False):
        plugins._state.discovered = False
        yield run


def test_lazy_ref_imports_nothing_until_asked(discover) -> None:
    sys.modules.pop("tests.core.toy_impls", None)
    discover("good")
    rows = jaxattn.list_impls()
    assert [r.name for r in rows] == ["plain"] and rows[0].plugin == "good"
    assert "tests.core.toy_impls" not in sys.modules
    assert jaxattn.get_impl("plain_alias").name() == "plain"
    assert "tests.core.toy_impls" in sys.modules


def test_broken_plugins_are_isolated_warned_once_and_reraised(discover) -> None:
    discover("good", "import_error", "hook_error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = {r.name: r for r in jaxattn.list_impls()}
        jaxattn.list_impls()
    assert [w.category for w in caught] == [PluginWarning, PluginWarning]  # one per broken plugin, not per call
    assert rows["plain"].status == "ok"
    assert rows["import_error"].status == "broken" and "libmissing" in rows["import_error"].reason
    assert rows["hook_error"].status == "broken" and "exploded" in rows["hook_error"].reason
    with pytest.raises(PluginError, match="libmissing") as info:
        jaxattn.get_impl("import_error")
    assert isinstance(info.value.__cause__, ImportError)


def test_bad_lazy_ref_is_listed_broken_before_anything_asks(discover) -> None:
    discover("bad_ref")  # its ImplRef names a module that does not exist: found without importing
    rows = jaxattn.list_impls()
    assert [r.status for r in rows] == ["broken"] and "no_such_module" in rows[0].reason
    with pytest.raises(PluginError, match=r"failed to load.*no_such_module"):
        jaxattn.get_impl("ghost")


def test_strict_makes_failures_fatal(discover, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_STRICT_PLUGINS", "1")
    discover("good", "import_error")
    with pytest.raises(PluginError, match="libmissing"):
        jaxattn.list_impls()


def test_allow_and_deny_lists(discover, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_PLUGINS", "good")
    discover("good", "import_error")
    rows = {r.name: r.status for r in jaxattn.list_impls()}
    assert rows == {"plain": "ok", "import_error": "disabled"}


def test_unknown_names_in_lists_are_reported(discover, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_DISABLE_PLUGINS", "import_error,typo_plugin")
    discover("good", "import_error")
    with pytest.warns(PluginWarning, match="typo_plugin"):
        rows = {r.name: r.status for r in jaxattn.list_impls()}
    assert rows == {"plain": "ok", "import_error": "disabled"}


def test_equal_priority_plugins_conflict_naming_both(discover) -> None:
    discover("good", "twin")
    with pytest.warns(PluginWarning, match="good.*twin|twin.*good"):
        rows = jaxattn.list_impls()
    assert {r.status for r in rows} == {"conflict"}
    with pytest.raises(PluginError, match="equal priority"):
        jaxattn.get_impl("plain")


def test_runtime_plugin_object(discover) -> None:
    discover()

    class Plugin:
        @jaxattn.hookimpl
        def jaxattn_register_impls(self) -> list[jaxattn.ImplRef]:
            return [jaxattn.ImplRef("tests.core.toy_impls:FancyImpl", names=("fancy",), platforms=("cpu", "gpu", "tpu"),
                                    priority=10)]

    jaxattn.register_plugin(Plugin(), name="runtime-fancy")
    assert jaxattn.get_impl("fancy").name() == "fancy"


def test_ref_declaration_must_match_class(discover) -> None:
    discover()

    class Liar:
        @jaxattn.hookimpl
        def jaxattn_register_impls(self) -> list[jaxattn.ImplRef]:
            return [jaxattn.ImplRef("tests.core.toy_impls:PlainImpl", names=("plain",), platforms=("tpu",))]

    jaxattn.register_plugin(Liar(), name="liar")
    with pytest.raises(PluginError, match="disagrees with its declaration: platforms"):
        jaxattn.get_impl("plain", jaxattn.AttentionMetadata(platform="tpu", interpret=True))
