"""``jaxattn_flax.dot_product_attention`` as the ``attention_fn`` of Flax's own modules.

Outputs and gradients are compared with the same module running Flax's own attention, on the
rows that see at least one key (a row with nothing visible is zeros in jaxattn, Flax's uniform
average: the documented difference), eagerly and under jit; decoding with Flax's cache too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxattn
from jaxattn.testing import oracle
from jaxattn_flax import dot_product_attention

B, T, F, H = 2, 8, 16, 4
LENGTHS = np.array([8, 5])  # the second sequence is padded after 5 tokens
VALID = np.arange(T)[None, :] < LENGTHS[:, None]  # (B, T): query rows that see a key
IMPLS = ["auto", "vanilla"]


def inputs(t: int = T, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (B, t, F))


def flax_mask() -> jax.Array:
    """Causal and padding, built as Flax users build them (float32 masks)."""
    valid = jnp.asarray(VALID)
    return nnx.combine_masks(nnx.make_causal_mask(valid), nnx.make_attention_mask(valid, valid))


def nnx_mha(attention_fn: Any = None, **kw: Any) -> nnx.MultiHeadAttention:
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(num_heads=H, in_features=F, qkv_features=F, decode=False, rngs=nnx.Rngs(0),
                                  **extra, **kw)


def valid_rows(x: Any) -> np.ndarray:
    return np.asarray(x)[VALID]


def cotangent() -> jax.Array:
    # weights only the rows that see a key: the gradients then compare exactly with Flax's
    return jax.random.normal(jax.random.key(5), (B, T, F)) * jnp.asarray(VALID)[..., None]


def _loss(module: Any, x: Any, mask: Any) -> Any:
    return jnp.sum(module(x, mask=mask) * cotangent())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_nnx_multi_head_attention(impl: str, jit: bool, kv_heads: int) -> None:
    ours = nnx_mha(functools.partial(dot_product_attention, impl=impl), num_kv_heads=kv_heads)
    theirs = nnx_mha(num_kv_heads=kv_heads)
    x, mask = inputs(), flax_mask()
    grad = nnx.value_and_grad(_loss, argnums=(0, 1))
    if jit:
        grad = nnx.jit(grad)
    (loss, (g_mod, g_x)) = grad(ours, x, mask)
    (want_loss, (want_mod, want_x)) = grad(theirs, x, mask)
    np.testing.assert_allclose(valid_rows(ours(x, mask=mask)), valid_rows(theirs(x, mask=mask)), atol=2e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, want_x, atol=5e-5)
    got, want = jax.tree.leaves(nnx.state(g_mod)), jax.tree.leaves(nnx.state(want_mod))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impl", IMPLS)
def test_linen_multi_head_dot_product_attention(impl: str, jit: bool) -> None:
    ours = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=F,
                                           attention_fn=functools.partial(dot_product_attention, impl=impl))
    theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=F)
    x, mask = inputs(), flax_mask()
    params = theirs.init(jax.random.key(0), x, mask=mask)

    def loss(module: nn.Module, params: Any, x: Any) -> Any:
        return jnp.sum(module.apply(params, x, mask=mask) * cotangent())

    grad = jax.value_and_grad(loss, argnums=(1, 2))
    if jit:
        grad = jax.jit(grad, static_argnums=0)
    (got_loss, got), (want_loss, want) = grad(ours, params, x), grad(theirs, params, x)
    np.testing.assert_allclose(valid_rows(ours.apply(params, x, mask=mask)),
                               valid_rows(theirs.apply(params, x, mask=mask)), atol=2e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_decode_with_flax_cache(impl: str, jit: bool) -> None:
    ours = nnx_mha(functools.partial(dot_product_attention, impl=impl), num_kv_heads=2)
    theirs = nnx_mha(num_kv_heads=2)
    x = inputs()
    full = theirs(x, mask=nnx.make_causal_mask(jnp.ones((B, T))))
    for m in (ours, theirs):
        m.init_cache((B, T, F))
    step = nnx.jit(lambda m, x: m(x, decode=True)) if jit else (lambda m, x: m(x, decode=True))
    for i in range(T):
        got, want = step(ours, x[:, i:i + 1]), step(theirs, x[:, i:i + 1])
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"step {i}")
        np.testing.assert_allclose(got, full[:, i:i + 1], atol=2e-5, err_msg=f"step {i}")


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_decode_with_flax_cache(impl: str) -> None:
    kw: dict[str, Any] = {"num_heads": H, "qkv_features": F, "decode": True}
    ours = nn.MultiHeadDotProductAttention(**kw, attention_fn=functools.partial(dot_product_attention, impl=impl))
    theirs = nn.MultiHeadDotProductAttention(**kw)
    x = inputs()
    variables = theirs.init(jax.random.key(0), x)  # decode=True: init builds the (B, T, H, D) cache
    params, cache_ours, cache_theirs = variables["params"], variables["cache"], variables["cache"]
    step = jax.jit(lambda module, params, cache, x: module.apply({"params": params, "cache": cache}, x,
                                                                  mutable=["cache"]), static_argnums=0)
    full = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=F).apply(
        {"params": params}, x, mask=nn.make_causal_mask(jnp.ones((B, T))))
    for i in range(T):
        got, upd_ours = step(ours, params, cache_ours, x[:, i:i + 1])
        want, upd_theirs = step(theirs, params, cache_theirs, x[:, i:i + 1])
        cache_ours, cache_theirs = upd_ours["cache"], upd_theirs["cache"]
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"step {i}")
        np.testing.assert_allclose(got, full[:, i:i + 1], atol=2e-5, err_msg=f"step {i}")


def test_dropout_is_flaxs_without_broadcast() -> None:
    """vanilla draws Flax's own keep-mask (bernoulli(rng, 1 - rate, (B, H, T, S))): the same numbers."""
    kw: dict[str, Any] = {"dropout_rate": 0.3, "broadcast_dropout": False, "num_kv_heads": 2}
    ours = nnx_mha(functools.partial(dot_product_attention, impl="vanilla"), **kw)
    theirs = nnx_mha(**kw)
    x, mask = inputs(), flax_mask()
    for _ in range(2):  # both rng streams advance alike
        got, want = ours(x, mask=mask, deterministic=False), theirs(x, mask=mask, deterministic=False)
        np.testing.assert_allclose(valid_rows(got), valid_rows(want), atol=2e-5)
    np.testing.assert_allclose(valid_rows(ours(x, mask=mask, deterministic=True)),
                               valid_rows(theirs(x, mask=mask, deterministic=True)), atol=2e-5)
    grads = nnx.grad(lambda m: jnp.sum(m(x, mask=mask, deterministic=False) * cotangent()))
    for a, b in zip(jax.tree.leaves(nnx.state(grads(ours))), jax.tree.leaves(nnx.state(grads(theirs))), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_broadcast_dropout_is_refused_by_name() -> None:
    module = nnx_mha(dot_product_attention, dropout_rate=0.1)  # Flax's default broadcast_dropout=True
    x = inputs()
    with pytest.raises(jaxattn.InvalidInputError, match=r"broadcast_dropout.*broadcast_dropout=False"):
        module(x, deterministic=False)
    module(x, deterministic=True)  # no dropout drawn: nothing to refuse
    # one batch row and one head: the shared mask is the independent one
    q = jax.random.normal(jax.random.key(1), (1, T, 1, 8))
    out = dot_product_attention(q, q, q, dropout_rate=0.5, dropout_rng=jax.random.key(2), impl="vanilla")
    want = nnx.dot_product_attention(q, q, q, dropout_rate=0.5, dropout_rng=jax.random.key(2))
    np.testing.assert_allclose(out, want, atol=2e-5)


def _value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value  # flax < 0.12 has only .value


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
def test_sown_weights_are_flaxs() -> None:
    ours, theirs = nnx_mha(functools.partial(dot_product_attention, impl="vanilla")), nnx_mha()
    x, mask = inputs(), flax_mask()
    for m in (ours, theirs):
        m(x, mask=mask, sow_weights=True)
    got, want = (np.asarray(_value(m.attention_weights)[0]) for m in (ours, theirs))
    assert got.shape == want.shape == (B, H, T, T)
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[VALID], want.transpose(0, 2, 1, 3)[VALID], atol=2e-6)
    drop = nnx_mha(dot_product_attention, dropout_rate=0.1, broadcast_dropout=False)
    with pytest.raises(jaxattn.InvalidInputError, match=r"module.*before dropout"):
        drop(x, mask=mask, sow_weights=True, deterministic=False)


