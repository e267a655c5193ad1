"""Choosing implementations: names, aliases, priorities, precedence, auto, explain, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import AttentionMetadata, ImplNotFoundError, PluginError, UnsupportedError
from jaxattn.testing import oracle as _oracle

from .toy_impls import CudaOnlyImpl, FallbackImpl, FancyImpl, PlainImpl, TpuOnlyImpl

pytestmark = pytest.mark.usefixtures("empty_registry")


def qkv(t: int = 5, s: int = 7, hq: int = 4, hkv: int = 4, d: int = 8, dtype: jnp.dtype = jnp.float32):
    # NumPy draws the values: jax.random.normal compiles a program per new shape (seconds each
    # on a 2-core CI machine), for inputs any generator serves.
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((2, s, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((2, s, hkv, d)), dtype)
    return q, k, v


def oracle(q, k, v, **kw):
    return _oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), **kw).output


def test_name_alias_and_enum_resolve_to_one_impl() -> None:
    jaxattn.register_impl(PlainImpl)
    for name in ("plain", "plain_alias", "PLAIN"):
        assert type(jaxattn.get_impl(name)) is PlainImpl
    q, k, v = qkv(hkv=2)
    out = jaxattn.attention(q, k, v, impl="plain_alias", causal=True)
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True), atol=2e-5)


def test_auto_takes_highest_priority_that_accepts() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FancyImpl)
    mha, gqa = qkv(), qkv(hkv=2)
    assert jaxattn.explain(*mha).chosen == "fancy"
    ex = jaxattn.explain(*gqa)
    assert ex.chosen == "plain"
    fancy = next(c for c in ex.candidates if c.name == "fancy")
    assert fancy.status == "declined"
    assert any("grouped" in r for r in fancy.reasons)


def test_explicit_choice_never_falls_back_and_lists_every_reason() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FancyImpl)
    q, k, v = qkv(hkv=2)
    with pytest.raises(UnsupportedError) as info:
        jaxattn.attention(q, k, v, impl="fancy", sliding_window=2, logits_soft_cap=5.0)
    err = info.value
    assert len(err.reasons) == 3  # GQA, window, soft cap: every reason, not the first
    assert "plain" not in str(err) or "accept" in str(err)


def test_auto_with_nothing_accepting_lists_each_impl() -> None:
    jaxattn.register_impl(FancyImpl)
    q, k, v = qkv(hkv=2)
    with pytest.raises(UnsupportedError, match="fancy"):
        jaxattn.attention(q, k, v)


def test_precedence_argument_scope_env_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FancyImpl)
    from jaxattn.selection.dispatch import current_impl_name

    assert current_impl_name() == "auto"
    monkeypatch.setenv("JAXATTN_IMPL", "plain")
    assert current_impl_name() == "plain"
    with jaxattn.use_impl("fancy"):
        assert current_impl_name() == "fancy"
        assert current_impl_name("plain_alias") == "plain_alias"
        with jaxattn.use_impl(jaxattn.AttentionMechanisms.VANILLA):
            assert current_impl_name() == "vanilla"
        assert current_impl_name() == "fancy"
    assert current_impl_name() == "plain"


def test_use_impl_routes_the_call() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FancyImpl)
    q, k, v = qkv()
    PlainImpl.calls.clear()
    with jaxattn.use_impl("plain"):
        jaxattn.attention(q, k, v)
    assert PlainImpl.calls
    # Outside the scope auto runs fancy's forward; fancy has no backward, so plain's runs
    # differentiated calls.
    selected = jaxattn.get_impl("auto").select(jaxattn.AttentionProblem.from_inputs(q, k, v))
    assert type(selected.primal) is FancyImpl and type(selected.backward) is PlainImpl


def test_unknown_name_lists_known_and_available() -> None:
    jaxattn.register_impl(PlainImpl)
    with pytest.raises(ImplNotFoundError) as info:
        jaxattn.get_impl("nonesuch")
    text = str(info.value)
    assert "nonesuch" in text and "plain" in text and "jaxattn list" in text


@pytest.mark.parametrize("name", ["ragged_page_attention_v3", "ragged_page_attention_v2", "ragged_page_attention",
                                  "page_attention",
                                  "autoregressive_decodeattn", "blockwise", "flash_attn2"])
def test_known_mechanism_without_a_plugin_says_which_plugin_brings_it(name: str) -> None:
    jaxattn.register_impl(PlainImpl)
    with pytest.raises(ImplNotFoundError) as info:
        jaxattn.get_impl(name)
    text = str(info.value)
    assert "unknown" not in text
    assert f"{name!r} is a known attention mechanism, but no installed plugin provides it" in text
    assert "pip install 'jaxattn[" in text and "Available here: plain" in text
    with pytest.raises(ImplNotFoundError, match="unknown attention impl 'ragged_page_attention_v9'"):
        jaxattn.get_impl("ragged_page_attention_v9")


def test_name_for_other_platform_says_where_and_what_runs_here() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(TpuOnlyImpl)
    jaxattn.register_impl(CudaOnlyImpl)
    with pytest.raises(ImplNotFoundError) as info:
        jaxattn.get_impl("tpu_only")
    text = str(info.value)
    assert "tpu" in text and "cpu" in text and "plain" in text and "interpret=True" in text
    with pytest.raises(ImplNotFoundError, match="cuda"):
        jaxattn.get_impl("cuda_only")


def test_platform_override_routes_forward() -> None:
    jaxattn.register_impl(PlainImpl)
    impl = jaxattn.get_impl("plain", AttentionMetadata(platform="cuda"))
    assert impl.platform == "gpu" and impl.vendor == "cuda"
    q, k, v = qkv()
    # The host is a CPU: a GPU override is declined with the reason, not run on the wrong path.
    with pytest.raises(UnsupportedError, match="this host"):
        impl(q, k, v)
    assert impl.route() == impl.forward_cuda
    PlainImpl.calls.clear()
    jaxattn.get_impl("plain", AttentionMetadata(platform="cpu"))(q, k, v)
    assert PlainImpl.calls == ["native:cpu"]


def test_tpu_override_needs_interpret() -> None:
    jaxattn.register_impl(TpuOnlyImpl)
    q, k, v = qkv()
    impl = jaxattn.get_impl("tpu_only", AttentionMetadata(platform="tpu"))
    assert any("interpret=True" in r for r in impl.supports(q, k, v))
    ok = jaxattn.get_impl("tpu_only", AttentionMetadata(platform="tpu", interpret=True))
    assert ok.supports(q, k, v) == []


def test_capability_checks_dtype_and_head_dim() -> None:
    jaxattn.register_impl(CudaOnlyImpl)
    impl = jaxattn.get_impl("cuda_only", AttentionMetadata(platform="cuda"))
    q, k, v = qkv(d=96)
    reasons = impl.supports(q, k, v)
    assert any("dtype float32" in r for r in reasons)
    assert any("head dim 96" in r for r in reasons)
    bf = AttentionMetadata(platform="cuda", runtime_dtype="bfloat16")
    assert not any("dtype" in r for r in jaxattn.get_impl("cuda_only", bf).supports(q, k, v))


def test_equal_priority_duplicate_names_both() -> None:
    jaxattn.register_impl(PlainImpl)

    class Twin(PlainImpl):
        @classmethod
        def get_impl_name(cls) -> str:
            return "plain"

    with pytest.raises(PluginError, match="equal priority"):
        jaxattn.register_impl(Twin)
    jaxattn.register_impl(Twin, replace=True)
    assert type(jaxattn.get_impl("plain")) is Twin


def test_higher_priority_provider_of_same_name_wins() -> None:
    jaxattn.register_impl(PlainImpl)

    class Better(PlainImpl):
        priority = 5

        @classmethod
        def get_impl_name(cls) -> str:
            return "plain"

    jaxattn.register_impl(Better)
    assert type(jaxattn.get_impl("plain")) is Better


def test_fallback_is_visible_and_refusable(caplog: pytest.LogCaptureFixture) -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FallbackImpl)
    q, k, v = qkv(hkv=2)
    PlainImpl.calls.clear()
    with caplog.at_level("INFO", logger="jaxattn"):
        out = jaxattn.attention(q, k, v, impl="falls_back")
        jaxattn.attention(q, k, v, impl="falls_back")
    np.testing.assert_allclose(out, oracle(q, k, v), atol=2e-5)
    assert sum("falls back" in r.message for r in caplog.records) == 1  # logged once
    ex = jaxattn.explain(q, k, v)
    assert ex.chosen == "plain"  # auto prefers an impl that runs the call itself
    falls_back = next(c for c in ex.candidates if c.name == "falls_back")
    assert falls_back.fallback == ("GQA falls back",)
    strict = AttentionMetadata(allow_fallback=False)
    with pytest.raises(UnsupportedError, match="allow_fallback=False"):
        jaxattn.attention(q, k, v, impl="falls_back", metadata=strict)


def test_auto_logs_choice_once_per_signature(caplog: pytest.LogCaptureFixture) -> None:
    jaxattn.register_impl(PlainImpl)
    q, k, v = qkv()
    with caplog.at_level("INFO", logger="jaxattn"):
        for _ in range(3):
            jaxattn.attention(q, k, v)
        jaxattn.attention(q, k, v, causal=True)
    assert sum("auto chose" in r.message for r in caplog.records) == 2


def test_dispatch_happens_at_trace_time() -> None:
    jaxattn.register_impl(PlainImpl)
    q, k, v = qkv()
    PlainImpl.calls.clear()
    f = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, impl="plain", causal=True))
    for _ in range(3):
        out = f(q, k, v)
    assert len(PlainImpl.calls) == 1  # traced once; the compiled program is the kernel's own
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True), atol=2e-5)


def test_explain_on_shapes_only() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(TpuOnlyImpl)
    spec = jax.ShapeDtypeStruct((1, 128, 8, 64), jnp.bfloat16)
    ex = jaxattn.explain(spec, spec, spec, causal=True)
    assert ex.chosen == "plain"
    tpu = next(c for c in ex.candidates if c.name == "tpu_only")
    assert tpu.status == "other platform"
    assert "plain" in str(ex) and ex.to_dict()["chosen"] == "plain"


def test_list_impls_reports_usable_here() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(TpuOnlyImpl)
    rows = {r.name: r for r in jaxattn.list_impls()}
    assert rows["plain"].usable_here and rows["plain"].aliases == ("plain_alias",)
    assert not rows["tpu_only"].usable_here and "runs on tpu" in rows["tpu_only"].reason


def test_get_optimal_config_agrees_with_auto() -> None:
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(FancyImpl)
    name, dtype = jaxattn.get_optimal_config()
    assert name == "fancy" and dtype == jnp.float32


def test_impl_without_grad_feature_refuses_gradients_clearly() -> None:
    jaxattn.register_impl(FancyImpl)  # declares no Feature.GRAD
    q, k, v = qkv()
    out = jaxattn.attention(q, k, v, impl="fancy")  # the forward is unaffected
    np.testing.assert_allclose(out, oracle(q, k, v), atol=2e-5)
    with pytest.raises(UnsupportedError, match="gradients are not supported by fancy"):
        jax.grad(lambda q: jaxattn.attention(q, k, v, impl="fancy").sum())(q)
    jaxattn.register_impl(PlainImpl)  # declares it: differentiable
    g = jax.grad(lambda q: jaxattn.attention(q, k, v, impl="plain").sum())(q)
    assert np.isfinite(np.asarray(g)).all()


def test_auto_differentiates_with_a_backward_that_runs_the_call() -> None:
    """A forward cannot know whether a gradient follows: auto's VJP runs the best backward."""
    from .toy_impls import OddBackwardImpl

    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(OddBackwardImpl)
    q, k, v = qkv(t=33, s=33, hkv=2)
    exp = jaxattn.explain(q, k, v, causal=True)
    chosen = next(c for c in exp.candidates if c.chosen)
    assert exp.chosen == "odd_bwd" and chosen.grad_impl == "plain"
    assert "backward needs even T and S" in chosen.rank_reason
    assert "(differentiated: plain)" in str(exp)

    PlainImpl.calls.clear()
    out = jaxattn.attention(q, k, v, causal=True)  # the forward alone runs the fastest forward
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True), atol=2e-5)
    assert PlainImpl.calls == ["odd_bwd"]

    PlainImpl.calls.clear()
    loss = lambda q, k, v: jnp.sum(jnp.sin(jaxattn.attention(q, k, v, causal=True)))  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert PlainImpl.calls == ["native:cpu"]  # differentiated: plain, forward and backward
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(oracle_jnp(*a))), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)

    # Even lengths: odd_bwd differentiates the call itself (no split).
    q2, k2, v2 = qkv(t=32, s=32, hkv=2)
    assert next(c for c in jaxattn.explain(q2, k2, v2, causal=True).candidates if c.chosen).grad_impl is None
    PlainImpl.calls.clear()
    jax.grad(loss)(q2, k2, v2)
    assert PlainImpl.calls == ["odd_bwd"]


