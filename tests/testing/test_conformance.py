"""The conformance suite itself: its matrix bites, and it fails backends that are wrong.

Each mutant below is vanilla with one deliberate bug (a feature ignored, causal aligned
top-left, NaN on empty rows, a gradient off by 1%, ...). The suite's test must fail on the
mutant, and pass on vanilla itself, so no check of the suite can pass vacuously.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend.call import AttentionCall, PagedCall
from jaxattn.backend.capabilities import ALL_FEATURES, Feature
from jaxattn.backend.output import AttentionOutput
from jaxattn.backend.problem import AttentionProblem
from jaxattn.testing import oracle
from jaxattn.testing.cases import (
    DEFAULT_CASES,
    FULL_CASES,
    Case,
    Tolerance,
    cases_for,
    decode_sweep,
    make_inputs,
    static_features,
)
from jaxattn.testing.compare import assert_close
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.paged_cases import DEFAULT_PAGED_CASES, make_paged_inputs, poison_unread
from jaxattn.testing.paged_conformance import PagedConformanceSuite
from jaxattn_vanilla.paged.impl import PagedReference
from jaxattn_vanilla.vanilla.impl import VanillaAttention

CASES = {c.name: c for c in FULL_CASES}

# --------------------------------------------------------------------------- the matrix


def _without(case: Case, feature: str, arrays: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The oracle's arguments for ``case``, and the same with one feature removed."""
    optional = ("mask", "bias", "q_segment_ids", "kv_segment_ids", "softmax_aux", "kv_lengths")
    kwargs: dict[str, Any] = {n: arrays[n] for n in optional if n in arrays}
    kwargs.update(static_features(case))
    grouped = {"segments": ("q_segment_ids", "kv_segment_ids"), "sinks": ("softmax_aux",)}
    removed = {n: a for n, a in kwargs.items() if n not in grouped.get(feature, (feature,))}
    return kwargs, removed


FEATURES_OF_CASES = [
    (case.name, feature)
    for case in FULL_CASES
    for feature in ("causal", "mask", "bias", "sliding_window", "segments", "logits_soft_cap", "sinks", "softmax_scale",
                    "kv_lengths")
    if getattr(case, feature) not in (None, False)
]


@pytest.mark.parametrize(("name", "feature"), FEATURES_OF_CASES)
def test_every_feature_of_a_case_changes_its_result(name: str, feature: str) -> None:
    """A backend that ignores a feature must fail the case; so the feature must matter there."""
    case = CASES[name]
    arrays = make_inputs(case, "float32")
    kwargs, removed = _without(case, feature, arrays)
    if feature == "causal" and case.t == 1:
        # Bottom-right causal lets a single query see every key: what the case checks is the
        # alignment (top-left would see key 0 only), so compare against that instead.
        removed["mask"] = np.arange(case.s) == 0
    with_it = oracle.attention(arrays["q"], arrays["k"], arrays["v"], **kwargs).output
    without = oracle.attention(arrays["q"], arrays["k"], arrays["v"], **removed).output
    assert np.abs(with_it - without).max() > 1e-2


def test_cases_are_distinct_and_levels_nest() -> None:
    names = [c.name for c in FULL_CASES]
    assert len(names) == len(set(names))
    assert set(cases_for("default")) <= set(cases_for("full"))
    assert any(c.t < c.s and c.causal for c in DEFAULT_CASES)
    assert any(c.t > c.s and c.causal for c in DEFAULT_CASES)
    assert any(c.t == 1 for c in DEFAULT_CASES)
    assert any(c.hkv == 1 < c.hq for c in DEFAULT_CASES)
    with pytest.raises(ValueError, match="level"):
        cases_for("huge")  # type: ignore[arg-type]


def test_inputs_are_rounded_to_the_dtype_and_reproducible() -> None:
    case = CASES["combined"]
    a, b = make_inputs(case, "bfloat16"), make_inputs(case, "bfloat16")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    q = a["q"]
    np.testing.assert_array_equal(q, np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32)))
    empty = make_inputs(CASES["empty_rows"], "float32")["mask"]
    assert not empty[..., 1, :].any()
    assert empty[..., 0, :].any(axis=-1).all()


# --------------------------------------------------------------------------- assert_close


