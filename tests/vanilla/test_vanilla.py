"""vanilla beyond the conformance matrix: transformations, registration, dtypes, the plain function."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.validation import resolve_call
from jaxattn.testing import oracle
from jaxattn.testing.quick_jit import quick_jit
from jaxattn_vanilla.vanilla.impl import VanillaAttention
from jaxattn_vanilla.vanilla.reference import vanilla_attention


def _qkv(
    b: int = 2, t: int = 5, s: int = 7, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(b, t, hq, d)).astype(np.float32),
        rng.normal(size=(b, s, hkv, d)).astype(np.float32),
        rng.normal(size=(b, s, hkv, d)).astype(np.float32),
    )


@pytest.fixture(scope="module")
def impl() -> jaxattn.AttentionImpl:
    return jaxattn.get_impl("vanilla")


def test_registered_through_its_entry_point(impl: jaxattn.AttentionImpl) -> None:
    assert isinstance(impl, VanillaAttention)
    info = {i.name: i for i in jaxattn.list_impls()}["vanilla"]
    assert info.distribution == "jaxattn-vanilla"
    assert set(info.platforms) == {"cpu", "gpu", "tpu"}
    assert info.status == "ok"


def test_plugin_module_imports_no_jax() -> None:
    code = (
        "import sys, jaxattn_vanilla.plugin as p; p.jaxattn_register_impls(); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'jaxattn_vanilla.vanilla.impl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_jit_matches_eager(impl: jaxattn.AttentionImpl) -> None:
    q, k, v = _qkv()
    eager = impl(q, k, v, causal=True, softmax_aux=jnp.zeros(4))
    jitted = quick_jit(lambda q, k, v: impl(q, k, v, causal=True, softmax_aux=jnp.zeros(4)))(q, k, v)
    np.testing.assert_allclose(jitted.attention_outputs, eager.attention_outputs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jitted.softmax_lse, eager.softmax_lse, rtol=1e-6, atol=1e-6)


def test_vmap_over_an_extra_axis(impl: jaxattn.AttentionImpl) -> None:
    q, k, v = (np.stack([x, 2 * x]) for x in _qkv())  # (2, B, T, H, D): a stack of problems
    bias = np.random.default_rng(1).normal(size=(2, 1, 4, 5, 7)).astype(np.float32)
    batched = quick_jit(jax.vmap(lambda q, k, v, b: impl(q, k, v, bias=b, causal=True).attention_outputs))(
        q, k, v, bias
    )
    for i in range(2):
        ref = oracle.attention(q[i], k[i], v[i], bias=bias[i], causal=True)
        np.testing.assert_allclose(batched[i], ref.output, rtol=1e-5, atol=1e-5)


def test_grad_under_jit_with_every_feature(impl: jaxattn.AttentionImpl) -> None:
    q, k, v = _qkv()
    rng = np.random.default_rng(2)
    bias = rng.normal(size=(1, 4, 5, 7)).astype(np.float32)
    aux = rng.normal(size=(4,)).astype(np.float32)
    mask = rng.random((2, 1, 5, 7)) > 0.3
    mask[0, 0, 2] = False  # one empty row: its gradient must be finite (zero)
    feats: dict[str, Any] = {"causal": True, "sliding_window": (3, 1), "logits_soft_cap": 2.5}
    d_out = rng.normal(size=(2, 5, 4, 8)).astype(np.float32)

    def loss(q: Any, k: Any, v: Any, bias: Any, aux: Any) -> Any:
        out = impl(q, k, v, mask=mask, bias=bias, softmax_aux=aux, **feats).attention_outputs
        return jnp.sum(out * d_out)

    grads = quick_jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, aux)
    ref = oracle.attention_backward(q, k, v, d_out, mask=mask, bias=bias, softmax_aux=aux, **feats)
    for got, want in zip(grads, (ref.dq, ref.dk, ref.dv, ref.dbias, ref.dsoftmax_aux), strict=True):
        assert want is not None
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fully_masked_everywhere_gives_zeros_and_zero_grads() -> None:
    q, k, v = _qkv()
    mask = np.zeros((1, 1, 5, 7), dtype=bool)

    def loss(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        res = vanilla_attention(q, k, v, mask=mask)
        return res.output.sum(), res

    grads, res = quick_jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_array_equal(res.output, 0.0)
    assert np.all(np.isneginf(res.lse))
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


def test_minus_inf_bias_rows_are_empty_not_nan() -> None:
    q, k, v = _qkv()
    bias = np.zeros((1, 1, 5, 7), dtype=np.float32)
    bias[..., 0, :] = -np.inf

    def loss(b: Any) -> tuple[Any, Any]:
        out = vanilla_attention(q, k, v, bias=b).output
        return out.sum(), out

    g, out = quick_jit(jax.grad(loss, has_aux=True))(bias)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    assert np.all(np.isfinite(g))


def test_gqa_never_materialises_repeated_kv() -> None:
    """No intermediate of the program has K/V's shape with Hq heads (B, S, Hq, D)."""
    b, t, s, hq, hkv, d = 2, 3, 11, 8, 2, 16
    q = jnp.zeros((b, t, hq, d))
    k = v = jnp.zeros((b, s, hkv, d))
    jaxpr = jax.make_jaxpr(lambda q, k, v: vanilla_attention(q, k, v, causal=True))(q, k, v)
    shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
    assert (b, s, hq, d) not in shapes
    assert (b, hq, s, d) not in shapes
    assert (b, hkv, hq // hkv, t, s) in shapes  # logits, grouped per kv head


def test_init_bias_is_called_when_bias_is_none(impl: jaxattn.AttentionImpl) -> None:
    q, k, v = _qkv()
    bias = np.random.default_rng(3).normal(size=(5, 7)).astype(np.float32)
    calls: list[int] = []

    def init_bias() -> np.ndarray:
        calls.append(1)
        return bias

    out = quick_jit(lambda q, k, v: impl(q, k, v, init_bias=init_bias).attention_outputs)(q, k, v)
    assert calls == [1]
    np.testing.assert_allclose(out, oracle.attention(q, k, v, bias=bias).output, rtol=1e-5, atol=1e-5)
    # validation calls it once: forward_native, called directly on the call object, sees the bias
    direct = quick_jit(lambda q, k, v: impl.forward_native(
        resolve_call(q, k, v, init_bias=init_bias, metadata=impl.metadata, prepare=True)))(q, k, v)
    np.testing.assert_allclose(direct.attention_outputs, out, rtol=1e-6, atol=1e-6)


def test_softmax_dtype_follows_metadata() -> None:
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv())
    f32 = VanillaAttention(jaxattn.AttentionMetadata())
    bf16 = VanillaAttention(jaxattn.AttentionMetadata(softmax_dtype="bfloat16"))
    ref = oracle.attention(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)))
    out32 = quick_jit(f32)(q, k, v)
    out16 = quick_jit(bf16)(q, k, v)
    assert out32.attention_outputs.dtype == jnp.bfloat16
    assert out32.softmax_lse.dtype == jnp.float32
    err32 = np.abs(np.asarray(out32.softmax_lse) - ref.lse).max()
    err16 = np.abs(np.asarray(out16.softmax_lse) - ref.lse).max()
    # a bfloat16 softmax rounds the logits (8 mantissa bits); float32 does not
    assert err32 < 1e-5 < err16


