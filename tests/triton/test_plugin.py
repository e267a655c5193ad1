"""Registration, declared capabilities, declines and tile selection (no kernel runs here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.problem import AttentionProblem
from jaxattn.discovery.registry import Provider
from jaxattn.testing import oracle
from jaxattn_triton import plugin, tuning
from jaxattn_triton.flash import impl as impl_module
from jaxattn_triton.flash.impl import TritonFlashAttention
from jaxattn_triton.flash.launch import DQ_ATOMIC, DQ_KERNEL, KernelTiles, Tiles
from jaxattn_triton.spec import AttnSpec

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
T4 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="Tesla T4", compute_capability="7.5")


def _problem(**kw: object) -> AttentionProblem:
    base: dict[str, object] = {
        "batch": 2,
        "seq_q": 128,
        "seq_k": 128,
        "heads_q": 8,
        "heads_kv": 2,
        "head_dim": 128,
        "head_dim_v": 128,
        "dtype": "bfloat16",
    }
    base.update(kw)
    return AttentionProblem(**base)  # type: ignore[arg-type]


@pytest.fixture
def kernels_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_module, "_installed", lambda module: True)


def test_registration_imports_no_kernel_library() -> None:
    code = (
        "import sys, jaxattn_triton.plugin as p, jaxattn_triton.flash.impl, jaxattn_triton.decode.impl,"
        " jaxattn_triton.paged.impl;"
        "p.jaxattn_register_impls();"
        "bad = [m for m in ('triton', 'jax_triton', 'torch') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_implref_matches_the_class() -> None:
    refs = plugin.jaxattn_register_impls()
    assert refs[0] is plugin.FLASH_ATTN2
    provider = Provider.from_source(refs[0], "triton", "jaxattn-triton", "0.1.0")
    assert provider.load() is TritonFlashAttention  # the registry's own consistency check
    assert refs[0].priority == TritonFlashAttention.priority
    assert TritonFlashAttention.name() == "flash_attn2"
    # Every reference agrees with its class (names, platforms, priority, kind): the serving
    # backends' references are checked in test_serving_plugin.
    for ref in refs:
        cls = Provider.from_source(ref, "triton", "jaxattn-triton", "0.1.0").load()
        assert (ref.names, ref.priority, ref.kind) == (cls.names(), cls.priority, cls.kind)
        assert set(ref.platforms) == set(cls.platforms)


def test_declines_on_cpu_with_the_platform() -> None:
    impl = TritonFlashAttention(AttentionMetadata(), DeviceInfo(platform="cpu"))
    reasons = impl.not_supported_reasons(_problem())
    assert any("cuda" in r and "cpu" in r for r in reasons), reasons


@pytest.mark.usefixtures("kernels_installed")
def test_accepts_every_declared_feature_on_an_h100() -> None:
    impl = TritonFlashAttention(AttentionMetadata(), H100)
    problem = _problem(
        seq_q=100, seq_k=300, head_dim=96, head_dim_v=64, causal=True,
        mask_shape=(2, 1, 100, 300), bias_shape=(1, 8, 100, 300), sliding_window=(64, 0),
        segment_ids=True, logits_soft_cap=30.0, sinks=True, needs_grad=True,
    )  # fmt: skip
    assert impl.not_supported_reasons(problem) == []


@pytest.mark.usefixtures("kernels_installed")
@pytest.mark.parametrize(
    ("problem", "metadata", "expected"),
    [
        (_problem(dropout_prob=0.1), AttentionMetadata(), "dropout"),
        (_problem(dtype="float32"), AttentionMetadata(), "float32"),
        (_problem(head_dim=320, head_dim_v=320), AttentionMetadata(), "320"),
        (_problem(), AttentionMetadata(softmax_dtype="bfloat16"), "softmax_dtype"),
        (_problem(), AttentionMetadata(block_q=48), "powers of two"),
    ],
)
def test_declines_with_a_reason(problem: AttentionProblem, metadata: AttentionMetadata, expected: str) -> None:
    reasons = TritonFlashAttention(metadata, H100).not_supported_reasons(problem)
    assert any(expected in r for r in reasons), reasons


def test_declines_without_jax_triton_and_on_old_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_module, "_installed", lambda module: module != "jax_triton")
    reasons = TritonFlashAttention(AttentionMetadata(), T4).not_supported_reasons(_problem())
    assert any("jax-triton" in r for r in reasons), reasons
    assert any("7.5" in r for r in reasons), reasons


def _spec(**kw: object) -> AttnSpec:
    base: dict[str, object] = {
        "batch": 2,
        "seq_q": 4096,
        "seq_k": 4096,
        "heads_q": 32,
        "heads_kv": 32,
        "head_dim": 128,
        "head_dim_v": 128,
        "dtype": "bfloat16",
        "softmax_scale": 128**-0.5,
    }
    base.update(kw)
    return AttnSpec(**base)  # type: ignore[arg-type]


def test_spec_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        _spec(heads_q=6, heads_kv=4)
    with pytest.raises(ValueError, match="broadcast"):
        _spec(mask_shape=(2, 3, 4096, 4096))


@pytest.mark.parametrize(
    ("t", "s", "causal", "window"),
    [(7, 13, True, None), (13, 7, True, None), (10, 10, False, (2, 3)), (6, 15, True, (4, 9))],
)
def test_band_fraction_counts_visible_pairs(t: int, s: int, causal: bool, window: tuple[int, int] | None) -> None:
    spec = _spec(batch=1, heads_q=1, heads_kv=1, seq_q=t, seq_k=s, causal=causal, window=window)
    visible = oracle.visibility(1, 1, t, s, causal=causal, sliding_window=window)
    assert spec.band_fraction() == pytest.approx(visible.mean())


def test_default_tiles_shrink_for_short_sequences_and_dense_extras() -> None:
    short = tuning.default_tiles(_spec(seq_q=20, seq_k=40), "9.0")
    assert (short.fwd.block_m, short.fwd.block_n) == (32, 64)
    masked = tuning.default_tiles(_spec(bias_shape=(1, 32, 4096, 4096)), "9.0")
    assert masked.fwd.num_stages <= 2 and masked.dkdv.block_n <= 64


def _section(path: Path) -> dict[str, object]:
    """This plugin's object in the tuning cache file ``path`` (jaxattn's one cache), this environment's section."""
    from jaxattn_bench.keys import current_environment

    data = json.loads(path.read_text())
    [mine] = [s for s in data["sections"] if s["environment"] == current_environment().to_dict()]
    return dict(mine.get("plugins", {}).get(tuning.SECTION, {}))


