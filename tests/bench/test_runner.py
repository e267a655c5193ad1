"""The benchmark runner with toy backends: declines, failures, limits and ratios are results, not crashes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from jaxattn import AttentionCall, AttentionImpl, AttentionOutput, Feature
from jaxattn.cli._output import Printer
from jaxattn.discovery.plugins import isolated_registry
from jaxattn_bench import BenchConfig, BenchShape, default_matrix, quick_matrix, run_bench
from jaxattn_bench.record import problem_of
from jaxattn_bench.report import auto_gaps, not_run_lines, summary_lines, tables
from jaxattn_bench.store import TuningStore


class Plain(AttentionImpl):
    features: ClassVar = frozenset({Feature.CAUSAL, Feature.GRAD})
    priority: ClassVar[int] = 10

    @classmethod
    def get_impl_name(cls) -> str:
        return "plain"

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        s = jnp.einsum("bthd,bshd->bhts", q, k) * call.softmax_scale
        if call.causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        return AttentionOutput(
            jnp.einsum(
                "bhts,bshd->bthd",
                jnp.exp(s - s.max(-1, keepdims=True)) / jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True),
                v,
            )
        )


class Broken(Plain):
    """Accepts everything Plain does, then fails while tracing."""

    features: ClassVar = Plain.features | {Feature.GQA}
    priority: ClassVar[int] = 5

    @classmethod
    def get_impl_name(cls) -> str:
        return "broken"

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        raise RuntimeError("kernel exploded")


class Flaky(Plain):
    """Fails its first trace only, like a kernel library that cannot compile in two threads at once."""

    traces: ClassVar[list[int]] = []
    priority: ClassVar[int] = 1  # never auto's pick in these tests

    @classmethod
    def get_impl_name(cls) -> str:
        return "flaky"

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        type(self).traces.append(1)
        if len(type(self).traces) == 1:
            raise RuntimeError("compiler state clobbered by another thread")
        return super().forward_native(call)


class Twin(Plain):
    """Plain's computation under another name: compiles to Plain's very program."""

    priority: ClassVar[int] = 2

    @classmethod
    def get_impl_name(cls) -> str:
        return "twin"


class Other(Plain):
    """A different program: masks with a large negative number instead of -inf."""

    priority: ClassVar[int] = 3

    @classmethod
    def get_impl_name(cls) -> str:
        return "other"

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        q, k, v = call.q, call.k, call.v
        s = jnp.einsum("bthd,bshd->bhts", q, k) * call.softmax_scale
        if call.causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
        return AttentionOutput(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v))


@pytest.fixture
def toys() -> Iterator[None]:
    with isolated_registry(discover=False):
        jaxattn.register_impl(Plain)
        jaxattn.register_impl(Broken)
        jaxattn.register_impl(Flaky)
        jaxattn.register_impl(Twin)
        jaxattn.register_impl(Other)
        yield


MHA = BenchShape(1, 32, 32, 2, 2, 8, True, "float32")
GQA = BenchShape(1, 32, 32, 4, 2, 8, True, "float32")


def config(**kw: Any) -> BenchConfig:
    base: dict[str, Any] = {
        "shapes": [MHA, GQA],
        "backends": ["plain", "broken", "auto"],
        "reference": "plain",
        "warmup": 0,
        "repeats": 2,
        "compile_workers": 2,
    }
    base.update(kw)
    return BenchConfig(**base)


def test_flops_follow_gpu_md() -> None:
    shape = BenchShape(4, 4096, 4096, 32, 32, 128, False, "bfloat16")
    assert shape.flops("fwd") == 4 * 4 * 32 * 4096 * 4096 * 128
    assert BenchShape(4, 4096, 4096, 32, 32, 128, True, "bfloat16").flops("fwd") == shape.flops("fwd") / 2
    assert shape.flops("fwdbwd") == 3.5 * shape.flops("fwd")


def test_default_gpu_matrix() -> None:
    shapes = default_matrix()
    assert len(shapes) == 3 * 5 * 2 + 5 * 2  # D x S x mask, plus GQA 4:1 at D=128
    assert all(s.batch * s.seq_k == 16384 and s.dtype == "bfloat16" for s in shapes)
    assert {s.heads_q for s in shapes if s.head_dim == 256} == {16}
    assert {s.heads_q for s in shapes if s.head_dim != 256} == {32}
    assert {(s.head_dim, s.group) for s in shapes if s.group > 1} == {(128, 4)}
    assert {s.label for s in shapes} >= {
        "B4 S4096 H32 D128 causal",
        "B1 S16384 H32/8 D128 full",
        "B16 S1024 H16 D256 full",
    }
    assert len(quick_matrix()) == 8


@pytest.mark.usefixtures("toys")
def test_declines_and_failures_become_cells() -> None:
    report = run_bench(config())
    assert {(r.backend, r.mode): r.status for r in report.results if r.shape == MHA} == {
        ("plain", "fwd"): "ok",
        ("plain", "fwdbwd"): "ok",
        ("broken", "fwd"): "failed",
        ("broken", "fwdbwd"): "failed",
        ("auto", "fwd"): "ok",
        ("auto", "fwdbwd"): "ok",
    }
    gqa_plain = report.get(GQA, "plain", "fwd")
    assert gqa_plain is not None and gqa_plain.status == "declined"
    assert "grouped/multi-query heads" in gqa_plain.reason
    assert gqa_plain.cell().startswith("declined: ")
    failed = report.get(MHA, "broken", "fwd")
    assert failed is not None and "kernel exploded" in failed.reason
    auto = report.get(MHA, "auto", "fwd")
    assert auto is not None and auto.note == "-> plain (declared priority)" and auto.ratio is not None
    # auto on GQA: plain declines, broken accepts (and fails): a failed cell, not a crash
    assert report.get(GQA, "auto", "fwd").status == "failed"  # type: ignore[union-attr]
    not_run = not_run_lines(report)
    assert any(line.startswith("plain declined on 1 of 2 shapes") for line in not_run), not_run
    assert any(line.startswith("auto failed on 1 of 2 shapes") for line in not_run), not_run
    for mode_table in tables(report):
        Printer(plain=True).table(mode_table)
    assert any("auto vs the fastest backend" in line for line in summary_lines(report))
    assert [g["fastest"] for g in auto_gaps(report)] == ["plain", "plain"]


@pytest.mark.usefixtures("toys")
def test_memory_limit_and_time_budget_skip_with_a_reason() -> None:
    report = run_bench(config(backends=["plain"], shapes=[MHA], max_temp_bytes=1))
    assert {r.status for r in report.results} == {"skipped"}
    assert "temporary memory" in report.results[0].reason
    report = run_bench(config(backends=["plain"], time_budget_s=-1.0))
    assert {r.status for r in report.results} == {"skipped"} and len(report.results) == 4
    assert report.notes and "time budget" in report.notes[0]


@pytest.mark.usefixtures("toys")
def test_bench_tune_records_then_times_auto(cache_dir: Path) -> None:
    report = run_bench(config(backends=["plain", "auto"], shapes=[MHA], record_tuning=True))
    entry = TuningStore.load().lookup(problem_of(MHA))
    assert entry is not None and set(entry.results) == {"plain"}
    assert entry.results["plain"].fwd_ms and entry.results["plain"].fwdbwd_ms
    # the table's numbers come from a second round in which auto is timed with the others
    assert {(r.backend, r.mode): len(r.times_ms) for r in report.results} == {
        ("plain", "fwd"): 2, ("plain", "fwdbwd"): 2, ("auto", "fwd"): 2, ("auto", "fwdbwd"): 2}
    auto = report.get(MHA, "auto", "fwd")
    # this registry has no jaxattn-bench plugin, so no records hook: auto ranks by declared priority
    assert auto is not None and auto.ok and auto.note == "-> plain (declared priority)"
    # without auto: measured once, stored all the same
    (cache_dir / "tuning.json").unlink()
    report = run_bench(config(backends=["plain"], shapes=[GQA, MHA], record_tuning=True))
    assert {len(r.times_ms) for r in report.results if r.ok} == {2}
    assert TuningStore.load().lookup(problem_of(MHA)) is not None
    assert TuningStore.load().lookup(problem_of(GQA)) is None  # plain declines GQA: nothing to store


def test_pallas_mha_declines_what_it_cannot_run() -> None:
    report = run_bench(config(backends=["pallas_mha"], shapes=[GQA], reference=None))
    assert {r.status for r in report.results} == {"declined"}
    for r in report.results:
        assert "Hq == Hkv" in r.reason  # mha has no grouped-query attention
        assert ("needs a CUDA GPU" in r.reason) == (jaxattn.detect_device().vendor != "cuda")


@pytest.mark.usefixtures("toys")
def test_a_compile_that_fails_in_the_pool_is_retried_alone() -> None:
    Flaky.traces.clear()
    report = run_bench(config(backends=["flaky", "plain"], shapes=[MHA], modes=("fwd",)))
    flaky = report.get(MHA, "flaky", "fwd")
    assert flaky is not None and flaky.ok, flaky
    assert len(Flaky.traces) == 2


def test_samples_and_preroll_last_as_long_as_asked() -> None:
    from jaxattn_bench.timing import calls_lasting, platform_defaults

    assert calls_lasting(10.0, 0.3, 1000) == 34  # ceil(10 / 0.3)
    assert calls_lasting(10.0, 12.0, 1000) == 1  # one call is long enough
    assert calls_lasting(0.0, 0.3, 1000) == 0  # 0: none (no pre-roll; a sample is then one call)
    assert calls_lasting(10.0, 0.0, 50) == 50  # capped
    assert platform_defaults("gpu") == platform_defaults("tpu") == (10.0, 100.0)
    assert platform_defaults("cpu") == (1.0, 0.0)


def test_run_sample_and_preroll_make_every_call() -> None:
    import jax

    from jaxattn_bench.timing import Program, preroll, run_sample

    calls: list[int] = []

    def fake(x: Any) -> Any:
        calls.append(1)
        return jax.numpy.asarray(x)

    ms = run_sample(Program(fake, None, 0.0), (1.0,), 7)
    assert len(calls) == 7 and ms > 0
    preroll(Program(fake, None, 0.0), (1.0,), 3)
    assert len(calls) == 10


def test_seconds_per_call_times_samples_of_back_to_back_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import jax

    from jaxattn_bench import timing

    monkeypatch.setitem(timing.PLATFORM_DEFAULTS, "cpu", (20.0, 0.0))  # a sample lasts >= 20 ms
    calls: list[float] = []

    def slow(x: Any) -> Any:  # about 5 ms a call: a sample is several back-to-back calls
        calls.append(time.perf_counter())
        time.sleep(0.005)
        return jax.numpy.asarray(x)

    seconds = timing.seconds_per_call(slow, (1.0,), 3)
    assert 0.004 < seconds < 0.05, seconds
    # a warm-up call, one to size the samples, a sizing batch, then 3 samples of several calls each
    assert len(calls) >= 2 + 3 * 2, len(calls)


@pytest.mark.usefixtures("toys")
def test_samples_are_sized_by_the_warmup_call_and_spread_over_rounds() -> None:
    # a tiny CPU program takes well under 50 ms: each sample batches several calls
    report = run_bench(config(backends=["plain"], shapes=[MHA], modes=("fwd",), warmup=1, min_sample_ms=50.0,
                              preroll_ms=50.0, max_calls_per_sample=5, repeats=5, rounds=2))
    plain = report.get(MHA, "plain", "fwd")
    assert plain is not None and plain.ok and plain.calls_per_sample == 5 and plain.preroll_calls == 5
    assert len(plain.times_ms) == 5 and plain.median_ms is not None
    single = run_bench(config(backends=["plain"], shapes=[MHA], modes=("fwd",), min_sample_ms=0.0, preroll_ms=0.0))
    assert (single.results[0].calls_per_sample, single.results[0].preroll_calls) == (1, 0)


@pytest.mark.usefixtures("toys")
def test_identical_programs_are_timed_once_and_share_the_timing() -> None:
    report = run_bench(config(backends=["plain", "twin", "other", "auto"], shapes=[MHA]))
    for mode in ("fwd", "fwdbwd"):
        plain, twin, other, auto = (report.get(MHA, n, mode) for n in ("plain", "twin", "other", "auto"))
        assert plain is not None and twin is not None and other is not None and auto is not None
        assert plain.ok and plain.same_program_as is None
        assert twin.same_program_as == "plain" and twin.times_ms == plain.times_ms and twin.ok
        assert auto.same_program_as == "plain" and auto.median_ms == plain.median_ms
        assert auto.note == "-> plain (declared priority)"
        assert other.ok and other.same_program_as is None
    from jaxattn_bench.progress import describe

    assert describe(twin).endswith("plain's program")
    rows = [" ".join(r) for r in tables(report)[0].rows]
    assert any(r.startswith("twin") and "plain's program" in r for r in rows)
    assert any("on 2 of 2 auto compiled to the very program" in line for line in summary_lines(report))
    separate = run_bench(config(backends=["plain", "twin", "auto"], shapes=[MHA], dedupe=False))
    assert all(r.same_program_as is None and r.ok and len(r.times_ms) == 2 for r in separate.results)


@pytest.mark.usefixtures("toys")
def test_bench_tune_times_auto_again_only_for_a_new_program(cache_dir: Path) -> None:
    # auto compiles to plain's program (and twin's): its timing is plain's, the one timed
    report = run_bench(config(backends=["plain", "twin", "auto"], shapes=[MHA], record_tuning=True, repeats=3))
    auto, plain = report.get(MHA, "auto", "fwd"), report.get(MHA, "plain", "fwd")
    assert auto is not None and plain is not None
    assert auto.same_program_as == "plain" and len(plain.times_ms) == 3
    # not deduplicated: auto is a program of its own, timed in a new round with plain
    report = run_bench(config(backends=["plain", "auto"], shapes=[MHA], record_tuning=True, repeats=3,
                              dedupe=False))
    assert {(r.backend, r.mode): (len(r.times_ms), r.same_program_as) for r in report.results} == {
        ("plain", "fwd"): (3, None), ("plain", "fwdbwd"): (3, None),
        ("auto", "fwd"): (3, None), ("auto", "fwdbwd"): (3, None)}
