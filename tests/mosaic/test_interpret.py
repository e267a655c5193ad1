"""mosaic_flash's Mosaic GPU kernels run on a CPU in jax's Mosaic GPU interpreter (the
``mosaic_interpreter`` fixture, ``conftest.py``), against the float64 oracle: the forward, dQ and
dK/dV kernels with a mask_mod's bits and tile lists (GQA, T != S, rows that see no key, keys no
query sees poisoned with NaN, masks of b and h), and the kernels' causal, windowed and persistent
schedules, with the interpreter's race detector on. Through the impl too, differentiated, as a
GPU user calls it (the bits an argument of its custom gradient). Each kernel call runs alone (the
interpreter's simulated GPU is one global state), so nothing here runs under ``jax.jit``; the mods
run under each of the strict modes too."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import masks
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.testing import oracle
from jaxattn.testing.cases import DEFAULT_TOLERANCES
from jaxattn.testing.compare import assert_close
from jaxattn.testing.strict import STRICT_MODES
from jaxattn_mosaic import backward_kernel as KB
from jaxattn_mosaic import kernel as K
from jaxattn_mosaic import mods
from jaxattn_mosaic.impl import MosaicFlashAttention

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
TOL = DEFAULT_TOLERANCES["bfloat16"]


def _inputs(b: int, t: int, s: int, hq: int, hkv: int, d: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    raw = {n: rng.normal(size=(b, n_, h, d)) for n, n_, h in (("q", t, hq), ("k", s, hkv), ("v", s, hkv),
                                                               ("do", t, hq))}
    arrays = {n: jnp.asarray(x, jnp.bfloat16) for n, x in raw.items()}
    return arrays, {n: np.asarray(a, np.float64) for n, a in arrays.items()}


def _check(got: Any, x: dict[str, np.ndarray], grads: bool, **rules: Any) -> None:
    ref = oracle.attention(x["q"], x["k"], x["v"], **rules)
    out, lse = (np.asarray(a, np.float64) for a in got[:2])
    assert_close("output", out, ref.output, TOL.forward)
    finite = np.isfinite(ref.lse)
    assert np.array_equal(np.isfinite(lse), finite)  # rows that see no key: -inf
    assert np.max(np.abs(np.where(finite, lse, 0.0) - np.where(finite, ref.lse, 0.0)), initial=0.0) < 1e-2
    if grads:
        want = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], **rules)
        for name, g, r in zip(("dq", "dk", "dv"), got[2:], (want.dq, want.dk, want.dv), strict=True):
            assert_close(name, np.asarray(g, np.float64), r, TOL.grad)


def _kernels(a: dict[str, Any], bits: Any, grads: bool, **kw: Any) -> list[Any]:
    scale = a["q"].shape[-1] ** -0.5
    out, lse = K.mosaic_attention_forward(a["q"], a["k"], a["v"], softmax_scale=scale, bits=bits, **kw)
    got = [out, lse]
    if grads:
        kw.pop("config", None)
        got += KB.mosaic_attention_backward(a["q"], a["k"], a["v"], out, lse, a["do"], None, softmax_scale=scale,
                                            bits=bits, **kw)
    return [np.asarray(g) for g in got]


def _seen_after(diag: int, left: int) -> Any:
    return lambda b, h, qi, kv: kv >= qi + (diag - left)


#: (B, T, S, Hq, Hkv, D, the mask_mod's name, causal, gradients).
MOD_CASES = [
    (2, 130, 130, 2, 2, 128, "prefix", False, True),  # per-sequence prefixes, rows padded to a tile
    (1, 300, 200, 2, 1, 64, "band", True, True),  # T > S: rows 0..99 see no key (bottom-right)
    (1, 200, 200, 1, 1, 256, "chunked", False, False),  # head dim 256: the forward only
]


@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "name", "causal", "grads"), MOD_CASES)
def test_mask_mod_kernels_in_the_interpreter(mosaic_interpreter: Any, b: int, t: int, s: int, hq: int, hkv: int,
                                             d: int, name: str, causal: bool, grads: bool) -> None:
    mask_mod = {"prefix": masks.prefix_lm(jnp.asarray([20, 100][:b], jnp.int32)),
                "band": _seen_after(0, 150), "chunked": masks.chunked_causal(70)}[name]
    a, x = _inputs(b, t, s, hq, hkv, d)
    bits = mods.call_bits(mask_mod, None, batch=b, heads=hq, t_len=t, s_len=s, causal=causal, window=(None, None))
    with mosaic_interpreter():
        got = _kernels(a, bits, grads, causal=False)
    _check(got, x, grads, mask_mod=mask_mod, causal=causal)


@pytest.mark.parametrize("q_double", [False, True])
def test_a_persistent_mask_mod_forward_in_the_interpreter(mosaic_interpreter: Any, q_double: bool) -> None:
    """Two CTAs loop over the tiles of a band (query tiles of 0, 1 and 2 blocks: rows 0..99 see
    no key) and of per-head prefixes, the K/V ring and the bits' slots carried from tile to tile."""
    b, t, s, hq, hkv, d = 1, 512, 384, 4, 2, 64
    prefixes = jnp.asarray([300, 10, 128, 0], jnp.int32)
    mask_mod = masks.or_(_seen_after(0, 150), lambda b_, h, qi, kv: kv < prefixes[h])
    a, x = _inputs(b, t, s, hq, hkv, d)
    bits = mods.call_bits(mask_mod, None, batch=b, heads=hq, t_len=t, s_len=s, causal=True, window=(None, None))
    config = dataclasses.replace(K.mod_config(d), persistent=True, q_double=q_double, ctas=2)
    with mosaic_interpreter():
        got = _kernels(a, bits, False, causal=False, config=config)
    _check(got, x, False, mask_mod=mask_mod, causal=True)


