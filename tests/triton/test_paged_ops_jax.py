"""The JAX entry points of the paged kernels (``paged_ops``), through the interpreter.

``interpret=True`` sends each launch through ``jax.pure_callback`` to the Triton interpreter,
so this checks the GPU path minus ``triton_call``: argument checking, layouts (combined
``kv_pages`` without a copy), the dense cache seen as pages, reshapes of the outputs and the
log-sum-exp, jit, and the forward-only guard. Also ``flash_attn2``'s decode path, which
runs T == 1 calls through ``dense_decode`` and differentiates them with the flash backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.testing import oracle
from jaxattn_triton.decode import ops as decode_ops
from jaxattn_triton.decode.ops import dense_decode
from jaxattn_triton.decode.reference import dense_decode_reference
from jaxattn_triton.paged import launch as LP
from jaxattn_triton.paged.ops import paged_decode, ragged_paged

from ._env import needs_interpreter
from .test_paged_kernels import Paged, make, reference

pytestmark = [
    needs_interpreter,
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]

TOL = 2e-5


def _ref(p: Paged, x: dict[str, Any], **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    return reference(
        x["q"], np.nan_to_num(x["k_pages"]), np.nan_to_num(x["v_pages"]), x["page_table"], x["kv_lengths"],
        x["cu_q_lens"], p.num_seqs, scale=p.d**-0.5, sinks=x["sinks"], **kw,
    )  # fmt: skip


def _f32(a: np.ndarray) -> jax.Array:
    return jnp.asarray(a, jnp.float32)


def test_paged_decode_separate_layout_under_jit() -> None:
    p = Paged(q_len=2, hq=4, hkv=2, kv_lens=(30, 1, 50), sinks=True)
    x = make(p)
    n = p.num_seqs

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array, lens: jax.Array, sinks: jax.Array) -> Any:
        return paged_decode(q, k, v, table, lens, sinks=sinks, num_splits=2, return_lse=True, interpret=True)

    q = _f32(x["q"]).reshape(n, 2, 4, p.d)
    out, lse = run(q, _f32(x["k_pages"]), _f32(x["v_pages"]), x["page_table"], x["kv_lengths"], _f32(x["sinks"]))
    want, want_lse = _ref(p, x)
    assert out.shape == (n, 2, 4, p.d) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 4, p.d), want, atol=TOL, rtol=TOL)
    assert lse.shape == (n, 4, 2)
    np.testing.assert_allclose(np.asarray(lse).transpose(0, 2, 1).reshape(-1, 4), want_lse, atol=TOL, rtol=TOL)


def test_paged_decode_combined_layout_window_soft_cap() -> None:
    p = Paged(q_len=1, hq=4, hkv=2, kv_lens=(45, 9, 64))
    x = make(p)
    kv = np.stack([x["k_pages"], x["v_pages"]], axis=3).reshape(*x["k_pages"].shape[:2], 4, p.d)
    q = _f32(x["q"]).reshape(p.num_seqs, 1, 4, p.d)
    out = paged_decode(
        q, None, None, jnp.asarray(x["page_table"]), jnp.asarray(x["kv_lengths"]), kv_pages=_f32(kv),
        logits_soft_cap=1.5, window_left=10, interpret=True,
    )  # fmt: skip
    want, _ = _ref(p, x, softcap=1.5, left=10)
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 4, p.d), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("num_seqs_as_scalar", [False, True])
def test_ragged_paged_padding_rows_are_zero(num_seqs_as_scalar: bool) -> None:
    p = Paged(q_len=None, q_lens=(3, 1, 0, 4), kv_lens=(20, 33, 5, 4), pad_seqs=1, pad_tokens=3, hq=4, hkv=1)
    x = make(p)
    ns: Any = p.num_seqs if num_seqs_as_scalar else jnp.asarray(x["num_seqs"])

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        return ragged_paged(
            q, k, v, jnp.asarray(x["page_table"]), jnp.asarray(x["kv_lengths"]), jnp.asarray(x["cu_q_lens"]), ns,
            return_lse=True, interpret=True,
        )  # fmt: skip

    out, lse = run(_f32(x["q"]), _f32(x["k_pages"]), _f32(x["v_pages"]))
    want, want_lse = _ref(p, x)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL, rtol=TOL)
    assert np.all(np.asarray(out)[-3:] == 0.0)


def _dense_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray, *, left: int | None, right: int | None,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The dense decode's own reference (``decode.reference``, beside the kernel), checked here
    against the paged one with the dense cache as one page per sequence; a query at a negative
    position (``lens[b] - T + i < 0``) is no token of its sequence: zeros, lse -inf (docs/contract.md)."""
    b, t, hq, d = q.shape
    cu = np.arange(b + 1) * t
    table = np.arange(b)[:, None]
    out, lse = reference(
        q.reshape(b * t, hq, d), k, v, table, lens, cu, b, scale=d**-0.5, left=left, right=right, sinks=sinks
    )
    real = (np.asarray(lens)[:, None] - t + np.arange(t)[None, :] >= 0)  # (B, T)
    out = np.where(real[:, :, None, None], out.reshape(b, t, hq, -1), 0.0)
    lse = np.where(real[:, None, :], lse.reshape(b, t, hq).transpose(0, 2, 1), -np.inf)
    own, own_lse = dense_decode_reference(q, k, v, lens, causal=False, window=(left, right), sinks=sinks)
    np.testing.assert_allclose(own, out, atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(own_lse, lse, atol=1e-12, rtol=1e-12)
    return own, own_lse


@pytest.mark.parametrize(
    ("causal", "window", "t"),
    [(True, None, 1), (True, (5, 0), 3), (False, None, 2), (False, (4, 2), 3), (True, 6, 1)],
)
def test_dense_decode_with_lengths(causal: bool, window: Any, t: int) -> None:
    rng = np.random.default_rng(5)
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    q = rng.standard_normal((b, t, hq, d))
    k = rng.standard_normal((b, s, hkv, d))
    v = rng.standard_normal((b, s, hkv, d + 8))
    lens = np.array([40, 17, 2], np.int32)
    sinks = rng.standard_normal(hq)
    out, lse = dense_decode(
        _f32(q), _f32(k), _f32(v), jnp.asarray(lens), causal=causal, window=window, sinks=_f32(sinks),
        num_splits=2, return_lse=True, interpret=True,
    )  # fmt: skip
    pair = (window, window) if isinstance(window, int) else window
    left, right = (None, None) if pair is None else pair
    if causal:
        right = 0 if right is None else min(right, 0)
    want, want_lse = _dense_reference(q, k, v, lens, left=left, right=right, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_dense_decode_several_kv_heads_per_program(kv_heads: int) -> None:
    # The dense cache seen as pages, with a tile's columns spanning several KV heads.
    rng = np.random.default_rng(8)
    b, t, s, hq, hkv, d = 3, 2, 45, 8, 4, 16
    q, k, v = (rng.standard_normal(shape) for shape in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
    lens = np.array([45, 20, 1], np.int32)
    spec = decode_ops.dense_spec(_f32(q), _f32(k), _f32(v), causal=True, window=7)
    tiles = dataclasses.replace(LP.default_tiles(spec, num_splits=2), kv_heads=kv_heads, block_n=16)
    out = dense_decode(_f32(q), _f32(k), _f32(v), jnp.asarray(lens), causal=True, window=7, tiles=tiles,
                       interpret=True)  # fmt: skip
    want, _ = _dense_reference(q, k, v, lens, left=7, right=0, sinks=None)
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)


def test_dense_decode_full_cache_matches_oracle() -> None:
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 8, 16))
    k = rng.standard_normal((2, 37, 1, 16))
    v = rng.standard_normal((2, 37, 1, 16))
    out = dense_decode(_f32(q), _f32(k), _f32(v), causal=True, logits_soft_cap=2.0, interpret=True)
    want = oracle.attention(q, k, v, causal=True, logits_soft_cap=2.0).output
    np.testing.assert_allclose(np.asarray(out), want, atol=TOL, rtol=TOL)


