"""jaxattn-triton's serving backends over quantized KV caches: what they accept on an H100, what
they decline and say, the errors of ``paged_ops``, and the dense decode kernel on a quantized
cache with scales that broadcast in shapes the conformance cases do not use.

The numerics of every format x granularity are ``test_paged_kernels_quantized``'s (the kernels)
and ``test_serving_conformance``'s (``test_quantized_kv``, through the dispatch).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.problem import AttentionProblem
from jaxattn.testing import oracle
from jaxattn_triton.decode import ops as decode_ops
from jaxattn_triton.decode.impl import TritonDecodeAttention
from jaxattn_triton.paged import ops as paged_ops
from jaxattn_triton.paged.impl import TritonPagedDecode, TritonRaggedPagedAttention

from ._env import needs_interpreter
from ._serving import LOG2_WARNING, paged_problem

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
MD = AttentionMetadata()


def _dense(**kw: Any) -> AttentionProblem:
    base: dict[str, Any] = {
        "batch": 16, "seq_q": 1, "seq_k": 8192, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "head_dim_v": 128,
        "dtype": "bfloat16", "causal": True, "kv_lengths": True,
    }  # fmt: skip
    return AttentionProblem(**{**base, **kw})


@pytest.mark.usefixtures("kernels_installed")
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_accepted_on_an_h100_and_explained(fmt: str) -> None:
    for cls in (TritonPagedDecode, TritonRaggedPagedAttention):
        impl = cls(MD, H100)
        problem = paged_problem(kv_dtype=fmt)
        assert impl.not_supported_reasons(problem) == []
        assert any(f"as {fmt}, dequantized in registers" in n and "no full-size copy" in n
                   for n in impl.notes(problem))  # fmt: skip
    dense = TritonDecodeAttention(MD, H100)
    assert dense.not_supported_reasons(_dense(kv_dtype=fmt)) == []
    assert "forward only" in dense.notes(_dense(kv_dtype=fmt))[0]


@pytest.mark.usefixtures("kernels_installed")
def test_explain_says_how_the_kernel_tiles_the_call() -> None:
    # The tiles paged_ops picks for the call (launch_paged.default_tiles), said by explain: over
    # an int8 cache 16 decode sequences of 8k keys take 2-warp programs, 4 key splits merged in the launch.
    impl = TritonPagedDecode(MD, H100)
    quantized = [n for n in impl.notes(paged_problem(kv_dtype="int8", pages_per_seq=512)) if n.startswith("tiles:")]
    assert quantized == ["tiles: 1 query token(s) x 1 KV head a program, 64 keys a step, 2 warps; 4 key splits "
                         "merged in the launch; 512 programs on 132 SMs"], quantized
    wide = [n for n in impl.notes(paged_problem()) if n.startswith("tiles:")]
    assert wide == ["tiles: 1 query token(s) x 1 KV head a program, 128 keys a step, 8 warps; unsplit; "
                    "128 programs on 132 SMs"], wide
    mixed = paged_problem(num_tokens=2112, queries_per_seq=None, num_seqs=68, kv_dtype="int8", pages_per_seq=60)
    (note,) = [n for n in TritonRaggedPagedAttention(MD, H100).notes(mixed) if n.startswith("tiles:")]
    assert "decode programs of their own (16 rows, 128 keys a step)" in note, note


@pytest.mark.usefixtures("kernels_installed")
def test_explain_says_how_the_kernel_reads_a_quantized_cache() -> None:
    # The arithmetic launch_paged picks for a bf16 q over a narrow cache, said by explain.
    impl = TritonPagedDecode(MD, H100)
    offset = "int8 widened to fp16 as (v + 128) 2^-24, the offset taken out of the sums; "
    for fmt in ("int8", "float8_e4m3fn"):
        notes = [n for n in impl.notes(paged_problem(kv_dtype=fmt)) if n.startswith(f"{fmt} cache:")]
        assert notes == [f"{fmt} cache: Q K^T in fp16 (each query row moved there by a power of two of its own); "
                         + (offset if fmt == "int8" else "")
                         + "V read as 32-bit words, P V one dot per byte lane"], notes
    assert not [n for n in impl.notes(paged_problem()) if " cache: " in n]


@pytest.mark.usefixtures("kernels_installed")
def test_gradients_over_a_quantized_cache_are_declined() -> None:
    reasons = TritonDecodeAttention(MD, H100).not_supported_reasons(_dense(kv_dtype="int8", needs_grad=True))
    assert any("quantized (int8) cache" in r and "dequantize_kv" in r for r in reasons), reasons
    # The same call over a bf16 cache differentiates (the flash backward).
    assert TritonDecodeAttention(MD, H100).not_supported_reasons(_dense(needs_grad=True)) == []


def test_paged_ops_errors_name_the_argument() -> None:
    q = jnp.zeros((2, 1, 4, 16), jnp.bfloat16)
    pages = jnp.zeros((6, 8, 2, 16), jnp.bfloat16)
    table = jnp.zeros((2, 3), jnp.int32)
    lengths = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="k_scale/v_scale scale a quantized cache"):
        paged_ops.paged_decode(q, pages, pages, table, lengths, k_scale=jnp.ones(()), v_scale=jnp.ones(()))
    narrow = pages.astype(jnp.int8)
    with pytest.raises(ValueError, match=r"v_scale has shape \(3,\).*\(6, 8, 2\)"):
        paged_ops.paged_decode(q, narrow, narrow, table, lengths, k_scale=jnp.ones(()), v_scale=jnp.ones((3,)))
    with pytest.raises(ValueError, match="share a dtype, or the cache be quantized"):
        paged_ops.paged_decode(q, pages.astype(jnp.float16), pages.astype(jnp.float16), table, lengths)


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.parametrize("scale_shape", [(), (1, 1, 2), (3, 1, 1), (3, 40, 1), (40, 2)])
def test_dense_decode_broadcast_scales(scale_shape: tuple[int, ...]) -> None:
    # Scales of any shape that broadcasts against (B, S, Hkv) are read in place through their
    # strides (per sequence, per position across heads...); past each length they are NaN.
    rng = np.random.default_rng(7)
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    lengths = np.array([40, 17, 0], np.int32)
    q = rng.standard_normal((b, 2, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, hkv, d)) for _ in range(2))
    values = []
    for x in (k, v):
        scale = np.abs(rng.standard_normal(scale_shape)).astype(np.float32) + 0.01
        full = np.broadcast_to(scale, (b, s, hkv)).astype(np.float64)
        narrow = np.clip(np.round(x / full[..., None]), -127, 127).astype(np.int8)
        deq = narrow.astype(np.float64) * full[..., None]
        if scale.shape[:2] == (b, s):  # one scale per sequence and position: poison the unread ones
            for row, n in enumerate(lengths):
                scale[row, n:] = np.nan
        values.append((narrow, scale, deq))
    (kq, ks, kd), (vq, vs, vd) = values
    out = decode_ops.dense_decode(
        jnp.asarray(q), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(lengths), causal=True,
        k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs), interpret=True,
    )  # fmt: skip
    want = oracle.attention(q.astype(np.float64), kd, vd, causal=True, kv_lengths=lengths).output
    got = np.asarray(out, np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_quantize_kv_round_trip_through_the_kernel_spec() -> None:
    # jaxattn.quantize_kv's scales (tensor/head/token) give the kernel's three stride patterns.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 8, 2, 16)), jnp.float32)  # no jax.random compile
    modes = []
    for gran in ("tensor", "head", "token"):
        _, scale = jaxattn.quantize_kv(x, "int8", gran)
        spec = paged_ops.LP.scale_strides(scale.shape, (6, 8, 2))
        modes.append(paged_ops.LP.scale_mode(spec))
    assert modes == [1, 1, 2]
