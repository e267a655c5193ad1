"""``jaxattn_flax.FlexibleAttentionModule`` on the CPU: train, prefill and decode, against the oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx  # the test dependency group installs flax, as jaxattn[flax] does

import jaxattn
from jaxattn.backend.capabilities import Feature
from jaxattn.testing import oracle
from jaxattn_bench import records as cache_module
from jaxattn_flax import FlexibleAttentionModule, KVCache
from jaxattn_vanilla.vanilla.impl import VanillaAttention

B, T, HQ, HKV, D = 2, 12, 4, 2, 8


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    cache_module.reload()
    yield
    cache_module.reload()


def states(t: int = T, dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(1), 3)
    return (jax.random.normal(keys[0], (B, t, HQ, D), dtype), jax.random.normal(keys[1], (B, t, HKV, D), dtype),
            jax.random.normal(keys[2], (B, t, HKV, D), dtype))


def reference(q: Any, k: Any, v: Any, causal: bool = True) -> np.ndarray:
    return oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), causal=causal).output


def test_train_call_matches_the_oracle_with_auto() -> None:
    module = FlexibleAttentionModule(HQ, D, HKV)
    assert module.attention_mechanism == "auto" and isinstance(module.impl, jaxattn.AttentionImpl)
    q, k, v = states()
    out = module(q, k, v)
    assert isinstance(out, jaxattn.AttentionOutput)
    np.testing.assert_allclose(out.attention_outputs, reference(q, k, v), atol=2e-5)
    full = FlexibleAttentionModule(HQ, D, HKV, causal=False)(q, k, v).attention_outputs
    np.testing.assert_allclose(full, reference(q, k, v, causal=False), atol=2e-5)


def test_impl_is_resolved_once_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(jaxattn.ImplNotFoundError, match="no_such_impl"):
        FlexibleAttentionModule(HQ, D, HKV, attention_mechanism="no_such_impl")
    module = FlexibleAttentionModule(HQ, D, HKV, attention_mechanism=jaxattn.AttentionMechanisms.VANILLA)
    assert module.impl.name() == "vanilla"
    looked_up: list[object] = []
    monkeypatch.setattr(jaxattn, "get_impl", lambda *a, **kw: looked_up.append(a))
    q, k, v = states()
    for _ in range(3):
        module(q, k, v)
    assert looked_up == []  # calls use the resolved impl, never the registry by name


def test_dtype_is_the_compute_dtype() -> None:
    q, k, v = states()
    out = FlexibleAttentionModule(HQ, D, HKV, dtype=jnp.bfloat16)(q, k, v).attention_outputs
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), reference(q, k, v), atol=3e-2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_prefill_then_decode_with_a_held_cache(jit: bool) -> None:
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV)
    module.init_cache(B, max_length=16)

    def step(m: FlexibleAttentionModule, q: Any, k: Any, v: Any) -> Any:
        return m(q, k, v).attention_outputs

    call = nnx.jit(step) if jit else step
    np.testing.assert_allclose(call(module, q[:, :8], k[:, :8], v[:, :8]), want[:, :8], atol=2e-5)  # prefill
    for i in range(8, T):  # decode, one position at a time
        np.testing.assert_allclose(call(module, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1]), want[:, i:i + 1],
                                   atol=2e-5)
    assert int(module.cache_index[...]) == T
    np.testing.assert_array_equal(module.cached_key[...][:, :T], k)


def test_decode_with_a_passed_growing_cache_sees_every_key() -> None:
    # causal with T=1 is bottom-right aligned: the new query sees all cached keys, no mask needed
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV)
    cache = KVCache.growing(k[:, :0], v[:, :0])
    out, cache = module(q[:, :5], k[:, :5], v[:, :5], cache=cache, mode="prefill")
    np.testing.assert_allclose(out.attention_outputs, want[:, :5], atol=2e-5)
    for i in range(5, T):
        out, cache = module(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache=cache)
        np.testing.assert_allclose(out.attention_outputs, want[:, i:i + 1], atol=2e-5)
    assert cache.key.shape == (B, T, HKV, D) and cache.index is None
    assert not hasattr(module, "cache_index")  # a passed cache is returned, never held


def test_fixed_cache_under_jax_jit() -> None:
    q, k, v = states()
    want = reference(q, k, v)
    module = FlexibleAttentionModule(HQ, D, HKV)
    traces: list[int] = []

    @jax.jit
    def decode(cache: KVCache, q: Any, k: Any, v: Any) -> tuple[Any, KVCache]:
        traces.append(q.shape[1])  # runs once per trace
        out, cache = module(q, k, v, cache=cache)
        return out.attention_outputs, cache

    cache = KVCache.empty(B, 16, HKV, D)
    out, cache = decode(cache, q[:, :6], k[:, :6], v[:, :6])
    np.testing.assert_allclose(out, want[:, :6], atol=2e-5)
    for i in range(6, T):
        out, cache = decode(cache, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
        np.testing.assert_allclose(out, want[:, i:i + 1], atol=2e-5)
    assert traces == [6, 1]  # one trace for the prefill, one for every decode step: static shapes


def test_modes_are_checked() -> None:
    q, k, v = states()
    module = FlexibleAttentionModule(HQ, D, HKV)
    with pytest.raises(ValueError, match="needs a KV cache"):
        module(q, k, v, mode="decode")
    cache = KVCache.empty(B, 16, HKV, D)
    with pytest.raises(ValueError, match="T=1"):
        module(q, k, v, cache=cache, mode="decode")
    with pytest.raises(ValueError, match="takes no cache"):
        module(q, k, v, cache=cache, mode="train")
    with pytest.raises(ValueError, match="overflow"):
        module(q, k, v, cache=KVCache.empty(B, 8, HKV, D))
    with pytest.raises(ValueError, match="BTHD"):
        module(q.transpose(0, 2, 1, 3), k, v)
    with pytest.raises(ValueError, match="multiple"):
        FlexibleAttentionModule(4, D, 3)


def test_dropout_uses_the_module_rngs() -> None:
    q, k, v = states()
    module = FlexibleAttentionModule(HQ, D, HKV, dropout_prob=0.5, rngs=nnx.Rngs(dropout=0))
    quiet = module(q, k, v).attention_outputs  # deterministic by default
    np.testing.assert_allclose(quiet, reference(q, k, v), atol=2e-5)
    noisy1 = module(q, k, v, deterministic=False).attention_outputs
    noisy2 = module(q, k, v, deterministic=False).attention_outputs
    assert not np.allclose(noisy1, quiet) and not np.allclose(noisy1, noisy2)  # the stream advances
    with pytest.raises(ValueError, match="rngs"):
        FlexibleAttentionModule(HQ, D, HKV, dropout_prob=0.5)(q, k, v, deterministic=False)


def test_gradients_flow_through_the_module() -> None:
    q, k, v = states()
    module = FlexibleAttentionModule(HQ, D, HKV)
    grads = jax.grad(lambda q, k, v: module(q, k, v).attention_outputs.sum(), argnums=(0, 1, 2))(q, k, v)
    want = oracle.attention_backward(np.asarray(q), np.asarray(k), np.asarray(v),
                                     np.ones((B, T, HQ, D)), causal=True)
    for got, ref in zip(grads, (want.dq, want.dk, want.dv), strict=True):
        np.testing.assert_allclose(got, ref, atol=5e-5)


def test_explain_and_benchmarks_for_its_own_shapes() -> None:
    module = FlexibleAttentionModule(HQ, D, HKV)
    exp = module.explain(batch_size=1, seq_len=32)
    assert exp.chosen is not None and exp.problem.heads_kv == HKV
    report = module.run_attention_benchmarks(batch_sizes=(1,), sequence_lengths=(16, 32), warmup=0, repeats=2)
    assert [s.label for s in report.config.shapes] == ["B1 S16 H4/2 D8 causal", "B1 S32 H4/2 D8 causal"]
    assert report.config.backends[-1] == "auto" and "vanilla" in report.config.backends
    ok = {(r.backend, r.mode) for r in report.results if r.ok}
    assert {("vanilla", "fwd"), ("vanilla", "fwdbwd"), ("auto", "fwd"), ("auto", "fwdbwd")} <= ok
    assert all(r.tflops and r.tflops > 0 for r in report.results if r.ok)


class _NoKvLengths(VanillaAttention):
    """vanilla without ``Feature.KV_LENGTHS``: the module must mask a fixed cache itself."""

    features = VanillaAttention.features - {Feature.KV_LENGTHS}

    @classmethod
    def get_impl_name(cls) -> str:
        return "test_no_kv_lengths"


@pytest.mark.parametrize("impl", ["auto", "no_kv_lengths"])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, (2, 0)), (True, 3), (False, (1, 2)),
                                                (False, None), (True, (10**12, 0))])
def test_a_fixed_cache_aligns_causal_and_window_to_the_last_written_token(causal: bool, window: Any,
                                                                          impl: str) -> None:
    """Prefill then decode into a KVCache.empty buffer longer than the sequence (GQA): every step
    must see what the contract's kv_lengths alignment gives, not a window aligned to the
    buffer's end (a prefill error of ~2 and decode outputs of zeros before)."""
    q, k, v = (np.asarray(x) for x in states())
    module = FlexibleAttentionModule(HQ, D, HKV, causal=causal, sliding_window=window)
    if impl == "no_kv_lengths":
        module.impl = _NoKvLengths()
        assert module.impl.supports(q, k, v, kv_lengths=np.full(B, T, np.int32))  # declines: the mask path runs
    cache = KVCache.empty(B, 16, HKV, D)
    unbounded = window if window != (10**12, 0) else (T, 0)  # wider than any sequence: no key is hidden
    outputs = []
    for start, stop in [(0, 5), *((i, i + 1) for i in range(5, T))]:  # a prefill of 5, then decode steps
        out, cache = module(q[:, start:stop], k[:, start:stop], v[:, start:stop], cache=cache)
        want = oracle.attention(q[:, start:stop], k[:, :stop], v[:, :stop], causal=causal,
                                sliding_window=unbounded).output  # bottom-right: the queries are the last positions
        np.testing.assert_allclose(out.attention_outputs, want, atol=2e-5, err_msg=f"positions {start}:{stop}")
        outputs.append(np.asarray(out.attention_outputs))
    assert int(cache.index) == T
    if causal:  # causal steps are rows of one full-sequence computation
        full = oracle.attention(q, k, v, causal=True, sliding_window=unbounded).output
        np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=2e-5)


def test_a_held_fixed_cache_with_a_window_under_nnx_jit() -> None:
    q, k, v = states()
    want = oracle.attention(*(np.asarray(x) for x in (q, k, v)), causal=True, sliding_window=(2, 0)).output
    module = FlexibleAttentionModule(HQ, D, HKV, sliding_window=(2, 0))
    module.init_cache(B, max_length=16)
    step = nnx.jit(lambda m, q, k, v: m(q, k, v).attention_outputs)
    np.testing.assert_allclose(step(module, q[:, :6], k[:, :6], v[:, :6]), want[:, :6], atol=2e-5)
    for i in range(6, T):
        np.testing.assert_allclose(step(module, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1]), want[:, i:i + 1],
                                   atol=2e-5)


def test_the_old_import_path_says_where_the_module_went() -> None:
    """``jaxattn.flax`` left the core (the core imports no plugin): importing it names the new path."""
    with pytest.raises(ImportError, match=r"from jaxattn_flax import FlexibleAttentionModule.*jaxattn\[flax\]"):
        import jaxattn.flax  # noqa: F401