@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["no-batch", "two-batch-dims"])
def test_any_number_of_batch_dims(batch: tuple[int, ...]) -> None:
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (*batch, T, 4, 8))
    k, v = (jax.random.normal(kk, (*batch, T, 2, 8)) for kk in keys[1:3])
    bias = jax.random.normal(keys[3], (*batch[1:], 1, T, T))  # fewer leading dims: broadcast
    mask = nnx.make_causal_mask(jnp.ones((*batch, T)))
    out = dot_product_attention(q, k, v, bias=bias, mask=mask)
    # Flax's own reshapes a bias of rank > 4 without broadcasting it: give it the full shape
    want = nnx.dot_product_attention(q, k, v, bias=jnp.broadcast_to(bias, (*batch, 1, T, T)), mask=mask)
    assert out.shape == want.shape == (*batch, T, 4, 8)
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_is_causal_is_top_left_as_in_flax(jit: bool) -> None:
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (B, 5, H, 8))
    k, v = (jax.random.normal(kk, (B, 9, H, 8)) for kk in keys[1:])
    fn = jax.jit(dot_product_attention, static_argnames="is_causal") if jit else dot_product_attention
    out = fn(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, nnx.dot_product_attention(q, k, v, is_causal=True), atol=2e-5)
    # the oracle's bottom-right rule with the shift undone: query i sees keys j <= i
    want = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v),
                            mask=np.tril(np.ones((5, 9), bool))[None, None]).output
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mask_mod_and_score_mod_pass_through_flaxs_module(jit: bool) -> None:
    # A Flax module given ALiBi and a window as programs, beside Flax's padding mask: the oracle
    # with the same rules; b is the flattened batch (here Flax's batch itself).
    from jaxattn import masks

    slopes = jnp.exp2(-jnp.arange(1.0, H + 1))
    fn = functools.partial(dot_product_attention, impl="vanilla", mask_mod=masks.sliding_window(3),
                           score_mod=masks.alibi(slopes))
    mha, x = nnx_mha(fn), inputs()
    mask = flax_mask()
    run = nnx.jit(lambda m, x: m(x, mask=mask)) if jit else (lambda m, x: m(x, mask=mask))
    got = run(mha, x)
    q, k, v = (proj(x) for proj in (mha.query, mha.key, mha.value))  # (B, T, H, F // H)
    ref = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), mask=np.asarray(mask) != 0,
                           mask_mod=masks.sliding_window(3), score_mod=masks.alibi(np.asarray(slopes)))
    want = mha.out(jnp.asarray(ref.output, jnp.float32))
    np.testing.assert_allclose(valid_rows(got), valid_rows(want), atol=2e-5)


