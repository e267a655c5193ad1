"""What ``sdpa_attention`` hands to jax.nn, and the paths the conformance suite does not reach.

The suite runs under jit, so segment ids are always traced there; the concrete padding path
(sequence lengths), the exact operands of each translation, and the refusal of gradients
cuDNN would get wrong are checked here, against the oracle where numbers are involved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.validation import resolve_call
from jaxattn.errors import UnsupportedError
from jaxattn.testing import oracle
from jaxattn_sdpa.kernel import sdpa_attention

_jax_nn_dpa = jax.nn.dot_product_attention


class Spy:
    """Records every jax.nn.dot_product_attention call; runs XLA (cuDNN calls included)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kw: Any) -> Any:
        self.calls.append({"key": key, "bias": bias, "mask": mask, **kw})
        kw["implementation"] = "xla"
        return _jax_nn_dpa(query, key, value, bias, mask, **kw)

    @property
    def last(self) -> dict[str, Any]:
        return self.calls[-1]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    recorder = Spy()
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    return recorder


def inputs(
    b: int = 2, t: int = 6, s: int = 6, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.normal(size=shape), jnp.float32)  # type: ignore[return-value]
        for shape in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d))
    )


def check(out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, **features: Any) -> None:
    as_numpy: dict[str, Any] = {n: np.asarray(x) if hasattr(x, "shape") else x for n, x in features.items()}
    want = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), **as_numpy).output
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_plain_call_is_jax_nn_plain(spy: Spy) -> None:
    q, k, v = inputs()
    sdpa_attention(q, k, v, softmax_scale=0.25)
    assert spy.last == {"key": k, "bias": None, "mask": None, "scale": 0.25, "implementation": "xla"}
    sdpa_attention(q, k, v, softmax_scale=8**-0.5)  # the default: jax.nn's own (1 / sqrt(D))
    assert spy.last["scale"] is None
    sdpa_attention(q, k, v, causal=True)  # T == S: bottom-right is top-left
    assert spy.last["is_causal"] is True and spy.last["mask"] is None and "local_window_size" not in spy.last
    q1, _, _ = inputs(t=1)
    sdpa_attention(q1, k, v, causal=True)  # decode sees every key: no masking at all
    assert "is_causal" not in spy.last and spy.last["mask"] is None


def test_bottom_right_causal_is_a_band_on_xla(spy: Spy) -> None:
    q, k, v = inputs(t=3, s=7)
    out = sdpa_attention(q, k, v, causal=True)
    assert spy.last["local_window_size"] == (2, 4) and "is_causal" not in spy.last
    check(out, q, k, v, causal=True)


def test_concrete_padding_segments_become_lengths(spy: Spy) -> None:
    q, k, v = inputs(t=6, s=7)
    q_ids = np.array([[1, 1, 1, 1, 0, 0], [2, 2, 2, 2, 2, 2]], np.int32)
    kv_ids = np.array([[1, 1, 1, 0, 0, 0, 0], [2, 2, 2, 2, 2, 3, 3]], np.int32)
    # Padded queries 4, 5 of row 0 share id 0 with padded keys: that is packing, not padding.
    out = sdpa_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert spy.last["mask"] is not None and "query_seq_lengths" not in spy.last
    check(out, q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    kv_ids[0, 3:] = 9  # now padded queries see nothing: lengths
    for causal in (False, True):
        out = sdpa_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=causal)
        assert spy.last["mask"] is None
        assert spy.last["query_seq_lengths"].tolist() == [4, 6]
        assert spy.last["key_value_seq_lengths"].tolist() == [3, 5]
        check(out, q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=causal)
        assert not np.asarray(out[0, 4:]).any()  # padded queries give zeros


def test_traced_segments_become_a_mask(spy: Spy) -> None:
    q, k, v = inputs()
    ids = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], jnp.int32)
    out = jax.jit(lambda q, k, v, ids: sdpa_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids))(q, k, v, ids)
    assert spy.last["mask"] is not None and "key_value_seq_lengths" not in spy.last
    check(out, q, k, v, q_segment_ids=ids, kv_segment_ids=ids)


