"""The forms of a backend: ``forward(self, call)``, the per-platform forwards, the seed's
(EasyDeL's) ``forward_native(self, q, k, v, mask=None, ...)``; a forward of neither form refused
when its class is loaded; and a backend that breaks its contract at run time (a bare array, the
wrong dtype, an exception) declined by auto for such calls, with the reason in ``explain``."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import AttentionCall, AttentionImpl, AttentionOutput, Feature, PluginError
from jaxattn.backend import DeclarationError
from jaxattn.testing import oracle

from .toy_impls import PlainImpl, dense_attention

pytestmark = pytest.mark.usefixtures("empty_registry")


def qkv(t: int = 3, s: int = 5, hq: int = 4, hkv: int = 4, d: int = 8) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(2)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for shape in ((1, t, hq, d), (1, s, hkv, d), (1, s, hkv, d)))


def want(q: Any, k: Any, v: Any, **kw: Any) -> np.ndarray:
    return np.asarray(oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), **kw).output)


def close(got: Any, expected: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=2e-5)


def seed_math(q: Any, k: Any, v: Any, mask: Any, bias: Any, causal: bool, scale: float) -> Any:
    logits = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if bias is not None:
        logits = logits + bias
    t, s = q.shape[1], k.shape[1]
    keep = jnp.ones((1, 1, t, s), bool)
    if mask is not None:
        keep = keep & mask
    if causal:
        keep = keep & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + s - t)
    p = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v)


# -- the seed's style, as EasyDeL writes its operators --------------------------------------

class SeedStyle(AttentionImpl):
    """No declaration: names from get_impl_name(), features as a class attribute (names as
    strings, as a set), the scale read from self.metadata."""

    features = {"causal", "mask", Feature.BIAS, "cross"}  # noqa: RUF012 (the seed's own spelling)

    @classmethod
    def get_impl_name(cls) -> str:
        return "seed_style"

    def forward_native(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                       init_bias: Any = None, causal: bool = False, **ignore: Any) -> AttentionOutput:
        assert init_bias is None  # the core built the bias already
        scale = self.metadata.softmax_scale or q.shape[-1] ** -0.5
        return AttentionOutput(attention_outputs=seed_math(q, k, v, mask, bias, causal, scale))


class SeedOnCpu(SeedStyle):
    """The seed's per-platform forward: forward_cpu, and softmax_scale taken by name."""

    @classmethod
    def get_impl_name(cls) -> str:
        return "seed_cpu"

    ran: ClassVar[list[float]] = []

    def forward_cpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    causal: bool = False, softmax_scale: float | None = None) -> AttentionOutput:
        assert softmax_scale is not None
        type(self).ran.append(softmax_scale)
        return AttentionOutput(attention_outputs=seed_math(q, k, v, mask, bias, causal, softmax_scale))


class SeedPassingOn(SeedStyle):
    """The seed's per-platform forward that passes its arguments on, as EasyDeL's do."""

    ran: ClassVar[list[str]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "seed_passing_on"

    def forward_cpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        type(self).ran.append("cpu")
        return self.forward_native(*args, **kwargs)


@pytest.mark.parametrize("impl_cls", [SeedStyle, SeedOnCpu, SeedPassingOn])
@pytest.mark.parametrize("jit", [False, True])
def test_a_seed_style_backend_runs_what_it_declares(impl_cls: type[AttentionImpl], jit: bool) -> None:
    jaxattn.register_impl(impl_cls)
    name = impl_cls.name()
    q, k, v = qkv(t=3, s=5)
    mask = jnp.asarray(np.random.default_rng(0).random((1, 1, 3, 5)) > 0.3).at[..., 0].set(True)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 3, 5)), jnp.float32)
    kw: dict[str, Any] = {"causal": True, "mask": mask, "bias": bias, "softmax_scale": 0.3}

    def run(q: Any, k: Any, v: Any) -> Any:
        return jaxattn.attention(q, k, v, impl=name, **kw)

    got = (jax.jit(run) if jit else run)(q, k, v)
    close(got, want(q, k, v, causal=True, mask=np.asarray(mask), bias=np.asarray(bias), softmax_scale=0.3))
    close(jaxattn.attention(q, k, v, impl=name), want(q, k, v))  # the default scale too
    # The most specific forward for the platform ran: forward_cpu on a CPU (elsewhere the seed's
    # forward_native, since these classes override only forward_cpu), with the scale by name.
    on_cpu = jaxattn.detect_device().platform == "cpu"
    if impl_cls is SeedPassingOn:
        assert bool(SeedPassingOn.ran) == on_cpu
    if impl_cls is SeedOnCpu and on_cpu:
        assert SeedOnCpu.ran[-2:] == [0.3, 8 ** -0.5] if not jit else SeedOnCpu.ran[-1] == 8 ** -0.5
    if impl_cls is SeedOnCpu and not on_cpu:
        assert not SeedOnCpu.ran
    with pytest.raises(jaxattn.UnsupportedError, match="a sliding window is not supported by"):
        jaxattn.attention(q, k, v, impl=name, sliding_window=2)
    with pytest.raises(jaxattn.UnsupportedError, match="grouped/multi-query"):
        jaxattn.attention(q, k[:, :, :2], v[:, :, :2], impl=name)


