"""``jaxattn_sdpa.residual.cudnn_backward`` binds jax's private cuDNN backward primitive, whose
parameters change between jax releases (jax 0.12 added ``score_mod``). It runs only on a GPU,
but it lowers for CUDA on any host: lowering checks the binding against this jax's primitive, so
a jax that changes it fails here, on the CPU, and not in a user's first training step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxattn_sdpa import residual


@pytest.mark.parametrize("causal", [False, True])
def test_the_cudnn_backward_lowers_for_cuda_on_this_jax(causal: bool) -> None:
    if residual.unavailable() is not None:
        pytest.skip(str(residual.unavailable()))
    x = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 4, 256), jnp.float32)

    def grads(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array) -> object:
        return residual.cudnn_backward(q, k, v, out, lse, d_out, causal=causal)

    lowered = jax.jit(grads).trace(x, x, x, x, lse, x).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("custom_call") == 1 and "cudnn" in text


def test_the_binding_is_available_on_the_jax_releases_it_was_written_for() -> None:
    # jax 0.10-0.12 all expose the primitive; a jax that drops it is declined with the reason
    # (unavailable()), and this test says the binding needs a look.
    assert residual.unavailable() is None
