"""Bad input gets one clear error naming the argument and the constraint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxattn import AttentionMetadata, InvalidInputError
from jaxattn.backend.validation import resolve_call

Q = jax.ShapeDtypeStruct((2, 5, 4, 8), jnp.float32)
K = jax.ShapeDtypeStruct((2, 7, 2, 8), jnp.float32)


def sds(shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    ("q", "k", "v", "argument", "needle"),
    [
        (sds((5, 4, 8)), K, K, "q", "rank 4"),
        (Q, sds((2, 7, 8)), K, "k", "rank 4"),
        (Q, sds((2, 7, 3, 8)), sds((2, 7, 3, 8)), "k", "not a multiple"),
        (Q, sds((2, 7, 2, 16)), K, "k", "head dim 16 differs"),
        (Q, K, sds((2, 6, 2, 8)), "v", "sequence length 6"),
        (Q, K, sds((2, 7, 1, 8)), "v", "heads"),
        (Q, sds((3, 7, 2, 8)), sds((3, 7, 2, 8)), "k/v", "batch"),
        (Q, sds((2, 7, 2, 8), jnp.bfloat16), K, "k/v", "dtypes differ"),
        (sds((2, 5, 4, 8), jnp.int32), K, K, "q", "floating"),
    ],
)
def test_shape_errors(q, k, v, argument: str, needle: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        resolve_call(q, k, v)
    assert info.value.argument == argument
    assert needle in str(info.value)


def test_mask_must_broadcast_and_be_boolean() -> None:
    with pytest.raises(InvalidInputError, match=r"mask.*\(Hq: 3 vs 4\)"):
        resolve_call(Q, K, K, mask=sds((2, 3, 5, 7), jnp.bool_))
    with pytest.raises(InvalidInputError, match="boolean"):
        resolve_call(Q, K, K, mask=sds((5, 7), jnp.float32))
    with pytest.raises(InvalidInputError, match="rank 5"):
        resolve_call(Q, K, K, mask=sds((1, 2, 4, 5, 7), jnp.bool_))
    resolve_call(Q, K, K, mask=sds((5, 7), jnp.bool_))  # broadcasts: fine


def test_bias_and_init_bias() -> None:
    with pytest.raises(InvalidInputError, match=r"bias.*T: 4 vs 5"):
        resolve_call(Q, K, K, bias=sds((1, 1, 4, 7)))
    spec = resolve_call(Q, K, K, init_bias=lambda: sds((1, 4, 5, 7)))
    assert spec.bias.shape == (1, 4, 5, 7)
    with pytest.raises(InvalidInputError, match="init_bias"):
        resolve_call(Q, K, K, init_bias=3)  # type: ignore[arg-type]


def test_segment_ids() -> None:
    with pytest.raises(InvalidInputError, match=r"kv_segment_ids.*\(2, 7\)"):
        resolve_call(Q, K, K, q_segment_ids=sds((2, 5), jnp.int32), kv_segment_ids=sds((2, 5), jnp.int32))
    with pytest.raises(InvalidInputError, match="kv_segment_ids: is required"):
        resolve_call(Q, K, K, q_segment_ids=sds((2, 5), jnp.int32))
    with pytest.raises(InvalidInputError, match="integers"):
        resolve_call(Q, K, K, q_segment_ids=sds((2, 5)), kv_segment_ids=sds((2, 7)))
    square = sds((2, 7, 4, 8))
    spec = resolve_call(square, K, K, q_segment_ids=sds((2, 7), jnp.int32))
    assert spec.kv_segment_ids is spec.q_segment_ids  # T == S: one set serves both


def test_dropout_needs_rng_and_range() -> None:
    with pytest.raises(InvalidInputError, match="dropout_rng"):
        resolve_call(Q, K, K, dropout_prob=0.1)
    with pytest.raises(InvalidInputError, match=r"\[0, 1\)"):
        resolve_call(Q, K, K, dropout_prob=1.0, dropout_rng=jax.random.key(0))
    with pytest.raises(InvalidInputError, match="dropout_rng"):
        resolve_call(Q, K, K, metadata=AttentionMetadata(dropout_prob=0.2))


def test_window_scale_cap_sinks() -> None:
    assert resolve_call(Q, K, K, sliding_window=3).sliding_window == (3, 3)
    assert resolve_call(Q, K, K, sliding_window=(4, 0)).sliding_window == (4, 0)
    with pytest.raises(InvalidInputError, match="sliding_window"):
        resolve_call(Q, K, K, sliding_window=(-1, 2))
    with pytest.raises(InvalidInputError, match="sliding_window"):
        resolve_call(Q, K, K, sliding_window=(1, 2, 3))
    with pytest.raises(InvalidInputError, match="softmax_scale"):
        resolve_call(Q, K, K, softmax_scale=0.0)
    with pytest.raises(InvalidInputError, match="logits_soft_cap"):
        resolve_call(Q, K, K, logits_soft_cap=-1.0)
    with pytest.raises(InvalidInputError, match=r"softmax_aux.*\(4,\)"):
        resolve_call(Q, K, K, softmax_aux=sds((2,)))
    with pytest.raises(InvalidInputError, match="causal"):
        resolve_call(Q, K, K, causal=1)  # type: ignore[arg-type]


def test_defaults_come_from_metadata_and_calls_win() -> None:
    md = AttentionMetadata(softmax_scale=0.5, logits_soft_cap=30.0)
    assert resolve_call(Q, K, K).softmax_scale == pytest.approx(8**-0.5)
    spec = resolve_call(Q, K, K, metadata=md)
    assert (spec.softmax_scale, spec.logits_soft_cap) == (0.5, 30.0)
    assert resolve_call(Q, K, K, metadata=md, softmax_scale=0.25).softmax_scale == 0.25


def test_metadata_defaults_and_checks() -> None:
    md = AttentionMetadata()
    assert md.softmax_dtype == "float32" and md.runtime_dtype is None and md.allow_fallback
    assert hash(md) == hash(AttentionMetadata())
    assert AttentionMetadata(runtime_dtype=jnp.bfloat16).runtime_dtype == "bfloat16"
    assert AttentionMetadata(extra={"a": 1}).replace(block_q=128).block_sizes == {"block_q": 128}
    with pytest.raises(ValueError, match="platform"):
        AttentionMetadata(platform="npu")
    with pytest.raises(ValueError, match="block_q"):
        AttentionMetadata(block_q=0)


def test_metadata_hash_survives_pickle_and_replace() -> None:
    import pickle

    md = AttentionMetadata(extra={"k": 1}, block_q=64)
    back = pickle.loads(pickle.dumps(md))
    assert back == md and hash(back) == hash(md)
    assert hash(md.replace(block_q=64)) == hash(md)
    assert md.replace(block_q=128) != md
