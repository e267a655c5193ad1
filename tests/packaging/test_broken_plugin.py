"""Plugins whose modules fail to import (one raises ImportError, one calls sys.exit()),
installed next to working ones in a fresh venv."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from venvtools import Venv

# One xdist worker runs every fresh-venv test, so the wheelhouse and the dependency base
# (session fixtures) are built once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fresh_venvs")]

REQUIREMENTS = ("jaxattn-vanilla", "jaxattn-example-plugin", "jaxattn-broken-plugin")
CAUSE = "cannot import name '_kernels'"
EXIT = "SystemExit: jaxattn_broken.exits: exiting at import"

# Inside the fresh environment: the others keep working, the failure is warned about
# exactly once however often the registry is used, and asking for it re-raises the cause.
CHECK = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax.numpy as jnp
    import jaxattn
    rows = {r.name: r for r in jaxattn.list_impls()}
    jaxattn.list_impls()
    q = jnp.ones((1, 4, 2, 8))
    for name in ("vanilla", "example", "auto"):
        assert jaxattn.attention(q, q, q, impl=name).shape == q.shape, name
    jaxattn.get_impl("vanilla")

assert rows["broken"].status == "broken", rows["broken"]
assert rows["broken"].distribution == "jaxattn-broken-plugin", rows["broken"]
assert "CAUSE" in rows["broken"].reason, rows["broken"].reason
assert rows["vanilla"].status == rows["example"].status == "ok"
assert rows["exits"].status == "broken" and "EXIT" in rows["exits"].reason, rows["exits"]
mentions = [w for w in caught if "'broken'" in str(w.message)]
assert len(mentions) == 1, [str(w.message) for w in caught]
assert "CAUSE" in str(mentions[0].message), str(mentions[0].message)

try:
    jaxattn.get_impl("broken")
except jaxattn.PluginError as err:
    assert "CAUSE" in str(err), str(err)
    assert isinstance(err.__cause__, ImportError), repr(err.__cause__)
else:
    raise AssertionError("asking for the broken plugin by name did not raise")
print("broken plugin isolated")
""".replace("CAUSE", CAUSE).replace("EXIT", EXIT)


@pytest.fixture(scope="module")
def venv(make_venv: Callable[..., Venv]) -> Venv:
    return make_venv(*REQUIREMENTS)


def test_others_keep_working_warned_once_reraised_by_name(venv: Venv) -> None:
    assert venv.run("-c", CHECK).stdout.strip().endswith("broken plugin isolated")


def test_info_reports_it_with_its_cause(venv: Venv) -> None:
    info = json.loads(venv.script("jaxattn", "info", "--json").stdout)
    plugins = {p["name"]: p for p in info["plugins"]}
    assert plugins["broken"]["status"] == "broken"
    assert plugins["broken"]["distribution"] == "jaxattn-broken-plugin"
    assert CAUSE in plugins["broken"]["reason"]
    assert plugins["vanilla"]["status"] == plugins["example"]["status"] == "ok"
    assert plugins["exits"]["status"] == "broken" and EXIT in plugins["exits"]["reason"]
    assert any(CAUSE in w for w in info["warnings"])

    text = venv.script("jaxattn", "info", "--plain").stdout
    broken_line = next(line for line in text.splitlines() if line.startswith("broken "))
    assert "jaxattn-broken-plugin" in broken_line and "broken" in broken_line.split()[1:]
    assert CAUSE in text


def test_info_strict_flag_fails_on_it(venv: Venv) -> None:
    assert venv.script("jaxattn", "info", "--strict", "--json", check=False).returncode == 1


def test_strict_plugins_make_it_fatal(venv: Venv) -> None:
    strict = {"JAXATTN_STRICT_PLUGINS": "1"}
    result = venv.run("-c", "import jaxattn; jaxattn.list_impls()", env=strict, check=False)
    assert result.returncode != 0
    assert "PluginError" in result.stderr and CAUSE in result.stderr
    cli = venv.script("jaxattn", "list", env=strict, check=False)
    assert cli.returncode == 2 and CAUSE in cli.stderr


def test_disabling_it_silences_it(venv: Venv) -> None:
    code = ("import warnings, jaxattn\nwarnings.simplefilter('error')\n"
            "rows = {r.name: r.status for r in jaxattn.list_impls()}\nprint(rows['broken'], rows['exits'])")
    result = venv.run("-c", code, env={"JAXATTN_DISABLE_PLUGINS": "broken,exits"})
    assert result.stdout.strip() == "disabled disabled"
