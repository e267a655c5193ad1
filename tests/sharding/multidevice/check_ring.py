"""``ring`` on 4 and 8 devices (and with batch and heads sharded too) against the float64 oracle."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.errors import InvalidInputError, JaxattnError
from jaxattn.sharding.compat import shard_map
from jaxattn.testing import oracle

from ._util import Shape, assert_close, check_against_oracle, inputs, mesh, packed_segments, requires_8_devices

pytestmark = requires_8_devices


def ring(n: int = 4, **extra: Any) -> jaxattn.AttentionMetadata:
    return jaxattn.AttentionMetadata(mesh=mesh((n,), ("seq",)), sequence_axis="seq", extra=extra)


def attend(md: jaxattn.AttentionMetadata) -> Any:
    return functools.partial(jaxattn.attention, impl="ring", metadata=md)


GQA = Shape(b=2, t=32, s=32, hq=4, hkv=2, d=8, dv=8)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_and_segment_ids_across_shard_boundaries(n: int, causal: bool) -> None:
    shape = Shape(b=2, t=64, s=64, hq=4, hkv=2, d=8, dv=8)
    ids = packed_segments(np.random.default_rng(n), shape.b, shape.t, segments=4)
    ids[1, -11:] = 99  # padding at the end: on the last device and reaching into the one before
    check_against_oracle(attend(ring(n)), inputs(shape, seed=n), causal=causal, q_segment_ids=ids,
                         kv_segment_ids=ids)


def test_causal_contiguous_layout() -> None:
    # Unbalanced but exact: later devices' keys are skipped, earlier ones' taken whole.
    check_against_oracle(attend(ring(4, ring_layout="contiguous")), inputs(GQA, seed=3), causal=True)


def test_key_padding_mask() -> None:
    shape = Shape(b=2, t=32, s=32, hq=4, hkv=1, d=8, dv=8)
    mask = np.ones((shape.b, 1, 1, shape.s), bool)
    mask[0, ..., 21:] = False  # padding over two devices' keys
    mask[1, ..., 5:] = False
    check_against_oracle(attend(ring(4)), inputs(shape, seed=5), causal=True, mask=mask)


def test_full_mask_rows_move_with_their_queries() -> None:
    # A (B, 1, T, S) mask: its rows follow the queries into the zigzag layout, its keys stay whole.
    shape = Shape(b=2, t=32, s=32, hq=2, hkv=2, d=8, dv=8)
    mask = np.random.default_rng(4).random((shape.b, 1, shape.t, shape.s)) < 0.7
    check_against_oracle(attend(ring(4)), inputs(shape, seed=4), causal=True, mask=mask)


def test_bottom_right_causal_cross_lengths() -> None:
    shape = Shape(b=1, t=32, s=64, hq=2, hkv=2, d=8, dv=4)  # T < S: queries at the end of a KV cache
    check_against_oracle(attend(ring(4)), inputs(shape, seed=6), causal=True)


def test_two_sided_sliding_window() -> None:
    check_against_oracle(attend(ring(8)), inputs(GQA, seed=7), sliding_window=(3, 9))


def test_sinks_soft_cap_and_scale() -> None:
    aux = np.random.default_rng(8).normal(size=(GQA.hq,)).astype(np.float32)
    check_against_oracle(attend(ring(4)), inputs(GQA, seed=8), causal=True, softmax_aux=aux,
                         logits_soft_cap=2.0, softmax_scale=0.7)


def test_batch_heads_and_sequence_sharded_together() -> None:
    # 2 x 2 x 2: MQA heads over 'model' (K/V repeated), batch over 'data', a ring of 2.
    shape = Shape(b=2, t=32, s=32, hq=4, hkv=1, d=8, dv=8)
    md = jaxattn.AttentionMetadata(mesh=mesh((2, 2, 2), ("data", "model", "seq")), batch_axis="data",
                                   head_axis="model", sequence_axis="seq")
    check_against_oracle(attend(md), inputs(shape, seed=9), causal=True)


def test_held_out_shapes() -> None:
    # Sizes not used while writing the ring: odd head dims, Dv != D, 3 K/V heads, 5 segments.
    shape = Shape(b=3, t=48, s=48, hq=6, hkv=3, d=12, dv=20)
    ids = packed_segments(np.random.default_rng(10), shape.b, shape.t, segments=5)
    check_against_oracle(attend(ring(4)), inputs(shape, seed=10), causal=True, q_segment_ids=ids,
                         kv_segment_ids=ids)


def test_bfloat16() -> None:
    def attend_bf16(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        return jaxattn.attention(q, k, v, impl="ring", metadata=ring(8), **kw).astype(jnp.float32)

    check_against_oracle(attend_bf16, inputs(GQA, seed=12, dtype=jnp.bfloat16), tol=2e-2, grad_tol=5e-2,
                         causal=True)


def test_lse_and_its_gradient() -> None:
    data = inputs(GQA, seed=13)
    q, k, v = (jnp.asarray(data[x]) for x in "qkv")
    ref = oracle.attention(data["q"], data["k"], data["v"], causal=True)
    weights = jnp.asarray(np.random.default_rng(14).normal(size=ref.lse.shape), jnp.float32)

    def lse_and_grads(impl: str, md: jaxattn.AttentionMetadata) -> Any:
        def loss(q: Any, k: Any, v: Any) -> Any:
            res = jaxattn.get_impl(impl, md)(q, k, v, causal=True)
            return (res.softmax_lse * weights).sum() + res.attention_outputs.sum(), res.softmax_lse

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    grads, lse = lse_and_grads("ring", ring(8))
    assert_close("softmax_lse", lse, ref.lse, 2e-5)
    # The lse cotangent path of the ring backward, against single-device vanilla (itself oracle-tested).
    want, _ = lse_and_grads("vanilla", jaxattn.AttentionMetadata())
    for got, expected in zip(grads, want, strict=True):
        assert_close("d(lse)", got, np.asarray(expected, np.float64), 5e-5)


def test_inside_the_callers_shard_map() -> None:
    # mesh=None: the caller's shard_map binds the axis and ring gets local shards.
    md = jaxattn.AttentionMetadata(sequence_axis="seq")

    def local(q: Any, k: Any, v: Any, bias: Any = None, softmax_aux: Any = None, **kw: Any) -> Any:
        body = functools.partial(jaxattn.attention, impl="ring", metadata=md, **kw)
        spec = P(None, "seq")
        return shard_map(body, mesh=mesh((4,), ("seq",)), in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)

    check_against_oracle(local, inputs(GQA, seed=15), causal=True)


def test_auto_picks_ring_when_the_sequence_is_sharded() -> None:
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    explanation = jaxattn.explain(q, q, q, causal=True, metadata=ring(4))
    assert explanation.chosen == "ring", str(explanation)


def test_sequence_that_does_not_split_names_axis_and_sizes() -> None:
    q = jax.ShapeDtypeStruct((1, 36, 2, 8), jnp.float32)  # 36 % (2 x 4) != 0
    with pytest.raises(InvalidInputError, match=r"36 .*8 = 2 x 4 chunks.*'seq' of size 4"):
        jax.eval_shape(functools.partial(jaxattn.attention, impl="ring", causal=True, metadata=ring(4)), q, q, q)


class _LseWithoutGradient(jaxattn.AttentionImpl):
    """vanilla whose lse is a by-product, as cuDNN's is: its cotangent is dropped."""

    platforms = frozenset({"cpu"})
    features = frozenset({jaxattn.Feature.CAUSAL, jaxattn.Feature.GQA, jaxattn.Feature.CROSS,
                          jaxattn.Feature.LSE, jaxattn.Feature.GRAD})

    @classmethod
    def get_impl_name(cls) -> str:
        return "test_lse_without_gradient"

    def forward_native(self, call: jaxattn.AttentionCall) -> jaxattn.AttentionOutput:
        res = jaxattn.get_impl("vanilla").forward_native(call)
        return jaxattn.AttentionOutput(res.attention_outputs, None, jax.lax.stop_gradient(res.softmax_lse))


