"""jaxattn-pallas as a plugin: lazy registration, the public API, and what it declines."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxattn
from jaxattn.errors import ImplNotFoundError, UnsupportedError
from jaxattn.testing import oracle

INTERPRET = jaxattn.AttentionMetadata(platform="tpu", interpret=True)


def test_discovery_and_listing_import_no_kernel() -> None:
    # A fresh interpreter: this process has long imported the kernels.
    script = textwrap.dedent(
        """
        import sys
        import jaxattn_pallas.plugin
        assert "jax" not in sys.modules, "the entry-point module imported jax"
        import jaxattn
        rows = [r for r in jaxattn.list_impls() if r.name == "flash_attn2" and "tpu" in r.platforms]
        assert rows and rows[0].distribution == "jaxattn-pallas", rows
        impl = jaxattn.get_impl("flash_attn2", jaxattn.AttentionMetadata(platform="tpu", interpret=True))
        import jax
        x = jax.ShapeDtypeStruct((1, 8, 2, 16), "float32")
        assert impl.supports(x, x, x, causal=True) == []
        kernels = [m for m in sys.modules if m.startswith("jax.experimental.pallas")]
        assert not kernels, kernels
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_public_api_matches_the_oracle() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 5, 4, 16), (2, 11, 2, 16), (2, 11, 2, 16)))
    out = jaxattn.attention(*(jax.numpy.asarray(a, "float32") for a in (q, k, v)), impl="flash_attn2",
                            causal=True, metadata=INTERPRET)
    np.testing.assert_allclose(np.asarray(out), oracle.attention(q, k, v, causal=True).output, atol=1e-5)


def test_on_a_cpu_it_says_where_it_runs() -> None:
    with pytest.raises(ImplNotFoundError) as info:
        jaxattn.get_impl("flash_attn2")
    text = str(info.value)
    for part in ("runs on tpu", "jaxattn-pallas", "vanilla", "interpret=True"):
        assert part in text, (part, text)


def test_unsupported_features_and_block_sizes_are_declined_with_reasons() -> None:
    x = jax.ShapeDtypeStruct((1, 16, 2, 32), "float32")
    impl = jaxattn.get_impl("flash_attn2", INTERPRET.replace(block_k=100))
    reasons = impl.supports(x, x, x, sliding_window=4, logits_soft_cap=5.0)
    assert any("sliding window" in r for r in reasons)
    assert any("soft cap" in r for r in reasons)
    assert any("block_k=100" in r and "128" in r for r in reasons)
    q = jax.numpy.zeros((1, 16, 2, 32))
    with pytest.raises(UnsupportedError) as info:
        impl(q, q, q, sliding_window=4)
    assert len(info.value.reasons) == 2
    assert jaxattn.get_impl("flash_attn2", INTERPRET).supports(x, x, x, softmax_aux=jax.numpy.zeros(2))
    wide = jaxattn.get_impl("flash_attn2", INTERPRET.replace(softmax_dtype="float64")).supports(x, x, x)
    assert any("softmax_dtype='float64'" in r for r in wide)
    half = x.update(dtype="float16")
    assert any("float16" in r for r in jaxattn.get_impl("flash_attn2", INTERPRET).supports(half, half, half))
