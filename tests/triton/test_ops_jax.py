"""The JAX entry point (``ops.flash_attention``): custom VJP wiring, through the interpreter.

``interpret=True`` sends each launch through ``jax.pure_callback`` to the Triton
interpreter, so what is checked here is exactly the GPU path minus ``triton_call``:
the residuals, the preprocess/dK-dV/dQ launches, the bias and sink gradient reductions,
the gradient through the returned log-sum-exp, and jit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.testing import oracle
from jaxattn_triton.flash.launch import DQ_ATOMIC, KernelTiles, Tiles
from jaxattn_triton.flash.ops import flash_attention, flash_attention_backward

from ._env import needs_interpreter

pytestmark = [
    needs_interpreter,
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]

B, T, S, HQ, HKV, D = 1, 20, 36, 4, 2, 16


def _arrays(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    f32 = jnp.float32
    return {
        "q": jnp.asarray(rng.standard_normal((B, T, HQ, D)), f32),
        "k": jnp.asarray(rng.standard_normal((B, S, HKV, D)), f32),
        "v": jnp.asarray(rng.standard_normal((B, S, HKV, D)), f32),
        "bias": jnp.asarray(rng.standard_normal((HQ, 1, S)), f32),  # rank 3: broadcast
        "sinks": jnp.asarray(rng.standard_normal(HQ), f32),
        "dout": jnp.asarray(rng.standard_normal((B, T, HQ, D)), f32),
        "dlse": jnp.asarray(rng.standard_normal((B, HQ, T)), f32),
    }


def _reference(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Plain jnp attention (causal, bias, sinks) whose autodiff is the independent check."""
    g = HQ // HKV
    kk, vv = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
    x = jnp.einsum("bthd,bshd->bhts", q, kk) * D**-0.5 + bias
    visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
    x = jnp.where(visible, x, -jnp.inf)
    lse = jax.nn.logsumexp(x, axis=-1)
    total = jnp.logaddexp(lse, sinks[None, :, None])
    out = jnp.einsum("bhts,bshd->bthd", jnp.exp(x - total[..., None]), vv)
    return out, lse


