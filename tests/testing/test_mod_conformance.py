"""The mask_mod / score_mod conformance test catches the bugs it is for: a backend that ignores
the mask_mod or the score_mod, one that reads keys no query sees (NaN there), one that drops the
gradient of a score_mod's captured array, and one that accepts a mask_mod it cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxattn.backend import AttentionCall, AttentionOutput, Feature
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.mod_cases import MOD_CASES
from jaxattn_vanilla.vanilla.impl import VanillaAttention

CASES = {c.name: c for c in MOD_CASES}


class IgnoresMaskMod(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return super().forward_native(call.replace(mask_mod=None))


class IgnoresScoreMod(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        return super().forward_native(call.replace(score_mod=None))


class ReadsUnseenKeys(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        out = super().forward_native(call)
        return AttentionOutput(attention_outputs=out.attention_outputs + 0.0 * jnp.sum(call.v))


class StopsScoreGradients(VanillaAttention):
    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        fn = call.score_mod
        if fn is None:
            return super().forward_native(call)
        def no_param_grads(score: jax.Array, *index: jax.Array) -> jax.Array:
            # The score's own derivative kept, the captured arrays' cut.
            changed: jax.Array = jax.lax.stop_gradient(fn(score, *index) - score)
            return score + changed

        return super().forward_native(call.replace(score_mod=no_param_grads))


class ClaimsNoMaskMod(VanillaAttention):
    """Accepts a mask_mod without declaring Feature.MASK_MOD."""

    features = VanillaAttention.features - {Feature.MASK_MOD}

    def not_supported_reasons(self, problem):  # type: ignore[no-untyped-def]
        return [r for r in super().not_supported_reasons(problem) if "mask_mod" not in r]


def _suite(impl: type[VanillaAttention]) -> ConformanceSuite:
    class Suite(ConformanceSuite):
        impl_class = impl
        dtypes = ("float32",)

    return Suite()


@pytest.mark.parametrize(("impl", "case"), [
    (IgnoresMaskMod, "mm_document"),
    (IgnoresScoreMod, "sm_alibi_causal"),
    (ReadsUnseenKeys, "mm_lambda_bh"),
    (StopsScoreGradients, "sm_relative_cap_bias"),
    (ClaimsNoMaskMod, "mm_causal"),
])
def test_a_broken_backend_fails(impl: type[VanillaAttention], case: str) -> None:
    with pytest.raises(AssertionError):
        _suite(impl).test_mask_and_score_mods(CASES[case], "float32")


def test_vanilla_passes() -> None:
    _suite(VanillaAttention).test_mask_and_score_mods(CASES["sm_relative_cap_bias"], "float32")
