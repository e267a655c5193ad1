"""A valid tiny ``softmax_scale`` (below float32's smallest normal, ~1.2e-38) gives the oracle's
numbers, never NaN: the plain-JAX kernels keep the scale out of the logits until the max is
subtracted, and a factor that small flushes to zero, where a hidden key's ``-inf * 0`` was NaN.
Eagerly and under jit, forward and gradients, full, causal and over a cache with lengths; and
"auto", which picks blockwise for float16 on a CPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle
from jaxattn.testing.compare import to_float64

CASES = [  # impl, T, causal, with kv_lengths, scale (a float32 subnormal, or 0 in float32), dtype
    ("vanilla", 5, True, False, 1e-39, "float32"), ("vanilla", 5, False, True, 1e-300, "float32"),
    ("blockwise", 5, False, False, 1e-38, "float32"), ("blockwise", 5, True, False, 1e-300, "float32"),
    ("blockwise", 5, False, True, 1e-45, "float32"),
    ("autoregressive_decodeattn", 1, False, True, 1e-39, "float32"),
    ("auto", 5, True, False, 1e-38, "float16"), ("auto", 5, False, False, 1e-300, "float16"),
]


@pytest.mark.parametrize(("impl", "t", "causal", "lengths", "scale", "dtype"), CASES)
def test_tiny_softmax_scale(impl: str, t: int, causal: bool, lengths: bool, scale: float, dtype: str) -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), dtype)
    k = jnp.asarray(rng.standard_normal((2, 7, 2, 8)), dtype)
    v = jnp.asarray(rng.standard_normal((2, 7, 2, 8)), dtype)
    kv_lengths = jnp.asarray([7, 4], jnp.int32) if lengths else None
    blocks = jaxattn.AttentionMetadata(block_q=2, block_k=3)  # several tiles, padded ones too

    def f(q: Any, k: Any, v: Any) -> Any:
        return jaxattn.attention(q, k, v, impl=impl, causal=causal, softmax_scale=scale, kv_lengths=kv_lengths,
                                 metadata=blocks)

    want = oracle.attention(q, k, v, causal=causal, softmax_scale=scale, kv_lengths=kv_lengths).output
    tol = 2e-3 if dtype == "float16" else 1e-5
    for label, out in (("eager", f(q, k, v)), ("jit", jax.jit(f)(q, k, v))):
        got = to_float64(out)
        assert np.isfinite(got).all(), f"{label}: NaN or Inf"
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=label)
    if impl == "autoregressive_decodeattn":
        return  # forward-only
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)
    for name, g in zip("qkv", grads, strict=True):
        assert np.isfinite(to_float64(g)).all(), f"d{name}: NaN or Inf"
