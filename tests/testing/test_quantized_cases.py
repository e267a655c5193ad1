"""The quantized-cache conformance checks catch wrong backends, and the cases poison what they say."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend.call import AttentionCall, PagedCall
from jaxattn.backend.capabilities import Feature
from jaxattn.backend.output import AttentionOutput
from jaxattn.backend.problem import PagedProblem
from jaxattn.backend.quantize import GRANULARITIES, QUANTIZED_KV_DTYPES, dequantize_kv
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.paged_cases import DEFAULT_PAGED_CASES, make_paged_inputs
from jaxattn.testing.paged_conformance import PagedConformanceSuite
from jaxattn.testing.quantized_cases import (
    QUANTIZED_DENSE_CASES,
    QUANTIZED_PAGED_CASES,
    QuantizedCase,
    quantize_paged_inputs,
)
from jaxattn_vanilla.paged.impl import PagedReference
from jaxattn_vanilla.vanilla.impl import VanillaAttention


def test_every_format_and_granularity_is_covered() -> None:
    for cases in (QUANTIZED_PAGED_CASES, QUANTIZED_DENSE_CASES):
        assert {(c.kv_dtype, c.granularity) for c in cases} == {(f, g) for f in QUANTIZED_KV_DTYPES
                                                                for g in GRANULARITIES}
    # The paged cases cover a uniform decode, a ragged batch and the combined layout.
    bases = {c.name: c for c in DEFAULT_PAGED_CASES}
    used = [bases[c.base] for c in QUANTIZED_PAGED_CASES]
    assert any(c.uniform for c in used) and any(not c.uniform for c in used)
    assert any(c.layout == "combined" for c in used)


@pytest.mark.parametrize("qcase", QUANTIZED_PAGED_CASES, ids=lambda c: c.name)
def test_unread_slots_are_poisoned_and_the_oracle_is_not(qcase: QuantizedCase) -> None:
    case = next(c for c in DEFAULT_PAGED_CASES if c.name == qcase.base)
    arrays = make_paged_inputs(case, "float32")
    call, ref = quantize_paged_inputs(case, qcase, arrays)
    key = "kv_pages" if "kv_pages" in call else "k_pages"
    k_values = call[key][:, :, 0::2] if key == "kv_pages" else call[key]
    assert all(np.all(np.isfinite(ref[n])) for n in ("k_pages", "v_pages", "kv_pages") if n in ref)
    # K's poison: NaN in float8, -128 in int8 (quantize_kv never writes it: the range is symmetric).
    bad = (k_values == -128) if qcase.kv_dtype == "int8" else np.isnan(k_values.astype(np.float64))
    assert bad.any(), "no unread slot is poisoned"
    if qcase.granularity == "token":
        assert np.isnan(call["k_scale"]).any() and np.isinf(call["v_scale"]).any()
    # Slots some sequence reads are untouched: they dequantize to the oracle's cache.
    read = np.zeros(k_values.shape[:2], bool)
    for s, n in enumerate(case.kv_lens):
        for p in range(n):
            read[arrays["page_table"][s, p // case.page_size], p % case.page_size] = True
    assert not bad[read].any()
    if key == "k_pages":
        deq = np.asarray(dequantize_kv(jnp.asarray(call["k_pages"]), jnp.asarray(call["k_scale"])))
        np.testing.assert_allclose(deq[read], ref["k_pages"][read], rtol=1e-6)


# -- wrong backends the checks must fail -----------------------------------------------------
class DenseIgnoresScales(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        dtype = call.q.dtype
        return super().forward_native(call.replace(k=call.k.astype(dtype), v=call.v.astype(dtype), k_scale=None,
                                                   v_scale=None))


class DenseReadsPastTheLength(VanillaAttention):
    """Reads one slot past each length (an off-by-one): the poison there must show."""

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return super().forward_native(call.replace(kv_lengths=jnp.minimum(call.kv_lengths + 1, call.k.shape[1])))


class PagedReadsPastTheLength(PagedReference):
    def forward_native(self, call: PagedCall) -> AttentionOutput:
        return super().forward_native(call.replace(kv_lengths=call.kv_lengths + 1))


class PagedLiesAboutQuantized(PagedReference):
    features: ClassVar[frozenset[Feature]] = PagedReference.features - {Feature.QUANTIZED_KV}

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        return [r for r in super().not_supported_reasons(problem) if "quantized" not in r]


def _dense_suite(impl: type[VanillaAttention]) -> ConformanceSuite:
    class Suite(ConformanceSuite):
        impl_class = impl
        dtypes = ("float32",)

    return Suite()


def _paged_suite(impl: type[PagedReference]) -> PagedConformanceSuite:
    class Suite(PagedConformanceSuite):
        impl_class = impl
        dtypes = ("float32",)

    return Suite()


def _pick(cases: tuple[QuantizedCase, ...], fmt: str, gran: str) -> QuantizedCase:
    return next(c for c in cases if c.kv_dtype == fmt and c.granularity == gran)


@pytest.mark.parametrize(("impl", "qcase", "message"), [
    (DenseIgnoresScales, _pick(QUANTIZED_DENSE_CASES, "int8", "head"), "values off by more than"),
    (DenseReadsPastTheLength, _pick(QUANTIZED_DENSE_CASES, "float8_e4m3fn", "token"), "non-finite"),
], ids=["ignores_scales", "reads_past_the_length"])
def test_dense_check_fails_a_wrong_backend(impl: type[VanillaAttention], qcase: QuantizedCase, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        _dense_suite(impl).test_quantized_kv(qcase, "float32")


def test_paged_check_fails_a_backend_that_reads_past_the_length() -> None:
    qcase = next(c for c in QUANTIZED_PAGED_CASES if c.base == "ragged_mixed" and c.granularity == "token")
    with pytest.raises(AssertionError, match=r"non-finite|values off"):
        _paged_suite(PagedReadsPastTheLength).test_quantized_kv(qcase, "float32")


def test_paged_check_fails_a_backend_that_accepts_without_declaring() -> None:
    with pytest.raises(AssertionError, match="does not declare quantized_kv"):
        _paged_suite(PagedLiesAboutQuantized).test_quantized_kv(QUANTIZED_PAGED_CASES[0], "float32")


def test_the_checks_pass_the_references() -> None:
    _dense_suite(VanillaAttention).test_quantized_kv(QUANTIZED_DENSE_CASES[0], "float32")
    _paged_suite(PagedReference).test_quantized_kv(QUANTIZED_PAGED_CASES[0], "float32")
