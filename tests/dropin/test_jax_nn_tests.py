"""JAX's own DotProductAttention tests, run against ``jaxattn.dot_product_attention``.

Source: JAX's ``tests/nn_test.py`` (repository jax-ml/jax), class ``NNFunctionsTest``: the tests
``testDotProductAttention``, ``testDotProductAttentionMask`` and
``testDotProductAttentionBiasGradient``. Their cases, inputs, checks and tolerances are the same
here, written against jaxattn rather than copied: JAX's tests compare
``jax.nn.dot_product_attention(implementation=None)`` (the reference) with
``implementation='cudnn'``; here the answer is ``jaxattn.dot_product_attention`` on every backend
that can take the call on this host (``auto``, ``vanilla``, ``sdpa``, ``blockwise``, and ``cudnn``
where there is one). What JAX's harness does for them, done here:

* ``jax_numpy_rank_promotion="raise"`` around every test (JAX's test harness default);
* ``jtu.JaxTestCase.assertAllClose`` is :func:`_assert_close` (``np.testing.assert_allclose`` in
  float32, with the test's tolerances; JAX's default tolerance for bfloat16 where a test gives none);
* the cuDNN-only checks (the HLO names cuDNN's kernel; cuDNN's bias-gradient error at batch > 1)
  apply to ``cudnn`` only; other backends check the bias gradient at every batch size.

A backend may decline a case only with ``UnsupportedError`` whose every reason comes from its
declarations (a feature or dtype it does not declare), or from a limit listed in
``DOCUMENTED_LIMITS``; any other exception, or a wrong number, fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import jaxattn

BACKENDS = (None, "vanilla", "sdpa", "blockwise", "cudnn")
IDS = ["auto" if b is None else b for b in BACKENDS]

#: Reasons a backend gives that are not a declared feature or dtype, each with where it is said.
DOCUMENTED_LIMITS = {
    "sdpa": ("F16_F16_F32",),  # XLA:CPU rejects jax.nn's float16 dot algorithm under jit (jaxattn_sdpa.impl)
}


@pytest.fixture(autouse=True)
def _like_jax_harness() -> Iterator[None]:
    # JAX's tests run with rank promotion "raise"; CPU float32 products are exact anyway.
    with jax.numpy_rank_promotion("raise"), jax.default_matmul_precision("highest"):
        yield


def _assert_close(want: Any, got: Any, atol: float = 1e-2, rtol: float = 1e-2) -> None:
    if want is None or got is None:
        assert want is None and got is None, "one side has no value"
        return
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    assert want.shape == got.shape, f"shapes differ: {want.shape} vs {got.shape}"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


def _backend(name: str | None) -> str | None:
    """``name``, or skip when no backend of that name runs on this host."""
    if name is not None:
        try:
            jaxattn.get_impl(name)
        except jaxattn.ImplNotFoundError as err:
            pytest.skip(f"{name} does not run here: {err}")
    return name


def _declared(name: str | None, reasons: list[str]) -> bool:
    """Whether every reason comes from the backend's declarations or a documented limit."""
    if name is None:
        return False  # auto must find a backend for every case
    impl = jaxattn.get_impl(name)
    allowed = tuple(getattr(impl, "why_not", {}).values())
    limits = DOCUMENTED_LIMITS.get(name, ())
    return all(re.search(r" (is|are) not supported by \S+$", r) or r.startswith("dtype ") or r in allowed
               or any(text in r for text in limits) for r in reasons)


def _run(name: str | None, thunk: Callable[[], Any]) -> Any:
    """``thunk()``; a decline explained by the backend's declarations skips the test."""
    try:
        return thunk()
    except jaxattn.UnsupportedError as err:
        if _declared(name, err.reasons):
            pytest.skip(f"{name} declines, as it declares: {'; '.join(err.reasons)}")
        raise


#: jax.nn's results per case: the reference is the same for every backend, and eager VJPs on a
#: CPU cost seconds each.
_REFERENCE: dict[tuple[Any, ...], Any] = {}


