"""The pure-JAX paged reference against the paged conformance suite, by each of its names."""

from __future__ import annotations

from typing import ClassVar

from jaxattn.testing.paged_conformance import PagedConformanceSuite


class TestVanillaPaged(PagedConformanceSuite):
    impl_name = "vanilla_paged"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")


class TestPageAttentionOnCpu(PagedConformanceSuite):
    """On a CPU the mechanism name resolves to the reference."""

    impl_name = "page_attention"
