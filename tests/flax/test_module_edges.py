"""``FlexibleAttentionModule`` at its edges: a full cache under jit, mixed dtypes, refused
constructions (each case returned wrong numbers or failed late before)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
from jaxattn.testing import oracle
from jaxattn_flax import FlexibleAttentionModule, KVCache

B, T, HQ, HKV, D = 2, 8, 4, 2, 8
CAPACITY = 6


def states(dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(keys[0], (B, T, HQ, D), dtype), jax.random.normal(keys[1], (B, T, HKV, D), dtype),
            jax.random.normal(keys[2], (B, T, HKV, D), dtype))


def reference(q: Any, k: Any, v: Any) -> np.ndarray:
    return oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True).output


def test_overflow_under_nnx_jit_gives_nan_and_a_flag_and_keeps_the_cache() -> None:
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV)
    module.init_cache(B, max_length=CAPACITY)
    step = nnx.jit(lambda m, q, k, v: m(q, k, v).attention_outputs)
    np.testing.assert_allclose(step(module, q[:, :4], k[:, :4], v[:, :4]), want[:, :4], atol=2e-5)
    for i in range(4, CAPACITY):  # fits: right numbers, no flag
        np.testing.assert_allclose(step(module, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1]), want[:, i:i + 1],
                                   atol=2e-5)
    assert not bool(module.cache_overflowed_flag)
    full_keys = np.asarray(module.cached_key[...])
    for i in range(CAPACITY, T):  # past capacity: NaN (wrong numbers before), the write dropped
        out = step(module, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
        assert np.isnan(np.asarray(out)).all(), f"step {i}"
        assert bool(module.cache_overflowed_flag) and int(module.cache_index[...]) == CAPACITY
        np.testing.assert_array_equal(module.cached_key[...], full_keys)
    with pytest.raises(jaxattn.InvalidInputError, match="overflow"):  # eagerly it is an error
        module(q[:, :1], k[:, :1], v[:, :1])


def test_overflow_of_a_passed_cache_under_jax_jit() -> None:
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV)

    @jax.jit
    def step(cache: KVCache, q: Any, k: Any, v: Any) -> tuple[Any, KVCache]:
        out, cache = module(q, k, v, cache=cache)
        return out.attention_outputs, cache

    cache = KVCache.empty(B, CAPACITY, HKV, D)
    out, cache = step(cache, q[:, :5], k[:, :5], v[:, :5])
    np.testing.assert_allclose(out, want[:, :5], atol=2e-5)
    out, cache = step(cache, q[:, 5:7], k[:, 5:7], v[:, 5:7])  # 5 + 2 > 6: the whole write is dropped
    assert np.isnan(np.asarray(out)).all() and bool(cache.overflowed) and int(cache.index) == 5
    out, cache = step(cache, q[:, 5:6], k[:, 5:6], v[:, 5:6])  # one fits: right again, the flag stays
    np.testing.assert_allclose(out, want[:, 5:6], atol=2e-5)
    assert bool(cache.overflowed) and int(cache.index) == CAPACITY
    with pytest.raises(jaxattn.InvalidInputError, match=r"overflow.*max_length"):  # never fits: refused even traced
        step(cache, q, k, v)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [("bfloat16", None), (None, "bfloat16"),
                                                    ("float32", "bfloat16"), ("bfloat16", "float32")])
def test_float32_states_into_a_held_cache_of_another_dtype(dtype: Any, cache_dtype: Any) -> None:
    """Was "k/v: dtypes differ" at the first call: the states are cast to the compute dtype and
    the cache's contents read back in it."""
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV, dtype=dtype, cache_dtype=cache_dtype)
    module.init_cache(B, max_length=T)
    assert module.cached_key[...].dtype == jnp.dtype(cache_dtype or dtype)
    outputs = [module(q[:, :5], k[:, :5], v[:, :5]).attention_outputs]
    outputs += [module(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1]).attention_outputs for i in range(5, T)]
    assert all(o.dtype == jnp.dtype(dtype or "float32") for o in outputs)
    np.testing.assert_allclose(np.concatenate([np.asarray(o, np.float32) for o in outputs], axis=1), want,
                               atol=5e-2)  # bfloat16 somewhere on the way


def test_a_paged_impl_is_refused_at_construction() -> None:
    with pytest.raises(jaxattn.InvalidInputError, match=r"attention_mechanism.*paged.*paged_attention"):
        FlexibleAttentionModule(HQ, D, HKV, attention_mechanism="vanilla_paged")


def test_dropout_with_an_impl_that_declines_it_is_refused_at_construction() -> None:
    with pytest.raises(jaxattn.InvalidInputError, match=r"dropout_prob.*'sdpa'.*vanilla"):
        FlexibleAttentionModule(HQ, D, HKV, attention_mechanism="sdpa", dropout_prob=0.1, rngs=nnx.Rngs(0))
    FlexibleAttentionModule(HQ, D, HKV, attention_mechanism="sdpa")  # without dropout it is fine


def test_a_cache_dtype_that_is_not_floating_is_refused() -> None:
    with pytest.raises(jaxattn.InvalidInputError, match=r"cache_dtype.*quantize_kv"):
        FlexibleAttentionModule(HQ, D, HKV, cache_dtype="int8")
