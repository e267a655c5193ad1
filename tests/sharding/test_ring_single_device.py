"""ring's declarations, declines and layouts, on this process' single device (a ring of one)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxattn
from jaxattn.testing import oracle
from jaxattn_ring import RingAttention
from jaxattn_ring.layout import positions, zigzag_permutation


def ring_of_one(**extra: Any) -> jaxattn.AttentionMetadata:
    return jaxattn.AttentionMetadata(mesh=Mesh(np.array(jax.devices()[:1]), ("seq",)), sequence_axis="seq",
                                     extra=extra)


Q = jax.ShapeDtypeStruct((2, 16, 4, 8), np.float32)


def test_ring_is_registered_for_every_platform() -> None:
    rows = {r.name: r for r in jaxattn.list_impls()}
    assert rows["ring"].platforms == ("cpu", "gpu", "tpu")
    assert rows["ring"].distribution == "jaxattn-ring"
    assert rows["ring"].usable_here


def test_without_a_sequence_axis_ring_declines() -> None:
    reasons = jaxattn.get_impl("ring").supports(Q, Q, Q)
    assert any("set AttentionMetadata(mesh=..., sequence_axis=...)" in r for r in reasons)


@pytest.mark.parametrize(("features", "expected"), [
    ({"bias": jnp.zeros((1, 4, 16, 16))}, "an additive bias is not supported by ring"),
    ({"dropout_prob": 0.1, "dropout_rng": jax.random.key(0)}, "dropout is not supported by ring"),
])
def test_declined_features_say_why(features: dict[str, Any], expected: str) -> None:
    assert expected in jaxattn.get_impl("ring", ring_of_one()).supports(Q, Q, Q, **features)


def test_the_block_kernel_is_the_best_impl_here_that_returns_its_lse() -> None:
    # On a CPU, for a prefill-sized block: blockwise (priority 10, returns a differentiable lse);
    # sdpa's jax.nn path has no lse, vanilla ranks below blockwise. Blocks of T <= 16 queries
    # (Q's 16) go to autoregressive_decodeattn, which also returns its lse and ranks 60 there.
    ring = jaxattn.get_impl("ring", ring_of_one())
    assert isinstance(ring, RingAttention)
    long_q = jax.ShapeDtypeStruct((2, 64, 4, 8), np.float32)
    assert ring.block_kernel(long_q, long_q, long_q, causal=True).name() == "blockwise"
    assert ring.block_kernel(Q, Q, Q, causal=True).name() == "autoregressive_decodeattn"
    pinned = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="vanilla"))
    assert isinstance(pinned, RingAttention)
    assert pinned.block_kernel(Q, Q, Q, causal=True).name() == "vanilla"


def test_auto_tries_the_measured_candidates_first_and_says_why_not() -> None:
    from jaxattn.backend.problem import AttentionProblem
    from jaxattn_ring.blocks import CANDIDATES, choose_kernel

    assert CANDIDATES == ("cudnn", "flash_attn2", "mosaic_flash+blockwise", "cudnn+blockwise")
    problem = AttentionProblem.from_inputs(Q, Q, Q, causal=True)
    unrunnable = dataclasses.replace(problem, head_dim=1 << 20, head_dim_v=1 << 20)
    choice, reasons = choose_kernel(jaxattn.AttentionMetadata(), [unrunnable])
    assert choice is None
    tried = [r.split(":")[0] for r in reasons]
    assert tried[:4] == [f"block kernel {name}" for name in CANDIDATES], reasons
    assert "block kernel blockwise" in tried and "block kernel vanilla" in tried, reasons


def test_a_forward_paired_with_the_blockwise_backward() -> None:
    pinned = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="vanilla+blockwise"))
    assert isinstance(pinned, RingAttention)
    choice = pinned.block_kernel(Q, Q, Q, causal=True)
    assert choice.name() == "vanilla+blockwise" and choice.own_backward
    reasons = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="vanilla+sdpa")).supports(Q, Q, Q, causal=True)
    assert any("only 'blockwise' can be paired as a backward" in r for r in reasons), reasons


def test_a_block_kernel_without_lse_is_declined() -> None:
    reasons = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="sdpa")).supports(Q, Q, Q, causal=True)
    assert any("block kernel sdpa: does not return its log-sum-exp" in r for r in reasons), reasons


def test_unknown_layout_is_an_input_error() -> None:
    # The caller's option is wrong whoever would run the call: raised, not a reason to decline.
    with pytest.raises(jaxattn.InvalidInputError, match=r"'striped' is not one of \['zigzag', 'contiguous'\]"):
        jaxattn.get_impl("ring", ring_of_one(ring_layout="striped")).supports(Q, Q, Q, causal=True)


def test_a_ring_of_one_matches_the_oracle() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 16, 4, 8)).astype(np.float32) for _ in range(3))
    run = jax.jit(functools.partial(jaxattn.attention, impl="ring", causal=True, metadata=ring_of_one()))
    out = run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(out, oracle.attention(q, k, v, causal=True).output, atol=2e-5)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_gives_each_device_chunk_i_and_its_mirror(n: int) -> None:
    length = 4 * n
    perm = zigzag_permutation(length, n)
    assert sorted(perm) == list(range(length))
    local, c = length // n, length // (2 * n)
    for i in range(n):
        rows = perm[i * local:(i + 1) * local]
        assert list(rows) == [*range(i * c, (i + 1) * c), *range((2 * n - 1 - i) * c, (2 * n - i) * c)]
        np.testing.assert_array_equal(positions("zigzag", i, n, local), rows)
        # Causal work is balanced: every device's rows see the same number of keys in all.
    work = [sum(int(p) + 1 for p in perm[i * local:(i + 1) * local]) for i in range(n)]
    assert len(set(work)) == 1


def test_zigzag_needs_2n_chunks() -> None:
    with pytest.raises(ValueError, match="multiple of 2 \\* 4"):
        zigzag_permutation(12, 4)


def test_infinite_sinks_zero_their_heads_and_minus_inf_is_no_sink() -> None:
    """A +inf sink takes the whole mass (zeros, zero gradients); the blocks' lse merge would be inf - inf."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    aux = np.array([np.inf, 0.5, -np.inf, 1.0], np.float32)
    ring = jaxattn.get_impl("ring", ring_of_one())
    with jax.default_matmul_precision("highest"):
        out = ring(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, softmax_aux=jnp.asarray(aux))
        dq, daux = jax.grad(lambda q, a: jnp.sum(ring(q, jnp.asarray(k), jnp.asarray(v), causal=True, softmax_aux=a)
                                                 .attention_outputs), argnums=(0, 1))(jnp.asarray(q), jnp.asarray(aux))
    want = oracle.attention(q, k, v, causal=True, softmax_aux=aux)
    grads = oracle.attention_backward(q, k, v, np.ones(q.shape), causal=True, softmax_aux=aux)
    np.testing.assert_allclose(out.attention_outputs, want.output, atol=2e-5)
    np.testing.assert_allclose(dq, grads.dq, atol=2e-5)
    assert grads.dsoftmax_aux is not None
    np.testing.assert_allclose(daux, grads.dsoftmax_aux, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cudnn_forward_with_lse_and_the_blockwise_backward(causal: bool) -> None:
    # The code of ring's cudnn+blockwise kernel with jax.nn's XLA path standing in for cuDNN (no GPU
    # here): output, lse and the gradients through both against vanilla in float64.
    from jaxattn_ring.blocks import CudnnLseKernel

    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(2, 32, h, 8)) for h in (4, 2, 2))
    do, w = rng.normal(size=(2, 32, 4, 8)), rng.normal(size=(2, 4, 32))

    def loss(kernel: Any, dtype: Any) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            out, lse = kernel(q, k, v, causal=causal)
            return (out * jnp.asarray(do, dtype)).sum() + (lse * jnp.asarray(w, dtype)).sum(), (out, lse)
        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)

    kernel = CudnnLseKernel(jaxattn.get_impl("vanilla"), 0.3, None, implementation="xla")
    got, (out, lse) = jax.jit(loss(kernel, jnp.float32))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    with jax.enable_x64(True):
        vanilla = jaxattn.get_impl("vanilla")

        def reference(q: Any, k: Any, v: Any, causal: bool) -> Any:
            res = vanilla(q, k, v, causal=causal, softmax_scale=0.3)
            return res.attention_outputs, res.softmax_lse

        want, (out64, lse64) = loss(reference, jnp.float64)(*(jnp.asarray(x) for x in (q, k, v)))
        want, out64, lse64 = [np.asarray(g) for g in want], np.asarray(out64), np.asarray(lse64)
    np.testing.assert_allclose(np.asarray(out), out64, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), lse64, atol=2e-5)
    for g, g64 in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), g64, atol=5e-5)


