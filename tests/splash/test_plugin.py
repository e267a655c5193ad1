"""jaxattn-splash as a plugin: lazy registration, the alias, the visible vanilla fallback,
the ranking against flash_attn2 by TPU generation, and what it declines."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
import jaxattn.backend.impl
from jaxattn.api import calls as api
from jaxattn.api import compose
from jaxattn.backend.device import DeviceInfo
from jaxattn.errors import UnsupportedError
from jaxattn.testing import oracle

INTERPRET = jaxattn.AttentionMetadata(platform="tpu", interpret=True)


def test_discovery_and_listing_import_no_kernel() -> None:
    script = textwrap.dedent(
        """
        import sys
        import jaxattn_splash.plugin
        assert "jax" not in sys.modules, "the entry-point module imported jax"
        import jaxattn
        rows = {r.name: r for r in jaxattn.list_impls()}
        assert rows["splash"].distribution == "jaxattn-splash", rows["splash"]
        assert "blocksparse" in rows["splash"].aliases
        impl = jaxattn.get_impl("blocksparse", jaxattn.AttentionMetadata(platform="tpu", interpret=True))
        import jax
        x = jax.ShapeDtypeStruct((1, 8, 2, 128), "float32")
        assert impl.name() == "splash" and impl.supports(x, x, x, causal=True, sliding_window=4) == []
        kernels = [m for m in sys.modules if m.startswith("jax.experimental.pallas")]
        assert not kernels, kernels
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_public_api_matches_the_oracle() -> None:
    q, k, v = _inputs(6, 9, 128)
    out = jaxattn.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), impl="splash", causal=True,
                            sliding_window=(4, 0), metadata=INTERPRET)
    ref = oracle.attention(q, k, v, causal=True, sliding_window=(4, 0)).output
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def _inputs(t: int, s: int, d: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(t * 1000 + d)
    return rng.standard_normal((1, t, 4, d)), rng.standard_normal((1, s, 2, d)), rng.standard_normal((1, s, 2, d))


@pytest.mark.parametrize(("t", "d", "why"), [(1, 128, "decode step"), (5, 72, "head dim 72")])
def test_fallback_to_vanilla_is_visible_and_exact(
    t: int, d: int, why: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The core logs each fallback once per process, when it plans the call (the plan is then
    # memoised on the impl jaxattn.get_impl built); other tests may have had this one.
    monkeypatch.setattr(compose, "_logged", set())
    api._composed.cache_clear()
    q, k, v = _inputs(t, 11, d)
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    explained = str(jaxattn.explain(*args, impl="splash", causal=True, metadata=INTERPRET))
    assert "falls back on vanilla" in explained and why in explained
    with caplog.at_level(logging.INFO, logger="jaxattn"):
        out = jaxattn.attention(*args, impl="splash", causal=True, metadata=INTERPRET)
        jaxattn.attention(*args, impl="splash", causal=True, metadata=INTERPRET)
    lines = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage() and why in r.getMessage()]
    assert len(lines) == 1, lines  # logged once, not per call
    np.testing.assert_allclose(np.asarray(out), oracle.attention(q, k, v, causal=True).output, atol=1e-5)

    strict = INTERPRET.replace(allow_fallback=False)
    with pytest.raises(UnsupportedError) as info:
        jaxattn.attention(*args, impl="splash", causal=True, metadata=strict)
    assert any(why in r and "allow_fallback=False" in r for r in info.value.reasons)


def test_declines_masks_biases_and_dropout_with_reasons() -> None:
    x = jax.ShapeDtypeStruct((1, 8, 2, 128), "float32")
    impl = jaxattn.get_impl("splash", INTERPRET.replace(block_q=100))
    reasons = impl.supports(x, x, x, mask=jnp.ones((8, 8), bool), bias=jnp.zeros((8, 8)), dropout_prob=0.1,
                             dropout_rng=jax.random.key(0))
    reasons += jaxattn.get_impl("splash", INTERPRET.replace(softmax_dtype="bfloat16")).supports(x, x, x)
    for word in ("mask", "bias", "dropout", "block_q=100", "softmax_dtype='bfloat16'"):
        assert any(word in r for r in reasons), (word, reasons)


@pytest.mark.parametrize(("generation", "prefer"), [("v2", "flash_attn2"), ("v3", "flash_attn2"),
                                                    ("v4", "splash"), ("v5e", "splash"), ("v7x", "splash")])
def test_ranked_against_flash_attn2_by_generation(generation: str, prefer: str) -> None:
    device = DeviceInfo("tpu", device_kind=f"TPU {generation}", tpu_generation=generation)
    splash = jaxattn.get_impl("splash", INTERPRET).priority_for(device)
    flash = jaxattn.get_impl("flash_attn2", INTERPRET).priority_for(device)
    assert (splash > flash) == (prefer == "splash")


def test_infinite_sinks_zero_their_heads_and_minus_inf_is_no_sink() -> None:
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, 4, 128)), jnp.float32) for _ in range(3))
    aux = np.array([np.inf, 0.5, -np.inf, 1.0], np.float32)
    with jax.default_matmul_precision("highest"):
        out = jaxattn.attention(q, k, v, causal=True, softmax_aux=jnp.asarray(aux), impl="splash", metadata=INTERPRET)
    want = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), causal=True, softmax_aux=aux).output
    assert not np.asarray(out)[:, :, 0].any()
    np.testing.assert_allclose(out, want, atol=2e-3)
