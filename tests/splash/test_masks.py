"""splash with a static mask_mod, in TPU interpret mode: with segment ids and with causal T > S
(the paths the conformance cases do not take), K and V poisoned with NaN at keys no query of a KV
head sees; forward and gradients against vanilla. The suite (test_conformance.py) covers the rest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle

INTERPRET = jaxattn.AttentionMetadata(platform="tpu", interpret=True)


def _mod(b: jax.Array, h: jax.Array, i: jax.Array, j: jax.Array) -> jax.Array:
    return ((j + h // 2) % 5 != 4) & (j <= i + 3)  # every fifth key hidden per KV head


@pytest.mark.parametrize(("t", "s", "segments", "causal"), [(12, 12, True, False), (10, 6, False, True)])
def test_static_mask_mod_with_segments_and_dropped_rows(t: int, s: int, segments: bool, causal: bool) -> None:
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 128))
    k = jax.random.normal(keys[1], (2, s, 2, 128))
    v = jax.random.normal(keys[2], (2, s, 2, 128))
    feats: dict = {"causal": causal, "mask_mod": _mod}
    if segments:
        ids = jnp.asarray([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3], jnp.int32)
        feats.update(q_segment_ids=ids, kv_segment_ids=ids)
    # Keys hidden from every query of a KV head (mask_mod and segments), poisoned.
    vis = oracle.visibility(2, 4, t, s, causal=causal, mask_mod=_mod,
                                            q_segment_ids=feats.get("q_segment_ids"),
                                            kv_segment_ids=feats.get("kv_segment_ids"))
    unseen = ~vis.reshape(2, 2, 2, t, s).any(axis=(2, 3))  # (B, Hkv, S)
    assert unseen.any()
    poison = jnp.asarray(unseen.transpose(0, 2, 1)[..., None])
    kp, vp = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)

    def loss(impl: str, md: jaxattn.AttentionMetadata | None, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(jaxattn.attention(q, k, v, impl=impl, metadata=md, **feats)))

    want, want_g = jax.value_and_grad(lambda *a: loss("vanilla", None, *a), argnums=(0, 1, 2))(q, k, v)
    got, got_g = jax.jit(jax.value_and_grad(lambda *a: loss("splash", INTERPRET, *a), argnums=(0, 1, 2)))(q, kp, vp)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
