"""autoregressive_decodeattn (jaxattn-vanilla): the conformance suite, the split-K combine at
lengths that are not multiples of a chunk or a step, step skipping, registration and choice."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.impl import AttentionImpl
from jaxattn.testing import oracle
from jaxattn.testing.cases import DEFAULT_TOLERANCES, Case, Level, decode_sweep, make_inputs
from jaxattn.testing.compare import assert_close
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.quick_jit import default_compiler_options, quick_jit
from jaxattn_vanilla.decode.impl import MAX_DECODE_QUERIES, MAX_STREAMED_ROWS, DecodeAttention
from jaxattn_vanilla.decode.kernel import decode_attention, decode_tiling
from jaxattn_vanilla.plugin import DECODE


def _impl(md: jaxattn.AttentionMetadata | None = None) -> DecodeAttention:
    """This plugin's provider of the name: what get_impl gives on a CPU; on a GPU the name is the
    Triton decode kernel's (tests/triton), so the vanilla class is built directly to test it there."""
    impl = jaxattn.get_impl("autoregressive_decodeattn", md)
    if jax.default_backend() == "cpu":
        assert isinstance(impl, DecodeAttention)
    elif not isinstance(impl, DecodeAttention):
        impl = DecodeAttention(md or jaxattn.AttentionMetadata())
    return impl


def _notes(q: Any, k: Any, v: Any, metadata: jaxattn.AttentionMetadata | None = None, **kw: Any) -> str:
    """What explain notes for this plugin's autoregressive_decodeattn; on a GPU, where explain
    describes the Triton kernel of that name, the notes come from this plugin's class."""
    if jax.default_backend() == "cpu":
        row = next(c for c in jaxattn.explain(q, k, v, impl="autoregressive_decodeattn", metadata=metadata,
                                              **kw).candidates if c.name == "autoregressive_decodeattn")
        return " ".join(row.notes)
    from jaxattn.backend.problem import AttentionProblem

    return " ".join(_impl(metadata).notes(AttentionProblem.from_inputs(q, k, v, **kw)))


class TestDecodeConformance(ConformanceSuite):
    """The whole matrix with the CPU's cut (one chunk over the cache): calls with T <= 16 run,
    masks, biases, segment ids, dropout and longer T are declined."""

    impl_name = "autoregressive_decodeattn"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")

    @classmethod
    def make_impl(cls) -> AttentionImpl:
        return _impl(cls.metadata)


#: Chunks of 3 keys, steps of 7: every case's S (4 to 20, 333) spans several steps and chunks,
#: the last step shifted, and lengths end inside chunks.
SMALL_CUT = jaxattn.AttentionMetadata(block_k=3, extra={"decode_step_keys": 7})


class TestDecodeConformanceSplitK(ConformanceSuite):
    """The cases the decode path runs, cut into many chunks and steps (float32)."""

    impl_name = "autoregressive_decodeattn"
    metadata = SMALL_CUT

    @classmethod
    def make_impl(cls) -> AttentionImpl:
        return _impl(cls.metadata)
    backward_lengths: ClassVar[tuple[tuple[int, int], ...]] = ((1, 1), (3, 3), (1, 333))

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        return [c for c in super().cases(level) if not _impl(SMALL_CUT).not_supported_reasons(_problem(c))]


def _problem(case: Case) -> Any:
    from jaxattn.backend.problem import AttentionProblem

    sds = jax.ShapeDtypeStruct
    window = case.sliding_window
    return AttentionProblem.from_inputs(
        sds((case.b, case.t, case.hq, case.d), jnp.float32), sds((case.b, case.s, case.hkv, case.d), jnp.float32),
        sds((case.b, case.s, case.hkv, case.value_dim), jnp.float32), causal=case.causal,
        mask=None if case.mask is None else sds((1, 1, 1, 1), jnp.bool_),
        bias=None if case.bias is None else sds((1, 1, 1, 1), jnp.float32),
        sliding_window=(window, window) if isinstance(window, int) else window,
        q_segment_ids=True if case.segments else None, logits_soft_cap=case.logits_soft_cap,
        softmax_aux=True if case.sinks else None, kv_lengths=case.kv_lengths,
    )


def _qkv(b: int, t: int, s: int, hq: int, hkv: int, d: int = 8, dv: int | None = None,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, t, hq, d)).astype(np.float32), rng.normal(size=(b, s, hkv, d)).astype(np.float32),
            rng.normal(size=(b, s, hkv, dv or d)).astype(np.float32))