def test_one_segment_masks_nothing(spy: Spy) -> None:
    q, k, v = inputs()
    ids = np.zeros((2, 6), np.int32)
    sdpa_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
    assert spy.last["mask"] is None and "query_seq_lengths" not in spy.last


@pytest.mark.parametrize(("s", "columns"), [(7, 1), (8, 2)])
def test_cudnn_sinks_keep_the_parity_of_s(spy: Spy, s: int, columns: int) -> None:
    q, k, v = inputs(t=s, s=s)
    aux = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    out = sdpa_attention(q, k, v, softmax_aux=aux, causal=True, implementation="cudnn")
    call = spy.last
    assert call["key"].shape[1] == s + columns
    assert call["bias"].shape == (1, 4, s, s + columns) and call["bias"].dtype == q.dtype
    assert call["mask"].shape[-2:] == (s, s + columns)
    assert "is_causal" not in call  # T != S + columns: the band is in the mask
    check(out, q, k, v, softmax_aux=aux, causal=True)


def test_sink_with_a_left_window_stays_visible_on_xla(spy: Spy) -> None:
    q, k, v = inputs(t=9, s=9)
    aux = jnp.asarray([3.0, -1.0, 0.0, 1.0], jnp.float32)
    out = sdpa_attention(q, k, v, softmax_aux=aux, sliding_window=(2, 0))
    assert spy.last["mask"] is not None and "local_window_size" not in spy.last
    check(out, q, k, v, softmax_aux=aux, sliding_window=(2, 0))
    out = sdpa_attention(q, k, v, softmax_aux=aux, causal=True)  # no left edge: stays native
    assert spy.last["mask"] is None and spy.last["local_window_size"] == (8, 1)
    check(out, q, k, v, softmax_aux=aux, causal=True)


def test_cudnn_native_window_only_for_t_equal_s(spy: Spy) -> None:
    q, k, v = inputs(t=8, s=8)
    out = sdpa_attention(q, k, v, causal=True, sliding_window=(3, 5), implementation="cudnn")
    assert spy.last["is_causal"] is True and spy.last["local_window_size"] == (3, 0)
    assert spy.last["mask"] is None
    check(out, q, k, v, causal=True, sliding_window=(3, 5))
    q, k, v = inputs(t=8, s=10)
    out = sdpa_attention(q, k, v, causal=True, implementation="cudnn")
    call = spy.last
    assert "is_causal" not in call and call["mask"].shape == (1, 1, 8, 10)
    check(out, q, k, v, causal=True)


def test_cudnn_widens_a_gradient_carrying_bias_to_every_head(spy: Spy) -> None:
    q, k, v = inputs()
    bias = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, 1, 6)), jnp.float32)
    mask = jnp.asarray(np.random.default_rng(2).random((1, 1, 6, 1)) > 0.2)
    out = sdpa_attention(q, k, v, bias=bias, mask=mask, implementation="cudnn")
    assert spy.last["bias"].shape == (1, 4, 6, 6) and spy.last["mask"].shape == (1, 1, 6, 6)
    check(out, q, k, v, bias=bias, mask=mask)

    def loss(bias: jax.Array) -> jax.Array:
        return jnp.sum(sdpa_attention(q, k, v, bias=bias, implementation="cudnn") ** 2)

    def reference(bias: jax.Array) -> jax.Array:
        return jnp.sum(sdpa_attention(q, k, v, bias=bias) ** 2)

    np.testing.assert_allclose(jax.grad(loss)(bias), jax.grad(reference)(bias), atol=1e-5)


