"""``jaxattn_mosaic.kernel.exp2_fma``, the forward's exp2 on the FMA units (``Config.exp2_fma_cols``),
against float64 ``2**x``, eager and under jit, on a CPU (it is plain jax), and the configurations
that use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn_mosaic.kernel import Config, exp2_fma

# Every softmax input is <= 0 (scores minus the row max); masked keys give about -1e29.
_X = np.concatenate([np.linspace(-125, 0, 100_001, dtype=np.float32),
                     np.float32([-0.0, -1e-8, -0.5, -0.49999997, -0.50000006, -1.5, -2.5, -124.5])])


@pytest.mark.parametrize("jit", [False, True])
def test_exp2_fma_against_float64(jit: bool) -> None:
    fn = jax.jit(exp2_fma) if jit else exp2_fma
    got = np.asarray(fn(jnp.asarray(_X)), np.float64)
    want = np.exp2(_X.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 4e-6


@pytest.mark.parametrize("jit", [False, True])
def test_exp2_fma_far_below_gives_a_negligible_weight(jit: bool) -> None:
    fn = jax.jit(exp2_fma) if jit else exp2_fma
    got = np.asarray(fn(jnp.float32([-125.5, -126.0, -1000.0, -1e29, -1e30])))
    assert np.all((got > 0) & (got < 3e-38))


def test_configurations_that_take_it() -> None:
    assert Config(exp2_fma_cols=64).exp2_fma_cols == 64
    assert Config(block_kv=192, exp2_fma_cols=128).exp2_fma_cols == 128
    for bad in ({"exp2_fma_cols": 32}, {"exp2_fma_cols": 128}, {"exp2_fma_cols": 64, "overlap": True}):
        with pytest.raises(ValueError, match="exp2_fma_cols"):
            Config(**bad)  # type: ignore[arg-type]
