"""The third-party example plugins, pip-installed into one fresh environment, found and run: the
example (``forward(self, call)``) and the seed-style one (EasyDeL's ``forward_native(self, q, k, v, ...)``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from venvtools import Venv

# One xdist worker runs every fresh-venv test, so the wheelhouse and the dependency base
# (session fixtures) are built once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fresh_venvs")]

REQUIREMENTS = ("jaxattn-vanilla", "jaxattn-example-plugin", "jaxattn-seed-plugin")

# Runs inside the fresh environment: by name and by alias, against the oracle, and checks
# that a feature it does not declare is declined with a reason instead of being ignored.
CHECK = """
import jax, numpy as np
import jaxattn
from jaxattn.testing import oracle

by_name, by_alias = jaxattn.get_impl("example"), jaxattn.get_impl("example_dense")
assert type(by_name) is type(by_alias), (by_name, by_alias)
assert type(by_name).__module__ == "jaxattn_example.impl", type(by_name).__module__

# NumPy draws the values: jax.random.normal would compile a program per shape.
rng = np.random.default_rng(1)
q = jax.numpy.asarray(rng.standard_normal((2, 12, 4, 16)), "float32")
k = jax.numpy.asarray(rng.standard_normal((2, 20, 2, 16)), "float32")
v = jax.numpy.asarray(rng.standard_normal((2, 20, 2, 16)), "float32")
ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True).output
for name in ("example", "example_dense"):
    out = jaxattn.attention(q, k, v, impl=name, causal=True)
    err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
    assert err < 1e-5, (name, err)
grad = jax.grad(lambda q: jaxattn.attention(q, k, v, impl="example").sum())(q)
assert grad.shape == q.shape and bool(np.isfinite(np.asarray(grad)).all())

try:
    jaxattn.attention(q, k, v, impl="example", sliding_window=4)
except jaxattn.UnsupportedError as err:
    assert any("sliding window" in r for r in err.reasons), err.reasons
else:
    raise AssertionError("the example impl silently accepted a sliding window")

# The seed-style backend: by name and alias, the scale read from its metadata, declines with reasons.
assert type(jaxattn.get_impl("seed_dense")).__module__ == "jaxattn_seed.impl"
for name, scale in (("seed_example", None), ("seed_dense", 0.2)):
    out = jaxattn.attention(q, k, v, impl=name, causal=True, softmax_scale=scale)
    want = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True, softmax_scale=scale).output
    err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
    assert err < 1e-5, (name, err)
jitted = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, impl="seed_example", causal=True))(q, k, v)
assert float(np.max(np.abs(np.asarray(jitted, np.float64) - ref))) < 1e-5
try:
    jaxattn.attention(q, k, v, impl="seed_example", logits_soft_cap=30.0)
except jaxattn.UnsupportedError as err:
    assert any("soft cap" in r for r in err.reasons), err.reasons
else:
    raise AssertionError("the seed-style impl silently accepted a soft cap")

# auto prefers the real backends: the example declares the lowest priority. jaxattn-vanilla
# brings autoregressive_decodeattn (priority 60 on a CPU, calls of T <= 16 queries: this one
# has 12), blockwise (10, every length: a prefill of 64 queries) and vanilla (0).
for t, expected in ((12, "autoregressive_decodeattn"), (64, "blockwise")):
    qt = jax.numpy.asarray(rng.standard_normal((2, t, 4, 16)), "float32")
    explained = jaxattn.explain(qt, k, v, causal=True)
    assert explained.chosen == expected, (t, explained.chosen)
    accepted = [c.name for c in explained.candidates if c.accepted or c.chosen]
    assert accepted[-2:] == ["seed_example", "example"], (t, accepted)
print("example plugin ok")
"""


@pytest.fixture(scope="module")
def venv(make_venv: Callable[..., Venv]) -> Venv:
    return make_venv(*REQUIREMENTS)


def test_found_by_name_and_alias_and_runs(venv: Venv) -> None:
    assert venv.run("-c", CHECK).stdout.strip().endswith("example plugin ok")


def test_listed_with_its_distribution(venv: Venv) -> None:
    rows = json.loads(venv.script("jaxattn", "list", "--json").stdout)
    example = [r for r in rows if r["name"] == "example"]
    assert len(example) == 1, rows
    assert example[0]["aliases"] == ["example_dense"]
    assert example[0]["distribution"] == "jaxattn-example-plugin"
    assert example[0]["version"] == "0.1.0"
    assert example[0]["status"] == "ok" and example[0]["usable_here"] is True


def test_listing_does_not_import_the_impl_module(venv: Venv) -> None:
    # The plugin hands over a lazy ImplRef: listing must not import jaxattn_example.impl.
    code = "import sys, jaxattn; jaxattn.list_impls(); print('jaxattn_example.impl' in sys.modules)"
    assert venv.run("-c", code).stdout.strip() == "False"


def test_disabled_by_name(venv: Venv) -> None:
    rows = json.loads(venv.script("jaxattn", "list", "--json",
                                  env={"JAXATTN_DISABLE_PLUGINS": "example"}).stdout)
    assert {r["name"]: r["status"] for r in rows}.get("example") == "disabled"
    assert "example_dense" not in {a for r in rows for a in r["aliases"]}


CONFORMANCE = """
from typing import ClassVar

from jaxattn.testing.conformance import ConformanceSuite


class TestExampleConformance(ConformanceSuite):
    impl_name = "example_dense"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")


class TestSeedStyleConformance(ConformanceSuite):
    impl_name = "seed_dense"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
"""


def test_passes_the_conformance_suite_as_a_third_party(venv: Venv, tmp_path: Path) -> None:
    # What a plugin author does in their own repository: subclass the suite, run pytest (both
    # plugins' suites in one run: each fresh-venv pytest costs a jax import and its compiles).
    (tmp_path / "test_example_conformance.py").write_text(CONFORMANCE)
    result = venv.run("-m", "pytest", "-v", "-p", "no:cacheprovider", str(tmp_path), check=False, timeout=900)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
    # Features the example does not declare are declined (skipped with a reason), not ignored.
    assert " skipped" in summary, summary
    for suite in ("TestExampleConformance", "TestSeedStyleConformance"):  # both ran, with the contract checks
        for test in ("test_forward_form", "test_output_contract[float32]", "test_output_contract[bfloat16]"):
            assert f"{suite}::{test} PASSED" in result.stdout, (suite, test, result.stdout[-3000:])