def test_cudnn_refuses_a_bias_gradient_it_would_get_wrong(spy: Spy) -> None:
    q, k, v = inputs()
    batched = jnp.ones((2, 4, 6, 6), jnp.float32)
    shared = jnp.ones((1, 4, 6, 6), jnp.float32)
    batch_mask = jnp.ones((2, 1, 6, 6), bool)
    aux = jnp.zeros((4,), jnp.float32)

    def loss(bias: jax.Array, aux: jax.Array | None, mask: jax.Array | None) -> jax.Array:
        return jnp.sum(sdpa_attention(q, k, v, bias=bias, mask=mask, softmax_aux=aux, implementation="cudnn"))

    with pytest.raises(UnsupportedError, match="shared across the batch"):
        jax.grad(loss)(batched, None, None)
    with pytest.raises(UnsupportedError, match="shared across the batch"):
        jax.grad(loss)(shared, None, batch_mask)
    with pytest.raises(UnsupportedError, match="shared across the batch"):
        jax.grad(loss, argnums=1)(shared, aux, batch_mask)
    jax.grad(loss)(shared, None, None)  # the (1, Hq, T, S) layout has its gradient
    # Gradients that do not involve the bias are unaffected, and so is the forward.
    jax.grad(lambda q: jnp.sum(sdpa_attention(q, k, v, bias=batched, implementation="cudnn")))(q)
    check(sdpa_attention(q, k, v, bias=batched, implementation="cudnn"), q, k, v, bias=batched)


def test_rows_without_keys_are_zero_with_zero_gradients() -> None:
    q, k, v = inputs(t=7, s=4)  # causal with T > S: the first 3 queries see nothing

    def loss(q: jax.Array) -> jax.Array:
        return jnp.sum(sdpa_attention(q, k, v, causal=True) ** 2)

    out = sdpa_attention(q, k, v, causal=True)
    assert not np.asarray(out[:, :3]).any()
    check(out, q, k, v, causal=True)
    dq = jax.grad(loss)(q)
    assert np.isfinite(np.asarray(dq)).all() and not np.asarray(dq[:, :3]).any()


def test_runtime_dtype_comes_from_metadata() -> None:
    q, k, v = inputs()
    md = AttentionMetadata(runtime_dtype="bfloat16")
    out = jaxattn.attention(q, k, v, impl="sdpa", metadata=md)
    assert out.dtype == jnp.bfloat16
    want = oracle.attention(*(np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))).output
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)


def test_forward_called_directly_never_drops_a_feature() -> None:
    impl = jaxattn.get_impl("sdpa")
    q, k, v = inputs()
    with pytest.raises(UnsupportedError, match="soft cap"):
        impl.forward_cpu(resolve_call(q, k, v, logits_soft_cap=5.0, softmax_scale=0.3, prepare=True))
    with pytest.raises(UnsupportedError, match="no dropout"):
        impl.forward_cpu(resolve_call(q, k, v, dropout_prob=0.5, dropout_rng=jax.random.key(0), prepare=True))
    # init_bias is called by validation: a direct call on the call object sees the bias.
    bias = jnp.full((1, 1, 6, 6), -1e9).at[..., 0].set(0.0)
    out = impl.forward_cpu(resolve_call(q, k, v, init_bias=lambda: bias, prepare=True)).attention_outputs
    np.testing.assert_allclose(
        np.asarray(out), np.broadcast_to(np.repeat(np.asarray(v[:, :1]), 2, 2), out.shape), atol=1e-6
    )


# -- kv_lengths: a dense KV cache of capacity S ------------------------------------------------