def oracle_jnp(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    from .toy_impls import dense_attention

    return dense_attention(q, k, v, True, q.shape[-1] ** -0.5)


def test_explicit_backend_whose_backward_cannot_run_raises_unsupported_not_a_kernel_error() -> None:
    from .toy_impls import OddBackwardImpl

    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(OddBackwardImpl)
    q, k, v = qkv(t=33, s=33, hkv=2)
    impl = jaxattn.get_impl("odd_bwd")
    assert impl.supports(q, k, v, causal=True) == []
    assert impl.supports(q, k, v, causal=True, needs_grad=True) == [
        "the backward needs even T and S, got T=33, S=33"]
    for run in (lambda q: jaxattn.attention(q, k, v, causal=True, impl="odd_bwd"),
                lambda q: impl(q, k, v, causal=True).attention_outputs):
        with pytest.raises(UnsupportedError) as info:
            jax.grad(lambda q: run(q).sum())(q)  # noqa: B023
        assert info.value.gradient and info.value.reasons == ["the backward needs even T and S, got T=33, S=33"]
        assert "cannot differentiate this call" in str(info.value)
    with pytest.raises(UnsupportedError, match="impls that differentiate this call here: plain"):
        jax.jit(jax.grad(lambda q: jaxattn.attention(q, k, v, causal=True, impl="odd_bwd").sum()))(q)


def test_auto_with_no_backward_for_the_call_refuses_with_every_reason() -> None:
    from .toy_impls import OddBackwardImpl

    jaxattn.register_impl(OddBackwardImpl)
    jaxattn.register_impl(FancyImpl)  # MHA only, no gradients at all
    q, k, v = qkv(t=33, s=33)
    out = jaxattn.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True), atol=2e-5)
    assert "(differentiated: no impl here can)" in str(jaxattn.explain(q, k, v, causal=True))
    with pytest.raises(UnsupportedError) as info:
        jax.grad(lambda q: jaxattn.attention(q, k, v, causal=True).sum())(q)
    text = str(info.value)
    assert info.value.impl_name == "auto" and info.value.gradient
    assert "odd_bwd: the backward needs even T and S" in text and "fancy: gradients are not supported" in text