@pytest.fixture(scope="module")
def lse_without_gradient() -> str:
    jaxattn.register_impl(_LseWithoutGradient)
    return _LseWithoutGradient.get_impl_name()


def test_kernel_whose_lse_has_no_gradient_differentiates_with_the_blockwise_backward(
        lse_without_gradient: str) -> None:
    check_against_oracle(attend(ring(4, ring_block_impl=lse_without_gradient)), inputs(GQA, seed=17), causal=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal-zigzag", "full"])
@pytest.mark.parametrize("n", [2, 4])
def test_own_backward_block_kernel_gradients_through_lse(lse_without_gradient: str, causal: bool, n: int) -> None:
    # "X+blockwise": X's forward (here an lse without gradient, as cuDNN's), the blockwise backward.
    # Output, lse and the gradients of sum(out * do) + sum(lse * w) against float64 on one device.
    md = ring(n, ring_block_impl=f"{lse_without_gradient}+blockwise")
    data = inputs(GQA, seed=20 + n)
    weights = np.random.default_rng(21).normal(size=(GQA.b, GQA.hq, GQA.t))
    impl = jaxattn.get_impl("ring", md)
    assert impl.block_kernel(jnp.asarray(data["q"]), jnp.asarray(data["k"]), jnp.asarray(data["v"]),
                             causal=causal).name() == f"{lse_without_gradient}+blockwise"

    def loss(impl: Any, dtype: Any) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            res = impl(q, k, v, causal=causal)
            value = (res.attention_outputs * jnp.asarray(data["do"], dtype)).sum()
            return value + (res.softmax_lse * jnp.asarray(weights, dtype)).sum(), (res.attention_outputs,
                                                                                    res.softmax_lse)
        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)

    grads, (out, lse) = jax.jit(loss(impl, jnp.float32))(*(jnp.asarray(data[x]) for x in "qkv"))
    with jax.enable_x64(True):
        want, (out64, lse64) = loss(jaxattn.get_impl("vanilla"), jnp.float64)(
            *(jnp.asarray(data[x], jnp.float64) for x in "qkv"))
        want = [np.asarray(g) for g in want]
        out64, lse64 = np.asarray(out64), np.asarray(lse64)
    assert_close("output", out, out64, 2e-5)
    assert_close("softmax_lse", lse, lse64, 2e-5)
    for label, got, expected in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close(label, got, expected, 5e-5)


