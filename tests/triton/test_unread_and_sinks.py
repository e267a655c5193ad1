"""The Triton backends where the contract promises no NaN, in the interpreter, against the oracle.

* infinite sinks (``+inf`` zeroes the head, with zero gradients; ``-inf`` is no sink) through
  ``flash_attn2``, ``autoregressive_decodeattn`` and the ragged paged kernel;
* a dense cache poisoned past ``kv_lengths``: the split-K forward skips those keys, and the
  flash backward it is differentiated with gets zeros there (its gradients were NaN);
* a query at a negative position (T > ``kv_lengths[b]``) gives zeros, causal or not;
* a paged pool poisoned wherever no query reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.testing import oracle

from ._env import needs_interpreter
from .test_conformance import InterpretedTritonFlash
from .test_serving_conformance import InterpretedDecode, InterpretedRaggedPaged

pytestmark = [
    needs_interpreter,
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

# flash_attn2 in float32; the decode kernel multiplies in TF32 on a GPU, so it takes 16-bit inputs.
DENSE = {"flash_attn2": (InterpretedTritonFlash, np.float32, 1e-5), "decode": (InterpretedDecode, np.float16, 3e-3)}


def _qkv(b: int, t: int, s: int, dtype: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=shape).astype(dtype) for shape in ((b, t, 4, 16), (b, s, 2, 16), (b, s, 2, 16))]


def _close(got: Any, want: np.ndarray, tol: float) -> None:
    got64 = np.asarray(got, np.float64)
    assert np.isfinite(got64).all()
    np.testing.assert_allclose(got64, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", DENSE)
def test_infinite_sinks(name: str) -> None:
    cls, dtype, tol = DENSE[name]
    impl = cls()
    q, k, v = _qkv(2, 1, 7, dtype)
    aux = np.array([np.inf, 0.5, -np.inf, 1.0], np.float32)
    want = oracle.attention(q, k, v, causal=True, softmax_aux=aux)
    grads = oracle.attention_backward(q, k, v, np.ones(q.shape), causal=True, softmax_aux=aux)

    def loss(q: Any, aux: Any) -> Any:
        return jnp.sum(impl(q, jnp.asarray(k), jnp.asarray(v), causal=True, softmax_aux=aux)
                       .attention_outputs.astype(jnp.float32))

    _close(impl(*map(jnp.asarray, (q, k, v)), causal=True, softmax_aux=jnp.asarray(aux)).attention_outputs,
           want.output, tol)
    dq, daux = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(aux))
    _close(dq, grads.dq, tol)
    assert grads.dsoftmax_aux is not None
    _close(daux, grads.dsoftmax_aux, tol)


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("name", DENSE)
def test_cache_poisoned_past_the_lengths_and_queries_before_the_start(name: str, t: int) -> None:
    cls, dtype, tol = DENSE[name]
    impl = cls()
    q, k, v = _qkv(3, t, 8, dtype)
    lengths = np.array([2, 0, 8], np.int32)  # with T = 4, sequence 0's first two queries sit at -2, -1
    kp, vp = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        kp[b, n:] = np.nan
        vp[b, n:] = np.nan
    if impl.supports(q, k, v, kv_lengths=lengths, needs_grad=True):
        pytest.skip(f"{name} declines kv_lengths with T={t}")
    want = oracle.attention(q, k, v, kv_lengths=lengths)
    grads = oracle.attention_backward(q, k, v, np.ones(q.shape), kv_lengths=lengths)

    def run(q: Any, k: Any, v: Any) -> Any:
        return impl(q, k, v, kv_lengths=jnp.asarray(lengths)).attention_outputs

    _close(run(*map(jnp.asarray, (q, kp, vp))), want.output, tol)
    got = jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32)), argnums=(0, 1, 2))(*map(jnp.asarray, (q, kp, vp)))
    for g, w in zip(got, (grads.dq, grads.dk, grads.dv), strict=True):
        _close(g, w, 2 * tol)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "infinite-sinks"])
def test_ragged_paged_poisoned_pool(sinks: bool) -> None:
    rng = np.random.default_rng(0)
    k, v = (rng.normal(size=(10, 4, 2, 16)).astype(np.float16) for _ in range(2))
    table, lengths = np.array([[3, 1, 7], [5, 2, 8]], np.int32), np.array([6, 3], np.int32)
    kp, vp = k.copy(), v.copy()
    for x in (kp, vp):
        x[[7, 2, 8, 0]] = np.nan  # listed past a last page, or unused
        x[1, 2:] = np.nan  # sequence 0's last page, past its 6 tokens
        x[5, 3:] = np.nan  # sequence 1's, past its 3
    q, cu = rng.normal(size=(5, 4, 16)).astype(np.float16), np.array([0, 3, 5], np.int32)
    aux = np.array([np.inf, 0.5, -np.inf, 1.0], np.float32) if sinks else None
    want = oracle.paged_attention(q, k, v, table, lengths, cu, np.array([2]), softmax_aux=aux)
    extra = {} if aux is None else {"softmax_aux": jnp.asarray(aux)}
    got = InterpretedRaggedPaged()(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
                                   jnp.asarray(lengths), cu_q_lens=jnp.asarray(cu),
                                   num_seqs=jnp.asarray([2], jnp.int32), **extra).attention_outputs
    _close(got, want, 3e-3)
