"""A --serving row's JSON carries what its label packs as fields (impl, call, cache)."""

from __future__ import annotations

import pytest

from jaxattn_bench.serving import PALLAS_GPU_PAGED, READ_PEAK, WIDE_SUFFIX, row_fields


@pytest.mark.parametrize(("label", "kv_dtype", "want"), [
    ("page_attention", None, ("page_attention", "paged", "16-bit")),
    ("ragged_page_attention_v3", "int8", ("ragged_page_attention_v3", "paged", "int8")),
    ("page_attention" + WIDE_SUFFIX, "int8", ("page_attention", "paged", "16-bit")),
    ("ragged_page_attention_v3 separate", "float8_e4m3fn", ("ragged_page_attention_v3", "separate calls",
                                                            "float8_e4m3fn")),
    ("ragged_page_attention_v3 separate", None, ("ragged_page_attention_v3", "separate calls", "16-bit")),
    ("cudnn (dense)", "int8", ("cudnn", "dense", "16-bit")),
    ("autoregressive_decodeattn (dense)", None, ("autoregressive_decodeattn", "dense", "16-bit")),
    (READ_PEAK, "int8", (None, "memory read", "int8")),
    (PALLAS_GPU_PAGED, None, (None, "outside", "16-bit")),
])
def test_row_fields(label: str, kv_dtype: str | None, want: tuple[str | None, str, str]) -> None:
    got = row_fields(label, kv_dtype)
    assert (got["impl"], got["call"], got["cache"]) == want
