"""The pure-JAX paged references against the paged conformance suite."""

from __future__ import annotations

from typing import ClassVar

from jaxattn.testing.paged_conformance import PagedConformanceSuite


class TestRaggedPagedReference(PagedConformanceSuite):
    impl_name = "ragged_page_attention_v3"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")


class TestPagedDecodeReference(PagedConformanceSuite):
    impl_name = "page_attention"