def test_kernel_whose_lse_has_no_gradient_without_fallback_raises(lse_without_gradient: str) -> None:
    md = ring(4, ring_block_impl=lse_without_gradient).replace(allow_fallback=False)
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    forward = functools.partial(jaxattn.attention, impl="ring", causal=True, metadata=md)
    jax.eval_shape(forward, q, q, q)  # the forward needs no gradient
    with pytest.raises(JaxattnError, match="cotangent"):
        jax.eval_shape(jax.grad(lambda q, k, v: forward(q, k, v).sum()), q, q, q)


# -- ring's backward from its own residuals (no block forward in the backward) ----------------------
# "blockwise" has a residual backward (BlockKernel.residual_backward); under "auto" the blocks of
# the tests above run autoregressive_decodeattn, differentiated through jax.vjp of each block.
RESIDUAL = {"ring_block_impl": "blockwise"}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal-zigzag"])
def test_residual_backward_with_gqa_and_segment_ids(n: int, causal: bool) -> None:
    shape = Shape(b=2, t=64, s=64, hq=4, hkv=2, d=8, dv=8)
    ids = packed_segments(np.random.default_rng(30 + n), shape.b, shape.t, segments=4)
    ids[1, -11:] = 99
    md = ring(n, **RESIDUAL)
    q = jax.ShapeDtypeStruct((shape.b, shape.t, shape.hq, shape.d), jnp.float32)
    assert jaxattn.get_impl("ring", md).block_kernel(q, q, q, causal=causal).kernel(1.0, None).residual_backward
    check_against_oracle(attend(md), inputs(shape, seed=30 + n), causal=causal, q_segment_ids=ids,
                         kv_segment_ids=ids)


@pytest.mark.parametrize("case", ["contiguous", "padding-mask", "window", "sinks-cap-scale", "cross-lengths"])
def test_residual_backward_per_layout_and_feature(case: str) -> None:
    aux = np.random.default_rng(31).normal(size=(GQA.hq,)).astype(np.float32)
    mask = np.ones((GQA.b, 1, 1, GQA.s), bool)
    mask[0, ..., 21:] = False
    mask[1, ..., :3] = False  # the first rows see nothing: zeros, zero gradients
    shape, md, features = GQA, ring(4, **RESIDUAL), {"causal": True}
    if case == "contiguous":
        md = ring(4, ring_layout="contiguous", **RESIDUAL)
    elif case == "padding-mask":
        features["mask"] = mask
    elif case == "window":
        md, features = ring(8, **RESIDUAL), {"sliding_window": (3, 9)}
    elif case == "sinks-cap-scale":
        features.update(softmax_aux=aux, logits_soft_cap=2.0, softmax_scale=0.7)
    else:
        shape = Shape(b=1, t=32, s=64, hq=2, hkv=2, d=8, dv=4)
    check_against_oracle(attend(md), inputs(shape, seed=32), **features)


