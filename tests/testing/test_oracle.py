"""The float64 oracle against hand-computed cases, finite differences and jax's own attention."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from jaxattn.testing import oracle

RNG = np.random.default_rng(0)


def _qkv(
    b: int = 2, t: int = 3, s: int = 4, hq: int = 4, hkv: int = 2, d: int = 3, dv: int = 2
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(b * 1000 + t * 100 + s * 10 + hq + hkv + d + dv)
    return (
        rng.normal(size=(b, t, hq, d)),
        rng.normal(size=(b, s, hkv, d)),
        rng.normal(size=(b, s, hkv, dv)),
    )


# --------------------------------------------------------------------------- hand-computed


def test_single_key_returns_its_value() -> None:
    q = RNG.normal(size=(1, 2, 1, 3))
    k = RNG.normal(size=(1, 1, 1, 3))
    v = np.array([[[[1.5, -2.0]]]])
    res = oracle.attention(q, k, v)
    np.testing.assert_allclose(res.output, np.broadcast_to(v, (1, 2, 1, 2)))
    np.testing.assert_allclose(res.probs, np.ones((1, 1, 2, 1)))


def test_two_keys_by_hand() -> None:
    # q.k = (0, 2) with scale 0.5 gives logits (0, 1): p = (1, e) / (1 + e).
    q = np.array([[[[1.0, 1.0]]]])
    k = np.array([[[[0.0, 0.0]], [[1.0, 1.0]]]])
    v = np.array([[[[10.0]], [[20.0]]]])
    res = oracle.attention(q, k, v, softmax_scale=0.5)
    p1 = np.e / (1 + np.e)
    np.testing.assert_allclose(res.probs[0, 0, 0], [1 - p1, p1])
    np.testing.assert_allclose(res.output[0, 0, 0, 0], 10 * (1 - p1) + 20 * p1)
    np.testing.assert_allclose(res.lse[0, 0, 0], np.log(1 + np.e))


def test_default_scale_is_inverse_sqrt_head_dim() -> None:
    q, k, v = _qkv(d=5)
    np.testing.assert_allclose(
        oracle.attention(q, k, v).output, oracle.attention(q, k, v, softmax_scale=5**-0.5).output
    )


def test_causal_is_bottom_right_aligned() -> None:
    vis = oracle.visibility(1, 1, 2, 4, causal=True)[0, 0]
    # query 0 sits at key position 2, query 1 at key position 3 (the last one).
    np.testing.assert_array_equal(vis, [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(oracle.visibility(1, 1, 3, 3, causal=True)[0, 0], np.tril(np.ones((3, 3))))


def test_sliding_window_is_relative_to_aligned_position_and_combines_with_causal() -> None:
    vis = oracle.visibility(1, 1, 2, 5, sliding_window=(1, 0))[0, 0]
    # aligned positions 3 and 4: keys {2, 3} and {3, 4}
    np.testing.assert_array_equal(vis, [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    sym = oracle.visibility(1, 1, 3, 3, sliding_window=1)[0, 0]
    np.testing.assert_array_equal(sym, [[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    both = oracle.visibility(1, 1, 3, 3, sliding_window=(1, 1), causal=True)[0, 0]
    np.testing.assert_array_equal(both, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])


def test_segment_ids_restrict_to_own_segment() -> None:
    vis = oracle.visibility(1, 2, 3, 4, q_segment_ids=[[0, 1, 2]], kv_segment_ids=[[0, 0, 1, 1]])
    np.testing.assert_array_equal(vis[0, 1], [[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="together"):
        oracle.visibility(1, 1, 3, 4, q_segment_ids=[[0, 1, 2]])


def test_gqa_query_head_reads_kv_head_h_div_groups() -> None:
    q, k, v = _qkv(hq=6, hkv=2)
    res = oracle.attention(q, k, v)
    for h in range(6):
        single = oracle.attention(q[:, :, h : h + 1], k[:, :, h // 3 : h // 3 + 1], v[:, :, h // 3 : h // 3 + 1])
        np.testing.assert_allclose(res.output[:, :, h], single.output[:, :, 0])


def test_soft_cap_applies_before_bias_and_mask() -> None:
    q, k, v = _qkv()
    bias = RNG.normal(size=(1, 4, 3, 4)) * 3
    cap = 0.7
    res = oracle.attention(q, k, v, bias=bias, logits_soft_cap=cap)
    logits = cap * np.tanh(np.einsum("bthd,bshd->bhts", q, np.repeat(k, 2, axis=2)) * 3**-0.5 / cap) + bias
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(res.probs, expected)


def test_sink_joins_denominator_only() -> None:
    # all logits zero: S keys and one sink of logit 0 share the row equally.
    q = np.zeros((1, 2, 2, 3))
    k = RNG.normal(size=(1, 4, 1, 3))
    v = RNG.normal(size=(1, 4, 1, 2))
    res = oracle.attention(q, k, v, softmax_aux=[0.0, np.log(4.0)])
    np.testing.assert_allclose(res.probs[0, 0], np.full((2, 4), 1 / 5))
    np.testing.assert_allclose(res.probs[0, 1], np.full((2, 4), 1 / 8))  # sink weighs like 4 keys
    np.testing.assert_allclose(res.lse, np.log(4.0))  # the sink is excluded from lse
    np.testing.assert_allclose(res.output[0, :, 1], np.broadcast_to(v[0, :, 0].sum(0) / 8, (2, 2)))


def test_fully_masked_rows_give_zeros_and_minus_inf_lse() -> None:
    q, k, v = _qkv()
    mask = np.ones((2, 4, 3, 4), dtype=bool)
    mask[0, 1, 2] = False
    res = oracle.attention(q, k, v, mask=mask, softmax_aux=np.ones(4))
    assert np.all(np.isfinite(res.output))
    np.testing.assert_array_equal(res.output[0, 2, 1], 0.0)
    np.testing.assert_array_equal(res.probs[0, 1, 2], 0.0)
    assert res.lse[0, 1, 2] == -np.inf
    assert np.all(np.isfinite(np.delete(res.lse.reshape(-1), 1 * 3 + 2)))
    grads = oracle.attention_backward(q, k, v, np.ones_like(res.output), mask=mask, softmax_aux=np.ones(4))
    np.testing.assert_array_equal(grads.dq[0, 2, 1], 0.0)
    assert grads.dsoftmax_aux is not None
    assert all(np.all(np.isfinite(g)) for g in (grads.dq, grads.dk, grads.dv, grads.dsoftmax_aux))


def test_minus_inf_bias_on_every_key_counts_as_masked() -> None:
    q, k, v = _qkv(b=1)
    bias = np.zeros((1, 4, 3, 4))
    bias[0, 0, 1] = -np.inf
    res = oracle.attention(q, k, v, bias=bias)
    np.testing.assert_array_equal(res.output[0, 1, 0], 0.0)
    assert res.lse[0, 0, 1] == -np.inf


def test_dropout_scales_kept_weights() -> None:
    q, k, v = _qkv()
    keep = RNG.random((2, 4, 3, 4)) > 0.3
    plain = oracle.attention(q, k, v)
    dropped = oracle.attention(q, k, v, dropout_prob=0.3, dropout_keep=keep)
    np.testing.assert_allclose(dropped.weights, plain.probs * keep / 0.7)
    np.testing.assert_allclose(dropped.probs, plain.probs)
    with pytest.raises(ValueError, match="dropout_keep"):
        oracle.attention(q, k, v, dropout_prob=0.3)


# --------------------------------------------------------------------------- finite differences


def _numeric_grad(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        orig = x[idx]
        x[idx] = orig + eps
        hi = f(x)
        x[idx] = orig - eps
        lo = f(x)
        x[idx] = orig
        grad[idx] = (hi - lo) / (2 * eps)
    return grad


FD_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "gqa_causal_cross": {"causal": True},
    "mask_with_empty_row": {"mask": "empty_row"},
    "bias_broadcast": {"bias": (1, 4, 1, 4)},
    "bias_full": {"bias": (2, 4, 3, 4)},
    "soft_cap_bias": {"logits_soft_cap": 1.3, "bias": (4, 3, 4)},
    "sinks_window": {"softmax_aux": True, "sliding_window": (1, 0)},
    "segments_scale": {"segments": True, "softmax_scale": 0.9},
    "dropout": {"dropout": 0.4},
    "everything": {
        "causal": True,
        "bias": (2, 1, 3, 4),
        "logits_soft_cap": 2.0,
        "softmax_aux": True,
        "mask": "empty_row",
    },
}


@pytest.mark.parametrize("name", list(FD_CASES))
def test_backward_matches_finite_differences(name: str) -> None:
    spec = FD_CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v = _qkv(b=2, t=3, s=4, hq=4, hkv=2, d=3, dv=2)
    kw: dict[str, Any] = {
        key: spec[key] for key in ("causal", "logits_soft_cap", "sliding_window", "softmax_scale") if key in spec
    }
    if spec.get("mask") == "empty_row":
        mask = rng.random((2, 1, 3, 4)) > 0.3
        mask[1, 0, 0] = False
        kw["mask"] = mask
    if "bias" in spec:
        kw["bias"] = rng.normal(size=spec["bias"])
    if spec.get("softmax_aux"):
        kw["softmax_aux"] = rng.normal(size=4)
    if spec.get("segments"):
        kw["q_segment_ids"] = np.array([[0, 0, 1], [2, 2, 2]])
        kw["kv_segment_ids"] = np.array([[0, 1, 1, 1], [2, 2, 3, 2]])
    if "dropout" in spec:
        kw["dropout_prob"] = spec["dropout"]
        kw["dropout_keep"] = rng.random((2, 4, 3, 4)) > spec["dropout"]
    d_out = rng.normal(size=(2, 3, 4, 2))
    grads = oracle.attention_backward(q, k, v, d_out, **kw)

    def loss(**override: Any) -> float:
        args = {"q": q, "k": k, "v": v, **kw, **override}
        return float((oracle.attention(**args).output * d_out).sum())

    close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-8)
    close(grads.dq, _numeric_grad(lambda x: loss(q=x), q.copy()))
    close(grads.dk, _numeric_grad(lambda x: loss(k=x), k.copy()))
    close(grads.dv, _numeric_grad(lambda x: loss(v=x), v.copy()))
    if "bias" in kw:
        assert grads.dbias is not None
        assert grads.dbias.shape == kw["bias"].shape
        close(grads.dbias, _numeric_grad(lambda x: loss(bias=x), kw["bias"].copy()))
    else:
        assert grads.dbias is None
    if "softmax_aux" in kw:
        assert grads.dsoftmax_aux is not None
        close(
            grads.dsoftmax_aux,
            _numeric_grad(lambda x: loss(softmax_aux=x), kw["softmax_aux"].copy()),
        )
    assert np.abs(grads.dq).max() > 0  # a zero gradient would pass the comparison vacuously


# --------------------------------------------------------------------------- jax's attention


JAX_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "cross": {"s": 5},
    "gqa": {"hq": 6, "hkv": 2},
    "mqa_causal": {"hq": 4, "hkv": 1, "causal": True},
    "bias_mask": {"bias": True, "mask": True},
    "window": {"window": (2, 1)},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("name", list(JAX_CASES))
def test_matches_jax_dot_product_attention_with_float64_inputs(name: str) -> None:
    jax = pytest.importorskip("jax")
    spec = JAX_CASES[name]
    rng = np.random.default_rng(7)
    hq, hkv, t = spec.get("hq", 4), spec.get("hkv", 4), 4
    s = spec.get("s", t)
    q = rng.normal(size=(2, t, hq, 8))
    k = rng.normal(size=(2, s, hkv, 8))
    v = rng.normal(size=(2, s, hkv, 8))
    bias = rng.normal(size=(2, hq, t, s)) if spec.get("bias") else None
    mask = (rng.random((2, 1, t, s)) > 0.3) | np.eye(t, s, dtype=bool) if spec.get("mask") else None
    causal = spec.get("causal", False)
    window = spec.get("window")
    from jaxattn.testing.quick_jit import quick_jit

    def reference(q: Any, k: Any, v: Any, bias: Any, mask: Any) -> Any:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            scale=spec.get("scale"),
            is_causal=causal,
            local_window_size=window,
        )

    with jax.enable_x64(True):
        expected = quick_jit(reference)(q, k, v, bias, mask)
        assert expected.dtype == np.float64
    got = oracle.attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        causal=causal,
        sliding_window=window,
        softmax_scale=spec.get("scale"),
    )
    # jax runs the softmax in float32 even for float64 inputs, so agreement is float32-tight;
    # the point is the semantics (masks, window, GQA, scale), not the last digits.
    np.testing.assert_allclose(got.output, np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_rejects_bad_shapes() -> None:
    q, k, v = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        oracle.attention(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        oracle.attention(q, k, v, bias=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="softmax_aux"):
        oracle.attention(q, k, v, softmax_aux=np.zeros(3))
