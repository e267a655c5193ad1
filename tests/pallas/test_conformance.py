"""flash_attn2 on TPU (Pallas) runs the conformance suite in TPU interpret mode on any host.

Forward and gradients (the kernel's own backward kernels, interpreted) against the float64
oracle: every default case in float32, a subset in bfloat16 (interpret mode compiles each
case for seconds; the 16-bit path differs only in dtype). ``JAXATTN_CONFORMANCE=full``
runs the full matrix in both. Sliding windows, soft caps, sinks and dropout are declined,
which the suite checks as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import pytest

from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.testing.cases import Case, Level
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.mod_cases import ModCase

INTERPRET = AttentionMetadata(platform="tpu", interpret=True)

# Everything this kernel supports at once: causal with T < S folded into the bias, a
# mask, a bias, packed segments and grouped heads.
COMBINED = Case(
    "combined_flash",
    b=2,
    t=6,
    s=9,
    hq=4,
    hkv=2,
    d=8,
    causal=True,
    mask=("B", 1, "T", "S"),
    bias=(1, "H", "T", "S"),
    segments=True,
)

#: docs/contract.md, "Logits of any finite size": the kernel is JAX's, so recorded here.
JAX_KERNEL_FUSES = ("JAX's TPU flash kernel, interpreted by XLA:CPU, fuses s * scale - max into one "
                    "multiply-add in the forward it differentiates: NaN out of finite inputs past ~2^32")

#: Pallas TPU interpret mode runs a kernel through io_callbacks, and jax_enable_checks refuses
#: effects inside a custom_vjp (JAX's own flash kernel is one): an interpreter limit, no TPU's.
INTERPRET_CHECKS = {"enable_checks": "Pallas TPU interpret mode runs kernels through io_callback, whose effects "
                    "jax_enable_checks refuses inside a custom_vjp (JAX's flash kernel is one); a TPU has no callback"}

BF16_CASES = {"causal_t_lt_s", "decode", "mqa_causal", "mask_per_head", "segment_ids", "empty_rows"}
BF16_GRAD_CASES = {"causal_t_lt_s", "mask_per_head", "segment_ids"}


class TestPallasFlashConformance(ConformanceSuite):
    impl_name = "flash_attn2"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    strict_mode_failures = INTERPRET_CHECKS

    @pytest.mark.xfail(strict=True, reason=JAX_KERNEL_FUSES)
    def test_logits_of_any_magnitude(self, magnitude_case: Case, dtype: str) -> None:
        super().test_logits_of_any_magnitude(magnitude_case, dtype)

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        return (*super().cases(level), COMBINED)


class TestPallasFlashConformanceBfloat16(ConformanceSuite):
    impl_name = "flash_attn2"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 above (the same code); here under jax.jit, both programs.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()
    mod_cases: ClassVar[tuple[ModCase, ...]] = ()  # float32 above: the mask_mod's lowering is dtype-blind

    def test_strict_modes(self, strict_mode: str) -> None:
        pytest.skip("the float32 suite above runs the strict modes through the same kernel code (interpret mode "
                    "costs ~15 s a mode)")

    @pytest.mark.xfail(strict=True, reason=JAX_KERNEL_FUSES)
    def test_logits_of_any_magnitude(self, magnitude_case: Case, dtype: str) -> None:
        super().test_logits_of_any_magnitude(magnitude_case, dtype)

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        every = (*super().cases(level), COMBINED)
        if level == "full":
            return every
        subset = [c for c in every if c.name in BF16_CASES]
        return [dataclasses.replace(c, grad=c.grad and c.name in BF16_GRAD_CASES) for c in subset]
