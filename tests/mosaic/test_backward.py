"""``jaxattn_mosaic.backward`` on a CPU, with stand-ins for the two GPU kernels it joins.

Mosaic GPU and cuDNN do not run here; what this checks is the module's own algebra: a
forward's residuals handed to a flash backward that, as cuDNN's, takes *no* lse cotangent,
and the exact lse terms added at run time when a loss uses the lse. The stand-ins: the
vanilla impl's forward (with its lse) for mosaic's, and jaxattn-vanilla's blockwise backward
with its lse cotangent dropped for cuDNN's. The GPU run (tests/mosaic/test_gpu.py) checks
the real pair against the oracle.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle
from jaxattn.testing.cases import Tolerance
from jaxattn.testing.compare import assert_close


@pytest.fixture
def backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    import jaxattn_sdpa.residual
    from jaxattn_mosaic.backward import with_cudnn_backward
    from jaxattn_vanilla.blockwise.kernel import blockwise_backward

    def cudnn_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, *, causal: bool,
                       softmax_scale: float) -> Any:  # no lse cotangent, as cuDNN's
        return blockwise_backward(q, k, v, out, lse, d_out, None, causal=causal, softmax_scale=softmax_scale)

    monkeypatch.setattr(jaxattn_sdpa.residual, "cudnn_backward", cudnn_backward)

    def make(causal: bool, scale: float) -> Any:
        def forward(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
            res = jaxattn.get_impl("vanilla")(q, k, v, causal=causal, softmax_scale=scale)
            return res.attention_outputs, res.softmax_lse

        return with_cudnn_backward(forward, causal=causal, softmax_scale=scale)

    return make


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("through_lse", [False, True], ids=["output", "output-and-lse"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_against_the_oracle(backward_on_cpu: Any, causal: bool, through_lse: bool, jit: bool) -> None:
    rng = np.random.default_rng(7)
    b, t, hq, hkv, d, scale = 2, 24, 4, 2, 8, 0.3
    q, k, v = (rng.normal(size=(b, t, h, d)) for h in (hq, hkv, hkv))
    do = rng.normal(size=(b, t, hq, d))
    weights = rng.normal(size=(b, hq, t)) if through_lse else np.zeros((b, hq, t))
    attend = backward_on_cpu(causal, scale)

    def loss(q: Any, k: Any, v: Any) -> Any:
        out, lse = attend(q, k, v)
        return (out * jnp.asarray(do, jnp.float32)).sum() + (lse * jnp.asarray(weights, jnp.float32)).sum()

    def want(q: Any, k: Any, v: Any) -> Any:  # plain float64 attention, differentiated by jax
        k, v = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))
        logits = scale * jnp.einsum("bthd,bshd->bhts", q, k)
        if causal:
            logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = jnp.einsum("bhts,bshd->bthd", jnp.exp(logits - lse[..., None]), v)
        return (out * jnp.asarray(do, jnp.float64)).sum() + (lse * jnp.asarray(weights, jnp.float64)).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    with jax.default_matmul_precision("highest"):
        got = (jax.jit(grad) if jit else grad)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    with jax.enable_x64():
        ref = jax.grad(want, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    if not through_lse:  # the reference itself, where the oracle has gradients: the output's
        oracle_dq = oracle.attention_backward(q, k, v, do, causal=causal, softmax_scale=scale).dq
        np.testing.assert_allclose(np.asarray(ref[0]), oracle_dq, rtol=1e-9, atol=1e-9)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert_close(name, g, np.asarray(r), Tolerance(atol=2e-5, rtol=2e-5))