def test_the_seed_features_are_features() -> None:
    assert SeedStyle.features == frozenset({Feature.CAUSAL, Feature.MASK, Feature.BIAS, Feature.CROSS})


# -- the call form: forward(self, call) ------------------------------------------------------

class OneForward(AttentionImpl):
    features: ClassVar = frozenset({Feature.CAUSAL, Feature.GQA, Feature.CROSS})

    @classmethod
    def get_impl_name(cls) -> str:
        return "one_forward"

    def forward(self, call: AttentionCall) -> AttentionOutput:
        return AttentionOutput(dense_attention(call.q, call.k, call.v, call.causal, call.softmax_scale))


@pytest.mark.parametrize("jit", [False, True])
def test_one_forward_is_the_whole_protocol(jit: bool) -> None:
    jaxattn.register_impl(OneForward)
    q, k, v = qkv(hkv=2)
    run = partial(jaxattn.attention, impl="one_forward", causal=True)
    close((jax.jit(run) if jit else run)(q, k, v), want(q, k, v, causal=True))
    close(jaxattn.attention(q, k, v, causal=True), want(q, k, v, causal=True))  # through auto


# -- a forward of neither form: refused when the class is loaded -----------------------------

class TwoArgs(PlainImpl):
    @classmethod
    def get_impl_name(cls) -> str:
        return "two_args"

    def forward_native(self, q: Any, k: Any) -> AttentionOutput:
        raise AssertionError("never called")


class SwallowsTheWindow(SeedStyle):
    features = frozenset({Feature.CAUSAL, Feature.SLIDING_WINDOW})

    @classmethod
    def get_impl_name(cls) -> str:
        return "swallows"


class SeedForward(PlainImpl):
    @classmethod
    def get_impl_name(cls) -> str:
        return "seed_forward"

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None) -> AttentionOutput:
        raise AssertionError("never called")


@pytest.mark.parametrize(("impl_cls", "why"), [
    (TwoArgs, r"forward_native\(self, q: 'Any', k: 'Any'\) -> 'AttentionOutput' has neither form"),
    (SwallowsTheWindow, r"takes no argument sliding_window \(it declares Feature.SLIDING_WINDOW\)"),
    (SeedForward, "takes q, k, v, which only a dense impl's forward_<platform> may"),
])
def test_a_forward_of_neither_form_is_refused_when_registered(impl_cls: type[AttentionImpl], why: str) -> None:
    with pytest.raises(DeclarationError, match=why) as raised:
        jaxattn.register_impl(impl_cls)
    message = str(raised.value)
    assert f"impl {impl_cls.name()!r}" in message and impl_cls.__qualname__ in message
    assert "forward(self, call)" in message and "forward_<platform>(self, q, k, v, mask=None" in message
    assert impl_cls.name() not in {r.name for r in jaxattn.list_impls()}


