"""Random valid dense calls (hypothesis) against the float64 oracle, through every dense backend here.

Each example draws one call: shapes (T != S included), a GQA ratio, the dtype, causal, a
sliding window, a soft cap, sinks, ``kv_lengths``, a bias or a mask. Every registered dense
backend usable on this machine whose ``supports(...)`` accepts the call must match the oracle,
eagerly and under ``jax.jit`` (XLA's default options), within the dtype's tolerance from
``jaxattn.testing.cases``. The profile is fixed and derandomized, so CI sees the same calls
every run; ``JAXATTN_PROPERTY_EXAMPLES`` asks for more locally.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn
from jaxattn.testing import oracle
from jaxattn.testing.cases import DEFAULT_TOLERANCES, round_to_dtype
from jaxattn.testing.compare import assert_close
from jaxattn.testing.quick_jit import default_compiler_options

EXAMPLES = int(os.environ.get("JAXATTN_PROPERTY_EXAMPLES") or 6)


def _dense_backends() -> list[str]:
    """Names of the dense backends registered and usable here (ring needs a mesh: its supports() says so)."""
    return sorted({i.name for i in jaxattn.list_impls() if i.kind == "dense" and i.usable_here})


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    """One valid dense call as float64 NumPy arrays (rounded to its dtype) and keywords."""
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    b = draw(st.integers(1, 2))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    t = draw(st.integers(1, 9))
    s = draw(st.integers(1, 13))
    d = draw(st.sampled_from([8, 16]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["sliding_window"] = (draw(st.integers(0, 6)), draw(st.integers(0, 6)))
    if draw(st.booleans()):
        kw["logits_soft_cap"] = draw(st.sampled_from([1.5, 5.0]))
    if draw(st.booleans()):
        kw["softmax_aux"] = rng.normal(size=(hq,)).astype(np.float32).astype(np.float64)
    if draw(st.booleans()):
        kw["kv_lengths"] = np.asarray(draw(st.lists(st.integers(0, s), min_size=b, max_size=b)), np.int32)
    extra = draw(st.sampled_from(["none", "bias", "mask"]))
    if extra == "bias":
        kw["bias"] = round_to_dtype(rng.normal(size=(1, hq, t, s)), dtype)
    elif extra == "mask":
        kw["mask"] = rng.random((b, 1, t, s)) > 0.3
    q = round_to_dtype(rng.normal(size=(b, t, hq, d)), dtype)
    k = round_to_dtype(rng.normal(size=(b, s, hkv, d)), dtype)
    v = round_to_dtype(rng.normal(size=(b, s, hkv, d)), dtype)
    return {"dtype": dtype, "q": q, "k": k, "v": v, "kw": kw}


def _jax_kw(kw: dict[str, Any], dtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in kw.items():
        if name == "bias":
            out[name] = jnp.asarray(value, dtype)
        elif name == "softmax_aux":
            out[name] = jnp.asarray(value, jnp.float32)
        elif isinstance(value, np.ndarray):
            out[name] = jnp.asarray(value)
        else:
            out[name] = value
    return out


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(call=calls())
def test_every_backend_that_accepts_a_random_call_matches_the_oracle(call: dict[str, Any]) -> None:
    dtype = call["dtype"]
    kw = call["kw"]
    want = oracle.attention(call["q"], call["k"], call["v"], **kw).output
    q, k, v = (jnp.asarray(call[n], dtype) for n in ("q", "k", "v"))
    jkw = _jax_kw(kw, dtype)
    arrays = {n: a for n, a in jkw.items() if hasattr(a, "shape")}
    static = {n: a for n, a in jkw.items() if not hasattr(a, "shape")}
    tol = DEFAULT_TOLERANCES[dtype].forward
    ran = []
    for name in _dense_backends():
        impl = jaxattn.get_impl(name)
        if impl.supports(q, k, v, **jkw):
            continue
        ran.append(name)
        label = f"{name} {dtype} q{q.shape} k{k.shape} {sorted(kw)} {static}"
        with jax.default_matmul_precision("highest"):
            eager = impl(q, k, v, **jkw).attention_outputs
            jitted = jax.jit(lambda q, k, v, a, impl=impl: impl(q, k, v, **a, **static).attention_outputs,
                             compiler_options=default_compiler_options())(
                q, k, v, arrays)
        assert_close(f"eager {label}", eager, want, tol)
        assert_close(f"jit {label}", jitted, want, tol)
    assert "vanilla" in ran, "vanilla takes every dense call"


def test_the_profile_is_fixed() -> None:
    """CI runs the same examples every time: derandomized, no example database."""
    wrapped = test_every_backend_that_accepts_a_random_call_matches_the_oracle
    chosen = wrapped.hypothesis.inner_test  # type: ignore[attr-defined]
    assert chosen is not None
    current = getattr(wrapped, "_hypothesis_internal_use_settings", None)
    if current is None:
        pytest.skip("this hypothesis keeps its settings elsewhere")
    assert current.derandomize and current.deadline is None and current.max_examples == EXAMPLES
