"""No NaN where the contract promises none, on every dense backend of this CPU.

* a cache with ``kv_lengths`` may hold any bit pattern past a length (NaN, +Inf, -Inf): the
  output and the gradients equal the oracle's over the clean cache, and the poisoned
  positions get zero gradients;
* a query whose position ``kv_lengths[b] - T + i`` is negative is no token of the sequence:
  zeros, causal or not;
* a bias row that is -inf on every key is an empty row: zeros, zero gradients;
* an infinite sink: ``+inf`` takes the whole mass (zeros, zero gradients), ``-inf`` is no
  sink; a sink is a raw logit (neither scaled nor soft-capped).

Each is checked against the float64 oracle, eager and under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.sinks import split_absorbing_sinks, zero_absorbed_heads
from jaxattn.backend.unread import zero_past_lengths, zero_unseen_keys
from jaxattn.testing import oracle

IMPLS = ["vanilla", "blockwise", "sdpa", "autoregressive_decodeattn"]
POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
TOL = 2e-5


@pytest.fixture(autouse=True)
def _highest_precision() -> Any:
    with jax.default_matmul_precision("highest"):
        yield


def _qkv(b: int, t: int, s: int, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(np.float32)
                 for shape in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hq, d)))


def _runs(name: str, q: Any, k: Any, v: Any, needs_grad: bool, **features: Any) -> bool:
    impl = jaxattn.get_impl(name)
    return not impl.supports(q, k, v, needs_grad=needs_grad, **features)


def _check(name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, *, clean: tuple[Any, Any] | None
           = None, jit: bool, **features: Any) -> Any:
    """Forward and (where the backend differentiates) gradients against the oracle.

    ``clean``: the K and V the oracle sees (the backend gets the poisoned ``k``, ``v``).
    Returns the backend's gradients (None if it declines them)."""
    k_ref, v_ref = (k, v) if clean is None else clean
    ref = oracle.attention(q, k_ref, v_ref, **features)
    # Float arrays (bias, sinks) are differentiated; the rest is closed over.
    arrays = {n: jnp.asarray(x) for n, x in features.items() if isinstance(x, np.ndarray) and x.dtype.kind == "f"}
    static = {n: x for n, x in features.items() if n not in arrays}
    if not _runs(name, q, k, v, False, **features):
        pytest.skip(f"{name} declines this call")

    def out(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        return jaxattn.attention(q, k, v, impl=name, **static, **arrays)

    run = jax.jit(out) if jit else out
    got = np.asarray(run(q, k, v, arrays))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref.output, atol=TOL, rtol=TOL)
    if not _runs(name, q, k, v, True, **features):
        return None
    want = oracle.attention_backward(q, k_ref, v_ref, do, **features)

    def loss(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        return jnp.sum(out(q, k, v, arrays) * do)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    dq, dk, dv, darrays = (jax.jit(grad) if jit else grad)(q, k, v, arrays)
    for got_g, want_g in ((dq, want.dq), (dk, want.dk), (dv, want.dv), (darrays.get("bias"), want.dbias),
                          (darrays.get("softmax_aux"), want.dsoftmax_aux)):
        if want_g is None:
            continue
        assert np.isfinite(np.asarray(got_g)).all()
        np.testing.assert_allclose(np.asarray(got_g), want_g, atol=TOL, rtol=TOL)
    return dq, dk, dv


# (T, causal, jit): a decode step and a causal prefill chunk, each poison under jit; one eager.
SHAPES = [(1, False, True), (3, True, True)]


@pytest.mark.parametrize(("t", "causal", "jit"), [*SHAPES, (3, False, False)], ids=["decode", "causal", "eager"])
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", IMPLS)
def test_cache_past_a_length_may_hold_any_bit_pattern(name: str, poison: str, t: int, causal: bool,
                                                      jit: bool) -> None:
    q, k, v, do = _qkv(3, t, 9)
    lengths = np.array([5, 9, 3], np.int32)
    kp, vp = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        kp[b, n:] = POISONS[poison]
        vp[b, n:] = POISONS[poison]
    grads = _check(name, q, kp, vp, do, clean=(k, v), jit=jit, causal=causal, kv_lengths=lengths)
    if grads is not None:  # no gradient reaches what no query reads
        for g in grads[1:]:
            for b, n in enumerate(lengths):
                np.testing.assert_array_equal(np.asarray(g)[b, n:], 0.0)


@pytest.mark.parametrize("features", [{}, {"causal": True}, {"sliding_window": (8, 8)}],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("name", IMPLS)
def test_a_query_at_a_negative_position_gives_zeros(name: str, features: dict[str, Any]) -> None:
    q, k, v, do = _qkv(3, 4, 6)
    lengths = np.array([2, 0, 6], np.int32)  # sequence 0: queries 0 and 1 sit at -2 and -1
    want = oracle.attention(q, k, v, kv_lengths=lengths, **features).output
    assert not want[0, :2].any() and not want[1].any() and want[0, 2:].all()
    _check(name, q, k, v, do, jit=True, kv_lengths=lengths, **features)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", IMPLS)
def test_a_bias_row_of_minus_inf_is_an_empty_row(name: str, jit: bool) -> None:
    q, k, v, do = _qkv(2, 5, 7)
    bias = np.random.default_rng(3).normal(size=(1, 4, 5, 7)).astype(np.float32)
    bias[0, 1, 2] = -np.inf  # head 1, query 2: no key
    bias[0, 3, 4, :5] = -np.inf  # head 3, query 4: keys 5 and 6 only
    _check(name, q, k, v, do, jit=jit, bias=bias)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", IMPLS)
def test_infinite_sinks(name: str, causal: bool) -> None:
    """+inf: the head's output and gradients are zeros; -inf: no sink."""
    q, k, v, do = _qkv(2, 3, 7)
    aux = np.array([np.inf, 0.5, -np.inf, 1.0], np.float32)
    _check(name, q, k, v, do, jit=True, causal=causal, softmax_aux=aux)
    want = oracle.attention(q, k, v, causal=causal, softmax_aux=aux)
    assert not want.output[:, :, 0].any() and not want.probs[:, 0].any()
    no_sink = oracle.attention(q[:, :, 2:3], k[:, :, 1:2], v[:, :, 1:2], causal=causal)
    np.testing.assert_allclose(want.output[:, :, 2:3], no_sink.output, atol=1e-12)
    grads = oracle.attention_backward(q, k, v, do, causal=causal, softmax_aux=aux)
    assert grads.dsoftmax_aux is not None and np.isfinite(grads.dsoftmax_aux).all()
    assert grads.dsoftmax_aux[0] == 0 and grads.dsoftmax_aux[2] == 0 and not grads.dq[:, :, 0].any()


@pytest.mark.parametrize("name", IMPLS)
def test_a_sink_is_a_raw_logit_neither_scaled_nor_capped(name: str) -> None:
    q, k, v, do = _qkv(2, 3, 7)
    aux = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    features: dict[str, Any] = {"softmax_scale": 0.25, "softmax_aux": aux}
    if _runs(name, q, k, v, False, logits_soft_cap=1.5, **features):
        features["logits_soft_cap"] = 1.5  # a cap of 1.5 would squash a capped sink of 3 to ~1.5
    # The oracle, spelled out: the sink joins the denominator as it is.
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    x = np.einsum("bthd,bshd->bhts", q64, np.repeat(k64, 2, axis=2)) * 0.25
    if "logits_soft_cap" in features:
        x = 1.5 * np.tanh(x / 1.5)
    e = np.exp(x)
    p = e / (e.sum(-1, keepdims=True) + np.exp(aux.astype(np.float64))[None, :, None, None])
    by_hand = np.einsum("bhts,bshd->bthd", p, np.repeat(v64, 2, axis=2))
    np.testing.assert_allclose(oracle.attention(q, k, v, **features).output, by_hand, atol=1e-12)
    _check(name, q, k, v, do, jit=True, **features)


def test_helpers_use_selects_not_products() -> None:
    k = jnp.full((2, 4, 1, 2), jnp.nan)
    zk, zv = zero_past_lengths(k, k, jnp.asarray([0, 4]))
    assert not np.asarray(zk[0]).any() and np.isnan(np.asarray(zv[1])).all()
    aux, absorbed = split_absorbing_sinks(jnp.asarray([jnp.inf, -jnp.inf, 1.0]))
    assert aux is not None and absorbed is not None
    np.testing.assert_array_equal(np.asarray(aux), [0.0, -np.inf, 1.0])
    out = zero_absorbed_heads(jnp.full((1, 2, 3, 4), jnp.nan), absorbed, 2)
    assert not np.asarray(out[:, :, 0]).any() and np.isnan(np.asarray(out[:, :, 1:])).all()
    assert split_absorbing_sinks(None) == (None, None)


@pytest.mark.parametrize("lead", [(2, 4), (1, 4), (2, 1), ()], ids=["full", "one-b", "one-h", "rank-2"])
def test_zero_unseen_keys_zeroes_exactly_the_keys_no_query_of_a_kv_head_sees(lead: tuple[int, ...]) -> None:
    # Hq 4 over Hkv 2; NaN keys and values everywhere: what survives was seen, what was not is 0.
    visible = np.random.default_rng(1).random((*lead, 3, 6)) < 0.25
    k = jnp.full((2, 6, 2, 3), jnp.nan)
    zk, zv = zero_unseen_keys(visible, k, k + 1)
    grid = np.broadcast_to(visible.reshape((1,) * (4 - visible.ndim) + visible.shape), (2, 4, 3, 6))
    seen = grid.reshape(2, 2, 2, 3, 6).any(axis=(2, 3)).transpose(0, 2, 1)  # (B, S, Hkv)
    for z in (zk, zv):
        assert np.isnan(np.asarray(z)[seen]).all() and not np.asarray(z)[~seen].any()