def test_a_class_registered_by_a_plugin_is_refused_and_auto_says_why() -> None:
    jaxattn.register_impl(PlainImpl)

    class Plugin:
        @staticmethod
        @jaxattn.hookimpl
        def jaxattn_register_impls() -> list[Any]:
            return [TwoArgs]

    jaxattn.register_plugin(Plugin(), name="two_args_plugin")
    row = next(r for r in jaxattn.list_impls() if r.name == "two_args")
    assert row.status == "broken" and "has neither form" in row.reason
    with pytest.raises(PluginError, match="has neither form"):
        jaxattn.get_impl("two_args")
    q, k, v = qkv()
    close(jaxattn.attention(q, k, v, causal=True), want(q, k, v, causal=True))  # auto: plain
    candidate = next(c for c in jaxattn.explain(q, k, v, causal=True).candidates if c.name == "two_args")
    assert candidate.status == "declined" and any("has neither form" in r for r in candidate.reasons)


# -- reserved and empty names ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["auto", " Auto ", ""])
def test_reserved_and_empty_names_are_refused(name: str) -> None:
    with pytest.raises(PluginError, match=r"reserved|empty name"):
        jaxattn.ImplRef("m:C", names=(name,), platforms=("cpu",))

    class Named(PlainImpl):
        @classmethod
        def get_impl_name(cls) -> str:
            return name

    with pytest.raises(PluginError, match=r"reserved|empty name"):
        jaxattn.register_impl(Named)


# -- contract breaks at run time: auto declines the backend, with the reason -----------------

class Hostile(PlainImpl):
    """First in auto's ranking; breaks its contract as ``how`` says."""

    priority: ClassVar[int] = 1000
    how: ClassVar[Callable[[AttentionCall], Any]]

    def forward_native(self, call: AttentionCall) -> Any:
        return type(self).how(call)

    forward_cuda = forward_native  # PlainImpl's own forward_cuda would route around ``how`` on a GPU


def _hostile(name: str, how: Callable[[AttentionCall], Any]) -> type[Hostile]:
    return type(name, (Hostile,), {"how": staticmethod(how), "get_impl_name": classmethod(lambda cls: name)})


def _raise(call: AttentionCall) -> Any:
    raise RuntimeError("kernel exploded")


HOSTILE = {
    "bare_array": (lambda call: dense_attention(call.q, call.k, call.v, call.causal, call.softmax_scale),
                   "returned ArrayImpl, not an AttentionOutput|returned DynamicJaxprTracer, not an AttentionOutput"),
    "half": (lambda call: AttentionOutput(dense_attention(call.q, call.k, call.v, call.causal,
                                                          call.softmax_scale).astype(jnp.float16)),
             "dtype float16 for a float32 call"),
    "raises": (_raise, "raised RuntimeError: kernel exploded"),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_auto_declines_a_backend_that_breaks_its_contract(kind: str, jit: bool, caplog: Any) -> None:
    how, why = HOSTILE[kind]
    jaxattn.register_impl(PlainImpl)
    jaxattn.register_impl(_hostile(kind, how))
    q, k, v = qkv()
    assert jaxattn.explain(q, k, v, causal=True).chosen == kind
    run = partial(jaxattn.attention, causal=True)
    got = (jax.jit(run) if jit else run)(q, k, v)
    assert got.dtype == jnp.float32
    close(got, want(q, k, v, causal=True))
    after = jaxattn.explain(q, k, v, causal=True)
    # The next in auto's ranking: plain on a CPU; a GPU's own backends may rank above it.
    assert after.chosen != kind and (after.chosen == "plain" or jaxattn.detect_device().platform != "cpu")
    row = next(c for c in after.candidates if c.name == kind)
    assert row.status == "declined" and any(re.search(why, r) for r in row.reasons), row.reasons
    assert any(kind in r.getMessage() for r in caplog.records)  # logged: never silent
    with pytest.raises((PluginError, RuntimeError), match=why.removeprefix("raised RuntimeError: ")):  # named: raises
        jaxattn.attention(q, k, v, causal=True, impl=kind)
