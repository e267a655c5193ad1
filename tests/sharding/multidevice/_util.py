"""Shared helpers of the multi-device checks: inputs, the oracle comparison, meshes.

These modules run only in the subprocess that ``tests/sharding/test_multidevice.py`` starts
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (they are named ``check_*.py``
so that the main test run, whose jax has one CPU device, never collects them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxattn.testing import oracle

NEEDED_DEVICES = 8

requires_8_devices = pytest.mark.skipif(
    jax.device_count() < NEEDED_DEVICES,
    reason="needs 8 devices: run through tests/sharding/test_multidevice.py, or with "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8",
)


def mesh(shape: Sequence[int], names: Sequence[str]) -> Mesh:
    """A mesh over the first prod(shape) CPU devices."""
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(tuple(shape)), tuple(names))


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    t: int
    s: int
    hq: int
    hkv: int
    d: int
    dv: int


def inputs(shape: Shape, seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """q, k, v and an output cotangent, rounded to ``dtype`` (the oracle sees the same values)."""
    rng = np.random.default_rng(seed)

    def draw(*dims: int) -> np.ndarray:
        return np.asarray(jnp.asarray(rng.normal(size=dims), dtype).astype(np.float32))

    s = shape
    return {
        "q": draw(s.b, s.t, s.hq, s.d),
        "k": draw(s.b, s.s, s.hkv, s.d),
        "v": draw(s.b, s.s, s.hkv, s.dv),
        "do": draw(s.b, s.t, s.hq, s.dv),
    }


def packed_segments(rng: np.random.Generator, b: int, n: int, segments: int = 3) -> np.ndarray:
    """Sorted segment ids whose boundaries fall anywhere, shard boundaries included."""
    cuts = np.sort(rng.integers(1, n, size=(b, segments - 1)), axis=1)
    ids: np.ndarray = (np.arange(n)[None, None, :] >= cuts[:, :, None]).sum(axis=1).astype(np.int32)
    return ids


def assert_close(label: str, got: Any, want: np.ndarray, tol: float) -> None:
    """``|got - want| <= tol * max(1, max|want|)`` elementwise; -inf must match exactly."""
    got64 = np.asarray(np.asarray(got, dtype=np.float32), dtype=np.float64)
    assert got64.shape == want.shape, f"{label}: shape {got64.shape}, expected {want.shape}"
    finite = np.isfinite(want)
    assert np.array_equal(got64[~finite], want[~finite]), f"{label}: non-finite entries differ"
    err = np.abs(np.where(finite, got64 - want, 0.0))
    bound = tol * max(1.0, float(np.abs(np.where(finite, want, 0.0)).max(initial=0.0)))
    assert err.max(initial=0.0) <= bound, f"{label}: max abs error {err.max():.3g} > {bound:.3g}"


Attention = Callable[..., Any]


def check_against_oracle(
    attend: Attention,
    data: dict[str, np.ndarray],
    *,
    tol: float = 2e-5,
    grad_tol: float = 5e-5,
    grads: bool = True,
    bias: np.ndarray | None = None,
    softmax_aux: np.ndarray | None = None,
    **features: Any,
) -> None:
    """Forward and gradients of ``attend(q, k, v, bias=, softmax_aux=, **features)`` vs the oracle.

    Gradients (unless ``grads=False``) are those of ``sum(out * do)`` with respect to q, k,
    v, and bias and softmax_aux when given; both run in one jitted program, as in training.
    """

    def loss_parts(q: Any, k: Any, v: Any, bias: Any, aux: Any) -> Any:
        return attend(q, k, v, bias=bias, softmax_aux=aux, **features)

    @jax.jit
    def forward_backward(q: Any, k: Any, v: Any, bias: Any, aux: Any, do: Any) -> Any:
        if not grads:
            return loss_parts(q, k, v, bias, aux), None
        out, vjp = jax.vjp(loss_parts, q, k, v, bias, aux)
        return out, vjp(do)

    as_jnp = {key: jnp.asarray(x) for key, x in data.items()}
    out, got_grads = forward_backward(as_jnp["q"], as_jnp["k"], as_jnp["v"], bias, softmax_aux, as_jnp["do"])
    ref = oracle.attention(data["q"], data["k"], data["v"], bias=bias, softmax_aux=softmax_aux, **features)
    assert_close("output", out, ref.output, tol)
    if not grads:
        return
    ref_grads = oracle.attention_backward(
        data["q"], data["k"], data["v"], data["do"], bias=bias, softmax_aux=softmax_aux, **features
    )
    for name, got, want in zip(
        ("dq", "dk", "dv", "dbias", "dsoftmax_aux"),
        got_grads,
        (ref_grads.dq, ref_grads.dk, ref_grads.dv, ref_grads.dbias, ref_grads.dsoftmax_aux),
        strict=True,
    ):
        if want is not None:
            assert_close(name, got, want, grad_tol)