def _close(got: Any, want: Any, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: -inf at other places"
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol, err_msg=what)


# -- the split-K cut -------------------------------------------------------------------------
@pytest.mark.parametrize(("s", "chunks", "step", "want"), [
    (37, None, None, (37, 1, 1)),  # the default: one chunk, one step
    (37, 4, None, (37, 1, 1)),  # 37 is prime: no equal cut, one chunk
    (36, 5, None, (36, 4, 1)),  # the most chunks <= 5 that divide 36
    (37, 3, 10, (10, 2, 4)),  # steps of 10 (the last shifted to end at 37), chunks of 5
    (8, 2, 100, (8, 2, 1)),  # a step never exceeds the cache
])
def test_decode_tiling(s: int, chunks: int | None, step: int | None, want: tuple[int, int, int]) -> None:
    tiling = decode_tiling(s, chunks, step)
    assert (tiling.step_keys, tiling.num_chunks, tiling.steps) == want
    assert tiling.chunk * tiling.num_chunks == tiling.step_keys and tiling.steps * tiling.step_keys >= s
    with pytest.raises(ValueError, match="positive"):
        decode_tiling(s, 0)


CUTS = [(1, None), (4, None), (2, 5), (3, 7), (1, 4), (5, 10)]  # (num_chunks, step)


@pytest.mark.parametrize(("t", "s", "lengths", "features"), [
    (1, 37, (37, 0, 13, 1), {"causal": True}),  # decode: empty, full, lengths inside a chunk
    (3, 41, (2, 41, 19), {"causal": True, "logits_soft_cap": 2.5}),  # speculative: query 0 of row 0 sees nothing
    (2, 30, (30, 17), {"causal": True, "sliding_window": (5, 0)}),  # the window's left edge skips whole steps
    (4, 23, None, {"sliding_window": (3, 2)}),  # no lengths: S is every sequence's length
    (16, 12, (12, 5), {"causal": True}),  # T > S: early queries before the cache's start
])
def test_split_k_combine_at_lengths_that_are_not_chunk_multiples(
        t: int, s: int, lengths: tuple[int, ...] | None, features: dict[str, Any]) -> None:
    """Every cut (chunks within a step, steps, the shifted last step, skipped steps) gives the
    oracle's output, lse and gradients, sinks and GQA included."""
    b = 2 if lengths is None else len(lengths)
    q, k, v = _qkv(b, t, s, hq=6, hkv=2, dv=5, seed=s)
    aux = np.random.default_rng(1).normal(size=(6,)).astype(np.float32)
    n = None if lengths is None else np.asarray(lengths, np.int32)
    d_out = np.random.default_rng(2).normal(size=(b, t, 6, 5)).astype(np.float32)
    ref = oracle.attention(q, k, v, kv_lengths=n, softmax_aux=aux, **features)
    back = oracle.attention_backward(q, k, v, d_out, kv_lengths=n, softmax_aux=aux, **features)

    def loss(q: Any, k: Any, v: Any, aux: Any, chunks: int, step: int | None) -> tuple[Any, Any]:
        res = decode_attention(q, k, v, kv_lengths=n, softmax_aux=aux, num_chunks=chunks, step=step, **features)
        return jnp.sum(res.output * d_out), res

    def every_cut(q: Any, k: Any, v: Any, aux: Any) -> list[Any]:
        # One program for all cuts: one compile rather than one per cut (compiling is the time).
        return [jax.grad(functools.partial(loss, chunks=chunks, step=step), argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, aux) for chunks, step in CUTS]

    for (chunks, step), (grads, res) in zip(CUTS, quick_jit(every_cut)(q, k, v, aux), strict=True):
        label = f"cut {chunks}x{step} {decode_tiling(s, chunks, step)}"
        _close(res.output, ref.output, 1e-5, f"output {label}")
        _close(res.lse, ref.lse, 1e-5, f"lse {label}")
        for name, got, want in zip(("dq", "dk", "dv", "daux"), grads,
                                   (back.dq, back.dk, back.dv, back.dsoftmax_aux), strict=True):
            _close(got, want, 1e-4, f"{name} {label}")