@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "window", "config", "grads"), [
    (1, 256, 384, 2, 1, 64, True, None, None, True),  # T < S: the bottom-right diagonal, a key block past S
    (1, 256, 100, 2, 1, 64, True, (40, 0), None, False),  # T > S: rows 0..155 see no key (lse -inf)
    (1, 256, 256, 1, 1, 64, True, (70, 0), None, True),  # a window's band, masked at both edges
    (1, 256, 256, 1, 1, 64, True, None, K.Config(persistent=True, q_double=True, scheduled=True, ctas=2), False),
])
def test_the_kernels_schedules_in_the_interpreter(mosaic_interpreter: Any, b: int, t: int, s: int, hq: int,
                                                  hkv: int, d: int, causal: bool, window: Any, config: Any,
                                                  grads: bool) -> None:
    a, x = _inputs(b, t, s, hq, hkv, d)
    with mosaic_interpreter():
        got = _kernels(a, None, grads, causal=causal, sliding_window=window, config=config)
    _check(got, x, grads, causal=causal, sliding_window=window)


def test_the_impl_differentiated_with_a_mask_mod_in_the_interpreter(mosaic_interpreter: Any) -> None:
    # As a GPU user calls it: traced document ids (the last keys in no document) ANDed
    # with a rule of h and bottom-right causal, T < S, GQA; K and V NaN at the keys no query of
    # their KV head sees (unread, and their gradients 0).
    b, t, s, hq, hkv, d = 1, 200, 300, 2, 1, 64
    a, x = _inputs(b, t, s, hq, hkv, d)
    ids = np.searchsorted([50, 51, 130], np.arange(s), side="right")
    kv_ids = jnp.asarray(np.where(np.arange(s) < s - 40, ids, -1)[None], jnp.int32)
    q_ids = jnp.asarray(ids[None, s - t:], jnp.int32)
    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def rule(qi: Any, kv: Any) -> Any:
        return masks.and_(masks.document(qi, kv), lambda bb, h, q_, k_: (h == 0) | (k_ % 3 == 0))

    def loss(q: Any, k: Any, v: Any, qi: Any, kv: Any) -> Any:
        res = impl(q, k, v, causal=True, mask_mod=rule(qi, kv))
        return jnp.sum(res.attention_outputs.astype(jnp.float32) * a["do"].astype(jnp.float32)), res

    seen = mods.unread_zeroed(jnp.ones((b, s, hkv, 1)), jnp.ones((b, s, hkv, 1)), mods.call_bits(
        rule(q_ids, kv_ids), None, batch=b, heads=hq, t_len=t, s_len=s, causal=True, window=(None, None)))[0] != 0
    assert not bool(jnp.all(seen))
    k_bad, v_bad = (jnp.where(seen, a[n], jnp.nan) for n in ("k", "v"))
    # Eagerly: under jax.jit, XLA may run the independent dQ and dK/dV kernels at once, and the
    # interpreter's simulated GPU is one global state (it hangs); the GPU tests run it jitted.
    with mosaic_interpreter():
        (_, res), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            a["q"], k_bad, v_bad, q_ids, kv_ids)
    dk, dv = (np.asarray(g, np.float64) for g in grads[1:])
    for g in (dk, dv):
        assert np.all(g[~np.broadcast_to(np.asarray(seen), g.shape)] == 0)
    _check([res.attention_outputs, res.softmax_lse, *grads], x, True, causal=True, mask_mod=rule(q_ids, kv_ids))


