"""The splash adapter on shapes the conformance matrix does not reach: several query and
key tiles, lengths that are not tile multiples, and both batch paths (the batch folded into
the heads; one kernel per batch element, with segment ids). Interpret mode, against the
float64 oracle, forward and gradients."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.testing import oracle
from jaxattn_splash.kernel import splash_attention

TILES = {"block_q": 128, "block_k": 128}


def _check(b: int, t: int, s: int, hq: int, hkv: int, seed: int, **features: Any) -> None:
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal(shape) for n, shape in
         (("q", (b, t, hq, 128)), ("k", (b, s, hkv, 128)), ("v", (b, s, hkv, 128)), ("do", (b, t, hq, 128)))}
    arrays = {n: a for n, a in features.items() if isinstance(a, np.ndarray)}
    static = {n: a for n, a in features.items() if n not in arrays}
    scale = 128**-0.5

    fixed = {n: jnp.asarray(a) for n, a in arrays.items() if n != "softmax_aux"}

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, aux: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out = splash_attention(
            q, k, v, softmax_scale=scale, block_sizes=TILES, interpret=True, **static, **fixed, **aux
        )
        return jnp.sum(out * jnp.asarray(x["do"], jnp.float32)), out

    q, k, v = (jnp.asarray(x[n], jnp.float32) for n in "qkv")
    aux = {n: jnp.asarray(a) for n, a in arrays.items() if n == "softmax_aux"}
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, aux)

    ref = oracle.attention(x["q"], x["k"], x["v"], softmax_scale=scale, **features)
    np.testing.assert_allclose(np.asarray(out), ref.output, atol=2e-5, rtol=1e-4)
    want = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], softmax_scale=scale, **features)
    for got, expected in zip(grads[:3], (want.dq, want.dk, want.dv), strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-4)
    if "softmax_aux" in aux:
        np.testing.assert_allclose(np.asarray(grads[3]["softmax_aux"]), want.dsoftmax_aux, atol=1e-4, rtol=1e-4)


def test_segments_window_gqa_over_several_tiles() -> None:
    rng = np.random.default_rng(7)
    q_ids = np.sort(rng.integers(0, 3, (2, 200)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 3, (2, 300)), axis=1).astype(np.int32)
    _check(2, 200, 300, 4, 2, seed=1, causal=True, sliding_window=(150, 0),
           q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def test_batch_folded_into_heads_with_sinks_and_soft_cap_over_several_tiles() -> None:
    sinks = np.random.default_rng(8).standard_normal(4).astype(np.float32)
    _check(2, 130, 260, 4, 1, seed=2, causal=True, softmax_aux=sinks, logits_soft_cap=2.0)