def test_rows_without_keys_give_zeros_and_zero_gradients() -> None:
    q, k, v = _qkv(2, 3, 9, hq=4, hkv=1)
    n = np.array([0, 2], np.int32)  # sequence 0 is empty; query 0 of sequence 1 sits before the cache

    def loss(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        res = decode_attention(q, k, v, kv_lengths=n, causal=True, num_chunks=3, step=3)
        return jnp.sum(res.output), res

    grads, res = quick_jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    out = np.asarray(res.output)
    assert not out[0].any() and not out[1, 0].any() and out[1, 1:].all()
    assert np.isneginf(np.asarray(res.lse)[0]).all() and np.isneginf(np.asarray(res.lse)[1, :, 0]).all()
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(grads[0])[0].any() and not np.asarray(grads[0])[1, 0].any()


def test_lengths_traced_under_jit_are_clamped() -> None:
    q, k, v = _qkv(2, 1, 10, hq=4, hkv=2)
    run = quick_jit(lambda q, k, v, n: _impl()(q, k, v, causal=True, kv_lengths=n).attention_outputs)
    for given, meant in (([4, 10], [4, 10]), ([99, -1], [10, 0])):
        want = oracle.attention(q, k, v, causal=True, kv_lengths=np.asarray(meant)).output
        _close(run(q, k, v, jnp.asarray(given, jnp.int32)), want, 1e-5, str(given))


# -- jaxlib 0.10.2's XLA:CPU miscompile (issue 18 item 1) ------------------------------------
def test_issue_repro_eager_and_jit_match_the_oracle() -> None:
    """The reported call: auto's decode under a plain jax.jit (XLA's default options, a forward-only
    program) gave errors of 0.37 through the multiply-and-reduce logits; eager was right."""
    r = np.random.default_rng(0)
    q = r.normal(size=(1, 1, 4, 16)).astype(np.float32)
    k, v = (r.normal(size=(1, 64, 2, 16)).astype(np.float32) for _ in range(2))
    want = oracle.attention(q, k, v, causal=True).output
    if jax.default_backend() == "cpu":
        assert next(c for c in jaxattn.explain(q, k, v, causal=True).candidates if c.chosen).name == \
            "autoregressive_decodeattn"
    eager = jaxattn.attention(q, k, v, causal=True)
    jitted = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, causal=True),
                     compiler_options=default_compiler_options())(q, k, v)
    _close(eager, want, 1e-5, "eager")
    _close(jitted, want, 1e-5, "jit")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gqa_decode_sweep_under_default_jit(dtype: str) -> None:
    """The kernel alone, forward-only under jax.jit with XLA's default options (where the miscompile
    lived), over the decode sweep's shapes (seeds 0-2: D 16-128, Hkv 1/2/8, groups 1/2/4, odd and
    even S, T 1-16, lengths) against the float64 oracle."""
    tol = DEFAULT_TOLERANCES[dtype].forward
    for case in (c for seed in range(3) for c in decode_sweep(seed)):
        arrays = make_inputs(case, dtype)
        lengths = arrays.get("kv_lengths")
        q, k, v = (jnp.asarray(arrays[n], dtype) for n in ("q", "k", "v"))
        run = jax.jit(lambda q, k, v, n, causal=case.causal: decode_attention(q, k, v, kv_lengths=n, causal=causal),
                      compiler_options=default_compiler_options())
        res = run(q, k, v, lengths)
        ref = oracle.attention(arrays["q"], arrays["k"], arrays["v"], causal=case.causal, kv_lengths=lengths)
        assert_close(f"{case.describe()} output", res.output, ref.output, tol)
        assert_close(f"{case.describe()} lse", res.lse, ref.lse, tol)


def _results(jaxpr: Any) -> Iterator[tuple[int, ...]]:
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _results(inner)