def _alibi_through_the_impl(interpreter: Any, b: int, t: int, s: int, hq: int, hkv: int, d: int, mask_mod: Any,
                            cap: float | None) -> None:
    # masks.alibi's term added in registers, forward and backward, and its slopes' gradient from
    # the dQ kernel's row sums, through the impl as a GPU user calls it (the slopes an argument of
    # its custom gradient, differentiated).
    a, x = _inputs(b, t, s, hq, hkv, d)
    slopes = jnp.asarray(3.0 * np.exp2(-8.0 * np.arange(1, hq + 1) / hq), jnp.float32)
    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def loss(q: Any, k: Any, v: Any, slopes: Any) -> Any:
        res = impl(q, k, v, causal=True, mask_mod=mask_mod, score_mod=masks.alibi(slopes), logits_soft_cap=cap)
        return jnp.sum(res.attention_outputs.astype(jnp.float32) * a["do"].astype(jnp.float32)), res

    with interpreter():
        (_, res), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(a["q"], a["k"], a["v"], slopes)
    rules = {"causal": True, "mask_mod": mask_mod, "logits_soft_cap": cap, "score_mod": masks.alibi,
             "score_params": np.asarray(slopes, np.float64)}
    _check([res.attention_outputs, res.softmax_lse, *grads[:3]], x, True, **rules)
    want = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], **rules)
    assert_close("d slopes", np.asarray(grads[3], np.float64), want.dscore_params, TOL.grad)


@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "name", "cap"), [
    (1, 256, 256, 2, 1, 64, None, None),  # ALiBi over causal attention, GQA
    (1, 200, 300, 2, 2, 64, "chunked", 20.0),  # with a mask_mod's lists and a soft cap, T < S
])
def test_alibi_in_the_interpreter(mosaic_interpreter: Any, b: int, t: int, s: int, hq: int, hkv: int, d: int,
                                  name: str | None, cap: float | None) -> None:
    _alibi_through_the_impl(mosaic_interpreter, b, t, s, hq, hkv, d, masks.chunked_causal(64) if name else None, cap)


@pytest.mark.parametrize("strict_mode", sorted(STRICT_MODES))
def test_mods_under_strict_modes_in_the_interpreter(mosaic_interpreter: Any, strict_mode: str) -> None:
    # The mask_mod path (its bits, lists and the zeroing of keys no query sees: here 100..191) and
    # ALiBi's slopes gradient under the modes JAX's tests and careful users run: rank promotion
    # "raise", NaN/Inf checks, jax's internal checks. Every row sees a key, so no -inf reaches an
    # output the Inf check reads; the rows the kernels pad (100..127) see none, and must leave no
    # Inf in the kernels' outputs either.
    with STRICT_MODES[strict_mode]():
        _alibi_through_the_impl(mosaic_interpreter, 1, 100, 192, 2, 1, 64, masks.chunked_causal(64), None)
    # Without a mask_mod: a causal window over GQA, T < S, whose padded rows (8..127: one consumer's
    # tile all padding) see no key through it, forward and backward.
    a, x = _inputs(2, 8, 24, 4, 2, 64)
    with STRICT_MODES[strict_mode](), mosaic_interpreter():
        got = _kernels(a, None, True, causal=True, sliding_window=(4, 0))
    _check(got, x, True, causal=True, sliding_window=(4, 0))
