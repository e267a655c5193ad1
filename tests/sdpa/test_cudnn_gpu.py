"""cuDNN's own answers for the translations the conformance matrix does not reach (GPU only).

The default matrix never takes cuDNN's native sliding window (its windows have T != S or a
right edge) nor the sequence-length path (segment ids are traced under jit there). These
run eagerly and under jit through ``impl="cudnn"`` and are checked against the oracle.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle
from jaxattn.testing.cases import DEFAULT_TOLERANCES
from jaxattn.testing.compare import assert_close

from ._devices import ON_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")]


def make(b: int, t: int, s: int, hq: int, hkv: int, d: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731
    return {"q": as_bf16(rng.normal(size=(b, t, hq, d))), "k": as_bf16(rng.normal(size=(b, s, hkv, d))),
            "v": as_bf16(rng.normal(size=(b, s, hkv, d))), "do": rng.normal(size=(b, t, hq, d))}


def run_and_check(x: dict[str, np.ndarray], grads: bool, **features: Any) -> None:
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    ref_kw: dict[str, Any] = {n: np.asarray(a) if hasattr(a, "shape") else a for n, a in features.items()}
    tol = DEFAULT_TOLERANCES["bfloat16"]
    out = jaxattn.attention(q, k, v, impl="cudnn", **features)
    assert_close("eager output", out, oracle.attention(x["q"], x["k"], x["v"], **ref_kw).output, tol.forward)
    if not grads:
        return

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = jaxattn.attention(q, k, v, impl="cudnn", **features)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(x["do"], jnp.float32))

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], **ref_kw)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
        assert_close(name, got, want, tol.grad)


@pytest.mark.parametrize("window", [(15, 0), (15, 7)])
def test_native_causal_sliding_window(window: tuple[int, int]) -> None:
    run_and_check(make(2, 128, 128, 8, 2, 64), grads=True, causal=True, sliding_window=window)


@pytest.mark.parametrize(("t", "s"), [(64, 192), (1, 257), (96, 64)])
def test_bottom_right_causal(t: int, s: int) -> None:
    x = make(2, t, s, 4, 4, 64)
    run_and_check(x, grads=t % 2 == 0 and s % 2 == 0 and t <= s, causal=True)
    if t > s:  # the first T - S queries see no key: cuDNN's gradient would be NaN, so it is refused
        q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
        with pytest.raises(jaxattn.UnsupportedError, match="see no key"):
            jax.grad(lambda q: jaxattn.attention(q, k, v, impl="cudnn", causal=True).astype(jnp.float32).sum())(q)


def test_padding_segments_as_sequence_lengths() -> None:
    q_ids = np.zeros((2, 128), np.int32)
    kv_ids = np.zeros((2, 128), np.int32)
    q_ids[0, 100:], kv_ids[0, 90:] = 1, 2  # row 0: 100 real queries, 90 real keys
    run_and_check(make(2, 128, 128, 4, 4, 64), grads=False, causal=True, q_segment_ids=q_ids,
                  kv_segment_ids=kv_ids)


@pytest.mark.parametrize("s", [127, 128])
def test_sinks(s: int) -> None:
    aux = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    run_and_check(make(1, s, s, 4, 2, 64), grads=s % 2 == 0, causal=True, softmax_aux=aux)


def test_batched_bias_forward_and_key_padding_mask() -> None:
    rng = np.random.default_rng(1)
    bias = np.asarray(jnp.asarray(rng.normal(size=(2, 1, 64, 64)), jnp.bfloat16).astype(jnp.float32))
    mask = rng.random((2, 1, 1, 64)) > 0.2
    run_and_check(make(2, 64, 64, 4, 4, 64), grads=False, bias=jnp.asarray(bias, jnp.bfloat16), mask=mask)


def test_issue_odd_lengths_gradient_through_auto_and_explicit_cudnn() -> None:
    """The reported case: B=2, T=S=333, Hq=8, Hkv=2, D=128, bf16, causal, differentiated.

    auto's backward is one that can take odd lengths (never cuDNN's: its forward with another
    backward, or a forward that differentiates itself, as mosaic_flash does); impl="cudnn" raises
    UnsupportedError with the reason instead of cuDNN's raw NotImplementedError.
    """
    x = make(2, 333, 333, 8, 2, 128)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    exp = jaxattn.explain(q, k, v, causal=True)
    chosen = next(c for c in exp.candidates if c.chosen)
    differentiated_by = chosen.grad_impl or chosen.name
    assert differentiated_by != "cudnn", str(exp)

    def loss(impl: str) -> Any:
        def f(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            out = jaxattn.attention(q, k, v, impl=impl, causal=True)
            return jnp.sum(out.astype(jnp.float32) * jnp.asarray(x["do"], jnp.float32))
        return f

    dq, dk, dv = jax.jit(jax.grad(loss("auto"), argnums=(0, 1, 2)))(q, k, v)
    ref = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], causal=True)
    tol = DEFAULT_TOLERANCES["bfloat16"]
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
        assert_close(name, got, want, tol.grad)
    with pytest.raises(jaxattn.UnsupportedError, match="needs even T and S") as info:
        jax.grad(loss("cudnn"))(q, k, v)
    assert info.value.gradient


# -- kv_lengths: decode over a dense cache (lengths traced under jit, as a server runs them) ----


def check_kv_lengths(x: dict[str, np.ndarray], lengths: np.ndarray, grads: bool, **features: Any) -> None:
    """Eager, then jitted with traced lengths; cuDNN must run it (its custom call in the program)."""
    run_and_check(x, grads=grads, kv_lengths=lengths, **features)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    run = jax.jit(lambda q, k, v, n: jaxattn.attention(q, k, v, impl="cudnn", kv_lengths=n, **features))
    n = jnp.asarray(lengths, jnp.int32)
    assert "__cudnn$fmha" in run.lower(q, k, v, n).as_text()
    ref_kw = {name: np.asarray(a) if hasattr(a, "shape") else a for name, a in features.items()}
    want = oracle.attention(x["q"], x["k"], x["v"], kv_lengths=lengths, **ref_kw).output
    assert_close("jit output", run(q, k, v, n), want, DEFAULT_TOLERANCES["bfloat16"].forward)


@pytest.mark.parametrize("causal", [True, False])
def test_kv_lengths_decode_step(causal: bool) -> None:
    """T = 1: cuDNN's kv_seqlen (PADDING); the empty sequence must come out as zeros."""
    lengths = np.array([1, 77, 256, 0], np.int32)
    check_kv_lengths(make(4, 1, 256, 8, 2, 128), lengths, grads=False, causal=causal)