def check_gradients_through_the_lse(md: jaxattn.AttentionMetadata, seed: int) -> None:
    """Ring's gradients of a loss on its output and its lse (with a sink) against vanilla's: the lse
    cotangent reaches the blocks as exp(L - lse) d lse."""
    data = inputs(GQA, seed=seed)
    q, k, v = (jnp.asarray(data[x]) for x in "qkv")
    weights = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(GQA.b, GQA.hq, GQA.t)), jnp.float32)
    aux = jnp.asarray(np.random.default_rng(seed + 2).normal(size=(GQA.hq,)), jnp.float32)

    def grads(impl: str, md: jaxattn.AttentionMetadata) -> Any:
        def loss(q: Any, k: Any, v: Any) -> Any:
            res = jaxattn.get_impl(impl, md)(q, k, v, causal=True, softmax_aux=aux)
            return (res.softmax_lse * weights).sum() + (res.attention_outputs * jnp.asarray(data["do"])).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want = grads("vanilla", jaxattn.AttentionMetadata())
    for got, expected in zip(grads("ring", md), want, strict=True):
        assert_close("d(lse, out)", got, np.asarray(expected, np.float64), 5e-5)


def test_residual_backward_through_the_lse() -> None:
    check_gradients_through_the_lse(ring(4, **RESIDUAL), seed=33)


# float32's own precision: an identity whose equation marks each block forward in a jaxpr.
_MARK = {"exponent_bits": 8, "mantissa_bits": 23}


def _block_forwards(closed: Any) -> int:
    """How many marked block forwards a jaxpr holds, loop, shard_map, jit and custom-VJP bodies included."""
    def count(jaxpr: Any) -> int:
        marks = sum(eqn.primitive.name == "reduce_precision" and eqn.params == _MARK for eqn in jaxpr.eqns)
        return marks + sum(count(sub) for eqn in jaxpr.eqns for sub in jaxprs_in_params(eqn.params))

    return count(closed.jaxpr)


class _MarkedBlocks(jaxattn.AttentionImpl):
    """blockwise's forward, its output marked (:data:`_MARK`) so that the jaxprs show where it runs."""

    platforms = frozenset({"cpu"})
    features = frozenset({jaxattn.Feature.CAUSAL, jaxattn.Feature.GQA, jaxattn.Feature.CROSS,
                          jaxattn.Feature.LSE, jaxattn.Feature.GRAD})

    @classmethod
    def get_impl_name(cls) -> str:
        return "test_marked_blocks"

    def forward_native(self, call: jaxattn.AttentionCall) -> jaxattn.AttentionOutput:
        res = jaxattn.get_impl("blockwise").forward_native(call)
        assert res.attention_outputs.dtype == jnp.float32  # where the mark is an identity
        return dataclasses.replace(res, attention_outputs=jax.lax.reduce_precision(res.attention_outputs, **_MARK))


class _MarkedBlocksWithResidualBackward(_MarkedBlocks):
    @classmethod
    def get_impl_name(cls) -> str:
        return "test_marked_blocks_residual"

    def backward_from_residuals(self, *args: Any, **features: Any) -> Any:
        return jaxattn.get_impl("blockwise").backward_from_residuals(*args, **features)