def test_dtype_promotes_as_flax() -> None:
    q = inputs(seed=1).reshape(B, T, H, 4)
    out = dot_product_attention(q, q, q, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), nnx.dot_product_attention(q, q, q), atol=3e-2)
    assert dot_product_attention(q.astype(jnp.bfloat16), q, q).dtype == jnp.float32  # promoted, as Flax does


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    q = inputs().reshape(B, T, H, 4)
    for name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
        with pytest.raises(jaxattn.InvalidInputError, match=name):
            dot_product_attention(q, q, q, **{name: jnp.einsum})
    with pytest.raises(jaxattn.InvalidInputError, match="precision"):
        dot_product_attention(q, q, q, precision=("highest", "default"))
    with pytest.raises(jaxattn.InvalidInputError, match="dropout_rng"):
        dot_product_attention(q, q, q, dropout_rate=0.1, broadcast_dropout=False)
    np.testing.assert_allclose(dot_product_attention(q, q, q, precision=jax.lax.Precision.HIGHEST),
                               nnx.dot_product_attention(q, q, q), atol=2e-5)
    with pytest.raises(jaxattn.InvalidInputError, match="qk_attn_weights_einsum"):  # linen passes it by name
        nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=F, attention_fn=dot_product_attention,
                                        qk_attn_weights_einsum_cls=lambda: jnp.einsum).init(jax.random.key(0),
                                                                                            inputs())


def test_keywords_a_later_flax_may_pass() -> None:
    q = inputs().reshape(B, T, H, 4)
    np.testing.assert_allclose(dot_product_attention(q, q, q, out_sharding=None, some_flag=False),
                               nnx.dot_product_attention(q, q, q), atol=2e-5)
    with pytest.raises(jaxattn.InvalidInputError, match=r"^some_flag: not an argument"):
        dot_product_attention(q, q, q, some_flag=True)