def test_kv_lengths_speculative_decode() -> None:
    """T = 3, causal per sequence (a per-sequence mask); length 2 < T leaves query 0 without keys."""
    lengths = np.array([2, 3, 130, 256], np.int32)
    check_kv_lengths(make(4, 3, 256, 8, 2, 128), lengths, grads=False, causal=True)


def test_kv_lengths_gradient_with_empty_rows() -> None:
    """T = 4 (even, so cuDNN's backward runs): rows before the cache's start get zero gradients."""
    lengths = np.array([2, 0, 131, 256], np.int32)
    check_kv_lengths(make(4, 4, 256, 8, 2, 128), lengths, grads=True, causal=True)


def test_kv_lengths_decode_with_sinks_and_window() -> None:
    aux = np.array([0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 0.25, 3.0], np.float32)
    lengths = np.array([5, 200, 0, 256], np.int32)
    check_kv_lengths(make(4, 1, 256, 8, 2, 128), lengths, grads=False, causal=True, softmax_aux=aux)
    check_kv_lengths(make(4, 1, 256, 8, 2, 128), lengths, grads=False, causal=True, sliding_window=(31, 0))


# -- cuDNN's backward fed residuals it did not compute (ring attention's `cudnn` block kernel) --


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cudnn_backward_from_its_own_residuals_is_the_gradient(causal: bool) -> None:
    from jaxattn_sdpa.residual import cudnn_backward

    x = make(2, 256, 256, 8, 2, 128)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    do = jnp.asarray(x["do"], jnp.bfloat16)
    out, lse = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn", return_residual=True)
    grads = jax.jit(functools.partial(cudnn_backward, causal=causal))(q, k, v, out, jnp.swapaxes(lse, 1, 2), do)
    ref = oracle.attention_backward(x["q"], x["k"], x["v"], np.asarray(do.astype(jnp.float32), np.float64),
                                    causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv), strict=True):
        assert_close(name, got, want, DEFAULT_TOLERANCES["bfloat16"].grad)


def test_cudnn_backward_at_global_residuals_is_each_key_blocks_share() -> None:
    # Causal T = S = 512 cut as a ring of two cuts it: queries 0..255 see key block 0 (causal);
    # queries 256..511 see key block 0 whole and key block 1 (causal). Each piece's backward at
    # the *whole* attention's output and lse; the pieces add up to the whole gradient.
    from jaxattn_sdpa.residual import cudnn_backward

    x = make(1, 512, 512, 8, 2, 128, seed=4)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    do = jnp.asarray(x["do"], jnp.bfloat16)
    whole = oracle.attention(x["q"], x["k"], x["v"], causal=True)
    out, lse = jnp.asarray(whole.output, jnp.bfloat16), jnp.asarray(whole.lse, jnp.float32)
    h = 256

    @jax.jit
    def pieces(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, do: jax.Array) -> Any:
        top = cudnn_backward(q[:, :h], k[:, :h], v[:, :h], out[:, :h], lse[..., :h], do[:, :h], causal=True)
        left = cudnn_backward(q[:, h:], k[:, :h], v[:, :h], out[:, h:], lse[..., h:], do[:, h:])
        diag = cudnn_backward(q[:, h:], k[:, h:], v[:, h:], out[:, h:], lse[..., h:], do[:, h:], causal=True)
        f32 = [[g.astype(jnp.float32) for g in piece] for piece in (top, left, diag)]
        dq = jnp.concatenate([f32[0][0], f32[1][0] + f32[2][0]], axis=1)
        dk = jnp.concatenate([f32[0][1] + f32[1][1], f32[2][1]], axis=1)
        dv = jnp.concatenate([f32[0][2] + f32[1][2], f32[2][2]], axis=1)
        return dq, dk, dv

    grads = pieces(q, k, v, out, lse, do)
    ref = oracle.attention_backward(x["q"], x["k"], x["v"], np.asarray(do.astype(jnp.float32), np.float64),
                                    causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv), strict=True):
        assert_close(name, got, want, DEFAULT_TOLERANCES["bfloat16"].grad)