@pytest.mark.parametrize("kind", [_MarkedBlocks, _MarkedBlocksWithResidualBackward], ids=["vjp", "residual"])
def test_a_residual_backward_runs_no_block_forward(kind: type[_MarkedBlocks]) -> None:
    # The block forwards in the gradient's program beyond the forward's are the backward's. Counted in
    # the jaxprs, not as Python traces: jax may trace a function more than once for one program.
    jaxattn.register_impl(kind)
    md = ring(4, ring_block_impl=kind.get_impl_name())
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    forward = functools.partial(jaxattn.attention, impl="ring", causal=True, metadata=md)
    per_forward = _block_forwards(jax.make_jaxpr(forward)(q, q, q))
    in_gradient = _block_forwards(jax.make_jaxpr(jax.grad(lambda q, k, v: forward(q, k, v).sum(),
                                                           argnums=(0, 1, 2)))(q, q, q))
    assert per_forward > 0
    # jax.vjp of each block runs its forward again in the backward (and transposes the mark's
    # tangent); a residual backward runs none.
    said = " ".join(str(jaxattn.explain(q, q, q, causal=True, impl="ring", metadata=md)).split())
    if kind is _MarkedBlocksWithResidualBackward:
        assert in_gradient == per_forward, (in_gradient, per_forward)
        assert "backward from the ring's output and lse (no block forward again)" in said, said
    else:
        assert in_gradient >= 2 * per_forward, (in_gradient, per_forward)
        assert "backward through jax.vjp of each block (its forward runs again)" in said, said


@pytest.fixture
def cudnn_kernel_on_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring's ``cudnn`` block kernel with stand-ins for cuDNN (no GPU here): jax.nn's XLA forward with
    its lse, and for cuDNN's residual backward the blockwise one *ignoring* the lse cotangent, as
    cuDNN's does. What runs is ring's code for that kernel: the global residuals handed to the
    backward, and the run-time branch to the blockwise backward where an lse cotangent exists."""
    import jaxattn_sdpa.residual
    from jaxattn_ring import impl as ring_impl
    from jaxattn_ring.blocks import BlockChoice, CudnnKernel
    from jaxattn_vanilla.blockwise.kernel import blockwise_backward

    @dataclasses.dataclass(frozen=True)
    class OnXla(BlockChoice):
        def name(self) -> str:
            return "cudnn"

        def kernel(self, softmax_scale: float, logits_soft_cap: float | None) -> CudnnKernel:
            return CudnnKernel(self.impl, softmax_scale, logits_soft_cap, implementation="xla")

    def cudnn_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, *, causal: bool,
                       softmax_scale: float) -> Any:
        return blockwise_backward(q, k, v, out, lse, d_out, None, causal=causal, softmax_scale=softmax_scale)

    monkeypatch.setattr(jaxattn_sdpa.residual, "cudnn_backward", cudnn_backward)
    monkeypatch.setattr(ring_impl, "choose_kernel",
                        lambda md, problems, requested: (OnXla(jaxattn.get_impl("vanilla", md)), []))


@pytest.mark.usefixtures("cudnn_kernel_on_xla")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_cudnn_kernel_on_the_ring(layout: str, causal: bool) -> None:
    check_against_oracle(attend(ring(4, ring_layout=layout)), inputs(GQA, seed=41), causal=causal)
    md = ring(4, ring_layout=layout)
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    said = " ".join(str(jaxattn.explain(q, q, q, causal=causal, impl="ring", metadata=md)).split())
    assert "per-block kernel cudnn, backward from the ring's output and lse" in said, said


@pytest.mark.usefixtures("cudnn_kernel_on_xla")
def test_the_cudnn_kernel_through_the_lse() -> None:
    # An lse cotangent: the run-time branch must leave the stand-in (which would drop it) for the blockwise backward.
    test_residual_backward_through_the_lse()


@pytest.mark.parametrize("block", ["blockwise", "vanilla+blockwise", "vanilla"])
def test_eager_gradients(block: str) -> None:
    # jax.grad without jax.jit: shard_map then runs eagerly, and jax 0.10 cannot run a custom_vjp with
    # symbolic zeros there (the blockwise kernel's, once): every block kernel must still differentiate.
    data = inputs(GQA, seed=51)
    q, k, v, do = (jnp.asarray(data[x]) for x in ("q", "k", "v", "do"))
    md = ring(4, ring_block_impl=block)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (jaxattn.attention(q, k, v, causal=True, impl="ring", metadata=md) * do).sum()

    with jax.default_matmul_precision("highest"):
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = oracle.attention_backward(data["q"], data["k"], data["v"], data["do"], causal=True)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, (want.dq, want.dk, want.dv), strict=True):
        assert_close(name, got, expected, 5e-5)


def in_zigzag_order(md: jaxattn.AttentionMetadata, n: int, t: int, s: int) -> Any:
    """Ring with ``ring_inputs="zigzag"``, called on natural-order arrays: this wrapper puts every
    sequence axis (q, k, v, segment ids, the mask's rows and keys) in zigzag order and the output
    back, so the result must be the oracle's."""
    from jaxattn_ring import zigzag_permutation

    rows, keys = zigzag_permutation(t, n), zigzag_permutation(s, n)

    def take(x: Any, axis: int, perm: np.ndarray) -> Any:
        return x if x is None or x.shape[axis] == 1 else jnp.take(jnp.asarray(x), perm, axis=axis)

    def attend(q: Any, k: Any, v: Any, *, mask: Any = None, q_segment_ids: Any = None, kv_segment_ids: Any = None,
               **features: Any) -> Any:
        if mask is not None:
            mask = take(take(mask, 2, rows), 3, keys)
        ids = {"q_segment_ids": take(q_segment_ids, 1, rows), "kv_segment_ids": take(kv_segment_ids, 1, keys)}
        out = jaxattn.attention(take(q, 1, rows), take(k, 1, keys), take(v, 1, keys), mask=mask, impl="ring",
                                metadata=md, **ids, **features)
        return jnp.take(out, np.argsort(rows), axis=1)

    return attend


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["causal", "full", "mask", "segments", "window", "longer_keys"])
def test_inputs_already_in_zigzag_order(n: int, case: str) -> None:
    shape = Shape(b=2, t=32, s=64 if case == "longer_keys" else 32, hq=4, hkv=2, d=8, dv=8)
    features: dict[str, Any] = {"causal": case != "full"}
    rng = np.random.default_rng(61)
    if case == "mask":
        features["mask"] = rng.random((shape.b, 1, shape.t, shape.s)) > 0.3
    if case == "segments":
        ids = packed_segments(rng, shape.b, shape.t, segments=3)
        features.update(q_segment_ids=ids, kv_segment_ids=ids)
    if case == "window":
        features["sliding_window"] = (5, 0)
    if case == "longer_keys":  # bottom-right causal over T < S, and key padding in its own order
        features["mask"] = np.arange(shape.s)[None, None, None, :] < np.array([64, 50])[:, None, None, None]
    md = ring(n, ring_inputs="zigzag")
    check_against_oracle(in_zigzag_order(md, n, shape.t, shape.s), inputs(shape, seed=62), **features)
    q = jax.ShapeDtypeStruct((2, 32, 4, 8), jnp.float32)
    said = " ".join(str(jaxattn.explain(q, q, q, causal=True, impl="ring", metadata=md)).split())
    assert "zigzag layout (inputs and outputs in zigzag order: no relayout)" in said, said