def _rows_see_a_key(mask: jax.Array, t: int, s: int) -> bool:
    return bool(np.asarray(jnp.broadcast_to(mask, (*mask.shape[:2], t, s))).any(axis=-1).all())


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_kv_lengths_decode_is_jax_nn_key_value_seq_lengths(spy: Spy, implementation: str) -> None:
    q, k, v = inputs(b=3, t=1, s=9)
    lengths = jnp.asarray([4, 9, 0], jnp.int32)
    for causal in (False, True):  # for T = 1, causal hides nothing that the length does not
        out = sdpa_attention(q, k, v, causal=causal, kv_lengths=lengths, implementation=implementation)  # type: ignore[arg-type]
        call = spy.last
        assert call["mask"] is None and "is_causal" not in call and "local_window_size" not in call
        # The empty sequence is shown key 0 (never a softmax over nothing, cuDNN's undefined case) ...
        assert call["key_value_seq_lengths"].tolist() == [4, 9, 1]
        check(out, q, k, v, causal=causal, kv_lengths=lengths)
        assert not np.asarray(out[2]).any()  # ... and zeroed after


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_kv_lengths_with_causal_spelled_per_sequence(spy: Spy, implementation: str) -> None:
    q, k, v = inputs(b=3, t=4, s=8)
    lengths = jnp.asarray([2, 8, 0], jnp.int32)  # row 0: queries 0, 1 sit before the cache's start
    out = sdpa_attention(q, k, v, causal=True, kv_lengths=lengths, implementation=implementation)  # type: ignore[arg-type]
    call = spy.last
    assert "is_causal" not in call and "local_window_size" not in call and "key_value_seq_lengths" not in call
    assert call["mask"].shape[0] == 3 and _rows_see_a_key(call["mask"], 4, 8)
    check(out, q, k, v, causal=True, kv_lengths=lengths)
    assert not np.asarray(out[0, :2]).any() and not np.asarray(out[2]).any()

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, impl: str) -> jax.Array:
        out = sdpa_attention(q, k, v, causal=True, kv_lengths=lengths, implementation=impl)  # type: ignore[arg-type]
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, implementation)
    d_out = np.arange(q.size, dtype=np.float64).reshape(q.shape) / q.size
    ref = oracle.attention_backward(np.asarray(q), np.asarray(k), np.asarray(v), d_out, causal=True,
                                    kv_lengths=np.asarray(lengths))
    for got, want in zip(grads, (ref.dq, ref.dk, ref.dv), strict=True):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_kv_lengths_with_a_mask_shows_key_zero_to_empty_rows(spy: Spy, implementation: str) -> None:
    q, k, v = inputs(b=2, t=1, s=6)
    lengths = jnp.asarray([3, 6], jnp.int32)
    mask = jnp.asarray([[[[False, False, False, True, True, True]]], [[[True] * 6]]])  # row 0 sees nothing
    out = sdpa_attention(q, k, v, mask=mask, kv_lengths=lengths, implementation=implementation)  # type: ignore[arg-type]
    call = spy.last
    assert call["key_value_seq_lengths"].tolist() == [3, 6] and _rows_see_a_key(call["mask"], 1, 6)
    check(out, q, k, v, mask=mask, kv_lengths=lengths)
    assert not np.asarray(out[0]).any()


def test_kv_lengths_with_sinks_and_a_window(spy: Spy) -> None:
    q, k, v = inputs(b=2, t=1, s=10)
    lengths = jnp.asarray([0, 7], jnp.int32)
    aux = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    out = sdpa_attention(q, k, v, softmax_aux=aux, kv_lengths=lengths)  # native lengths, one sink key in front
    assert spy.last["key_value_seq_lengths"].tolist() == [1, 8] and spy.last["mask"] is None
    check(out, q, k, v, softmax_aux=aux, kv_lengths=lengths)
    out = sdpa_attention(q, k, v, softmax_aux=aux, kv_lengths=lengths, sliding_window=(2, 0), causal=True,
                         implementation="cudnn")
    assert "key_value_seq_lengths" not in spy.last and spy.last["mask"].shape == (2, 1, 1, 12)
    check(out, q, k, v, softmax_aux=aux, kv_lengths=lengths, sliding_window=(2, 0), causal=True)


def test_kv_lengths_traced_under_jit_and_clamped(spy: Spy) -> None:
    q, k, v = inputs(b=2, t=3, s=8)
    run = jax.jit(lambda q, k, v, n: sdpa_attention(q, k, v, causal=True, kv_lengths=n))
    check(run(q, k, v, jnp.asarray([5, 1], jnp.int32)), q, k, v, causal=True, kv_lengths=np.array([5, 1]))
    # Out-of-range lengths cannot be checked under jit; they are clamped to 0..S, never read past the cache.
    out = run(q, k, v, jnp.asarray([99, -4], jnp.int32))
    check(out, q, k, v, causal=True, kv_lengths=np.array([8, 0]))