def test_the_cudnn_pairing_is_declined_with_reasons_off_cuda() -> None:
    reasons = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="cudnn+blockwise")).supports(Q, Q, Q, causal=True)
    assert any("block kernel cudnn+blockwise: impl 'cudnn' runs on cuda" in r for r in reasons), reasons


def test_the_cudnn_kernel_is_declined_with_reasons_off_cuda() -> None:
    reasons = jaxattn.get_impl("ring", ring_of_one(ring_block_impl="cudnn")).supports(Q, Q, Q, causal=True)
    assert any("block kernel cudnn: impl 'cudnn' runs on cuda" in r for r in reasons), reasons


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_cudnn_kernel_routes_an_lse_cotangent_to_the_blockwise_backward(
        causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The code of ring's cudnn kernel with stand-ins for cuDNN (no GPU here): jax.nn's XLA forward,
    # and for cuDNN's residual backward the blockwise one *ignoring* the lse cotangent, as cuDNN's
    # does. Without an lse cotangent the stand-in runs (and is right); with one, the run-time
    # branch must take the blockwise backward, or the lse gradient goes missing.
    import jaxattn_sdpa.residual
    from jaxattn_ring.blocks import CudnnKernel
    from jaxattn_vanilla.blockwise.kernel import blockwise_backward

    traced = []

    def stand_in(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, *, causal: bool,
                 softmax_scale: float) -> Any:
        traced.append(causal)
        return blockwise_backward(q, k, v, out, lse, d_out, None, causal=causal, softmax_scale=softmax_scale)

    monkeypatch.setattr(jaxattn_sdpa.residual, "cudnn_backward", stand_in)
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(2, 32, h, 8)) for h in (4, 2, 2))
    do, w = rng.normal(size=(2, 32, 4, 8)), rng.normal(size=(2, 4, 32))
    kernel = CudnnKernel(jaxattn.get_impl("vanilla"), 0.3, None, implementation="xla")

    def reference(q: Any, k: Any, v: Any) -> Any:
        res = jaxattn.get_impl("vanilla")(q, k, v, causal=causal, softmax_scale=0.3)
        return res.attention_outputs, res.softmax_lse

    for lse_weight in (0.0, 1.0):
        def loss(q: Any, k: Any, v: Any, attend: Any, dtype: Any, lse_weight: float = lse_weight) -> Any:
            out, lse = attend(q, k, v)
            return (out * jnp.asarray(do, dtype)).sum() + lse_weight * (lse * jnp.asarray(w, dtype)).sum()

        got = jax.jit(jax.grad(functools.partial(loss, attend=functools.partial(kernel, causal=causal),
                                                 dtype=jnp.float32), argnums=(0, 1, 2)))(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
        with jax.enable_x64(True):
            want = jax.grad(functools.partial(loss, attend=reference, dtype=jnp.float64), argnums=(0, 1, 2))(
                *(jnp.asarray(x) for x in (q, k, v)))
        for g, g64 in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(g64), atol=5e-5)
    assert traced == [causal, causal]  # traced once per jit (both branches are traced, one runs)