def test_zigzag_inputs_skip_the_relayout() -> None:
    # The relayout is two ppermutes of half a shard per array each way; inputs in zigzag order skip them.
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)

    def permutes(**extra: Any) -> int:
        attend = functools.partial(jaxattn.attention, impl="ring", causal=True, metadata=ring(4, **extra))
        return str(jax.make_jaxpr(attend)(q, q, q)).count("ppermute")

    natural, arrived = permutes(), permutes(ring_inputs="zigzag")
    assert natural - arrived == 2 * 5, (natural, arrived)  # q, k, v in; the output and the lse out


def test_ring_inputs_is_checked() -> None:
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    for extra, said in (({"ring_inputs": "sorted"}, "'sorted' is not 'natural' or 'zigzag'"),
                        ({"ring_inputs": "zigzag", "ring_layout": "contiguous"},
                         "inputs in zigzag order run the zigzag layout")):
        # The caller's option is wrong whoever would run the call: raised, not a reason to decline.
        with pytest.raises(InvalidInputError) as info:
            jaxattn.get_impl("ring", ring(4, **extra)).supports(q, q, q, causal=True)
        assert said in str(info.value), info.value


# -- comm="all_gather": the same blocks, K/V all-gathered and dK/dV reduce-scattered --------------------------------
def _features(case: str, shape: Shape, rng: np.random.Generator) -> dict[str, Any]:
    features: dict[str, Any] = {"causal": case not in ("full", "full-mask")}
    if case in ("mask", "full-mask"):
        features["mask"] = rng.random((shape.b, 1, shape.t, shape.s)) > 0.3
    if case == "segments":
        ids = packed_segments(rng, shape.b, shape.t, segments=3)
        ids[1, -7:] = 99  # padding reaching across the last device boundary
        features.update(q_segment_ids=ids, kv_segment_ids=ids)
    if case == "window":
        features["sliding_window"] = (5, 2)
    if case == "sinks-cap-scale":
        features.update(softmax_aux=rng.normal(size=(shape.hq,)).astype(np.float32), logits_soft_cap=2.0,
                        softmax_scale=0.7)
    if case == "longer_keys":  # bottom-right causal over T < S, with key padding
        features["mask"] = np.arange(shape.s)[None, None, None, :] < np.array([64, 50])[:, None, None, None]
    return features


