"""The Pallas TPU paged backends against the paged conformance suite, in TPU interpret mode.

``page_attention`` (JAX's TPU paged_attention kernel) runs in interpret mode on any host, so the
suite checks its numerics here: every decode case of the matrix, float32 and bfloat16, under
``jax.jit`` and under ``jax_enable_x64``; what it declines (several queries per sequence, ragged
batches, windows, sinks) the suite checks is declined with reasons.

``ragged_page_attention_v3`` cannot run in interpret mode on jax <= 0.11.2 (see
``jaxattn_pallas.paged_rules``): here it must decline every case, with that reason. Its numerics
are checked over an emulation of the kernel and by lowering it for TPU (``test_paged.py``).
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from jaxattn.metadata import AttentionMetadata
from jaxattn.testing.paged_cases import make_paged_inputs
from jaxattn.testing.paged_conformance import PagedConformanceSuite, _to_jax
from jaxattn_pallas import paged_rules

INTERPRET = AttentionMetadata(platform="tpu", interpret=True)


class TestPageAttentionInterpret(PagedConformanceSuite):
    impl_name = "page_attention"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")


class TestRaggedPageAttentionInterpret(PagedConformanceSuite):
    impl_name = "ragged_page_attention_v3"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")

    def test_runs_something(self, dtype: str) -> None:
        """On a jax whose interpreter cannot run the kernel, every case is declined with that
        reason (the suite's other tests check each decline raises); on a newer jax, the suite's
        own check that something runs."""
        if paged_rules.installed_jax_version() > paged_rules.INTERPRET_BROKEN_THROUGH:
            super().test_runs_something(dtype)
            return
        for case in self.cases(self.resolved_level()):
            reasons = self._supports(case, _to_jax(make_paged_inputs(case, dtype), dtype))
            interpret = [r for r in reasons if "TPU interpret mode of jax" in r]
            assert len(interpret) == 1, (case.name, reasons)
            assert "page_attention" in interpret[0] and "drop the TPU override" in interpret[0]

    def test_interpret_reason_is_the_only_one_for_plain_calls(self) -> None:
        """Without sinks, the interpreter is the only obstacle: off interpret mode the same calls
        would run (what TPU CI runs)."""
        if paged_rules.installed_jax_version() > paged_rules.INTERPRET_BROKEN_THROUGH:
            pytest.skip("this jax interprets the kernel")
        for case in self.cases(self.resolved_level()):
            if case.sinks:
                continue
            reasons = self._supports(case, _to_jax(make_paged_inputs(case, "bfloat16"), "bfloat16"))
            assert len(reasons) == 1, (case.name, reasons)
