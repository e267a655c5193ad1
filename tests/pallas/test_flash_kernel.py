"""The Pallas flash kernel adapter on shapes the conformance matrix does not reach.

Several query and key tiles (explicit block sizes), lengths that are not tile multiples,
the front-padded causal path (1 < T < S, no bias), grouped heads folded into query rows
with segment ids, and a bias of -inf. Interpret mode, against the float64 oracle.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.testing import oracle
from jaxattn_pallas.flash.kernel import flash_attention


def _inputs(b: int, t: int, s: int, hq: int, hkv: int, d: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q": rng.standard_normal((b, t, hq, d)),
        "k": rng.standard_normal((b, s, hkv, d)),
        "v": rng.standard_normal((b, s, hkv, d)),
        "d_output": rng.standard_normal((b, t, hq, d)),
    }


def _check(x: dict[str, np.ndarray], blocks: dict[str, int] | None, grad: bool, **features: Any) -> None:
    extra = {n: jnp.asarray(a) for n, a in features.items() if isinstance(a, np.ndarray)}
    static = {n: a for n, a in features.items() if not isinstance(a, np.ndarray)}
    scale = x["q"].shape[-1] ** -0.5

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return flash_attention(q, k, v, softmax_scale=scale, block_sizes=blocks, interpret=True, **static, **extra)

    q, k, v = (jnp.asarray(x[n], jnp.float32) for n in "qkv")
    ref = oracle.attention(x["q"], x["k"], x["v"], softmax_scale=scale, **features)
    np.testing.assert_allclose(np.asarray(jax.jit(run)(q, k, v)), ref.output, atol=2e-5, rtol=1e-4)
    if grad:
        d_out = jnp.asarray(x["d_output"], jnp.float32)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(q, k, v) * d_out), argnums=(0, 1, 2)))(q, k, v)
        want = oracle.attention_backward(x["q"], x["k"], x["v"], x["d_output"], softmax_scale=scale, **features)
        for got, expected in zip(grads, (want.dq, want.dk, want.dv), strict=True):
            np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-4)


def test_causal_chunk_front_padded_over_several_tiles() -> None:
    # T < S without a bias: S - T dummy query rows put the kernel's diagonal bottom-right;
    # 300 keys pad to 3 key tiles, 260 + 40 rows to 3 query tiles.
    x = _inputs(b=1, t=40, s=300, hq=4, hkv=2, d=32)
    _check(x, {"block_q": 128, "block_k": 128}, grad=True, causal=True)


def test_folded_groups_with_segments_over_several_tiles() -> None:
    # MQA, no in-kernel causal: the 4 query heads become 4 * 130 rows of the one kv head;
    # padded keys get a segment no query has.
    x = _inputs(b=2, t=130, s=200, hq=4, hkv=1, d=16, seed=1)
    rng = np.random.default_rng(2)
    q_ids = np.sort(rng.integers(0, 3, (2, 130)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 3, (2, 200)), axis=1).astype(np.int32)
    _check(x, {"block_q": 256, "block_k": 128}, grad=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def test_minus_inf_bias_empties_rows_like_the_oracle() -> None:
    x = _inputs(b=1, t=12, s=20, hq=2, hkv=2, d=8, seed=3)
    bias = np.random.default_rng(4).standard_normal((1, 2, 12, 20))
    bias[:, :, 3, :] = -np.inf  # row 3 sees nothing: zeros, not the kernel's average
    bias[:, :, 5, 7:] = -np.inf
    _check(x, None, grad=False, bias=bias, causal=True)