def test_assert_close_bounds_and_messages() -> None:
    tol = Tolerance(atol=1e-3, rtol=0.0)
    assert_close("x", np.array([1.0, -np.inf]), np.array([1.0005, -np.inf]), tol)
    with pytest.raises(AssertionError, match=r"x: 1 of 2 values off .* worst at \(0,\)"):
        assert_close("x", np.array([1.01, 0.0]), np.array([1.0, 0.0]), tol)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close("x", np.array([np.nan]), np.array([0.0]), tol)
    with pytest.raises(AssertionError, match="expected -inf"):
        assert_close("lse", np.array([0.0]), np.array([-np.inf]), tol)
    with pytest.raises(AssertionError, match="shape"):
        assert_close("x", np.zeros(2), np.zeros(3), tol)
    # atol scales with the largest expected value once it exceeds 1
    assert_close("g", np.array([100.05, 0.0]), np.array([100.0, 0.0]), tol)


# --------------------------------------------------------------------------- mutants

_NEUTRAL: dict[str, Any] = {
    "causal": False,
    "mask": None,
    "bias": None,
    "sliding_window": None,
    "q_segment_ids": None,
    "kv_segment_ids": None,
    "logits_soft_cap": None,
    "softmax_aux": None,
    "softmax_scale": 1.0,  # "ignoring" the scale: a fixed wrong one
    "dropout_prob": 0.0,
}


def _ignoring(*names: str) -> type[VanillaAttention]:
    """vanilla that accepts the features ``names`` and then silently ignores them."""

    class Ignoring(VanillaAttention):
        def forward_native(self, call: AttentionCall) -> AttentionOutput:
            return super().forward_native(call.replace(**{n: _NEUTRAL[n] for n in names}))

    Ignoring.__name__ = f"Ignoring_{'_'.join(names)}"
    return Ignoring