def test_overrides_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    tiles = tuning.tiles_for(
        _spec(), device=("H100", "9.0"), overrides={"block_q": 64, "block_k_bwd": 32, "num_warps": 4}
    )
    assert (tiles.fwd.block_m, tiles.fwd.num_warps) == (64, 4)
    assert tiles.dkdv.block_n == 32 and tiles.dq.block_n == 32


def test_tune_keeps_the_fastest_and_persists_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))  # jaxattn's one tuning cache
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_device", lambda: ("FakeGPU", "9.0"))
    spec = _spec(causal=True)
    cands = tuning.candidates(spec)
    winner = {name: c[-1] for name, c in cands.items() if c}
    calls: list[str] = []

    def measure(tiles: Tiles, name: str) -> float:
        calls.append(name)
        atomic = name == "dkdv_atomic"
        assert (tiles.dq_mode != DQ_KERNEL) == atomic
        chosen = tiles.dkdv if atomic else getattr(tiles, name)
        if chosen.block_n == 128 and name == "dq":
            raise RuntimeError("out of shared memory")  # failing candidates are skipped
        # The atomic backward (one launch) loses to the two kernels: 2.5 > 1 + 1.
        return (1.0 if chosen == winner[name] else 2.0) + (1.5 if atomic else 0.0)

    best = tuning.tune(spec, measure)
    assert (best.fwd, best.dkdv, best.dq) == (winner["fwd"], winner["dkdv"], winner["dq"])
    assert best.dq_mode == DQ_KERNEL
    assert set(calls) == {"fwd", "dkdv", "dq", "dkdv_atomic"}
    assert list(_section(path)) == [f"FakeGPU|{tuning.shape_class(spec)}"]
    # A new process (empty memory cache) reads the result instead of tuning again.
    monkeypatch.setattr(tuning, "_memory", {})
    assert tuning.tiles_for(spec, device=("FakeGPU", "9.0")) == best
    # Another shape class is not served from it.
    other = _spec(head_dim=64, head_dim_v=64)
    assert tuning.tiles_for(other, device=("FakeGPU", "9.0")) == tuning.default_tiles(other, "9.0")


def test_tune_takes_the_atomic_backward_when_it_beats_two_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_device", lambda: ("FakeGPU", "9.0"))
    spec = _spec()
    fast = tuning.candidates(spec)["dkdv_atomic"][1]

    def measure(tiles: Tiles, name: str) -> float:
        if name == "dkdv_atomic":
            return 1.5 if tiles.dkdv == fast else 3.0
        return 1.0

    best = tuning.tune(spec, measure)
    assert best.dq_mode == DQ_ATOMIC and best.dkdv == fast
    monkeypatch.setattr(tuning, "_memory", {})
    assert tuning.tiles_for(spec, device=("FakeGPU", "9.0")) == best  # the mode is cached too