def test_forward_only() -> None:
    rng = np.random.default_rng(7)
    q, k, v = (_f32(rng.standard_normal(shape)) for shape in ((1, 1, 2, 16), (1, 20, 1, 16), (1, 20, 1, 16)))

    def loss(q: jax.Array) -> jax.Array:
        out = dense_decode(q, k, v, causal=True, interpret=True)
        assert isinstance(out, jax.Array)
        return jnp.sum(out)

    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(loss)(q)


def test_argument_errors() -> None:
    q = jnp.zeros((2, 1, 4, 16))
    k = jnp.zeros((5, 8, 2, 16))
    table = jnp.zeros((2, 3), jnp.int32)
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="either kv_pages or k_pages"):
        paged_decode(q, k, k, table, lens, kv_pages=jnp.zeros((5, 8, 4, 16)))
    with pytest.raises(ValueError, match="share a dtype"):
        paged_decode(q.astype(jnp.float16), k, k, table, lens)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode(q, k, k, jnp.zeros((3, 3), jnp.int32), lens)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(q, k, k, table, lens, sinks=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged(q[:, 0], k, k, table, lens, jnp.zeros((2,), jnp.int32), 1)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        paged_decode(jnp.zeros((2, 1, 3, 16)), k, k, table, lens)


def test_empty_batch() -> None:
    out = dense_decode(jnp.zeros((0, 1, 2, 16)), jnp.zeros((0, 8, 1, 16)), jnp.zeros((0, 8, 1, 16)), causal=True)
    assert isinstance(out, jax.Array) and out.shape == (0, 1, 2, 16)


# -- flash_attn2's decode path ------------------------------------------------------------


def _flash_impl() -> Any:
    from .test_conformance import InterpretedTritonFlash

    return InterpretedTritonFlash()


@pytest.mark.parametrize(
    "features",
    [
        {"causal": True},
        {"causal": True, "sliding_window": (6, 0), "softmax_aux": True},
        {"causal": False, "logits_soft_cap": 2.0},
    ],
)
def test_flash_attn2_decode_runs_dense_decode_and_differentiates(
    features: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = decode_ops.decode_with_flash_grad

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_ops, "decode_with_flash_grad", counted)
    rng = np.random.default_rng(8)
    b, s, hq, hkv, d = 2, 29, 4, 2, 16
    q, k, v = (rng.standard_normal(sh) for sh in ((b, 1, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
    dout = rng.standard_normal((b, 1, hq, d))
    kw = {n: f for n, f in features.items() if n != "softmax_aux"}
    sinks = rng.standard_normal(hq) if features.get("softmax_aux") else None
    if sinks is not None:
        kw["softmax_aux"] = _f32(sinks)
    impl = _flash_impl()

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
        res = impl(q, k, v, **kw)
        return jnp.sum(res.attention_outputs * _f32(dout)), res

    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(_f32(q), _f32(k), _f32(v))
    assert calls, "flash_attn2 did not take the decode path"
    okw: dict[str, Any] = {n: features[n] for n in ("causal", "sliding_window", "logits_soft_cap") if n in features}
    if sinks is not None:
        okw["softmax_aux"] = sinks
    ref = oracle.attention(q, k, v, **okw)
    np.testing.assert_allclose(np.asarray(res.attention_outputs), ref.output, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(res.softmax_lse), ref.lse, atol=1e-4, rtol=1e-4)
    want = oracle.attention_backward(q, k, v, dout, **okw)
    for name, g, w in zip(("dq", "dk", "dv"), grads, (want.dq, want.dk, want.dv), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, rtol=2e-4, err_msg=name)


def test_flash_attn2_decode_with_mask_keeps_the_flash_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mask (or bias, segment ids) is outside dense_decode: the existing kernels run T == 1.
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decode path taken with a mask")

    monkeypatch.setattr(decode_ops, "decode_with_flash_grad", fail)
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(sh) for sh in ((1, 1, 2, 16), (1, 21, 1, 16), (1, 21, 1, 16)))
    mask = rng.random((1, 1, 1, 21)) > 0.3
    res = _flash_impl()(_f32(q), _f32(k), _f32(v), mask=jnp.asarray(mask))
    want = oracle.attention(q, k, v, mask=mask).output
    np.testing.assert_allclose(np.asarray(res.attention_outputs), want, atol=1e-4, rtol=1e-4)


def test_flash_attn2_declares_decode() -> None:
    from jaxattn.backend.capabilities import Feature
    from jaxattn_triton.flash.impl import TritonFlashAttention

    assert Feature.DECODE in TritonFlashAttention.features
    assert set(TritonFlashAttention.dtypes) <= LP.DTYPES


def test_flash_attn2_accepts_decode_on_an_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode steps were declined ("no split-K decode kernel") before dense_decode existed.
    from jaxattn.backend.device import DeviceInfo
    from jaxattn.backend.metadata import AttentionMetadata
    from jaxattn.backend.problem import AttentionProblem
    from jaxattn_triton.flash import impl as impl_module

    monkeypatch.setattr(impl_module, "_installed", lambda module: True)
    h100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    impl = impl_module.TritonFlashAttention(AttentionMetadata(), h100)
    problem = AttentionProblem(
        batch=16, seq_q=1, seq_k=8192, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
        dtype="bfloat16", causal=True, sliding_window=(1024, 0), logits_soft_cap=30.0, sinks=True,
        needs_grad=True,
    )  # fmt: skip
    assert impl.not_supported_reasons(problem) == []