def test_cudnn_backward_binds_with_this_jax() -> None:
    # cuDNN's backward is jax's private primitive: its operands and parameters must still be what
    # jaxattn_sdpa.residual passes (shapes checked by tracing; only a GPU runs it).
    from jaxattn_sdpa.residual import cudnn_backward, unavailable

    assert unavailable() is None
    q = jax.ShapeDtypeStruct((2, 64, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 8, 64), jnp.float32)
    for causal in (True, False):
        dq, dk, dv = jax.eval_shape(functools.partial(cudnn_backward, causal=causal), q, kv, kv, q, lse, q)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
        assert dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16


def test_the_cudnn_kernel_is_declined_where_jax_lacks_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import jaxattn_sdpa.residual
    from jaxattn.backend.device import DeviceInfo
    from jaxattn.backend.problem import AttentionProblem
    from jaxattn_ring.blocks import _block_reasons, block_problems
    from jaxattn_sdpa import CudnnAttention

    h100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    monkeypatch.setattr("jaxattn_ring.blocks.get_impl", lambda name, md: CudnnAttention(md, h100))
    monkeypatch.setattr(jaxattn_sdpa.residual, "_binding", lambda: "jax 9.9 does not expose it")
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)
    odd = jax.ShapeDtypeStruct((2, 18, 4, 8), jnp.bfloat16)  # zigzag halves of 9 keys: cuDNN's backward refuses
    for shape, extra in ((q, ""), (odd, "cuDNN's backward pass needs even T and S, got T=18, S=9")):
        problem = AttentionProblem.from_inputs(shape, shape, shape, causal=True)
        choice, why = _block_reasons(ring_of_one(), "cudnn", block_problems("causal", "zigzag", problem, None))
        assert choice is None
        assert not extra or any(extra in r for r in why), why
    assert not any("runs on cuda" in r for r in why), why
    assert any("cannot be fed the ring's residuals: jax 9.9 does not expose it; use 'cudnn+blockwise'" in r
               for r in why), why