def test_gqa_heads_are_packed_and_kv_never_repeated() -> None:
    """No intermediate of forward + backward has the repeated (B, S, Hq, D) K/V; the logits are
    (B, S, Hkv, T * G): each KV head's query rows side by side."""
    b, t, s, hq, hkv, d = 2, 3, 40, 8, 2, 16
    q, k, v = jnp.zeros((b, t, hq, d)), jnp.zeros((b, s, hkv, d)), jnp.zeros((b, s, hkv, d))

    def loss(q: Any, k: Any, v: Any) -> Any:
        return decode_attention(q, k, v, causal=True).output.sum()

    seen = set(_results(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr))
    assert (b, s, hq, d) not in seen and (b, hq, s, d) not in seen
    assert (b, s, hkv, t * (hq // hkv)) in seen


def test_steps_past_the_lengths_are_skipped() -> None:
    """A step no query sees is not computed: its keys may hold anything, NaN included (a
    cache's unwritten tail); the steps it does compute mask them."""
    q, k, v = _qkv(2, 2, 40, hq=4, hkv=2)
    n = np.array([9, 14], np.int32)
    k[:, 20:], v[:, 20:] = np.nan, np.nan  # steps of 10: steps 2 and 3 lie past both lengths
    out = decode_attention(q, k, v, kv_lengths=n, causal=True, step=10).output
    want = oracle.attention(q[:, :, :, :], np.nan_to_num(k), np.nan_to_num(v), kv_lengths=n, causal=True).output
    _close(out, want, 1e-5, "output")
    # With the window's left edge, steps before every query's window are skipped as well.
    k2, v2 = k.copy(), v.copy()
    k2[:, :5], v2[:, :5] = np.nan, np.nan
    out = decode_attention(q, k2, v2, kv_lengths=n, sliding_window=(2, 0), step=5).output
    clean = oracle.attention(q, np.nan_to_num(k2), np.nan_to_num(v2), kv_lengths=n, sliding_window=(2, 0)).output
    _close(out, clean, 1e-5, "windowed output")


# -- declarations, registration and choice -------------------------------------------------
def test_registered_in_jaxattn_vanilla_and_declarations_match() -> None:
    rows = {(i.name, i.distribution): i for i in jaxattn.list_impls()}
    info = rows["autoregressive_decodeattn", "jaxattn-vanilla"]
    # Usable here on a CPU; on a GPU a kernel plugin's provider of the name shadows it.
    assert info.status == "ok" and (info.usable_here or jax.default_backend() != "cpu")
    impl = _impl()
    assert set(DECODE.platforms) == set(DecodeAttention.platforms) == {"cpu", "gpu", "tpu"}
    assert DECODE.priority == DecodeAttention.priority == 60
    assert DECODE.names == DecodeAttention.names() and DECODE.description == DecodeAttention.description
    for feature in ("kv_lengths", "causal", "gqa", "cross", "decode", "value_dim", "sliding_window", "soft_cap",
                    "sinks", "lse", "grad"):
        assert jaxattn.Feature(feature) in impl.features


def test_priority_is_for_cpus_only() -> None:
    gpu = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100", compute_capability="9.0")
    tpu = DeviceInfo(platform="tpu", device_kind="TPU v5 lite")
    cpu = DeviceInfo(platform="cpu", device_kind="cpu")
    assert DecodeAttention.priority_for(cpu) == 60
    assert DecodeAttention.priority_for(gpu) == DecodeAttention.priority_for(tpu) == 5


def test_plugin_module_imports_neither_jax_nor_the_kernel() -> None:
    code = (
        "import sys, jaxattn_vanilla.plugin as p; p.jaxattn_register_impls(); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'jaxattn_vanilla.decode.kernel', 'jaxattn_vanilla.decode.impl')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's ranking")
def test_auto_takes_decode_calls_on_a_cpu() -> None:
    q, k, v = _qkv(2, 1, 64, hq=8, hkv=2)
    n = np.array([10, 64], np.int32)
    for kw in ({"causal": True, "kv_lengths": n}, {"causal": True}, {"kv_lengths": n, "logits_soft_cap": 5.0}):
        chosen = next(c for c in jaxattn.explain(q, k, v, **kw).candidates if c.chosen)
        assert chosen.name == "autoregressive_decodeattn", kw
    # ... never the calls it declines: a mask, or a prefill.
    mask = np.ones((2, 1, 1, 64), bool)
    assert next(c for c in jaxattn.explain(q, k, v, mask=mask).candidates if c.chosen).name != \
        "autoregressive_decodeattn"
    long_q = np.zeros((2, MAX_DECODE_QUERIES + 1, 8, 8), np.float32)
    assert next(c for c in jaxattn.explain(long_q, k, v, causal=True).candidates if c.chosen).name != \
        "autoregressive_decodeattn"


def test_declines_with_reasons_that_name_the_alternatives() -> None:
    q, k, v = _qkv(2, MAX_DECODE_QUERIES + 1, 64, hq=8, hkv=2)
    why = " | ".join(_impl().supports(q, k, v, causal=True))
    assert "T=17" in why and "prefill" in why and "'sdpa'" in why and "'blockwise'" in why
    q1 = q[:, :1]
    why = " | ".join(_impl().supports(q1, k, v, mask=np.ones((2, 1, 1, 64), bool), bias=np.zeros((1, 1, 1, 64))))
    assert "reads no mask" in why and "reads no bias" in why and "impl='blockwise'" in why
    assert _impl().supports(q[:, :MAX_DECODE_QUERIES], k, v, causal=True, needs_grad=True) == []
    with pytest.raises(jaxattn.UnsupportedError, match="T=17"):
        _impl()(q, k, v, causal=True)


def test_many_rows_per_kv_head_run_blockwise_kernel() -> None:
    """Past MAX_STREAMED_ROWS rows per KV head the call runs blockwise's kernel, still exactly."""
    q, k, v = _qkv(2, 8, 30, hq=8, hkv=2)  # 8 queries x 4 heads per KV head = 32 rows
    n = np.array([30, 11], np.int32)
    assert "blockwise's tiled kernel" in _notes(q, k, v, causal=True, kv_lengths=n) and MAX_STREAMED_ROWS < 8 * 4
    d_out = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)
    impl = _impl(jaxattn.AttentionMetadata(block_k=4))

    def loss(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        out = impl(q, k, v, causal=True, kv_lengths=n, sliding_window=(6, 0))
        return jnp.sum(out.attention_outputs * d_out), out

    grads, out = quick_jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    kw: dict[str, Any] = {"causal": True, "kv_lengths": n, "sliding_window": (6, 0)}
    ref = oracle.attention(q, k, v, **kw)
    _close(out.attention_outputs, ref.output, 1e-5, "output")
    _close(out.softmax_lse, ref.lse, 1e-5, "lse")
    back = oracle.attention_backward(q, k, v, d_out, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (back.dq, back.dk, back.dv), strict=True):
        _close(got, want, 1e-4, name)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's choice")
def test_a_cache_at_most_half_full_runs_blockwise_tiles() -> None:
    """On a CPU, with kv_lengths, the pass over the cache or blockwise's tiles is chosen at run
    time by the longest sequence; both give the oracle's output and gradients."""
    q, k, v = _qkv(2, 2, 2048, hq=4, hkv=2)
    d_out = np.random.default_rng(4).normal(size=q.shape).astype(np.float32)
    impl = _impl()
    row = next(c for c in jaxattn.explain(q, k, v, impl="autoregressive_decodeattn", causal=True,
                                          kv_lengths=np.array([1, 2], np.int32)).candidates
               if c.name == "autoregressive_decodeattn")
    assert "at most half the cache" in " ".join(row.notes)

    def loss(q: Any, k: Any, v: Any, n: Any) -> tuple[Any, Any]:
        out = impl(q, k, v, causal=True, kv_lengths=n, softmax_aux=jnp.ones((4,)))
        return jnp.sum(out.attention_outputs * d_out), out

    run = quick_jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    for lengths in ((300, 1024), (2048, 5), (0, 0)):  # tiles, one pass, tiles (nothing to see)
        n = np.asarray(lengths, np.int32)
        grads, out = run(q, k, v, n)
        kw: dict[str, Any] = {"causal": True, "kv_lengths": n, "softmax_aux": np.ones((4,))}
        _close(out.attention_outputs, oracle.attention(q, k, v, **kw).output, 1e-5, f"output {lengths}")
        _close(out.softmax_lse, oracle.attention(q, k, v, **kw).lse, 1e-5, f"lse {lengths}")
        back = oracle.attention_backward(q, k, v, d_out, **kw)
        for name, got, want in zip(("dq", "dk", "dv"), grads, (back.dq, back.dk, back.dv), strict=True):
            _close(got, want, 1e-4, f"{name} {lengths}")


def test_notes_and_metadata_cut() -> None:
    q, k, v = _qkv(1, 1, 40, hq=4, hkv=2)
    assert "1 chunk of 40 keys" in _notes(q, k, v)
    small = jaxattn.AttentionMetadata(block_k=4, extra={"decode_step_keys": 16})
    assert "4 chunks of 4 keys per step, 3 steps" in _notes(q, k, v, metadata=small)
    out = _impl(small)(q, k, v).attention_outputs
    _close(out, oracle.attention(q, k, v).output, 1e-5, "small cut")


# -- the docs page ---------------------------------------------------------------------------
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the page's example prints the CPU's choice")
def test_docs_example_runs_and_prints_what_it_says() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "decode.md").read_text()
    code = "\n".join(body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", page, re.S | re.M) if lang == "python")
    promised = re.search(r"^print\(.*\)  # (.*)$", code, re.M)
    assert promised is not None
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == promised.group(1)
