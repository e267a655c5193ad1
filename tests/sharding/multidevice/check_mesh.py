"""Every backend that runs on this CPU host, under a 2x4 mesh (batch x heads), against the oracle.

The TPU kernels (Pallas flash attention, splash) join in Pallas interpret mode. Each impl is
asked first; a case it declines is skipped with its reasons (never passed silently).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.errors import InvalidInputError, UnsupportedError
from jaxattn.testing import oracle

from ._util import Shape, assert_close, check_against_oracle, inputs, mesh, packed_segments, requires_8_devices

pytestmark = requires_8_devices

MESH = mesh((2, 4), ("data", "model"))
SHARDED = jaxattn.AttentionMetadata(mesh=MESH, batch_axis="data", head_axis="model")
INTERPRET: dict[str, Any] = {"platform": "tpu", "interpret": True}


def _backends() -> list[Any]:
    """(impl name, metadata overrides) for every impl usable on this host, TPU kernels interpreted."""
    found: dict[str, dict[str, Any]] = {}
    no_overrides: dict[str, Any] = {}
    for overrides in (no_overrides, INTERPRET):
        for row in jaxattn.list_impls(jaxattn.AttentionMetadata(**overrides)):
            if row.usable_here and row.kind == "dense" and row.name != "ring" and row.name not in found and (
                    not overrides or ("tpu" in row.platforms and "cpu" not in row.platforms)):
                found[row.name] = overrides
    return [pytest.param(name, overrides, id=name) for name, overrides in sorted(found.items())]


BACKENDS = _backends()


def _metadata(overrides: dict[str, Any]) -> jaxattn.AttentionMetadata:
    return SHARDED.replace(**overrides)


def _attend_or_skip(name: str, overrides: dict[str, Any], data: dict[str, np.ndarray], **features: Any) -> Any:
    """The sharded call, after asking the impl (with gradients) whether it runs these inputs."""
    md = _metadata(overrides)
    impl = jaxattn.get_impl(name, md)
    q, k, v = (jnp.asarray(data[x]) for x in "qkv")
    reasons = impl.supports(q, k, v, needs_grad=True, **features)
    if reasons:
        pytest.skip(f"{name} declines: {'; '.join(reasons)}")
    return functools.partial(jaxattn.attention, impl=name, metadata=md)


def _kernel_shape(name: str, shape: Shape) -> Shape:
    # splash tiles head dims by the TPU lane width; smaller ones would be handed to vanilla.
    return Shape(shape.b, shape.t, shape.s, shape.hq, shape.hkv, 128, 128) if name == "splash" else shape


# Shards of one batch row and one head: Pallas' TPU interpret mode simulates all 8 devices
# with one shared memory and global barriers in Python callbacks, and on a 2-core host it
# deadlocks when the kernels have more grid steps per device. K/V heads are still repeated
# (Hkv < 4 head shards) and the bias still replicated, so the wrapper's logic is exercised.
CAUSAL_MQA = Shape(b=2, t=128, s=128, hq=4, hkv=1, d=16, dv=16)
FULL_GQA = Shape(b=2, t=128, s=128, hq=4, hkv=2, d=16, dv=16)


@pytest.mark.parametrize(("name", "overrides"), BACKENDS)
def test_causal_mqa_segment_ids(name: str, overrides: dict[str, Any]) -> None:
    # Hkv=1 over a head axis of 4: K/V heads are repeated so each shard holds whole groups.
    shape = _kernel_shape(name, CAUSAL_MQA)
    data = inputs(shape, seed=1)
    ids = packed_segments(np.random.default_rng(1), shape.b, shape.t)
    features: dict[str, Any] = {"causal": True, "q_segment_ids": ids, "kv_segment_ids": ids}
    check_against_oracle(_attend_or_skip(name, overrides, data, **features), data, **features)


@pytest.mark.parametrize(("name", "overrides"), BACKENDS)
def test_full_gqa_mask_and_replicated_bias(name: str, overrides: dict[str, Any]) -> None:
    # The bias is shared by the batch (replicated over 'data'): its gradient sums both shards.
    shape = _kernel_shape(name, FULL_GQA)
    data = inputs(shape, seed=2)
    rng = np.random.default_rng(2)
    mask = np.ones((shape.b, 1, 1, shape.s), bool)
    mask[1, ..., 100:] = False
    bias = rng.normal(size=(1, shape.hq, shape.t, shape.s)).astype(np.float32)
    attend = _attend_or_skip(name, overrides, data, mask=mask, bias=jnp.asarray(bias))
    check_against_oracle(attend, data, mask=mask, bias=bias)


@pytest.mark.parametrize(("name", "overrides"), BACKENDS)
def test_held_out_shapes(name: str, overrides: dict[str, Any]) -> None:
    # Sizes not used while writing the wrapper: T < S (bottom-right causal), odd head dims,
    # GQA inside each shard (12 / 4 query heads on 4 / 4 K/V heads); for the interpreted
    # TPU kernels, one-row one-head shards again (see CAUSAL_MQA) with another head dim.
    held_out = Shape(b=2, t=128, s=128, hq=4, hkv=4, d=40, dv=40) if overrides.get("interpret") else Shape(
        b=4, t=24, s=40, hq=12, hkv=4, d=12, dv=12)
    shape = _kernel_shape(name, held_out)
    data = inputs(shape, seed=3)
    check_against_oracle(_attend_or_skip(name, overrides, data, causal=True), data, causal=True)


def test_sinks_sharded_over_heads() -> None:
    shape = Shape(b=2, t=16, s=16, hq=8, hkv=4, d=8, dv=8)
    aux = np.random.default_rng(4).normal(size=(shape.hq,)).astype(np.float32)
    check_against_oracle(functools.partial(jaxattn.attention, impl="vanilla", metadata=SHARDED),
                         inputs(shape, seed=4), softmax_aux=aux, causal=True)


def test_the_kernel_runs_under_shard_map_on_local_shards() -> None:
    shape = Shape(b=2, t=16, s=16, hq=8, hkv=8, d=8, dv=8)
    data = inputs(shape)
    q, k, v = (jnp.asarray(data[x]) for x in "qkv")
    seen: list[tuple[int, ...]] = []

    class Spy(jaxattn.AttentionImpl):
        platforms = frozenset({"cpu"})

        @classmethod
        def get_impl_name(cls) -> str:
            return "test_shape_spy"

        def forward_native(self, call: jaxattn.AttentionCall) -> jaxattn.AttentionOutput:
            seen.append(tuple(call.q.shape))
            assert self.metadata.mesh is None, "the kernel must see metadata without the mesh"
            assert call.metadata.mesh is None and call.problem.batch == 1 and call.problem.heads_q == 2
            return jaxattn.get_impl("vanilla")(call.q, call.k, call.v, causal=call.causal)

    jaxattn.register_impl(Spy)
    spy = functools.partial(jaxattn.attention, impl="test_shape_spy", metadata=SHARDED)
    out = jax.jit(spy)(q, k, v)
    assert seen == [(1, 16, 2, 8)]  # B 2/2, Hq 8/4
    assert_close("output", out, oracle.attention(data["q"], data["k"], data["v"]).output, 2e-5)
    # Without Feature.GRAD the sharded call refuses gradients like the unsharded one.
    with pytest.raises(UnsupportedError, match="gradients are not supported by test_shape_spy"):
        jax.eval_shape(jax.grad(lambda q: spy(q, k, v).sum()), q)
    jaxpr = jax.make_jaxpr(functools.partial(jaxattn.attention, impl="vanilla", metadata=SHARDED))(q, k, v)
    assert "shard_map" in {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}


def test_dropout_draws_a_different_mask_on_each_shard() -> None:
    # Two identical batch rows on two batch shards: one key for both would drop the same entries.
    shape = Shape(b=1, t=16, s=16, hq=8, hkv=8, d=8, dv=8)
    data = inputs(shape, seed=5)
    q, k, v = (jnp.asarray(np.concatenate([data[x]] * 2)) for x in "qkv")
    run = jax.jit(functools.partial(jaxattn.attention, impl="vanilla", metadata=SHARDED, dropout_prob=0.5))
    out = np.asarray(run(q, k, v, dropout_rng=jax.random.key(0)))
    assert not np.allclose(out[0], out[1])


def test_sizes_that_do_not_split_name_axis_and_sizes() -> None:
    q = jax.ShapeDtypeStruct((3, 16, 8, 8), jnp.float32)  # batch 3 over 'data' of size 2
    with pytest.raises(InvalidInputError, match=r"batch size B 3 is not divisible by mesh axis 'data' of size 2"):
        jax.eval_shape(functools.partial(jaxattn.attention, impl="vanilla", metadata=SHARDED), q, q, q)
    q = jax.ShapeDtypeStruct((2, 16, 6, 8), jnp.float32)  # 6 heads over 'model' of size 4
    with pytest.raises(InvalidInputError, match=r"query heads Hq 6 is not divisible by mesh axis 'model' of size 4"):
        jax.eval_shape(functools.partial(jaxattn.attention, impl="vanilla", metadata=SHARDED), q, q, q)


def test_a_sequence_axis_is_declined_by_impls_that_are_not_sequence_parallel() -> None:
    md = jaxattn.AttentionMetadata(mesh=MESH, batch_axis="data", sequence_axis="model")
    q = jax.ShapeDtypeStruct((2, 16, 8, 8), jnp.float32)
    with pytest.raises(UnsupportedError, match="sequence_axis='model' shards the sequence"):
        jax.eval_shape(functools.partial(jaxattn.attention, impl="vanilla", metadata=md), q, q, q)