class TopLeftCausal(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        mask = call.mask
        if call.causal:
            tril = jnp.tril(jnp.ones((call.q.shape[1], call.k.shape[1]), dtype=bool))
            mask = tril if mask is None else mask & tril
        return super().forward_native(call.replace(mask=mask, causal=False))


class NanOnEmptyRows(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        empty = jnp.isneginf(out.softmax_lse).transpose(0, 2, 1)[..., None]  # (B, T, H, 1)
        return dataclasses.replace(out, attention_outputs=jnp.where(empty, jnp.nan, out.attention_outputs))


class GradOffByOnePercent(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        q = call.q * 1.01 - jax.lax.stop_gradient(call.q * 0.01)  # same value, gradient scaled by 1.01
        return super().forward_native(call.replace(q=q))


class LseCountsTheSink(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        softmax_aux = call.softmax_aux
        if softmax_aux is None:
            return out
        lse = jnp.logaddexp(out.softmax_lse, softmax_aux.astype(jnp.float32)[None, :, None])
        return dataclasses.replace(out, softmax_lse=lse)


class ForgetsWeights(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return dataclasses.replace(super().forward_native(call), attention_weights=None)


class DropoutUnscaled(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        keep = 1.0 - call.dropout_prob
        return AttentionOutput(out.attention_outputs * keep, out.attention_weights * keep, out.softmax_lse)


class HonestWithoutSoftCap(VanillaAttention):
    features: ClassVar[frozenset[Feature]] = ALL_FEATURES - {Feature.SOFT_CAP, Feature.DROPOUT}


class LiesAboutSinks(VanillaAttention):
    """Does not declare sinks, yet accepts (and mis-runs) calls with them."""

    features: ClassVar[frozenset[Feature]] = ALL_FEATURES - {Feature.SINKS}

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return [r for r in super().not_supported_reasons(problem) if "sinks" not in r]

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return super().forward_native(call.replace(softmax_aux=None))


class WrongWhenEager(VanillaAttention):
    """Right under jit, off by 1% outside it (a compiler or a trace-time path that differs)."""

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        if isinstance(call.q, jax.core.Tracer):
            return out
        return dataclasses.replace(out, attention_outputs=out.attention_outputs * 1.01)


class WrongOnLongGqaDecode(VanillaAttention):
    """Wrong only where jaxlib 0.10.2 miscompiled the decode kernel: GQA, T <= 16, S >= 64."""

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        q, k = call.q, call.k
        if q.shape[1] <= 16 and k.shape[1] >= 64 and q.shape[2] != k.shape[2]:
            return dataclasses.replace(out, attention_outputs=out.attention_outputs * 1.1)
        return out


class ReadsPastLengths(VanillaAttention):
    """Excludes keys past kv_lengths by multiplying by zero: NaN there poisons the output."""

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        return dataclasses.replace(out, attention_outputs=out.attention_outputs + 0.0 * jnp.sum(call.v))


def _suite(impl: type[VanillaAttention]) -> ConformanceSuite:
    class Suite(ConformanceSuite):
        impl_class = impl
        dtypes = ("float32",)

    return Suite()


def _forward(case: str) -> Callable[[ConformanceSuite], None]:
    return lambda suite: suite.test_forward(CASES[case], "float32")


def _gradients(case: str) -> Callable[[ConformanceSuite], None]:
    return lambda suite: suite.test_gradients(CASES[case], "float32")


def _forward_eager(case: str) -> Callable[[ConformanceSuite], None]:
    return lambda suite: suite.test_forward_eager_and_default_jit(CASES[case], "float32")


def _unread(case: str) -> Callable[[ConformanceSuite], None]:
    return lambda suite: suite.test_unread_cache_positions(CASES[case], "float32")


def _sweep(seed: int) -> Callable[[ConformanceSuite], None]:
    """Every case of the seed's sweep; the first failure propagates."""

    def check(suite: ConformanceSuite) -> None:
        for case in decode_sweep(seed):
            suite.test_decode_sweep(case, "float32")

    return check


Check = Callable[[ConformanceSuite], None]
_VALUES_OFF = "attention_outputs: .* values off by more than"


def _dropout_statistics(suite: ConformanceSuite) -> None:
    suite.test_dropout_statistics("float32")


# mutant -> (impl, the suite's check that must fail, what its message must say)
MUTANTS: dict[str, tuple[type[VanillaAttention], Check, str]] = {
    "ignores_causal": (_ignoring("causal"), _forward("causal"), _VALUES_OFF),
    "ignores_mask": (_ignoring("mask"), _forward("mask"), _VALUES_OFF),
    "ignores_bias": (_ignoring("bias"), _forward("bias_broadcast"), _VALUES_OFF),
    "ignores_window": (_ignoring("sliding_window"), _forward("sliding_window"), _VALUES_OFF),
    "ignores_segments": (
        _ignoring("q_segment_ids", "kv_segment_ids"),
        _forward("segment_ids"),
        _VALUES_OFF,
    ),
    "ignores_soft_cap": (_ignoring("logits_soft_cap"), _forward("soft_cap"), _VALUES_OFF),
    "ignores_sinks": (_ignoring("softmax_aux"), _forward("sinks"), _VALUES_OFF),
    "ignores_scale": (_ignoring("softmax_scale"), _forward("softmax_scale"), _VALUES_OFF),
    "ignores_dropout": (_ignoring("dropout_prob"), _dropout_statistics, r"not scaled by 1/\(1-p\)"),
    "dropout_unscaled": (DropoutUnscaled, _dropout_statistics, r"not scaled by 1/\(1-p\)"),
    "top_left_causal_cross": (TopLeftCausal, _forward("causal_t_lt_s"), _VALUES_OFF),
    "top_left_causal_decode": (TopLeftCausal, _forward("decode"), _VALUES_OFF),
    "nan_on_empty_rows": (NanOnEmptyRows, _forward("empty_rows"), "non-finite values"),
    "grad_off_by_1pct": (GradOffByOnePercent, _gradients("plain"), "dq: .* values off"),
    "lse_counts_the_sink": (LseCountsTheSink, _forward("sinks"), "softmax_lse: .* values off"),
    "forgets_weights": (ForgetsWeights, _forward("plain"), "returned no weights"),
    "nan_on_neg_inf_bias_rows": (NanOnEmptyRows, _forward("bias_neg_inf_rows"), "non-finite values"),
    "wrong_when_eager": (WrongWhenEager, _forward_eager("plain"), "eager: .*values off"),
    "wrong_on_long_gqa_decode": (WrongOnLongGqaDecode, _forward_eager("decode_gqa_s64"), _VALUES_OFF),
    "wrong_on_long_gqa_decode_sweep": (WrongOnLongGqaDecode, _sweep(0), _VALUES_OFF),
    "reads_past_lengths": (ReadsPastLengths, _unread("kv_lengths_decode"), "non-finite values"),
    "lies_about_sinks": (
        LiesAboutSinks,
        lambda s: s.test_undeclared_features_are_declined(),
        r"does not declare sinks but supports\(\) accepts it",
    ),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_suite_fails_a_wrong_backend(name: str) -> None:
    impl, check, message = MUTANTS[name]
    with pytest.raises(AssertionError, match=message):
        check(_suite(impl))


@pytest.mark.parametrize(
    "check",
    [
        _forward("causal"),  # top-left and bottom-right agree when T == S
        _gradients("plain"),
    ],
)
def test_suite_passes_what_is_right(check: Callable[[ConformanceSuite], None]) -> None:
    check(_suite(TopLeftCausal))


def test_declined_features_are_checked_then_skipped() -> None:
    suite = _suite(HonestWithoutSoftCap)
    suite.test_undeclared_features_are_declined()
    with pytest.raises(pytest.skip.Exception, match="declined as it should"):
        suite.test_forward(CASES["soft_cap"], "float32")
    with pytest.raises(pytest.skip.Exception, match="declined as it should"):
        suite.test_dropout_statistics("float32")


def test_decode_sweep_is_seeded_and_spans_the_shapes() -> None:
    """Same seed, same cases; the seed is in every name; the shapes cover what a fixed matrix missed."""
    assert decode_sweep(3) == decode_sweep(3) and decode_sweep(3) != decode_sweep(4)
    assert all(c.name.startswith("sweep_s3_") for c in decode_sweep(3))
    many = [c for seed in range(40) for c in decode_sweep(seed)]
    assert {c.hkv for c in many} == {1, 2, 8} and {c.hq // c.hkv for c in many} == {1, 2, 4}
    assert {64, 512} <= {c.s for c in many} and {c.s % 2 for c in many} == {0, 1}
    assert {c.t for c in many} == set(range(1, 17)) and min(c.d for c in many) == 16 and max(c.d for c in many) == 128
    assert {c.causal for c in many} == {True, False} and {c.kv_lengths is None for c in many} == {True, False}


class _LeaksUnreadPages(PagedReference):
    """Multiplies the pool by zero somewhere: NaN in a page no query reads poisons the output."""

    def forward_native(self, call: PagedCall) -> AttentionOutput:
        out = super().forward_native(call)
        pool = call.k_pages if call.v_pages is None else call.v_pages
        return dataclasses.replace(out, attention_outputs=out.attention_outputs + 0.0 * jnp.sum(pool))


def _paged_suite(impl: type[PagedReference]) -> PagedConformanceSuite:
    class Suite(PagedConformanceSuite):
        impl_class = impl

    return Suite()


def test_paged_suite_poisons_what_no_query_reads() -> None:
    case = next(c for c in DEFAULT_PAGED_CASES if c.name == "ragged_mixed")
    poisoned = poison_unread(case, make_paged_inputs(case, "float32"), np.nan)
    assert np.isnan(poisoned["k_pages"]).any() and np.isnan(poisoned["v_pages"]).any()
    _paged_suite(PagedReference).test_unread_positions(case, "float32")
    _paged_suite(PagedReference).test_forward_eager(case, "float32")
    with pytest.raises(AssertionError, match="non-finite values"):
        _paged_suite(_LeaksUnreadPages).test_unread_positions(case, "float32")


# --------------------------------------------------------------------------- pytest wiring


def test_parametrisation_and_level_option(tmp_path: Path) -> None:
    """Run pytest on a third-party style test file: ids, the option, the class-level override."""
    (tmp_path / "test_mine.py").write_text(
        textwrap.dedent(
            """
            from jaxattn.testing.conformance import ConformanceSuite

            class TestFromOption(ConformanceSuite):
                impl_name = "vanilla"
                dtypes = ("float32", "bfloat16")

            class TestPinned(ConformanceSuite):
                impl_name = "vanilla"
                level = "default"
            """
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "jaxattn.testing.pytest_plugin",
        "--jaxattn-conformance=full",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = out.stdout.split()
    assert "test_mine.py::TestFromOption::test_forward[large-bfloat16]" in ids
    assert "test_mine.py::TestFromOption::test_gradients[combined-float32]" in ids
    assert "test_mine.py::TestFromOption::test_dropout_statistics[bfloat16]" in ids
    assert "test_mine.py::TestPinned::test_forward[plain-float32]" in ids
    # The new runs and the seeded sweep, the seed in the id; poison only where there are lengths.
    assert "test_mine.py::TestPinned::test_forward_eager_and_default_jit[plain-float32]" in ids
    assert "test_mine.py::TestPinned::test_decode_sweep[sweep_s0_0-float32]" in ids
    assert "test_mine.py::TestPinned::test_unread_cache_positions[kv_lengths_decode-float32]" in ids
    assert not any(i.startswith("test_mine.py::TestPinned::test_unread_cache_positions[plain") for i in ids)
    assert not any(i.startswith("test_mine.py::TestPinned::test_forward[large") for i in ids)
    assert not any("ConformanceSuite" in i for i in ids)  # the base class is not collected
