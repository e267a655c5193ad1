"""vanilla runs the whole conformance suite in float32 and bfloat16, gradients included."""

from __future__ import annotations

from typing import ClassVar

from jaxattn.testing.conformance import ConformanceSuite


class TestVanillaConformance(ConformanceSuite):
    impl_name = "vanilla"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
