"""``jaxattn tune`` resists noise: timings are stored only when every round tells the same story.

No test here times anything: a fake timer gives each program the times a noisy machine would.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import jaxattn
from jaxattn.cli import main
from jaxattn_bench import runner as runner_module
from jaxattn_bench.results import BenchConfig
from jaxattn_bench.runner import run_bench
from jaxattn_bench.shapes import BenchShape
from jaxattn_bench.stability import MAX_SPREAD, spread, unstable_reasons
from jaxattn_bench.store import TuningStore
from jaxattn_bench.timing import samples_per_round, split_rounds

from .helpers import FakeTimer, Timer, noisy, problem, qkv


def sample(times: dict[str, Timer], rounds: int = 5, per_round: int = 3, seed: int = 0) -> dict[str, list[list[float]]]:
    rng = random.Random(seed)
    return {name: [[timer(name, r, rng) for _ in range(per_round)] for r in range(rounds)]
            for name, timer in times.items()}


def slowed_in(round_slowed: int, ms: float, factor: float) -> Timer:
    """The reported case: a stretch of other work slows one impl's samples in one round."""
    return lambda name, round_, rng: ms * (factor if round_ == round_slowed else 1) * (1 + rng.uniform(-0.03, 0.03))


def test_quiet_timings_are_stable() -> None:
    assert unstable_reasons(sample({"vanilla": noisy(0.21), "blockwise": noisy(0.35), "sdpa": noisy(0.2)})) == []


def test_equal_impls_flipping_within_noise_are_a_tie_not_instability() -> None:
    for seed in range(20):
        assert unstable_reasons(sample({"a": noisy(1.0), "b": noisy(1.0)}, seed=seed)) == []


def test_one_slowed_round_is_not_stored() -> None:
    """sdpa at 0.818 ms against about 0.2 for its peers: one bad stretch, not sdpa's speed."""
    reasons = unstable_reasons(sample({"sdpa": slowed_in(2, 0.2, 4.1), "vanilla": noisy(0.21),
                                       "autoregressive_decodeattn": noisy(0.2)}))
    assert len(reasons) == 1 and reasons[0].startswith("sdpa: round medians") and "more than 25%" in reasons[0]


def test_a_ranking_that_flips_in_a_round_is_not_stored() -> None:
    rounds = {"a": [[1.0], [1.0], [1.06]], "b": [[1.1], [1.1], [1.04]]}  # spreads 6% and 6%, medians 10% apart
    assert unstable_reasons(rounds) == ["b beat a in round 3 of 3, though 1.10x slower overall"]


def test_one_round_cannot_show_a_ranking() -> None:
    assert "at least 2" in unstable_reasons({"a": [[1.0, 1.0]], "b": [[2.0, 2.0]]})[0]


def test_spread() -> None:
    assert spread([1.0]) == 0 and spread([2.0, 2.5, 2.2]) == pytest.approx(0.25)
    assert MAX_SPREAD == 0.25


# -- the runner's rounds are the rounds the check splits ------------------------------------------
@pytest.mark.usefixtures("toys")
def test_split_rounds_matches_the_runner_interleaving(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(10_000))
    monkeypatch.setattr(runner_module, "run_sample", lambda program, args, number: float(next(clock)))
    config = BenchConfig(shapes=[BenchShape(2, 16, 16, 4, 4, 8, True, "float32")], backends=["alpha", "beta"],
                         reference=None, modes=("fwd",), warmup=1, repeats=7, rounds=3, min_sample_ms=0.0,
                         preroll_ms=0.0, dedupe=False, compile_workers=1)
    results = {r.backend: r for r in run_bench(config).results}
    assert samples_per_round(7, 3) == [3, 2, 2]
    split = {name: split_rounds(r.times_ms, 7, 3) for name, r in results.items()}
    for k in range(3):  # round k of every program lies between rounds k-1 and k+1 of every other
        lo = min(t for s in split.values() for t in s[k])
        hi = max(t for s in split.values() for t in s[k])
        assert hi - lo + 1 == sum(len(s[k]) for s in split.values())  # one contiguous stretch of samples
        if k:
            assert lo > max(t for s in split.values() for t in s[k - 1])


# -- jaxattn tune with a fake noisy timer (the fake_timer fixture) ----------------------------
TUNE = ["tune", "--shape", "2,16,4,8", "--mask", "causal", "--modes", "fwd", "--impls", "alpha,beta", "--warmup", "1",
        "--min-sample-ms", "0", "--progress", "none", "--plain", "--compile-workers", "1"]


@pytest.mark.usefixtures("toys")
def test_tune_does_not_store_a_noisy_shape_and_says_so(fake_timer: FakeTimer,
                                                       capsys: pytest.CaptureFixture[str], cache_dir: Path) -> None:
    # beta is truly faster, but a stretch of other work slowed it 4x in round 2: nothing may be stored
    fake_timer({"alpha": noisy(1.0), "beta": slowed_in(1, 0.5, 4.0)}, 15, 5)
    assert main(TUNE) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines may wrap at the terminal's width
    assert "not stored (timings too noisy, nothing written): B2 S16 H4 D8 causal: fwd: beta: round medians" in out
    assert "more --rounds" in out
    assert TuningStore.load().lookup(problem()) is None
    q, k, v = qkv()
    assert jaxattn.explain(q, k, v, causal=True).chosen == "alpha"  # declared priority, as before tuning


@pytest.mark.usefixtures("toys")
def test_tune_stores_steady_timings(fake_timer: FakeTimer,
                                    capsys: pytest.CaptureFixture[str], cache_dir: Path) -> None:
    fake_timer({"alpha": noisy(1.0), "beta": noisy(0.5)}, 15, 5)
    assert main([*TUNE, "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["stored"] is True and rows[0]["unstable"] == [] and rows[0]["auto"] == "beta"
    entry = TuningStore.load().lookup(problem())
    assert entry is not None and entry.results["beta"].fwd_ms == pytest.approx(0.5, rel=0.05)
