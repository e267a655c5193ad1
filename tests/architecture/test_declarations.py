"""Declare once (issue 19): an impl's names, kind, platforms, priority and capabilities live in
its ``ImplRef``; the class binds to it and says none of them again.

A class that still sets a declared value disagrees with its declaration; that is found when the
commands that import the impl modules run (``jaxattn list``, ``jaxattn info --strict``: both
fail, naming the impl, the field and both values), never only when the impl is called. The
plugins here register in process, as ``tests/core/test_hostile_plugins.py``'s do, with their
classes in this module.
"""

from __future__ import annotations

import ast
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import jaxattn
from jaxattn import AttentionImpl, Feature, ImplRef
from jaxattn.backend.declaration import CLASS_FIELDS, DeclarationError
from jaxattn.backend.names import DISTRIBUTIONS, FIRST_PARTY, install_hint
from jaxattn.backend.paged_impl import PagedAttentionImpl
from jaxattn.cli import main as cli_main
from jaxattn.discovery.plugins import isolated_registry, problems, registry

ROOT = Path(__file__).resolve().parents[2]
HERE = __name__  # the declarations below name this module's classes
EVERYWHERE = ("cpu", "gpu", "tpu")

HONEST = ImplRef(
    f"{HERE}:Honest", names=("honest", "honest_alias"), platforms=("cpu", "tpu"), priority=-50,
    description="states everything once", dtypes={"float32", "bfloat16"}, head_dims=(8, 128),
    features={Feature.CAUSAL, Feature.GQA}, fallback_impl="vanilla", sequence_parallel=True,
)


class Honest(AttentionImpl, declaration=HONEST):
    """Binds to its declaration and says nothing again."""


class Heir(Honest):
    """No declaration of its own: a plain class that inherits its parent's values and may change them."""

    priority: ClassVar[int] = 3

    @classmethod
    def get_impl_name(cls) -> str:
        return "heir"


# -- classes that say a declared value again, differently ---------------------------------

def declared(cls_name: str, **fields: Any) -> ImplRef:
    return ImplRef(f"{HERE}:{cls_name}", **{"names": (cls_name.lower(),), "platforms": EVERYWHERE, **fields})


PRIORITY = declared("PriorityAgain", priority=5)
PLATFORMS = declared("PlatformsAgain")
DTYPES = declared("DtypesAgain", dtypes={"float32"})
HEAD_DIMS = declared("HeadDimsAgain", head_dims=(1, 256))
FEATURES = declared("FeaturesAgain", features={Feature.CAUSAL})
DESCRIPTION = declared("DescriptionAgain", description="the declared line")
NAMES = declared("NamesAgain")


class PriorityAgain(AttentionImpl, declaration=PRIORITY):
    priority: ClassVar[int] = 7


class PlatformsAgain(AttentionImpl, declaration=PLATFORMS):
    platforms: ClassVar[frozenset[str]] = frozenset({"cuda"})


class DtypesAgain(AttentionImpl, declaration=DTYPES):
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "float16"})


class HeadDimsAgain(AttentionImpl, declaration=HEAD_DIMS):
    head_dims: ClassVar[tuple[int, int] | frozenset[int]] = (1, 128)


class FeaturesAgain(AttentionImpl, declaration=FEATURES):
    features: ClassVar[frozenset[Feature]] = frozenset({Feature.CAUSAL, Feature.MASK})


class DescriptionAgain(AttentionImpl, declaration=DESCRIPTION):
    description: ClassVar[str] = "another line"


class NamesAgain(AttentionImpl, declaration=NAMES):
    @classmethod
    def get_impl_name(cls) -> str:
        return "another_name"


# (declaration, field, what the declaration says, what the class says), as reported
AGAIN = [
    (PRIORITY, "priority", "5", "7"),
    (PLATFORMS, "platforms", "{'cpu', 'gpu', 'tpu'}", "{'cuda'}"),
    (DTYPES, "dtypes", "{'float32'}", "{'float16', 'float32'}"),
    (HEAD_DIMS, "head_dims", "(1, 256)", "(1, 128)"),
    (FEATURES, "features", "{'causal'}", "{'causal', 'mask'}"),
    (DESCRIPTION, "description", "'the declared line'", "'another line'"),
    (NAMES, "names", "('namesagain',)", "('another_name',)"),
]


class Registering:
    """An in-process plugin whose hook returns ``refs``."""

    def __init__(self, *refs: ImplRef) -> None:
        self.refs = list(refs)

    @jaxattn.hookimpl
    def jaxattn_register_impls(self) -> list[ImplRef]:
        return self.refs


