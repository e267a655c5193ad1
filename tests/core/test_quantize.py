"""Quantized KV caches (issue 21): ``quantize_kv`` / ``dequantize_kv``, the validation of
``k_scale`` / ``v_scale``, declines and ``explain`` notes. The attention numerics over a
quantized cache are the conformance suites' (``test_quantized_kv``, against the float64 oracle)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.quantize import GRANULARITIES, QUANTIZED_KV_DTYPES, dequantize_visible, kv_format_max
from jaxattn.errors import InvalidInputError, UnsupportedError

FORMATS = sorted(QUANTIZED_KV_DTYPES)
# The largest magnitude of each format, from ml_dtypes / NumPy themselves (not from jaxattn).
FORMAT_MAX = {"int8": 127.0, "float8_e4m3fn": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
              "float8_e5m2": float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}
# Half an ulp, relative, of a normal float8 value: e4m3 keeps 3 mantissa bits, e5m2 2.
REL_HALF_STEP = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}


def _cache(shape: tuple[int, ...] = (5, 4, 3, 16), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Heads and tokens of different magnitudes, so the granularities differ.
    return (rng.normal(size=shape) * rng.uniform(0.1, 10, size=(*shape[:-1], 1))).astype(np.float32)


def _reduce(x: np.ndarray, granularity: str) -> np.ndarray:
    mag = np.abs(x)
    if granularity == "tensor":
        return np.asarray(mag.max())
    if granularity == "head":
        return np.asarray(mag.max(axis=tuple(i for i in range(x.ndim) if i != x.ndim - 2)))
    return np.asarray(mag.max(axis=-1))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_scales_and_error(fmt: str, granularity: str) -> None:
    x = _cache()
    values, scale = jaxattn.quantize_kv(jnp.asarray(x), fmt, granularity)
    absmax = _reduce(x, granularity)
    assert values.dtype == jnp.dtype(fmt) and values.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == absmax.shape
    assert scale.shape == {"tensor": (), "head": (3,), "token": (5, 4, 3)}[granularity]
    # The absmax maps to the format's largest value.
    np.testing.assert_allclose(np.asarray(scale), absmax / FORMAT_MAX[fmt], rtol=1e-6)
    deq = np.asarray(jaxattn.dequantize_kv(values, scale))
    np.testing.assert_array_equal(deq, np.asarray(values).astype(np.float32) * np.asarray(scale)[..., None])
    # Round to nearest: int8 within half a step (scale / 2); float8 within half an ulp of the
    # value, or half the smallest subnormal step near 0.
    step = np.broadcast_to(np.asarray(scale, np.float64), x.shape[:-1])[..., None]
    if fmt == "int8":
        bound = 0.5 * step
    else:
        subnormal = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).smallest_subnormal)
        bound = np.abs(x) * REL_HALF_STEP[fmt] + 0.5 * subnormal * step
    assert np.all(np.abs(deq - x) <= bound * 1.0001 + 1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_reaches_and_saturates_at_the_format_max(fmt: str) -> None:
    x = _cache((2, 3, 2, 8), seed=1)
    values, _ = jaxattn.quantize_kv(jnp.asarray(x), fmt, "token")
    top = np.abs(np.asarray(values).astype(np.float64)).max(axis=-1)
    np.testing.assert_array_equal(top, FORMAT_MAX[fmt])  # every token's absmax lands on the top value
    assert np.all(np.isfinite(np.asarray(values).astype(np.float64)))
    assert kv_format_max(fmt) == FORMAT_MAX[fmt]


def test_int8_is_symmetric_round_to_nearest() -> None:
    x = np.asarray([[[[127.0, -127.0, 0.49, 0.5, -1.51, 63.5]]]], np.float32)
    values, scale = jaxattn.quantize_kv(jnp.asarray(x), "int8", "tensor")
    assert float(scale) == 1.0
    np.testing.assert_array_equal(np.asarray(values), np.rint(x).astype(np.int8))  # half to even, as np.rint


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_blocks_get_a_finite_scale(fmt: str, granularity: str) -> None:
    x = np.zeros((2, 3, 2, 4), np.float32)
    x[0, 0, 0] = 3.0  # one token nonzero: under "token" the others are zero blocks
    values, scale = jaxattn.quantize_kv(jnp.asarray(x), fmt, granularity)
    assert np.all(np.isfinite(np.asarray(scale))) and np.all(np.asarray(scale) > 0)
    deq = np.asarray(jaxattn.dequantize_kv(values, scale))
    np.testing.assert_allclose(deq, x, rtol=1e-6)
    assert np.all(deq[x == 0] == 0)


def test_quantize_kv_bad_arguments() -> None:
    x = jnp.ones((2, 3, 2, 4))
    with pytest.raises(InvalidInputError, match="dtype"):
        jaxattn.quantize_kv(x, "int4")
    with pytest.raises(InvalidInputError, match="granularity"):
        jaxattn.quantize_kv(x, "int8", "page")
    with pytest.raises(InvalidInputError, match="rank"):
        jaxattn.quantize_kv(jnp.ones(4), "int8")


def test_dequantize_visible_keeps_nan_past_the_length_out() -> None:
    values = jnp.full((2, 4, 1, 2), jnp.nan, jnp.float8_e4m3fn).at[:, :2].set(1.0)
    scale = jnp.full((2, 4, 1), jnp.inf, jnp.float32).at[:, :2].set(0.5)
    out = np.asarray(dequantize_visible(values, scale, jnp.asarray([2, 1])))
    np.testing.assert_array_equal(out[0, :, 0, 0], [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(out[1, :, 0, 0], [0.5, 0, 0, 0])


# -- the calls -------------------------------------------------------------------------------
def _paged(fmt: str = "int8", granularity: str = "head") -> dict[str, Any]:
    k, v = _cache((6, 4, 2, 16), 2), _cache((6, 4, 2, 16), 3)
    kq, ks = jaxattn.quantize_kv(jnp.asarray(k), fmt, granularity)
    vq, vs = jaxattn.quantize_kv(jnp.asarray(v), fmt, granularity)
    return {"q": jnp.asarray(np.random.default_rng(4).normal(size=(3, 4, 16)), jnp.float32), "k_pages": kq,
            "v_pages": vq, "page_table": jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32),
            "kv_lengths": jnp.asarray([5, 8, 1], jnp.int32), "k_scale": ks, "v_scale": vs}


def _call(a: dict[str, Any], **kw: Any) -> Any:
    args = {**a, **kw}
    return jaxattn.paged_attention(args.pop("q"), args.pop("k_pages"), args.pop("v_pages"), args.pop("page_table"),
                                   args.pop("kv_lengths"), **args)


@pytest.mark.parametrize(("change", "arg", "text"), [
    ({"v_scale": None}, "v_scale", "is required"),
    ({"k_scale": None, "v_scale": None}, "k_scale", "is required"),
    ({"k_scale": jnp.ones((2,), jnp.bfloat16)}, "k_scale", "must be float32"),
    ({"v_scale": jnp.ones((3,), jnp.float32)}, "v_scale", "does not broadcast"),
    ({"v_scale": jnp.ones((1, 6, 4, 2), jnp.float32)}, "v_scale", "does not broadcast"),
    ({"v_pages": jnp.zeros((6, 4, 2, 16), jnp.float8_e4m3fn)}, "v_pages", "quantized alike"),
    ({"v_pages": jnp.zeros((6, 4, 2, 16), jnp.float32)}, "v_pages", "quantized alike"),
    ({"q": jnp.zeros((3, 4, 16), jnp.int8)}, "q", "not a floating dtype"),
])
def test_paged_scales_are_validated(change: dict[str, Any], arg: str, text: str) -> None:
    with pytest.raises(InvalidInputError, match=text) as info:
        _call(_paged(), **change)
    assert info.value.argument == arg


def test_scales_with_a_float_cache_are_refused() -> None:
    a = _paged()
    a["k_pages"], a["v_pages"] = (jnp.zeros((6, 4, 2, 16)),) * 2
    with pytest.raises(InvalidInputError, match="not quantized") as info:
        _call(a)
    assert info.value.argument == "k_scale"


@pytest.mark.parametrize("scale_shape", [(), (2,), (1, 1, 2), (6, 1, 1), (6, 4, 2), (4, 1)])
def test_every_broadcastable_scale_shape_runs(scale_shape: tuple[int, ...]) -> None:
    a = _paged()
    rng = np.random.default_rng(5)
    a["k_scale"] = jnp.asarray(rng.uniform(0.01, 0.1, size=scale_shape), jnp.float32)
    a["v_scale"] = jnp.asarray(rng.uniform(0.01, 0.1, size=scale_shape), jnp.float32)
    got = _call(a, impl="vanilla_paged")
    want = _call({**a, "k_pages": jaxattn.dequantize_kv(a["k_pages"], a["k_scale"]),
                  "v_pages": jaxattn.dequantize_kv(a["v_pages"], a["v_scale"]), "k_scale": None, "v_scale": None},
                 impl="vanilla_paged")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_runtime_dtype_leaves_the_quantized_cache_alone() -> None:
    """A backend receives the narrow cache as it is (q alone in runtime_dtype) and rank-3 scales."""
    from jaxattn_vanilla.paged.impl import PagedReference

    seen: dict[str, Any] = {}

    class Spy(PagedReference):
        def forward_native(self, call: jaxattn.PagedCall) -> Any:
            seen.update(q=call.q.dtype, k=call.k_pages.dtype, v=call.v_pages.dtype, k_scale=call.k_scale.shape)
            return super().forward_native(call)

    a = _paged("float8_e5m2", "head")
    got = _call(a, impl=Spy(jaxattn.AttentionMetadata(runtime_dtype="bfloat16")))
    assert got.dtype == jnp.bfloat16
    assert seen == {"q": jnp.bfloat16, "k": jnp.float8_e5m2, "v": jnp.float8_e5m2, "k_scale": (1, 1, 2)}
    want = _call(a, impl="vanilla_paged")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_paged_declines_and_explain_notes() -> None:
    a = _paged()
    exp = jaxattn.explain_paged(a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"],
                                k_scale=a["k_scale"], v_scale=a["v_scale"])
    assert exp.chosen == "vanilla_paged"
    row = next(c for c in exp.candidates if c.chosen)
    assert any("full-size" in n for n in row.notes), row.notes
    # Under a TPU override (interpret mode), JAX's kernels decline with their reason.
    md = jaxattn.AttentionMetadata(platform="tpu", interpret=True)
    with pytest.raises(UnsupportedError) as info:
        _call(a, impl="page_attention", metadata=md)
    assert any("QuantizedTensor" in r for r in info.value.reasons), info.value.reasons
    assert "vanilla_paged" in str(info.value)


def _dense(fmt: str = "int8") -> dict[str, Any]:
    k, v = _cache((2, 8, 2, 16), 6), _cache((2, 8, 2, 16), 7)
    kq, ks = jaxattn.quantize_kv(jnp.asarray(k), fmt, "token")
    vq, vs = jaxattn.quantize_kv(jnp.asarray(v), fmt, "token")
    return {"q": jnp.asarray(np.random.default_rng(8).normal(size=(2, 1, 4, 16)), jnp.float32), "k": kq, "v": vq,
            "kv_lengths": jnp.asarray([3, 8], jnp.int32), "k_scale": ks, "v_scale": vs}


def test_dense_decline_names_the_impls_that_accept() -> None:
    a = _dense()
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    with pytest.raises(UnsupportedError) as info:
        jaxattn.attention(q, k, v, impl="blockwise", causal=True, **a)
    assert any("quantized KV caches" in r for r in info.value.reasons)
    assert "vanilla" in (info.value.hint or "")
    with pytest.raises(UnsupportedError) as info:
        jaxattn.attention(q, k, v, impl="autoregressive_decodeattn", causal=True, **a)
    if jaxattn.Feature.QUANTIZED_KV in jaxattn.get_impl("autoregressive_decodeattn").features:
        # On a GPU the name is the Triton decode kernel, which reads quantized caches (and declines the
        # float32 q for its own reason): the decline must not blame the cache.
        assert not any("quantized" in r or "float caches" in r for r in info.value.reasons)
    else:
        assert any("reads float caches only" in r for r in info.value.reasons)
    exp = jaxattn.explain(q, k, v, causal=True, **a)
    assert exp.chosen == "vanilla"
    assert any("full-size" in n for c in exp.candidates if c.chosen for n in c.notes)


def test_dense_scales_are_validated() -> None:
    a = _dense()
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    with pytest.raises(InvalidInputError, match="does not broadcast") as info:
        jaxattn.attention(q, k, v, kv_lengths=a["kv_lengths"], k_scale=a["k_scale"], v_scale=jnp.ones((8, 3)))
    assert info.value.argument == "v_scale"
    with pytest.raises(InvalidInputError, match="is required"):
        jaxattn.attention(q, k, v, kv_lengths=a["kv_lengths"], k_scale=a["k_scale"])


def test_dense_quantized_under_jit_matches_the_dequantized_cache() -> None:
    a = _dense("float8_e4m3fn")
    # Positions past a length may hold NaN, values and scales alike.
    a["k"] = a["k"].at[0, 3:].set(jnp.nan)
    a["v_scale"] = a["v_scale"].at[0, 3:].set(jnp.nan)
    run = jax.jit(lambda a: jaxattn.attention(a["q"], a["k"], a["v"], causal=True, kv_lengths=a["kv_lengths"],
                                              k_scale=a["k_scale"], v_scale=a["v_scale"]))
    got = np.asarray(run(a))
    lengths = a["kv_lengths"]
    k = dequantize_visible(a["k"], a["k_scale"], lengths)
    v = dequantize_visible(a["v"], a["v_scale"], lengths)
    want = np.asarray(jaxattn.attention(a["q"], k, v, causal=True, kv_lengths=lengths, impl="vanilla"))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_quantized_dense_cache_on_a_mesh_is_declined() -> None:
    from jax.sharding import Mesh

    a = _dense()
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("b",))
    md = jaxattn.AttentionMetadata(mesh=mesh, batch_axis="b")
    reasons = jaxattn.get_impl("vanilla", md).supports(a["q"], a["k"], a["v"], kv_lengths=a["kv_lengths"],
                                                       k_scale=a["k_scale"], v_scale=a["v_scale"])
    assert any("shard_map" in r for r in reasons), reasons


TINY = {"int8": 1e-36, "float8_e4m3fn": 5e-36, "float8_e5m2": 7e-34}  # absmax whose scale was subnormal


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_of_a_tiny_block_stays_finite(fmt: str, jit: bool) -> None:
    # Blocks of absmax down to a tenth of the point where absmax / qmax leaves float32's normals
    # (XLA flushes subnormals to zero: the scale was 0 and float8 values 0/0 = NaN, int8 0).
    rng = np.random.default_rng(1)
    sizes = TINY[fmt] * np.logspace(-1, 0, 6)
    x = (rng.uniform(-1, 1, size=(6, 2, 8)) * sizes[:, None, None]).astype(np.float32)
    x[:, :, 0] = sizes[:, None]  # each block's absmax is exactly its size
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA flushes subnormal inputs: keep them out
    quantize = jax.jit(jaxattn.quantize_kv, static_argnums=(1, 2)) if jit else jaxattn.quantize_kv
    values, scale = quantize(jnp.asarray(x), fmt, "token")
    scale = np.asarray(scale)
    assert (scale >= np.finfo(np.float32).tiny).all(), scale
    deq = np.asarray(jaxattn.dequantize_kv(values, scale), np.float64)
    assert np.isfinite(deq).all()
    # Within half a level of the clamped scale (int8), or the format's error at the levels it
    # keeps (float8: relative half-ulp, or half the clamped scale near 0).
    err = np.abs(deq - x)
    level = np.broadcast_to(scale[..., None], x.shape).astype(np.float64)
    bound = 0.5 * level if fmt == "int8" else np.maximum(REL_HALF_STEP[fmt] * np.abs(x), level)
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
    np.testing.assert_allclose(deq[:, :, 0], x[:, :, 0], rtol=0.13)  # the absmax itself survives


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_scale_gradients_are_zero_at_unread_positions(fmt: str, jit: bool) -> None:
    # Positions at and past a length are unread: NaN values (a float8 NaN) and NaN scales
    # there give zero gradients to k_scale and v_scale, and finite ones elsewhere.
    rng = np.random.default_rng(2)
    b, s, h, d = 2, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((b, 1, 4, d)), jnp.float32)
    kv_lengths = jnp.asarray([6, 3], jnp.int32)
    k, ks = jaxattn.quantize_kv(jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32), fmt)
    v, vs = jaxattn.quantize_kv(jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32), fmt)
    poison = jnp.arange(s)[None, :, None, None] >= kv_lengths[:, None, None, None]
    bad = jnp.asarray(np.nan if fmt != "int8" else 127, jnp.float32).astype(k.dtype)
    k, v = jnp.where(poison, bad, k), jnp.where(poison, bad, v)
    ks, vs = jnp.where(poison[..., 0], jnp.nan, ks), jnp.where(poison[..., 0], jnp.nan, vs)

    def loss(ks: Any, vs: Any) -> Any:
        out = jaxattn.attention(q, k, v, impl="vanilla", k_scale=ks, v_scale=vs, kv_lengths=kv_lengths)
        return jnp.sum(out**2)

    grad = jax.grad(loss, argnums=(0, 1))
    dks, dvs = (np.asarray(g) for g in (jax.jit(grad) if jit else grad)(ks, vs))
    unread = np.broadcast_to(np.asarray(poison[..., 0]), dks.shape)
    for name, g in (("k_scale", dks), ("v_scale", dvs)):
        assert np.isfinite(g).all(), f"d {name}: {g}"
        assert (g[unread] == 0).all(), f"d {name} at unread positions: {g[unread]}"
        assert (g[~unread] != 0).any()
