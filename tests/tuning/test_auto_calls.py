"""What repeated "auto" calls cost and say: one log line per signature, choices memoised."""

from __future__ import annotations

import logging

import jax
import pytest

import jaxattn
from jaxattn.selection import dispatch

from .helpers import problem, qkv, runtime, store
from .toys import Alpha, Beta, reset_calls

pytestmark = pytest.mark.usefixtures("toys")


def auto_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("jaxattn auto chose")]


def test_auto_logs_once_per_distinct_signature(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="jaxattn")
    q, k, v = qkv()
    for _ in range(3):
        jaxattn.attention(q, k, v, causal=True)
    jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, causal=True))(q, k, v)
    assert len(auto_logs(caplog)) == 1
    assert "alpha" in auto_logs(caplog)[0] and "T=16" in auto_logs(caplog)[0]
    jaxattn.attention(q, k, v, causal=False)  # another signature
    q2, k2, v2 = qkv(t=8)
    jaxattn.attention(q2, k2, v2, causal=True)
    jaxattn.attention(q2, k2, v2, causal=True)
    assert len(auto_logs(caplog)) == 3


def test_repeated_calls_reuse_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []
    selected: list[object] = []
    evaluate, select = dispatch._evaluate, dispatch.AutoAttention.select
    monkeypatch.setattr(dispatch, "_evaluate", lambda p, md: asked.append(p) or evaluate(p, md))
    monkeypatch.setattr(dispatch.AutoAttention, "select", lambda self, p: selected.append(p) or select(self, p))
    q, k, v = qkv()
    for _ in range(5):
        jaxattn.attention(q, k, v, causal=True)
    # every later call is two dict lookups (its checks, its plan): no choice, no candidates asked
    assert len(asked) == 1 and len(selected) == 1
    jaxattn.attention(q, k, v, causal=False)
    assert len(asked) == 2 and len(selected) == 2
    # the choice is per problem: another scale is the same problem, so the same choice
    jaxattn.attention(q, k, v, causal=True, softmax_scale=0.5)
    assert len(asked) == 2 and len(selected) == 2
    # a feature value that cannot be a dict key is checked unmemoised; its problem is a new one
    # (here: to the toys' refusal)
    with pytest.raises(jaxattn.UnsupportedError, match="sliding window is not supported by alpha"):
        jaxattn.attention(q, k, v, causal=True, sliding_window=[3, 0])  # type: ignore[arg-type]
    assert len(selected) == 3


def test_memoised_choice_follows_new_registrations_and_new_measurements() -> None:
    q, k, v = qkv()
    reset_calls()
    jaxattn.attention(q, k, v, causal=True)
    assert Alpha.calls == ["alpha"]
    store(problem(), runtime("beta", 1.0), runtime("alpha", 2.0))  # saving clears the memo
    jaxattn.attention(q, k, v, causal=True)
    assert Beta.calls == ["beta"]

    class Gamma(Alpha):
        priority = 99
        calls: list[str] = []  # noqa: RUF012

        @classmethod
        def get_impl_name(cls) -> str:
            return "gamma"

    jaxattn.register_impl(Gamma)  # a new provider: new registry generation, new choice
    # beta is still the only measured candidate that is faster than the declared order
    assert jaxattn.explain(q, k, v, causal=True).chosen == "beta"
    store(problem(), runtime("gamma", 0.5))
    jaxattn.attention(q, k, v, causal=True)
    assert Gamma.calls == ["gamma"]
