"""The Pallas TPU paged backends against the paged conformance suite, in TPU interpret mode.

``page_attention`` (JAX's TPU paged_attention kernel) runs in interpret mode on any host, so the
suite checks its numerics here: every decode case of the matrix, float32 and bfloat16, under
``jax.jit`` and under ``jax_enable_x64``; what it declines (several queries per sequence, ragged
batches, windows, sinks) the suite checks is declined with reasons.

``ragged_page_attention_v3`` cannot run in interpret mode where jax's interpreter cannot run its
kernel (jax 0.10.2-0.12.1: ``jaxattn_pallas.ragged.rules.interpreter_runs_kernel`` asks the
interpreter): there it must decline every case, with that reason; elsewhere the suite runs. Its numerics
are checked over an emulation of the kernel and by lowering it for TPU (``test_ragged.py``).
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.testing import oracle
from jaxattn.testing.paged_cases import make_paged_inputs
from jaxattn.testing.paged_conformance import PagedConformanceSuite, _to_jax
from jaxattn_pallas.decode.kernel import live_rows
from jaxattn_pallas.ragged import rules as ragged_rules

INTERPRET = AttentionMetadata(platform="tpu", interpret=True)
#: As in test_conformance.py: an interpreter limit, no TPU's.
INTERPRET_CHECKS = {"enable_checks": "Pallas TPU interpret mode runs kernels through io_callback, whose effects "
                    "jax_enable_checks refuses inside a custom_vjp (the guard refusing paged gradients is one); a "
                    "TPU has no callback"}


class TestPageAttentionInterpret(PagedConformanceSuite):
    impl_name = "page_attention"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    strict_mode_failures = INTERPRET_CHECKS


class TestRaggedPageAttentionInterpret(PagedConformanceSuite):
    impl_name = "ragged_page_attention_v3"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    strict_mode_failures = INTERPRET_CHECKS

    def test_runs_something(self, dtype: str) -> None:
        """On a jax whose interpreter cannot run the kernel, every case is declined with that
        reason (the suite's other tests check each decline raises); on a newer jax, the suite's
        own check that something runs."""
        if ragged_rules.interpreter_runs_kernel("float32") and ragged_rules.interpreter_runs_kernel("bfloat16"):
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
        if ragged_rules.interpreter_runs_kernel("float32") and ragged_rules.interpreter_runs_kernel("bfloat16"):
            pytest.skip("this jax interprets the kernel")
        for case in self.cases(self.resolved_level()):
            if case.sinks:
                continue
            reasons = self._supports(case, _to_jax(make_paged_inputs(case, "bfloat16"), "bfloat16"))
            assert len(reasons) == 1, (case.name, reasons)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_page_attention_never_reads_unread_positions_into_the_output(value: float) -> None:
    """The kernel adds a large negative number to hidden logits and multiplies V by the zero
    probabilities: a NaN or Inf it loads would poison the row. Rows of a last page past the
    length, pages listed past a sequence's last page, and unused pages may hold anything."""
    rng = np.random.default_rng(0)
    k, v = (rng.normal(size=(10, 4, 2, 8)).astype(np.float32) for _ in range(2))
    table = np.array([[3, 1, 7], [5, 2, 8]], np.int32)  # 6 tokens in pages 3, 1; 3 tokens in page 5
    lengths = np.array([6, 3], np.int32)
    kp, vp = k.copy(), v.copy()
    for x in (kp, vp):
        x[[7, 2, 8, 0]] = value  # past the last page, or in no table at all
        x[1, 2:] = value
        x[5, 3:] = value
    live = np.asarray(live_rows(jnp.asarray(table), jnp.asarray(lengths), 10, 4))
    assert live.sum() == 9 and live[3].all() and live[1, :2].all() and live[5, :3].all()
    q = rng.normal(size=(2, 4, 8)).astype(np.float32)
    got = np.asarray(jaxattn.paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
                                             jnp.asarray(lengths), impl="page_attention", metadata=INTERPRET))
    want = oracle.paged_attention(q, k, v, table, lengths, np.arange(3), np.asarray([2]))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5)