def test_float64_matches_oracle_tightly() -> None:
    q, k, v = (x.astype(np.float64) for x in _qkv())
    with jax.enable_x64(True):
        impl = VanillaAttention(jaxattn.AttentionMetadata())
        out = quick_jit(lambda q, k, v: impl(q, k, v, causal=True, logits_soft_cap=3.0))(q, k, v)
        assert out.attention_outputs.dtype == jnp.float64
    ref = oracle.attention(q, k, v, causal=True, logits_soft_cap=3.0)
    np.testing.assert_allclose(out.attention_outputs, ref.output, rtol=1e-12, atol=1e-12)


def test_lse_combines_blocks_like_ring_attention() -> None:
    """Two key blocks merged through their lse equal attention over all keys (ring's use)."""
    q, k, v = _qkv(s=10)
    # second block fully masked for some rows: lse -inf there must merge cleanly
    mask = np.ones((1, 1, 5, 6), dtype=bool)
    mask[..., 1, :] = False

    @quick_jit
    def merged(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        a = vanilla_attention(q, k[:, :4], v[:, :4])
        b = vanilla_attention(q, k[:, 4:], v[:, 4:], mask=mask)
        lse = jnp.logaddexp(a.lse, b.lse)  # (B, H, T)
        wa = jnp.exp(a.lse - lse).transpose(0, 2, 1)[..., None]
        wb = jnp.exp(b.lse - lse).transpose(0, 2, 1)[..., None]
        return wa * a.output + wb * b.output, lse

    out, lse = merged(q, k, v)
    ref = oracle.attention(q, k, v, mask=np.concatenate([np.ones((1, 1, 5, 4), bool), mask], -1))
    np.testing.assert_allclose(out, ref.output, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref.lse, rtol=1e-5, atol=1e-5)


def test_dropout_needs_rng_and_is_reproducible() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_rng"):
        vanilla_attention(q, k, v, dropout_prob=0.5)
    run = quick_jit(lambda key: vanilla_attention(q, k, v, dropout_prob=0.5, dropout_rng=key))
    a = run(jax.random.key(0))
    b = run(jax.random.key(0))
    np.testing.assert_array_equal(a.output, b.output)
    # the weights returned are the ones applied: output = weights @ v per kv group
    vr = np.repeat(v, 2, axis=2)
    np.testing.assert_allclose(a.output, np.einsum("bhts,bshd->bthd", a.weights, vr), rtol=1e-5, atol=1e-5)


def test_rejects_heads_that_do_not_group() -> None:
    q, k, v = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        vanilla_attention(q, k, v)
    with pytest.raises(ValueError, match="head dim"):
        vanilla_attention(*_qkv(), mask=np.ones((1, 2, 5, 7), dtype=bool))