def test_tune_takes_split_dkdv_when_it_beats_one_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(tuning, "_device", lambda: ("FakeGPU", "9.0"))
    spec = _spec(head_dim=256, head_dim_v=256)
    cands = tuning.candidates(spec)
    assert cands["dkdv_split"]
    fast = cands["dkdv_split"][-1]

    def measure(tiles: Tiles, name: str) -> float:
        assert tiles.dkdv_split == (name == "dkdv_split")
        if name == "dkdv_split":
            return 1.5 if tiles.dkdv == fast else 3.0
        return {"dkdv": 2.0, "dq": 1.0, "dkdv_atomic": 9.0}.get(name, 1.0)

    best = tuning.tune(spec, measure)
    assert best.dkdv_split and best.dkdv == fast and best.dq_mode == DQ_KERNEL
    monkeypatch.setattr(tuning, "_memory", {})
    assert tuning.tiles_for(spec, device=("FakeGPU", "9.0")) == best


def test_tiles_share_the_one_tuning_cache_with_auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One file: the plugin's tiles sit beside auto's measurements, and writing either keeps the other."""
    from jaxattn.selection.tuning import Measurement
    from jaxattn_bench.records import TuningCache
    from jaxattn_bench.store import TuningStore

    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", {})
    measured = TuningStore.load()
    measured.record(_problem(), [Measurement("flash_attn2", "jaxattn-triton", "0.1.0", fwd_ms=1.0)])
    measured.save()
    spec = _spec()
    tiles = tuning.default_tiles(spec, "7.5")
    tuning.store("FakeGPU", spec, tiles)
    again = TuningStore.load()
    again.record(_problem(seq_q=4096, seq_k=4096), [Measurement("flash_attn2", "jaxattn-triton", "0.1.0", fwd_ms=2.0)])
    again.save()
    # One file holds records and tiles (the lock beside it serialises concurrent saves: no data).
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["tuning.json"]
    cache = TuningCache.load()
    assert len(cache) == 2 and list(cache.plugins[tuning.SECTION]) == [f"FakeGPU|{tuning.shape_class(spec)}"]
    monkeypatch.setattr(tuning, "_memory", {})
    assert tuning.load_cached("FakeGPU", spec) == tiles
    # A damaged entry of the plugin's is the plugin's to refuse: defaults, no error.
    damaged = TuningStore.load()
    damaged.update_plugin(tuning.SECTION, {f"FakeGPU|{tuning.shape_class(spec)}": {"fwd": "wide"}})
    damaged.save()
    monkeypatch.setattr(tuning, "_memory", {})
    assert tuning.load_cached("FakeGPU", spec) is None


def test_default_backward_modes_by_head_dim() -> None:
    d128 = tuning.default_tiles(_spec(), "9.0")
    assert d128.dq_mode == DQ_ATOMIC and not d128.dkdv_split
    d64 = tuning.default_tiles(_spec(head_dim=64, head_dim_v=64), "9.0")
    assert d64.dq_mode == DQ_KERNEL and not d64.dkdv_split
    d256 = tuning.default_tiles(_spec(head_dim=256, head_dim_v=256), "9.0")
    assert d256.dq_mode == DQ_KERNEL and d256.dkdv_split
    # Dense masks get narrow tiles, where the atomic dQ was slower: two kernels.
    masked = tuning.default_tiles(_spec(mask_shape=(1, 1, 4096, 4096)), "9.0")
    assert masked.dq_mode == DQ_KERNEL
    assert tuning.default_tiles(_spec(), "8.0").dq_mode == DQ_KERNEL


def test_corrupt_cache_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from jaxattn.selection.tuning import TuningCacheWarning

    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))  # jaxattn's one tuning cache, damaged
    monkeypatch.setattr(tuning, "_memory", {})
    spec = _spec()
    with pytest.warns(TuningCacheWarning, match="corrupt"):
        assert tuning.tiles_for(spec, device=("X", "9.0")) == tuning.default_tiles(spec, "9.0")
    tuning.store("X", spec, Tiles(*(KernelTiles(64, 64, 4, 2),) * 3))
    assert list(_section(path)) == [f"X|{tuning.shape_class(spec)}"]  # rewritten whole


def test_interpret_tiles_are_small_powers_of_two() -> None:
    tiles = tuning.tiles_for(_spec(seq_q=5, seq_k=9), interpret=True)
    for t in (tiles.fwd, tiles.dkdv, tiles.dq):
        assert t.block_m == 16 and t.block_n == 16
    assert np.log2(tuning.INTERPRET_TILES.block_m).is_integer()


def test_interpret_tiles_grow_with_long_sequences_and_stay_many() -> None:
    # 333 keys: 11 tiles of 32; 1001 queries: 16 tiles of 64 (the last one partial), not 32 of 32.
    tiles = tuning.tiles_for(_spec(seq_q=1001, seq_k=333), interpret=True)
    for t in (tiles.fwd, tiles.dkdv, tiles.dq):
        assert (t.block_m, t.block_n) == (64, 32)
    assert tuning.INTERPRET_MAX_TILES == -(-1001 // 64) and 1001 % 64
