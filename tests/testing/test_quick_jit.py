"""The suite's compile settings: the fast test options, and XLA's defaults where a test asks for them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.testing import quick_jit as Q

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are XLA:CPU's")


def test_test_options_add_only_what_this_jaxlib_knows() -> None:
    options = Q.compiler_options_for_tests()
    assert options is not None
    assert {k: options[k] for k in Q.CPU_TEST_COMPILER_OPTIONS} == Q.CPU_TEST_COMPILER_OPTIONS
    extra = set(options) - set(Q.CPU_TEST_COMPILER_OPTIONS)
    assert extra <= set(Q.CPU_TEST_COMPILER_OPTIONS_IF_KNOWN)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(jax.jit(lambda x: x * 2, compiler_options=options)(x), x * 2)


def test_default_options_undo_each_test_option_with_xlas_default() -> None:
    """Every test option (XLA_FLAGS may set each for every compile) comes back at XLA's own
    default (xla/debug_options_flags.cc: optimisation level 3, the expensive LLVM passes on,
    fusion emitters on)."""
    defaults = Q.default_compiler_options() or {}
    assert set(defaults) == set(Q.compiler_options_for_tests() or {})
    xla_defaults = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                    "xla_cpu_use_fusion_emitters": True}
    assert defaults == {k: xla_defaults[k] for k in defaults}
    assert all(defaults[k] != v for k, v in (Q.compiler_options_for_tests() or {}).items())
    x = jnp.arange(4, dtype=jnp.float32)
    np.testing.assert_array_equal(jax.jit(lambda x: x + 1, compiler_options=defaults or None)(x), np.arange(4) + 1)


def test_the_suite_sets_its_xla_flags_where_the_jaxlib_knows_them() -> None:
    """tests/conftest.py puts SUITE_XLA_FLAGS into XLA_FLAGS (inherited by the workers and the
    subprocesses) unless switched off; the same options are then known to the compile options."""
    conftest = next(m for m in list(sys.modules.values())
                    if getattr(m, "__file__", None) == str(Path(__file__).parents[1] / "conftest.py"))
    if os.environ.get(conftest.SUITE_XLA_FLAGS_SWITCH) == "0":
        pytest.skip("switched off")
    flags = os.environ.get("XLA_FLAGS", "").split()
    known = Q.compiler_options_for_tests() or {}
    for flag in conftest.SUITE_XLA_FLAGS:
        name = flag.removeprefix("--").split("=")[0]
        assert (flag in flags) == (name in known), (flag, flags, known)
