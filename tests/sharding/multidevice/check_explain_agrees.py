"""``jaxattn.explain`` runs the checks the call runs: on a mesh, a call that raises
``InvalidInputError`` before its kernel (T = 30 over a 4-device sequence axis for ring, B = 3 over
a 2-device batch axis for the decode backend) makes ``explain`` raise the same error, instead of
naming a backend."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.errors import InvalidInputError

from ._util import mesh, requires_8_devices

pytestmark = requires_8_devices

CASES = {
    "ring, T=30 over 4": ((4,), ("seq",), {"sequence_axis": "seq"}, (1, 30, 2, 8), 30, True, "ring"),
    "decode, B=3 over 2": ((2,), ("data",), {"batch_axis": "data"}, (3, 1, 2, 8), 16, False, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_explain_raises_what_the_call_raises(case: str) -> None:
    shape, names, axes, q_shape, s, causal, impl = CASES[case]
    md = jaxattn.AttentionMetadata(mesh=mesh(shape, names), **axes)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal(q_shape), jnp.float32)
    k = jnp.asarray(rng.standard_normal((q_shape[0], s, 2, 8)), jnp.float32)
    kw: dict[str, Any] = {"causal": causal, "metadata": md}
    if impl is None:
        kw["kv_lengths"] = jnp.asarray([s] * q_shape[0], jnp.int32)
    with pytest.raises(InvalidInputError) as call_error:
        jaxattn.attention(q, k, k, impl=impl, **kw)
    with pytest.raises(InvalidInputError) as explain_error:
        jaxattn.explain(q, k, k, impl=impl, **kw)
    assert str(explain_error.value) == str(call_error.value)
