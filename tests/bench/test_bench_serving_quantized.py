"""``jaxattn bench --serving --kv-dtype``: a quantized cache's rows count the bytes actually read
(one-byte values + float32 scales), beside the same backend and dense decode over the 16-bit
cache of the same tokens, each with GB/s and tokens/s."""

from __future__ import annotations

import pytest

from jaxattn.backend.metadata import AttentionMetadata
from jaxattn_bench.serving import READ_PEAK, WIDE_SUFFIX, ServingShape, run_serving, serving_matrix


@pytest.mark.parametrize(("granularity", "scales"), [("tensor", 1), ("head", 2), ("token", 4 * 96 * 2)])
def test_quantized_rows_count_values_and_scales(granularity: str, scales: int) -> None:
    shape = ServingShape(4, 96, 4, 2, 32, 16, "float32", kv_dtype="int8", granularity=granularity)
    # 4 sequences x 96 tokens x 2 heads x (K + V) x 32 dims: 1 byte each, 4 bytes per scale (K's and V's).
    assert shape.kv_bytes() == 4 * 96 * 2 * 2 * 32 + 2 * 4 * scales
    assert shape.wide_bytes() == 4 * 96 * 2 * 2 * 32 * 4
    assert shape.label.endswith(f"int8 per {granularity}")


def test_quantized_serving_run_times_the_quantized_and_the_16_bit_cache() -> None:
    shapes = serving_matrix(quick=True, dtype="float32", kv_dtype="float8_e4m3fn", granularity="token")
    assert all(s.kv_dtype == "float8_e4m3fn" for s in shapes) and any(s.mixed for s in shapes)
    results = run_serving(shapes[:1], paged=["vanilla_paged"], dense=["vanilla"], metadata=AttentionMetadata(),
                          repeats=1, min_sample_ms=0.0, preroll_ms=0.0)
    rows = {r.backend: r for r in results}
    shape = shapes[0]
    assert set(rows) == {READ_PEAK, "vanilla_paged", "vanilla_paged" + WIDE_SUFFIX, "vanilla (dense)"}
    for name, nbytes in ((READ_PEAK, shape.kv_bytes()), ("vanilla_paged", shape.kv_bytes()),
                         ("vanilla_paged" + WIDE_SUFFIX, shape.wide_bytes()), ("vanilla (dense)", shape.wide_bytes())):
        r = rows[name]
        assert r.ok and r.median_ms, r
        assert r.bytes_read == nbytes and r.gbps == pytest.approx(nbytes / (r.median_ms * 1e-3) / 1e9)
        assert r.tokens_per_s == pytest.approx(shape.query_tokens / (r.median_ms * 1e-3))
    assert "values + scales" in rows[READ_PEAK].note
    with pytest.raises(ValueError, match="kv_dtype"):
        ServingShape(4, 96, 4, 2, 32, 16, "float32", kv_dtype="uint8")
