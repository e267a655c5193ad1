"""mosaic_flash on a Hopper GPU (marked ``gpu``): the conformance suite against the float64
oracle, and the kernel's own edges (odd lengths, bottom-right causal with T != S, GQA, head
dims 64/128/256, the log-sum-exp), eager and under jax.jit.

Differentiation: the package's own backward kernels or cuDNN's backward fed mosaic_flash's
output and lse (``jaxattn_mosaic.backward``, chosen by ``impl.backward_choice``). The suite's
gradient tests run the default choice against the oracle; ``test_gradients`` runs each
backward, asked for by name, on GQA, every head dim, odd lengths, bottom-right causal with
T != S (rows that see no key) and a loss through the lse, and expects the ``UnsupportedError``
with the reasons where the asked-for backward cannot run the call; the own backward is
checked to be deterministic (bit-identical gradients from two runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.device import detect_device
from jaxattn.backend.validation import resolve_call
from jaxattn.testing import oracle
from jaxattn.testing.cases import DEFAULT_TOLERANCES, Case, Level
from jaxattn.testing.compare import assert_close
from jaxattn.testing.conformance import STRICT_CASES, ConformanceSuite
from jaxattn.testing.mod_cases import MOD_CASES
from jaxattn.testing.mod_conformance import STRICT_MOD_CASES

_here = detect_device()
ON_HOPPER = _here.platform == "gpu" and _here.vendor == "cuda" and str(_here.compute_capability).startswith("9.")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (sm_90)")]


class TestMosaicFlashConformance(ConformanceSuite):
    impl_name = "mosaic_flash"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        # The matrix's small head dims become 64 (the kernel's smallest tile of the head dim);
        # every shape, length and feature stays as it is (declined features stay declined).
        def dim(d: int | None) -> int | None:
            return d if d is None or d in (64, 128, 256) else 64

        def dim_v(c: Case) -> int | None:  # a value head dim of its own stays one (declined)
            return None if c.dv is None or c.dv == c.d else (128 if dim(c.d) != 128 else 64)

        return [dataclasses.replace(c, d=dim(c.d), dv=dim_v(c)) for c in super().cases(level)]

    # The mask_mod / score_mod cases at head dim 64, their shapes and rules as they are.
    mod_cases = tuple(dataclasses.replace(c, base=dataclasses.replace(c.base, d=64)) for c in MOD_CASES)
    strict_cases = tuple(dataclasses.replace(c, d=64) for c in STRICT_CASES)
    strict_mod_cases = tuple(dataclasses.replace(c, base=dataclasses.replace(c.base, d=64)) for c in STRICT_MOD_CASES)


def _make(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rounded(shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(jnp.asarray(rng.normal(size=shape), dtype).astype(jnp.float32), np.float64)

    return {"q": rounded((b, t, hq, d)), "k": rounded((b, s, hkv, d)), "v": rounded((b, s, hkv, d)),
            "do": rng.normal(size=(b, t, hq, d))}


CASES = [
    # (B, T, S, Hq, Hkv, D, causal, dtype)
    (2, 256, 256, 4, 4, 128, False, "float16"),
    (2, 256, 256, 4, 4, 128, True, "bfloat16"),
    (1, 384, 640, 8, 2, 64, True, "bfloat16"),  # T < S: bottom-right diagonal
    (1, 640, 384, 4, 1, 128, True, "float16"),  # T > S: the first 256 queries see no key
    (1, 333, 517, 4, 2, 128, False, "bfloat16"),  # odd lengths: masked tails
    (1, 333, 517, 4, 2, 128, True, "bfloat16"),
    (1, 517, 129, 2, 2, 64, True, "float16"),
    (1, 256, 384, 2, 1, 256, False, "bfloat16"),
    (1, 300, 300, 2, 2, 256, True, "float16"),
    (1, 1, 77, 2, 2, 128, True, "bfloat16"),  # decode over a key shorter than one block
    (2, 1000, 1000, 8, 8, 64, False, "float16"),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype"), CASES)
def test_against_the_oracle(b: int, t: int, s: int, hq: int, hkv: int, d: int, causal: bool, dtype: str,
                            jit: bool) -> None:
    x = _make(b, t, s, hq, hkv, d, dtype)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))
    impl = jaxattn.get_impl("mosaic_flash")

    def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        res = impl(q, k, v, causal=causal)
        return res.attention_outputs, res.softmax_lse

    out, lse = (jax.jit(run) if jit else run)(q, k, v)
    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal)
    tol = DEFAULT_TOLERANCES[dtype]
    assert out.dtype == jnp.dtype(dtype)
    assert_close("output", out, ref.output, tol.forward)
    lse = np.asarray(lse, np.float64)
    finite = np.isfinite(ref.lse)
    assert np.array_equal(np.isfinite(lse), finite)  # rows that see no key: -inf
    assert np.max(np.abs(np.where(finite, lse - ref.lse, 0.0))) < 1e-2


#: The kernel's other tilings and schedules (ablations the benchmark times, and the 64x192 tiles
#: the default takes for a full forward over >= 16k keys), by name.
CONFIGS = {
    # Config()'s own fields: the non-persistent 64x128 kernel, the default's at D = 128 causal
    # from 16k keys (CASES are shorter: their default at D <= 128 is persistent).
    "non-persistent": {},
    "no-pingpong": {"pingpong": False},
    "overlap": {"overlap": True},
    "overlap-3-stages": {"overlap": True, "stages": 3},
    "kv192": {"block_kv": 192},
    "exp2-fma": {"exp2_fma_cols": 64},
    "kv192-exp2-fma": {"block_kv": 192, "exp2_fma_cols": 128},
    "lean-barriers": {"lean_barriers": True},
    "kv192-lean-barriers": {"block_kv": 192, "lean_barriers": True},
    "turns": {"pass_turns": True},
    "named": {"named_barriers": True},
    "turns-named": {"pass_turns": True, "named_barriers": True},
    "kv192-turns-named-lean": {"block_kv": 192, "pass_turns": True, "named_barriers": True, "lean_barriers": True},
    "overlap-named": {"overlap": True, "named_barriers": True},
    "no-pingpong-named": {"pingpong": False, "named_barriers": True},
    "store-read-wait": {"store_read_wait": True},
    "persistent": {"persistent": True},
    # Three CTAs: many rounds each, both directions of the snake, a partial last round.
    "persistent-3-ctas-turns-named": {"persistent": True, "ctas": 3, "pass_turns": True, "named_barriers": True},
    "kv192-persistent": {"block_kv": 192, "persistent": True},
    "persistent-q-group-1": {"persistent": True, "q_group": 1},
    "persistent-q-double": {"persistent": True, "q_double": True},
    "persistent-3-ctas-q-double-turns": {"persistent": True, "ctas": 3, "q_double": True, "pass_turns": True},
    # Chunks of 2 query tiles where their count is even (CASES[1], [10]), of 1 where it is odd.
    "persistent-3-ctas-q-group-2-q-double": {"persistent": True, "ctas": 3, "q_group": 2, "q_double": True},
    # A short last round cut by keys: CASES[4]'s 12 tiles on 5 CTAs leave 2, each in pieces of
    # 3 and 2 blocks (the second with the key tail); CASES[10]'s 128 on 7 leave 2, in pieces of 2.
    "persistent-5-ctas-split-tail": {"persistent": True, "ctas": 5, "q_double": True, "split_tail": True},
    "persistent-7-ctas-split-tail-turns": {"persistent": True, "ctas": 7, "split_tail": True, "pass_turns": True},
    # Causal tiles as scheduled (full attention: the snake), with both Q slots; on 3 CTAs, many
    # tiles each and CTAs of unequal counts.
    "persistent-scheduled": {"persistent": True, "q_double": True, "scheduled": True},
    "persistent-3-ctas-scheduled-turns": {"persistent": True, "ctas": 3, "scheduled": True, "pass_turns": True},
    # One CTA per tile with its last wave cut: a 1-D grid (CASES[4]: 12 tiles, 2 pieces each).
    "split-tail": {"split_tail": True},
    "kv192-split-tail": {"block_kv": 192, "split_tail": True},
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype"),
                         [CASES[1], CASES[2], CASES[3], CASES[4], CASES[5], CASES[9], CASES[10]])
def test_kernel_configurations_against_the_oracle(b: int, t: int, s: int, hq: int, hkv: int, d: int, causal: bool,
                                                  dtype: str, config: str, jit: bool) -> None:
    from jaxattn_mosaic.kernel import Config, mosaic_attention_forward

    x = _make(b, t, s, hq, hkv, d, dtype)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))

    def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        return mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=d**-0.5, config=Config(**CONFIGS[config]))

    out, lse = (jax.jit(run) if jit else run)(q, k, v)
    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal)
    assert_close("output", out, ref.output, DEFAULT_TOLERANCES[dtype].forward)
    lse = np.asarray(lse, np.float64)
    finite = np.isfinite(ref.lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.max(np.abs(np.where(finite, lse - ref.lse, 0.0))) < 1e-2


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "ctas", "pieces"), [
    (1, 1664, 4096, 1, 1, 128, 8, 3),  # 13 tiles on 8 CTAs: 5 left, 15 pieces in two rounds
    (1, 256, 384, 2, 1, 256, 3, 3),  # D = 256: outputs stored from registers; 1 tile left, 3 pieces
    (1, 1664, 4096, 1, 1, 128, 0, 8),  # one CTA per tile (ctas 0): 13 tiles, 104 pieces in a 1-D grid
])
def test_pieces_of_a_short_last_round_over_several_rounds(b: int, t: int, s: int, hq: int, hkv: int, d: int,
                                                          ctas: int, pieces: int, jit: bool) -> None:
    from jaxattn_mosaic.kernel import Config, default_config, mosaic_attention_forward, sm_count, tail_split

    blocks = -(-s // default_config(d).block_kv)
    assert tail_split(b * hq * t // 128, ctas or sm_count(), blocks) == pieces
    x = _make(b, t, s, hq, hkv, d, "bfloat16", seed=5)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    cfg = Config(block_q=64, block_kv=default_config(d).block_kv, persistent=ctas > 0, ctas=ctas, split_tail=True)

    def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        return mosaic_attention_forward(q, k, v, causal=False, softmax_scale=d**-0.5, config=cfg)

    out, lse = (jax.jit(run) if jit else run)(q, k, v)
    ref = oracle.attention(x["q"], x["k"], x["v"])
    assert_close("output", out, ref.output, DEFAULT_TOLERANCES["bfloat16"].forward)
    assert np.max(np.abs(np.asarray(lse, np.float64) - ref.lse)) < 1e-2


def test_auto_split_gradient() -> None:
    """The gradient split: mosaic_flash's forward, cuDNN's forward+backward under jax.grad."""
    from jaxattn.api.split import SplitGradImpl

    x = _make(1, 256, 256, 4, 2, 128, "bfloat16")
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    split = SplitGradImpl(jaxattn.get_impl("mosaic_flash"), jaxattn.get_impl("cudnn"))

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = split(q, k, v, causal=True).attention_outputs
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(x["do"], jnp.float32))

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], causal=True)
    tol = DEFAULT_TOLERANCES["bfloat16"]
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
        assert_close(name, got, want, tol.grad)


GRAD_CASES = [
    # (B, T, S, Hq, Hkv, D, causal, dtype)
    (2, 256, 256, 4, 4, 128, True, "bfloat16"),
    (1, 512, 384, 8, 2, 64, False, "float16"),  # T != S, full
    (1, 384, 384, 4, 1, 256, True, "bfloat16"),
    (1, 1000, 1000, 8, 2, 128, False, "bfloat16"),
    (1, 333, 517, 4, 2, 128, True, "bfloat16"),  # odd lengths, bottom-right causal, T < S
    (1, 640, 384, 4, 1, 64, True, "float16"),  # T > S: the first 256 queries see no key
    (2, 1, 77, 4, 2, 128, True, "bfloat16"),  # one query over a key shorter than a block
]


@pytest.mark.parametrize("through_lse", [False, True], ids=["output", "output-and-lse"])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("backward", ["auto", "own", "cudnn"])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype"), GRAD_CASES)
def test_gradients(b: int, t: int, s: int, hq: int, hkv: int, d: int, causal: bool, dtype: str, backward: str,
                   jit: bool, through_lse: bool) -> None:
    from jaxattn_mosaic.impl import backward_choice

    x = _make(b, t, s, hq, hkv, d, dtype, seed=3)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))
    weights = np.random.default_rng(4).normal(size=(b, hq, t)) if through_lse else np.zeros((b, hq, t))
    impl = jaxattn.get_impl("mosaic_flash", jaxattn.AttentionMetadata(extra={"mosaic_backward": backward}))

    def loss(q: Any, k: Any, v: Any) -> Any:
        res = impl(q, k, v, causal=causal)
        lse = res.softmax_lse  # -inf where a row sees no key (T > S, causal): no term there
        return (jnp.sum(res.attention_outputs.astype(jnp.float32) * jnp.asarray(x["do"], jnp.float32))
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jnp.asarray(weights, jnp.float32)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    run = jax.jit(grad) if jit else grad
    problem = resolve_call(q, k, v, causal=causal, metadata=impl.metadata).problem
    chosen, reasons = backward_choice(dataclasses.replace(problem, needs_grad=True), _here, backward)
    if chosen is None:
        with pytest.raises(jaxattn.UnsupportedError) as err:
            run(q, k, v)
        for reason in reasons:
            assert reason in str(err.value), (reason, str(err.value))
        return
    got = run(q, k, v)
    if chosen == "own":  # deterministic: no atomics, one order of summation
        again = run(q, k, v)
        for g, h in zip(got, again, strict=True):
            assert np.array_equal(np.asarray(g), np.asarray(h))

    def want(q: Any, k: Any, v: Any) -> Any:  # float64 attention, differentiated by jax
        k, v = (jnp.repeat(a, hq // hkv, axis=2) for a in (k, v))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
        if causal:
            logits = jnp.where(jnp.tril(jnp.ones((t, s), bool), s - t), logits, -jnp.inf)
        # By hand rather than logsumexp: a row that sees no key gets output 0, lse term 0 and a
        # gradient of 0 (not NaN).
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        den = jnp.sum(e, axis=-1, keepdims=True)
        safe = jnp.where(den == 0, 1.0, den)
        lse = (jnp.log(safe) + jnp.where(jnp.isfinite(m), m, 0.0))[..., 0]
        out = jnp.einsum("bhts,bshd->bthd", e / safe, v)
        return jnp.sum(out * jnp.asarray(x["do"], jnp.float64)) + jnp.sum(lse * jnp.asarray(weights, jnp.float64))

    with jax.enable_x64():
        ref = jax.grad(want, argnums=(0, 1, 2))(*(jnp.asarray(x[n], jnp.float64) for n in ("q", "k", "v")))
        ref = [np.asarray(r, np.float64) for r in ref]
    tol = DEFAULT_TOLERANCES[dtype]
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert_close(name, g, r, tol.grad)


@pytest.mark.parametrize(("t", "s", "said"), [(384, 640, "needs T == S"), (333, 333, "even T and S")])
def test_differentiating_what_neither_backward_can_names_why(t: int, s: int, said: str) -> None:
    # Head dim 256: the own backward declines (registers), and cuDNN's cannot run these shapes.
    x = _make(1, t, s, 2, 2, 256, "bfloat16")
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    with pytest.raises(jaxattn.UnsupportedError, match=said) as err:
        jax.grad(lambda q: jaxattn.attention(q, k, v, causal=True, impl="mosaic_flash").astype(jnp.float32).sum())(q)
    assert "own backward takes head dims 64 and 128" in str(err.value)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype", "cap"), [
    (1, 333, 517, 4, 2, 128, True, "bfloat16", 50.0),  # odd lengths, bottom-right causal, GQA
    (1, 640, 384, 4, 1, 64, True, "float16", 5.0),  # T > S: rows that see no key
    (1, 4096, 4096, 2, 1, 128, False, "bfloat16", 30.0),  # where auto differentiates uncapped calls by cuDNN
    (2, 256, 256, 2, 2, 256, False, "float16", 20.0),  # head dim 256: forward only (no own backward)
])  # fmt: skip
def test_a_soft_cap_against_the_oracle(b: int, t: int, s: int, hq: int, hkv: int, d: int, causal: bool, dtype: str,
                                       cap: float, jit: bool) -> None:
    # Logits far past the cap (q scaled up): a tanh off by tanh.approx's 2^-11 would move a
    # capped logit of 50 by 0.02, past bf16's tolerance on the output.
    x = _make(b, t, s, hq, hkv, d, dtype, seed=5)
    x["q"] = np.asarray(jnp.asarray(x["q"] * 8.0, dtype).astype(jnp.float32), np.float64)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))
    do = jnp.asarray(x["do"], jnp.float32)
    tol = DEFAULT_TOLERANCES[dtype]
    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal, logits_soft_cap=cap)

    def forward(q: Any, k: Any, v: Any) -> Any:
        return jaxattn.attention(q, k, v, causal=causal, logits_soft_cap=cap, impl="mosaic_flash")

    out = (jax.jit(forward) if jit else forward)(q, k, v)
    assert_close("output", out, ref.output, tol.forward)
    if d == 256:
        return

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * do)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    back = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], causal=causal, logits_soft_cap=cap)
    for name, g, r in zip(("dq", "dk", "dv"), got, (back.dq, back.dk, back.dv), strict=True):
        assert_close(name, g, r, tol.grad)


WINDOW_CASES = [
    # (B, T, S, Hq, Hkv, D, causal, dtype, (left, right)); None: unbounded
    (1, 333, 517, 4, 2, 128, True, "bfloat16", (100, 0)),  # odd lengths, bottom-right, GQA
    (1, 640, 384, 4, 1, 64, True, "float16", (64, 0)),  # T > S: the first 256 queries see no key
    (1, 640, 384, 4, 1, 64, False, "float16", (30, 20)),  # two-sided, T > S: 236 rows see none
    (2, 1000, 1000, 4, 2, 128, False, "bfloat16", (200, 130)),  # bands of blocks cut at both edges
    (1, 2048, 2048, 2, 2, 64, False, "bfloat16", (0, 0)),  # each query sees its own key alone
    (1, 512, 512, 2, 2, 128, False, "float16", (None, 5)),  # a right side alone
    (1, 4096, 4096, 2, 1, 128, True, "bfloat16", (1000, 0)),  # where auto differentiates unwindowed calls by cuDNN
    (1, 300, 300, 2, 2, 256, True, "float16", (50, 0)),  # head dim 256: forward only (no own backward)
    (1, 1, 77, 2, 2, 128, True, "bfloat16", (10, 0)),  # decode over a key shorter than a block
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype", "window"), WINDOW_CASES)
def test_a_sliding_window_against_the_oracle(b: int, t: int, s: int, hq: int, hkv: int, d: int, causal: bool,
                                             dtype: str, window: tuple[int | None, int | None], jit: bool) -> None:
    sides = tuple(10**12 if w is None else w for w in window)
    x = _make(b, t, s, hq, hkv, d, dtype, seed=7)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))
    do = jnp.asarray(x["do"], jnp.float32)
    tol = DEFAULT_TOLERANCES[dtype]
    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal, sliding_window=sides)
    impl = jaxattn.get_impl("mosaic_flash")

    def forward(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        res = impl(q, k, v, causal=causal, sliding_window=sides)
        return res.attention_outputs, res.softmax_lse

    out, lse = (jax.jit(forward) if jit else forward)(q, k, v)
    assert_close("output", out, ref.output, tol.forward)
    lse = np.asarray(lse, np.float64)
    finite = np.isfinite(ref.lse)
    assert np.array_equal(np.isfinite(lse), finite)  # rows that see no key: -inf
    assert np.max(np.abs(np.where(finite, lse - ref.lse, 0.0))) < 1e-2
    if d == 256:
        return

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(forward(q, k, v)[0].astype(jnp.float32) * do)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    back = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], causal=causal, sliding_window=sides)
    for name, g, r in zip(("dq", "dk", "dv"), got, (back.dq, back.dk, back.dv), strict=True):
        assert_close(name, g, r, tol.grad)


@pytest.mark.parametrize("config", [c for c in CONFIGS if "overlap" not in c])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "causal", "dtype", "window"),
                         [WINDOW_CASES[0], WINDOW_CASES[3]])
def test_a_sliding_window_in_each_kernel_configuration(b: int, t: int, s: int, hq: int, hkv: int, d: int,
                                                        causal: bool, dtype: str, window: tuple[int, int],
                                                        config: str) -> None:
    # Under jax.jit: each schedule's band of key blocks, the second consumer's release of the
    # blocks left of its rows, tile schedules and rounds of a persistent CTA over windowed tiles.
    from jaxattn_mosaic.kernel import Config, mosaic_attention_forward

    x = _make(b, t, s, hq, hkv, d, dtype, seed=8)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))

    def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        return mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=d**-0.5, sliding_window=window,
                                        config=Config(**CONFIGS[config]))

    out, lse = jax.jit(run)(q, k, v)
    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal, sliding_window=window)
    assert_close("output", out, ref.output, DEFAULT_TOLERANCES[dtype].forward)
    assert np.max(np.abs(np.asarray(lse, np.float64) - ref.lse)) < 1e-2


def _mod(name: str, b: int, t: int, s: int) -> Any:
    """The mask_mods of the mask_mod tests: each constructor at sizes past one tile, and a user
    function of b and h."""
    from jaxattn import masks

    if name == "documents":  # ragged documents, causal within each; the last keys in none (id -1)
        cuts = np.sort(np.random.default_rng(5).choice(np.arange(1, t), size=4, replace=False))
        ids = np.searchsorted(cuts, np.arange(t), side="right")
        kv_ids = np.where(np.arange(s) < s - 37, np.resize(ids, s), -1)
        return masks.and_(masks.causal(), masks.document(jnp.asarray(np.tile(ids, (b, 1)), jnp.int32),
                                                         jnp.asarray(np.tile(kv_ids, (b, 1)), jnp.int32)))
    if name == "prefix":
        return masks.prefix_lm(jnp.asarray([s // 3, 70][:b], jnp.int32))
    if name == "chunked":
        return masks.chunked_causal(192)
    return lambda bb, h, qi, kv: ((h + bb) % 2 == 0) & (kv <= qi) | (abs(qi - kv) < 50)


#: (B, T, S, Hq, Hkv, D, mask_mod, causal, dtype): GQA, odd lengths, T != S, the call's causal rule
#: ANDed with a mask_mod (bottom-right).
MOD_CASES_GPU = [
    (2, 640, 640, 4, 2, 128, "documents", False, "bfloat16"),
    (2, 517, 517, 4, 1, 64, "prefix", False, "float16"),
    (1, 1000, 1000, 4, 4, 128, "chunked", False, "bfloat16"),
    (2, 333, 517, 4, 2, 128, "lambda_bh", True, "bfloat16"),
    (1, 300, 300, 2, 2, 256, "chunked", False, "bfloat16"),  # forward only: the own backward takes D <= 128
]


@pytest.mark.parametrize("block_mask", [False, True], ids=["built-by-the-impl", "block-mask-with-bits"])
@pytest.mark.parametrize(("b", "t", "s", "hq", "hkv", "d", "mod", "causal", "dtype"), MOD_CASES_GPU)
def test_mask_mods_against_the_oracle(b: int, t: int, s: int, hq: int, hkv: int, d: int, mod: str, causal: bool,
                                      dtype: str, block_mask: bool) -> None:
    # The forward eagerly and under jit, and the gradients under jit, K and V poisoned with NaN
    # where no query of the sequence sees a key (the contract says those are unread).
    from jaxattn import masks

    x = _make(b, t, s, hq, hkv, d, dtype, seed=7)
    mask_mod = _mod(mod, b, t, s)
    q, k, v = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v"))
    impl = jaxattn.get_impl("mosaic_flash")
    bm = masks.block_mask(mask_mod, b, hq, t, s, bits=True) if block_mask else None

    def run(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        res = impl(q, k, v, causal=causal, mask_mod=mask_mod, block_mask=bm)
        return res.attention_outputs, res.softmax_lse

    ref = oracle.attention(x["q"], x["k"], x["v"], causal=causal, mask_mod=mask_mod)
    tol = DEFAULT_TOLERANCES[dtype]
    for attend in (run, jax.jit(run)):
        out, lse = attend(q, k, v)
        assert_close("output", out, ref.output, tol.forward)
        lse = np.asarray(lse, np.float64)
        assert np.array_equal(np.isfinite(lse), np.isfinite(ref.lse))
        assert np.max(np.abs(np.where(np.isfinite(ref.lse), lse - ref.lse, 0.0))) < 1e-2
    # Poison the keys no query of a sequence (and KV head) sees.
    bits = np.asarray(masks.mask_bits(mask_mod if not causal else masks.and_(
        mask_mod, lambda bb, h, qi, kv: kv <= qi + (s - t)), b, hq, t, s))
    words = np.bitwise_or.reduce(np.broadcast_to(bits, (b, hq, t, bits.shape[-1])).reshape(b, hkv, -1, bits.shape[-1]),
                                 axis=2)
    key_seen = ((words[..., :, None] >> np.arange(32)) & 1).reshape(b, hkv, -1)[..., :s].astype(bool)
    unseen = ~np.swapaxes(key_seen, 1, 2)[..., None]  # (B, S, Hkv, 1)
    k_bad, v_bad = (jnp.where(jnp.asarray(unseen), jnp.nan, a) for a in (k, v))
    out, _ = jax.jit(run)(q, k_bad, v_bad)
    assert_close("output (unseen keys NaN)", out, ref.output, tol.forward)
    if d > 128:
        return

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(run(q, k, v)[0].astype(jnp.float32) * jnp.asarray(x["do"], jnp.float32))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k_bad, v_bad)
    want = oracle.attention_backward(x["q"], x["k"], x["v"], x["do"], causal=causal, mask_mod=mask_mod)
    for name, g, r in zip(("dq", "dk", "dv"), got, (want.dq, want.dk, want.dv), strict=True):
        g = np.asarray(g, np.float64)
        if name != "dq":  # unseen keys get a gradient of 0
            assert np.all(g[np.broadcast_to(unseen, g.shape)] == 0), name
        assert_close(name, g, r, tol.grad)