GATHER_CASES = ["causal", "full", "mask", "full-mask", "segments", "window", "sinks-cap-scale", "longer_keys"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("block", ["auto", "blockwise"], ids=["vjp-blocks", "residual-blocks"])
@pytest.mark.parametrize("case", GATHER_CASES)
def test_all_gather_comm(n: int, block: str, case: str) -> None:
    shape = Shape(b=2, t=32, s=64 if case == "longer_keys" else 32, hq=4, hkv=2, d=8, dv=8)
    features = _features(case, shape, np.random.default_rng(71))
    md = ring(n, ring_comm="all_gather", ring_block_impl=block)
    check_against_oracle(attend(md), inputs(shape, seed=72 + n), **features)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_all_gather_comm_layouts_and_zigzag_inputs(layout: str) -> None:
    data = inputs(GQA, seed=73)
    check_against_oracle(attend(ring(4, ring_comm="all_gather", ring_layout=layout)), data, causal=True)
    md = ring(4, ring_comm="all_gather", ring_inputs="zigzag", ring_block_impl="blockwise")
    check_against_oracle(in_zigzag_order(md, 4, GQA.t, GQA.s), data, causal=True)


def test_all_gather_comm_through_the_lse() -> None:
    check_gradients_through_the_lse(ring(4, ring_comm="all_gather", **RESIDUAL), seed=74)


@pytest.mark.usefixtures("cudnn_kernel_on_xla")
def test_the_cudnn_kernel_with_all_gather_comm() -> None:
    check_against_oracle(attend(ring(4, ring_comm="all_gather")), inputs(GQA, seed=75), causal=True)


def test_all_gather_comm_eager_gradients() -> None:
    data = inputs(GQA, seed=76)
    md = ring(4, ring_comm="all_gather", ring_block_impl="blockwise")

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (jaxattn.attention(q, k, v, causal=True, impl="ring", metadata=md) * data["do"]).sum()

    with jax.default_matmul_precision("highest"):
        grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(data[x]) for x in "qkv"))
    want = oracle.attention_backward(data["q"], data["k"], data["v"], data["do"], causal=True)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, (want.dq, want.dk, want.dv), strict=True):
        assert_close(name, got, expected, 5e-5)


def test_all_gather_comm_moves_kv_in_collectives() -> None:
    # K/V neither relayouted nor passed: one all-gather in the forward; the backward gathers again and
    # sends dK/dV home in one reduce-scatter. Only q (in), the output and the lse (out) relayout.
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    md = ring(4, ring_comm="all_gather", ring_block_impl="blockwise")

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jaxattn.attention(q, k, v, causal=True, impl="ring", metadata=md).sum()

    def count(primitive: str, jaxpr: str) -> int:
        return jaxpr.count(f"= {primitive}[")

    forward = str(jax.make_jaxpr(loss)(q, q, q))
    assert (count("ppermute", forward), count("all_gather", forward)) == (2 * 3, 2)  # q, out, lse; k and v
    backward = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))
    # The forward's gather and relayouts, the backward's gather and reduce-scatter; dq and dout relayout.
    assert (count("all_gather", backward), count("reduce_scatter", backward)) == (2 + 2, 2)
    assert count("ppermute", backward) == 2 * 3 + 2 * 2, count("ppermute", backward)
    said = " ".join(str(jaxattn.explain(q, q, q, causal=True, impl="ring", metadata=md)).split())
    assert "K/V all-gathered (every device holds all S keys during the call), dK/dV reduce-scattered" in said, said


def test_ring_comm_is_checked() -> None:
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    with pytest.raises(InvalidInputError, match=r"'broadcast' is not one of \['auto', 'ppermute', 'all_gather'\]"):
        jaxattn.get_impl("ring", ring(4, ring_comm="broadcast")).supports(q, q, q, causal=True)
