"""jaxattn's dispatch frames stay out of the source locations JAX records in programs: the
same backend reached by name or through ``impl="auto"`` lowers to the very same program
(Mosaic GPU kernels embed those locations; a different text is a different program to XLA)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from jaxattn.locations import DISPATCH_DIR, leave_dispatch_out_of_locations


def _lowered(impl: str, causal: bool) -> str:
    q = jnp.ones((1, 64, 4, 32), jnp.float32)
    k = jnp.ones((1, 64, 2, 32), jnp.float32)

    def call(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jaxattn.attention(q, k, v, causal=causal, impl=impl)

    text: str = jax.jit(call).lower(q, k, k).as_text(debug_info=True)
    return text


@pytest.mark.parametrize("causal", [False, True])
def test_auto_lowers_to_the_program_of_the_impl_it_picks(causal: bool) -> None:
    if not leave_dispatch_out_of_locations():
        pytest.skip("this jax has no jax.extend.source_info_util.register_exclusion")
    q = jnp.ones((1, 64, 4, 32), jnp.float32)
    chosen = jaxattn.explain(q, q[:, :, :2], q[:, :, :2], causal=causal).chosen
    assert chosen and chosen != "auto"
    # From one call site: the caller's own frames are part of every location.
    by_name, by_auto = (_lowered(impl, causal) for impl in (chosen, "auto"))
    files = set(re.findall(r'loc\("([^"]+\.py)"', by_name))
    assert files, "the lowering carries no file locations: nothing was compared"
    assert not [f for f in files if f.startswith(DISPATCH_DIR)], files
    assert by_auto == by_name