def _ours(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
    return flash_attention(q, k, v, bias=bias, causal=True, softmax_aux=sinks, interpret=True)


def test_gradients_through_output_and_lse_match_autodiff() -> None:
    a = _arrays()

    def loss(fn: Any) -> Any:
        def f(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array) -> Any:
            out, lse = fn(q, k, v, bias, sinks)
            return jnp.sum(out * a["dout"]) + jnp.sum(lse * a["dlse"])

        return f

    args = (a["q"], a["k"], a["v"], a["bias"], a["sinks"])
    got = jax.jit(jax.grad(loss(_ours), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.grad(loss(_reference), argnums=(0, 1, 2, 3, 4))(*args)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-4, err_msg=name)


def test_gradients_with_atomic_dq_match_autodiff() -> None:
    # dQ accumulated in float32 by the dK/dV kernel, scaled and cast by the JAX side.
    a = _arrays(4)
    kt = KernelTiles(16, 16, 4, 1)
    tiles = Tiles(kt, kt, kt, dq_mode=DQ_ATOMIC, dkdv_split=True)

    def loss(fn: Any) -> Any:
        def f(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array) -> Any:
            out, lse = fn(q, k, v, bias, sinks)
            return jnp.sum(out * a["dout"]) + jnp.sum(lse * a["dlse"])

        return f

    def ours(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array) -> Any:
        return flash_attention(q, k, v, bias=bias, causal=True, softmax_aux=sinks, tiles=tiles, interpret=True)

    args = (a["q"], a["k"], a["v"], a["bias"], a["sinks"])
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.grad(loss(_reference), argnums=(0, 1, 2, 3, 4))(*args)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-4, err_msg=name)


def test_forward_matches_oracle_under_jit_with_custom_tiles() -> None:
    a = _arrays(1)
    tiles = Tiles(KernelTiles(16, 32, 4, 1), KernelTiles(16, 16, 4, 1), KernelTiles(32, 16, 4, 1))

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return flash_attention(q, k, v, sliding_window=(4, 2), tiles=tiles, interpret=True)

    out, lse = run(a["q"], a["k"], a["v"])
    ref = oracle.attention(np.asarray(a["q"]), np.asarray(a["k"]), np.asarray(a["v"]), sliding_window=(4, 2))
    np.testing.assert_allclose(np.asarray(out), ref.output, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref.lse, atol=2e-5, rtol=2e-5)


def test_integer_inputs_get_no_cotangent() -> None:
    # Masks and segment ids are integers: differentiating q must not ask for their gradient.
    a = _arrays(2)
    rng = np.random.default_rng(3)
    mask = jnp.asarray(rng.random((B, 1, T, S)) > 0.2)
    qs = jnp.asarray(np.repeat([[0, 1]], T // 2, axis=1), jnp.int32)
    ks = jnp.asarray(np.sort(rng.integers(0, 2, (B, S)), axis=1), jnp.int32)

    def f(q: jax.Array) -> jax.Array:
        out, _ = flash_attention(q, a["k"], a["v"], mask=mask, q_segment_ids=qs, kv_segment_ids=ks, interpret=True)
        return jnp.sum(out * a["dout"])

    dq = jax.grad(f)(a["q"])
    want = oracle.attention_backward(
        np.asarray(a["q"]),
        np.asarray(a["k"]),
        np.asarray(a["v"]),
        np.asarray(a["dout"]),
        mask=np.asarray(mask),
        q_segment_ids=np.asarray(qs),
        kv_segment_ids=np.asarray(ks),
    ).dq
    np.testing.assert_allclose(np.asarray(dq), want, atol=2e-5, rtol=2e-4)


def test_one_segment_array_is_rejected() -> None:
    a = _arrays()
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
        flash_attention(a["q"], a["k"], a["v"], q_segment_ids=jnp.zeros((B, T), jnp.int32), interpret=True)


def test_backward_from_residuals_at_global_statistics_splits_over_key_blocks() -> None:
    # What ring attention does: each block of keys gets the backward kernels alone, fed the whole
    # attention's output and lse; the blocks' dq add up and their dk, dv are the whole's slices.
    a = _arrays(5)
    rng = np.random.default_rng(6)
    mask = rng.random((B, 1, T, S)) > 0.3
    mask[:, :, 3] = False  # a row with nothing visible: zero gradients, never NaN
    features = {"softmax_scale": 0.3, "logits_soft_cap": 4.0}
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    out, lse = flash_attention(q, k, v, mask=jnp.asarray(mask), interpret=True, **features)
    zero = jnp.zeros_like(lse)
    half = S // 2
    parts = [flash_attention_backward(q, k[:, sl], v[:, sl], out, lse, dout, zero, mask=jnp.asarray(mask[..., sl]),
                                      interpret=True, **features)
             for sl in (slice(0, half), slice(half, S))]
    got = (parts[0][0] + parts[1][0], jnp.concatenate([parts[0][1], parts[1][1]], axis=1),
           jnp.concatenate([parts[0][2], parts[1][2]], axis=1))
    want = oracle.attention_backward(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(dout), mask=mask,
                                     **features)
    for name, g, w in zip(("dq", "dk", "dv"), got, (want.dq, want.dk, want.dv), strict=True):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-4, err_msg=name)


def test_backward_from_its_own_residuals_is_the_vjp() -> None:
    # Fed its own forward's output and lse, with an lse cotangent too, it is the custom VJP's backward.
    a = _arrays(7)
    q, k, v = a["q"], a["k"], a["v"]
    (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True), q, k, v)
    want = vjp((a["dout"], a["dlse"]))
    got = flash_attention_backward(q, k, v, out, lse, a["dout"], a["dlse"], causal=True, interpret=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-6, err_msg=name)
