"""Measured ranking: the tuning cache changes auto's pick, deterministically, and only where it may."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.api.split import SplitGradImpl
from jaxattn.backend.device import DeviceInfo
from jaxattn.selection import dispatch
from jaxattn.selection.tuning import TuningCacheWarning

from .helpers import problem, qkv, runtime, store
from .toys import Alpha, Beta, NoGqa, dense, reset_calls

pytestmark = pytest.mark.usefixtures("toys")


def pick(**kw: object) -> str | None:
    q, k, v = qkv(**kw)  # type: ignore[arg-type]
    return jaxattn.explain(q, k, v, causal=True).chosen


def test_declared_priority_without_measurements() -> None:
    assert pick() == "alpha"
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    alpha = next(c for c in exp.candidates if c.name == "alpha")
    assert not alpha.measured and alpha.rank_reason == "declared priority 30"
    assert "rank: declared priority 30" in str(exp)


def test_measurements_reorder_auto_and_explain_says_why() -> None:
    store(problem(), runtime("alpha", 3.0), runtime("beta", 1.0), runtime("nogqa", 2.0))
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    assert exp.chosen == "beta"
    ranked = [c.name for c in exp.candidates if c.accepted]
    assert ranked == ["beta", "nogqa", "alpha"]
    beta = exp.candidates[0]
    assert beta.measured and beta.rank_reason.startswith("your tuning record: measured fwd 1.000 ms (fastest)")
    assert "3.00x the fastest" in next(c for c in exp.candidates if c.name == "alpha").rank_reason
    assert "rank: your tuning record: measured fwd 1.000 ms" in str(exp)
    # the call really runs the measured pick
    reset_calls()
    jaxattn.attention(q, k, v, causal=True)
    assert Beta.calls == ["beta"] and not Alpha.calls


def test_pick_is_deterministic_for_one_cache() -> None:
    # equal times: declared order breaks the tie, every time
    store(problem(), runtime("alpha", 1.0), runtime("beta", 1.0))
    picks = set()
    for _ in range(3):
        dispatch.clear_choices()
        picks.add(pick())
    assert picks == {"alpha"}


def test_times_within_the_tie_tolerance_keep_the_declared_order() -> None:
    # beta measured 0.5% faster than alpha: noise, so declared priority (alpha first) decides;
    # nogqa is clearly faster than both and leads
    store(problem(), runtime("alpha", 1.0), runtime("beta", 0.995))
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    assert exp.chosen == "alpha"
    alpha = exp.candidates[0]
    assert "1.005x the fastest: within 1%, a tie, declared priority 30" in alpha.rank_reason
    assert "(fastest)" in exp.candidates[1].rank_reason
    store(problem(), runtime("alpha", 1.0), runtime("beta", 0.98))  # 2% faster: measured order
    dispatch.clear_choices()
    assert pick() == "beta"
    store(problem(), runtime("alpha", 1.0), runtime("beta", 0.995), runtime("nogqa", 0.5))
    dispatch.clear_choices()
    q, k, v = qkv()
    assert [c.name for c in jaxattn.explain(q, k, v, causal=True).candidates if c.accepted] == [
        "nogqa", "alpha", "beta"]


def test_unmeasured_candidates_follow_the_measured_ones() -> None:
    store(problem(), runtime("nogqa", 1.0))
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    assert [c.name for c in exp.candidates if c.accepted] == ["nogqa", "alpha", "beta"]
    assert "no usable measurement" in exp.candidates[1].rank_reason


def test_a_measured_backend_that_declines_the_call_is_never_picked() -> None:
    # nogqa is "fastest" in a (hand-written) entry for a GQA key, but declines GQA calls
    store(problem(hkv=2), runtime("nogqa", 0.1), runtime("beta", 1.0), runtime("alpha", 2.0))
    assert pick(hkv=2) == "beta"
    q, k, v = qkv(hkv=2)
    exp = jaxattn.explain(q, k, v, causal=True)
    assert not next(c for c in exp.candidates if c.name == "nogqa").accepted


def test_other_shapes_keep_the_declared_order() -> None:
    store(problem(t=16), runtime("beta", 1.0), runtime("alpha", 2.0))
    assert pick(t=16) == "beta"
    assert pick(t=9) == "beta"  # same bucket (16)
    assert pick(t=17) == "alpha"  # next bucket: nothing measured
    assert pick(d=16) == "alpha"


def test_tuning_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    store(problem(), runtime("beta", 1.0), runtime("alpha", 2.0))
    assert pick() == "beta"
    monkeypatch.setenv("JAXATTN_TUNING", "0")
    dispatch.clear_choices()
    assert pick() == "alpha"


def test_measurement_of_another_plugin_version_is_not_used() -> None:
    prob = problem()
    stale = dataclasses.replace(runtime("beta", 0.5), origin="jaxattn-beta", version="0.0.1")
    store(prob, stale, runtime("alpha", 2.0))
    with pytest.warns(TuningCacheWarning, match="beta from jaxattn-beta 0.0.1"):
        assert pick() == "alpha"


def test_corrupt_cache_does_not_break_auto(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuning.json").write_text("\x00garbage")
    q, k, v = qkv()
    with pytest.warns(TuningCacheWarning, match="corrupt"):
        out = jaxattn.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, dense(q, k, v, True, 8 ** -0.5), atol=1e-6)


@pytest.mark.parametrize("info", [
    DeviceInfo(platform="cpu", device_kind="cpu"),
    DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"),
    DeviceInfo(platform="tpu", device_kind="TPU v5 lite", tpu_generation="v5e"),
], ids=["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("measured", [False, True], ids=["declared", "measured"])
def test_get_optimal_config_agrees_with_auto(fake_device: Callable[[DeviceInfo], DeviceInfo], info: DeviceInfo,
                                             measured: bool) -> None:
    fake_device(info)
    name, dtype = jaxattn.get_optimal_config()
    assert dtype == (jnp.float32 if info.platform == "cpu" else jnp.bfloat16)
    shape = jax.ShapeDtypeStruct((1, 2048, 32, 128), dtype)
    if measured:
        # make the lowest-priority candidate of this platform the fastest one
        prob = jaxattn.AttentionProblem.from_inputs(shape, shape, shape, causal=True)
        slowest_declared = {"cpu": "nogqa", "gpu": "gpu_only", "tpu": "tpu_only"}[info.platform]
        store(prob, runtime(slowest_declared, 0.1), runtime("alpha", 1.0))
        name, _ = jaxattn.get_optimal_config()
        assert name == slowest_declared
    auto = jaxattn.explain(shape, shape, shape, causal=True).chosen
    assert name == auto
    if not measured:
        assert name == "alpha"


# -- forward and backward from different backends ------------------------------------------------


def loss(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, cot: jax.Array) -> jax.Array:
    return jnp.sum(jaxattn.attention(q, k, v, impl=impl, causal=True) * cot)


def test_split_forward_and_gradient_backends() -> None:
    # alpha has the fastest forward, beta the fastest forward+backward
    store(problem(), runtime("alpha", 1.0, 10.0), runtime("beta", 2.0, 5.0))
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    chosen = exp.candidates[0]
    assert exp.chosen == "alpha" and chosen.grad_impl == "beta"
    assert "differentiated calls run beta" in chosen.rank_reason
    assert "(differentiated: beta)" in str(exp)
    assert isinstance(jaxattn.get_impl("auto").select(exp.problem), SplitGradImpl)

    reset_calls()
    out = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, causal=True))(q, k, v)
    assert Alpha.calls == ["alpha"] and not Beta.calls  # a forward call runs only alpha
    np.testing.assert_allclose(out, dense(q, k, v, True, 8 ** -0.5), atol=1e-6)

    reset_calls()
    cot = jnp.cos(jnp.arange(q.size, dtype=q.dtype)).reshape(q.shape)
    grads = jax.jit(jax.grad(lambda *a: loss("auto", *a, cot), argnums=(0, 1, 2)))(q, k, v)
    assert Beta.calls == ["beta"] and not Alpha.calls  # differentiated: beta, forward and backward
    want = jax.grad(lambda q, k, v: jnp.sum(dense(q, k, v, True, 8 ** -0.5) * cot), argnums=(0, 1, 2))(q, k, v)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    # explain(needs_grad=True) ranks by forward+backward
    assert jaxattn.explain(q, k, v, causal=True, needs_grad=True).chosen == "beta"


def test_no_split_within_the_margin_or_with_array_features() -> None:
    store(problem(), runtime("alpha", 1.0, 10.0), runtime("beta", 2.0, 9.95))  # 0.5% faster: not worth it
    q, k, v = qkv()
    assert jaxattn.explain(q, k, v, causal=True).candidates[0].grad_impl is None
    mask = jnp.ones((16, 16), bool)
    store(problem(mask=mask), runtime("alpha", 1.0, 10.0), runtime("beta", 2.0, 5.0))
    exp = jaxattn.explain(q, k, v, causal=True, mask=mask)
    assert exp.chosen == "alpha" and exp.candidates[0].grad_impl is None


def test_split_when_the_fastest_forward_has_no_backward() -> None:
    # nogqa would be picked for the forward; it has no backward measurement, beta has one
    store(problem(), runtime("nogqa", 0.5, None), runtime("beta", 2.0, 5.0))
    q, k, v = qkv()
    exp = jaxattn.explain(q, k, v, causal=True)
    assert (exp.chosen, exp.candidates[0].grad_impl) == ("nogqa", "beta")
    assert NoGqa.name() == "nogqa"