@pytest.fixture
def scope() -> Iterator[None]:
    """A registry holding only what the test registers."""
    with isolated_registry(discover=False):
        yield


def command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """(exit status, the JSON report, stderr) of one ``jaxattn`` command."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli_main([*argv, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


# -- one place ------------------------------------------------------------------------------

def test_a_bound_class_takes_every_declared_value_from_its_declaration() -> None:
    assert Honest.names() == ("honest", "honest_alias") and Honest.name() == "honest"
    assert Honest.platforms == frozenset({"cpu", "tpu"})
    assert (Honest.priority, Honest.description) == (-50, "states everything once")
    assert Honest.dtypes == frozenset({"float32", "bfloat16"}) and Honest.head_dims == (8, 128)
    assert Honest.features == frozenset({Feature.CAUSAL, Feature.GQA})
    assert (Honest.fallback_impl, Honest.sequence_parallel, Honest.declaration) == ("vanilla", True, HONEST)
    assert Honest.capabilities()["head_dims"] == [8, 128]
    assert "get_impl_name" not in Honest.__dict__


def test_the_declaration_of_a_bound_class_agrees_with_it(scope: None, capsys: pytest.CaptureFixture[str]) -> None:
    jaxattn.register_plugin(Registering(HONEST), name="honest")
    assert problems(load=True) == []
    assert registry().resolve("honest_alias", "cpu", None).load() is Honest
    code, rows, err = command(capsys, "list")
    assert code == 0, err
    assert [(r["name"], r["status"], r["priority"]) for r in rows] == [("honest", "ok", -50)]


def test_a_subclass_without_a_declaration_is_a_plain_class(scope: None) -> None:
    assert (Heir.names(), Heir.priority, Heir.dtypes) == (("heir",), 3, Honest.dtypes)
    jaxattn.register_impl(Heir)
    provider = registry().resolve("heir", "cpu", None)
    assert (provider.names, provider.priority, provider.platforms) == (("heir",), 3, ("cpu", "tpu"))
    assert jaxattn.get_impl("heir").name() == "heir"


def test_a_class_without_a_declaration_declares_its_values_itself(scope: None) -> None:
    class Own(AttentionImpl):
        priority: ClassVar[int] = 4
        dtypes: ClassVar[frozenset[str]] = frozenset({"float32"})

        @classmethod
        def get_impl_name(cls) -> str:
            return "own"

    jaxattn.register_impl(Own)
    provider = registry().resolve("own", "cpu", None)
    assert (provider.name, provider.priority, Own.declaration) == ("own", 4, None)
    assert jaxattn.get_impl("own").dtypes == frozenset({"float32"})


def test_a_class_with_neither_a_declaration_nor_names_says_what_it_lacks() -> None:
    class Nameless(AttentionImpl):
        pass

    with pytest.raises(NotImplementedError, match=r"declaration=.*get_impl_name"):
        Nameless.names()


def test_a_declaration_of_another_kind_cannot_bind() -> None:
    paged = declared("Dense", kind="paged")
    with pytest.raises(DeclarationError, match=r"dense backend.*kind 'paged'"):
        class Dense(AttentionImpl, declaration=paged):
            pass
    with pytest.raises(DeclarationError, match=r"paged backend.*kind 'dense'"):
        class Paged(PagedAttentionImpl, declaration=declared("Paged")):
            pass


def test_declared_capabilities_are_checked_when_declared() -> None:
    with pytest.raises(jaxattn.PluginError, match="head_dims"):
        declared("Bad", head_dims=(64, 8))
    with pytest.raises(jaxattn.PluginError, match="features"):
        declared("Bad", features={"no_such_feature"})


# -- a class that says a declared value again fails list and info --strict -------------------

@pytest.mark.parametrize(("ref", "field", "says", "class_says"), AGAIN, ids=[a[1] for a in AGAIN])
def test_a_class_that_says_a_declared_value_again_fails_list_and_info_strict(
    scope: None, capsys: pytest.CaptureFixture[str], ref: ImplRef, field: str, says: str, class_says: str,
) -> None:
    jaxattn.register_plugin(Registering(HONEST, ref), name="twice")
    impl = ref.names[0]
    assert problems(load=False) == []  # without importing the class nothing can tell

    found = problems(load=True)
    assert [(p.category, p.plugin, p.impl) for p in found] == [("declaration", "twice", impl)]
    wanted = f"{field}: the declaration says {says}, the class says {class_says}"
    assert wanted in found[0].message

    code, rows, err = command(capsys, "list")
    assert code == 1
    assert f"impl {impl!r}" in err and wanted in err
    statuses = {r["name"]: r["status"] for r in rows}
    assert statuses == {"honest": "ok", impl: "broken"}  # still the whole listing

    code, report, err = command(capsys, "info", "--strict")
    assert code == 1
    assert f"impl {impl!r}" in err and wanted in err
    assert [p["category"] for p in report["problems"]] == ["declaration"]


def test_a_class_bound_to_another_declaration_disagrees(scope: None, capsys: pytest.CaptureFixture[str]) -> None:
    other = ImplRef(f"{HERE}:Honest", names=("honest",), platforms=("cpu", "tpu"), priority=-50)
    jaxattn.register_plugin(Registering(other), name="borrower")
    (problem,) = problems(load=True)
    assert problem.category == "declaration"
    assert "binds to the ImplRef of" in problem.message
    assert command(capsys, "list")[0] == 1


# -- the first-party plugins ------------------------------------------------------------------

def _first_party_refs() -> list[ImplRef]:
    with isolated_registry(discover=True):
        return [p.source for p in registry().providers
                if p.first_party and isinstance(p.source, ImplRef)]


def test_every_first_party_impl_binds_to_the_declaration_that_names_it() -> None:
    refs = _first_party_refs()
    assert {ref.target.partition(".")[0] for ref in refs} >= {"jaxattn_vanilla", "jaxattn_sdpa"}
    for ref in refs:
        cls = ref.load()
        assert cls.__dict__.get("declaration") is ref, f"{ref.target} does not bind to its ImplRef"
        assert "get_impl_name" not in cls.__dict__, f"{ref.target} names itself again"
        stated = ref.class_values()
        assert set(stated) >= {"platforms", "priority", "description", "dtypes", "features"}, ref.target
        assert {f: getattr(cls, f) for f in stated} == stated, ref.target


def test_the_core_table_of_known_names_is_what_the_first_party_plugins_declare() -> None:
    """``names.DISTRIBUTIONS`` (which distribution brings a name no installed plugin provides) restates
    nothing: every name an installed first-party plugin declares is listed under its distribution,
    and nothing more is listed for an installed one."""
    with isolated_registry(discover=True):
        declared = {(name, p.distribution) for p in registry().providers if p.first_party for name in p.names}
    installed = {dist for _, dist in declared}
    assert installed >= {"jaxattn-vanilla", "jaxattn-sdpa"}
    listed = {(name, dist) for name, dists in DISTRIBUTIONS.items() for dist in dists if dist in installed}
    assert listed == declared
    assert {dist for dists in DISTRIBUTIONS.values() for dist in dists} == FIRST_PARTY


def test_install_hints_come_from_the_extras_of_jaxattn() -> None:
    hint = install_hint(("jaxattn-triton", "jaxattn-pallas"))
    assert hint.startswith("jaxattn-triton: pip install 'jaxattn[gpu]'; jaxattn-pallas: pip install 'jaxattn[tpu]'")
    assert "jaxattn[cuda12]" in hint and "jaxattn[libtpu]" in hint
    assert install_hint(("jaxattn-vanilla",)).startswith("jaxattn-vanilla: pip install 'jaxattn[cpu]' (also in ")
    assert install_hint(("somebody-else",)).startswith("somebody-else: pip install somebody-else")


def _class_attributes_set_in_bodies(path: Path) -> list[str]:
    """``Class.field`` for each declared field a class body in ``path`` sets, and each
    ``get_impl_name`` it defines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", [])
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if isinstance(stmt, ast.FunctionDef):
                names = [stmt.name]
            found += [f"{node.name}.{n}" for n in names if n in (*CLASS_FIELDS, "get_impl_name")]
    return found


def test_no_plugin_class_says_a_declared_value_itself() -> None:
    """The plugins' impl classes take every declared value from their ImplRef: none sets one or
    names itself, so no comment has to say that two places must match."""
    sources = sorted((ROOT / "plugins").glob("*/src/jaxattn_*/**/*.py"))
    assert sources
    said = {str(p.relative_to(ROOT)): _class_attributes_set_in_bodies(p) for p in sources}
    assert {p: s for p, s in said.items() if s} == {}
    matching = [str(p.relative_to(ROOT)) for p in sources if "must match" in p.read_text().lower()]
    assert matching == []