def _reference(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    if key not in _REFERENCE:
        _REFERENCE[key] = compute()
    return _REFERENCE[key]


def _uses_cudnn(fn: Callable[..., Any], *args: Any) -> bool:
    return "__cudnn$fmha" in jax.jit(fn).lower(*args).as_text("stablehlo", debug_info=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("use_vmap", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_dot_product_attention(dtype: Any, group_num: int, use_vmap: bool, backend: str | None) -> None:
    """testDotProductAttention: grouped heads (G = 1, 2, 4), with and without vmap over the batch;
    output and gradients against jax.nn on K/V repeated to every head."""
    name = _backend(backend)
    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N // G, H), dtype)
    V = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None

    reference = partial(jax.nn.dot_product_attention, implementation=None)
    answer = partial(jaxattn.dot_product_attention, implementation=name)
    if use_vmap:
        answer = jax.vmap(answer, in_axes=(0, 0, 0, None, None), out_axes=0)
    K_ref, V_ref = jnp.repeat(K, G, axis=2), jnp.repeat(V, G, axis=2)

    def expected() -> Any:
        out_ref, vjp_ref = jax.vjp(reference, Q, K_ref, V_ref, bias, mask)
        return out_ref, *vjp_ref(grad)[:3]

    out_ref, dQ_ref, dK_ref, dV_ref = _reference(("gqa", dtype, G), expected)  # vmap changes no number
    out_ans, vjp_ans = _run(name, lambda: jax.vjp(answer, Q, K, V, bias, mask))
    dQ_ans, dK_ans, dV_ans = vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    if name == "cudnn":
        assert _uses_cudnn(answer, Q, K, V, bias, mask)

    _assert_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    _assert_close(dQ_ref, dQ_ans, atol=0.01, rtol=0.01)
    _assert_close(dK_ref, dK_ans, atol=0.01, rtol=0.01)
    _assert_close(dV_ref, dV_ans, atol=0.01, rtol=0.01)


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "sliding_window")]


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("mask_mode", MASK_MODES, ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_dot_product_attention_mask(mask_mode: str | tuple[str, ...], backend: str | None) -> None:
    """testDotProductAttentionMask: bias, causal, padding (query and key lengths), a custom
    mask, their combinations and a causal sliding window; output and every gradient (the bias's
    too) against jax.nn."""
    name = _backend(backend)
    modes = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 4)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None
    is_causal = "causal" in modes
    if "padding" in modes:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in modes:
        mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in modes:
        # JAX's test draws it with keys[4] of these 4 keys: out of bounds, which JAX's indexing
        # clamps to the last key (keys[3]), said plainly here.
        bias = random.normal(keys[-1], (1, N, T, S), dtype)
    if "sliding_window" in modes:
        window_size = (3, 2) if is_causal else (3, 0)

    def call(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda q, k, v, b, m, qs, kvs: fn(q, k, v, b, m, is_causal=is_causal, query_seq_lengths=qs,
                                                 key_value_seq_lengths=kvs, local_window_size=window_size)

    fn_ref = call(partial(jax.nn.dot_product_attention, implementation=None))
    fn_ans = call(partial(jaxattn.dot_product_attention, implementation=name))
    args = (Q, K, V, bias, mask, q_seqlen, kv_seqlen)

    def expected() -> Any:
        out_ref, vjp_ref = jax.vjp(fn_ref, *args)
        return out_ref, *vjp_ref(grad)[:4]

    out_ref, dQ_ref, dK_ref, dV_ref, dbias_ref = _reference(("mask", modes), expected)
    out_ans, vjp_ans = _run(name, lambda: jax.vjp(fn_ans, *args))
    dQ_ans, dK_ans, dV_ans, dbias_ans = vjp_ans(grad)[:4]
    if name == "cudnn":
        assert _uses_cudnn(fn_ans, *args)

    _assert_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    _assert_close(dQ_ref, dQ_ans, atol=0.02, rtol=0.02)
    _assert_close(dK_ref, dK_ans, atol=0.02, rtol=0.02)
    _assert_close(dV_ref, dV_ans, atol=0.01, rtol=0.01)
    _assert_close(dbias_ref, dbias_ans, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("use_vmap", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_dot_product_attention_bias_gradient(batch_size: int, use_vmap: bool, backend: str | None) -> None:
    """testDotProductAttentionBiasGradient: self-attention with a per-batch bias and a rank-3
    mask, vmapped over the batch or not, under jit; output and the bias's gradient against
    jax.nn (cuDNN computes a bias gradient only at batch 1 and must say so otherwise)."""
    name = _backend(backend)
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (B, S, N, H), dtype)
    bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(fn: Callable[..., Any], x: Any, bias: Any, mask: Any) -> Any:
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    attn_ref = partial(attention, partial(jax.nn.dot_product_attention, implementation=None))
    attn_ans = partial(attention, partial(jaxattn.dot_product_attention, implementation=name))
    if use_vmap:
        batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
        batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    else:
        batched_ref, batched_ans = attn_ref, attn_ans
    y_ref = _reference(("bias_out", batch_size, use_vmap), lambda: jax.jit(batched_ref)(x, bias, mask))
    y_ans = _run(name, lambda: jax.jit(batched_ans)(x, bias, mask))
    _assert_close(y_ref, y_ans)

    def backward(fn: Callable[..., Any]) -> Callable[..., Any]:
        @jax.jit
        def run(x: Any, bias: Any, mask: Any) -> Any:
            _, f_vjp = jax.vjp(fn, x, bias, mask)
            return f_vjp(x)
        return run

    if name == "cudnn" and batch_size != 1:
        with pytest.raises(ValueError):  # cuDNN's own error, or jaxattn's UnsupportedError saying it
            backward(attn_ans)(x, bias, mask)
        return
    _, dbias_ref, _ = _reference(("bias_grad", batch_size), lambda: backward(attn_ref)(x, bias, mask))
    _, dbias_ans, _ = _run(name, lambda: backward(attn_ans)(x, bias, mask))
    _assert_close(dbias_ref, dbias_ans, rtol=0.1, atol=0.1)
