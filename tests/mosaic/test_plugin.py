"""Registration, declared capabilities, declines and import laziness of mosaic_flash (no kernel
runs here: Mosaic GPU does not run on a CPU)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.problem import AttentionProblem
from jaxattn.discovery.registry import Provider
from jaxattn_mosaic import plugin
from jaxattn_mosaic.impl import MosaicFlashAttention

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
A100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


def _problem(**kw: object) -> AttentionProblem:
    base: dict[str, object] = {
        "batch": 2, "seq_q": 4096, "seq_k": 4096, "heads_q": 32, "heads_kv": 8,
        "head_dim": 128, "head_dim_v": 128, "dtype": "bfloat16",
    }  # fmt: skip
    base.update(kw)
    return AttentionProblem(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("imports", "banned"), [
    # Discovery imports the entry-point module only: no jax at all.
    ("jaxattn_mosaic, jaxattn_mosaic.plugin", ("jax", "jaxattn_mosaic.kernel")),
    # The impl class (loaded on first use) imports no kernel: the Pallas dialect waits for a call.
    ("jaxattn_mosaic.impl", ("jaxattn_mosaic.kernel", "jax.experimental.pallas", "jax.experimental.mosaic")),
])  # fmt: skip
def test_registration_imports_no_kernel(imports: str, banned: tuple[str, ...]) -> None:
    code = (
        f"import sys, {imports}; import jaxattn_mosaic.plugin as p; p.jaxattn_register_impls();"
        f"bad = [m for m in {banned!r} if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_implref_matches_the_class() -> None:
    refs = plugin.jaxattn_register_impls()
    assert refs == [plugin.MOSAIC_FLASH]
    cls = Provider.from_source(refs[0], "mosaic", "jaxattn-mosaic", "0.1.0").load()
    assert cls is MosaicFlashAttention
    assert (refs[0].names, refs[0].priority) == (cls.names(), cls.priority)
    assert MosaicFlashAttention.name() == "mosaic_flash"


def test_discovered_by_the_registry() -> None:
    import jaxattn

    info = [i for i in jaxattn.list_impls() if i.name == "mosaic_flash"]
    assert len(info) == 1, info
    assert info[0].distribution == "jaxattn-mosaic"
    assert info[0].platforms == ("cuda",)


def test_declines_on_cpu_saying_mosaic_gpu_does_not_run_there() -> None:
    reasons = MosaicFlashAttention(AttentionMetadata(), DeviceInfo(platform="cpu")).not_supported_reasons(_problem())
    assert any("does not run on cpu" in r for r in reasons), reasons
    assert any("cuda" in r and "cpu" in r for r in reasons), reasons  # the core's platform reason


def test_declines_before_hopper() -> None:
    reasons = MosaicFlashAttention(AttentionMetadata(), A100).not_supported_reasons(_problem())
    assert any("8.0" in r and "Hopper" in r for r in reasons), reasons


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("t", "s", "hkv", "d", "dtype"), [
    (4096, 4096, 8, 128, "bfloat16"), (333, 517, 32, 64, "float16"), (1, 77, 1, 256, "bfloat16"),
    (517, 129, 4, 128, "float16"),
])  # fmt: skip
def test_accepts_what_it_declares_on_an_h100(causal: bool, t: int, s: int, hkv: int, d: int, dtype: str) -> None:
    problem = _problem(seq_q=t, seq_k=s, heads_kv=hkv, head_dim=d, head_dim_v=d, dtype=dtype, causal=causal)
    assert MosaicFlashAttention(AttentionMetadata(), H100).not_supported_reasons(problem) == []


def test_declines_every_missing_feature_with_all_reasons() -> None:
    problem = _problem(
        causal=True, mask_shape=(2, 1, 4096, 4096), bias_shape=(1, 32, 4096, 4096), sliding_window=(64, 0),
        segment_ids=True, logits_soft_cap=30.0, sinks=True, needs_grad=True, dropout_prob=0.1,
        head_dim_v=64, dtype="float32",
    )  # fmt: skip
    reasons = MosaicFlashAttention(AttentionMetadata(softmax_dtype="bfloat16"), H100).not_supported_reasons(problem)
    text = "\n".join(reasons)
    for word in ("mask", "bias", "segment ids", "sinks", "dropout", "head dim", "float32", "softmax_dtype"):
        assert word in text, (word, reasons)
    assert "soft cap" not in text and "window" not in text  # features of both kernels


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", [{"logits_soft_cap": 30.0}, {"sliding_window": (64, 0)},
                                     {"sliding_window": (300, 17), "logits_soft_cap": 5.0}], ids=str)
def test_a_soft_cap_and_a_window_run_forward_and_backward_on_an_h100(causal: bool, feature: dict[str, Any]) -> None:
    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    for d in (64, 128, 256):
        assert impl.not_supported_reasons(_problem(causal=causal, head_dim=d, head_dim_v=d, **feature)) == []
    assert impl.not_supported_reasons(_problem(causal=causal, needs_grad=True, **feature)) == []


@pytest.mark.parametrize(("problem", "metadata", "expected"), [
    (_problem(head_dim=96, head_dim_v=96), AttentionMetadata(), "96"),
    (_problem(), AttentionMetadata(block_q=48), "multiples of 64"),
    (_problem(), AttentionMetadata(num_stages=1), "2 stages"),
    # Differentiated, where neither backward runs: every reason of both.
    (_problem(needs_grad=True, causal=True, seq_q=1024, seq_k=2048, head_dim=256, head_dim_v=256),
     AttentionMetadata(), "needs T == S"),
    (_problem(needs_grad=True, seq_q=333, seq_k=517, head_dim=256, head_dim_v=256), AttentionMetadata(),
     "even T and S"),
    (_problem(needs_grad=True, seq_q=333, seq_k=517, head_dim=256, head_dim_v=256), AttentionMetadata(),
     "own backward takes head dims 64 and 128, got 256"),
    # cuDNN's backward asked for: its reasons, though the own backward would run the call.
    (_problem(needs_grad=True, seq_q=333, seq_k=517), AttentionMetadata(extra={"mosaic_backward": "cudnn"}),
     "even T and S"),
    (_problem(needs_grad=True), AttentionMetadata(extra={"mosaic_backward": "own"}), ""),
    # A soft cap at head dim 256: the own backward's head dims and cuDNN's missing cap, both.
    (_problem(needs_grad=True, logits_soft_cap=30.0, head_dim=256, head_dim_v=256), AttentionMetadata(),
     "cuDNN's backward takes no logits soft cap"),
    (_problem(needs_grad=True, logits_soft_cap=30.0, head_dim=256, head_dim_v=256), AttentionMetadata(),
     "own backward takes head dims 64 and 128, got 256"),
    (_problem(needs_grad=True, sliding_window=(64, 0), head_dim=256, head_dim_v=256), AttentionMetadata(),
     "cuDNN's backward, fed mosaic_flash's residuals, takes no sliding window"),
    (_problem(needs_grad=True), AttentionMetadata(extra={"mosaic_backward": "fast"}),
     "'fast' is not one of ['auto', 'own', 'cudnn']"),
])  # fmt: skip
def test_declines_with_a_reason(problem: AttentionProblem, metadata: AttentionMetadata, expected: str) -> None:
    reasons = MosaicFlashAttention(metadata, H100).not_supported_reasons(problem)
    if expected:
        assert any(expected in r for r in reasons), reasons
    else:  # the own backward asked for, where it runs: no reason (cuDNN's are not consulted)
        assert reasons == [], reasons


@pytest.mark.parametrize(("kw", "requested", "has_cudnn", "chosen"), [
    # auto: the own backward below OWN_BACKWARD_BELOW_KEYS keys, and wherever cuDNN's cannot run.
    ({"seq_q": 1024, "seq_k": 1024}, "auto", True, "own"),
    ({}, "auto", True, "cudnn"),
    ({}, "auto", False, "own"),
    ({"seq_q": 4095, "seq_k": 4095}, "auto", True, "own"),  # odd: cuDNN's declines
    ({"causal": True, "seq_q": 4096, "seq_k": 8192}, "auto", True, "own"),  # causal T != S
    ({"head_dim": 256, "head_dim_v": 256}, "auto", True, "cudnn"),
    ({"head_dim": 256, "head_dim_v": 256, "seq_q": 1024, "seq_k": 1024}, "auto", True, "cudnn"),
    ({"head_dim": 256, "head_dim_v": 256}, "auto", False, None),
    ({"head_dim": 64, "head_dim_v": 64, "seq_q": 16384, "seq_k": 16384}, "auto", True, "cudnn"),
    # asked for: that one or its reasons.
    ({"seq_q": 1024, "seq_k": 1024}, "cudnn", True, "cudnn"),
    ({}, "own", True, "own"),
    ({"head_dim": 256, "head_dim_v": 256}, "own", True, None),
    ({"seq_q": 333, "seq_k": 517}, "cudnn", True, None),
    # A soft cap: cuDNN's backward has none, so the own one at any length, or no backward.
    ({"logits_soft_cap": 30.0}, "auto", True, "own"),
    ({"logits_soft_cap": 30.0, "seq_q": 16384, "seq_k": 16384}, "auto", True, "own"),
    ({"logits_soft_cap": 30.0}, "cudnn", True, None),
    ({"logits_soft_cap": 30.0, "head_dim": 256, "head_dim_v": 256}, "auto", True, None),
    # A sliding window: cuDNN's backward as this forward feeds it has none either.
    ({"sliding_window": (128, 0), "causal": True, "seq_q": 16384, "seq_k": 16384}, "auto", True, "own"),
    ({"sliding_window": (128, 0)}, "cudnn", True, None),
    ({"sliding_window": (128, 128), "head_dim": 256, "head_dim_v": 256}, "auto", True, None),
])  # fmt: skip
def test_backward_choice(monkeypatch: pytest.MonkeyPatch, kw: dict[str, object], requested: str, has_cudnn: bool,
                         chosen: str | None) -> None:
    import jaxattn_sdpa.cudnn
    from jaxattn_mosaic.impl import backward_choice

    # Pretended either way: CI's machine has no cuDNN, the GPU machine has one.
    monkeypatch.setattr(jaxattn_sdpa.cudnn, "cudnn_version", lambda: 91000 if has_cudnn else None)
    problem = _problem(needs_grad=True, **kw)
    got, reasons = backward_choice(problem, H100, requested)
    assert got == chosen, reasons
    assert (reasons == []) == (chosen is not None), reasons
    impl = MosaicFlashAttention(AttentionMetadata(extra={"mosaic_backward": requested}), H100)
    assert impl.not_supported_reasons(problem) == reasons
    said = " ".join(impl.notes(problem))
    assert "forward: " in said and " tiles (" in said, said
    if chosen == "own":
        assert "backward: this package's Mosaic GPU kernels" in said, said
    elif chosen == "cudnn":
        assert "backward: cuDNN's" in said, said


@pytest.mark.parametrize(("kw", "summary"), [
    ({"seq_q": 4096, "seq_k": 4096}, "128x128 tiles (64 query rows per consumer), 2 K/V stages, persistent "
                                     "(one CTA per SM looping over the tiles, a head's query tiles together, "
                                     "two Q slots per consumer, a short last round of full attention split by keys)"),
    ({"seq_q": 16384, "seq_k": 16384}, "128x192 tiles (64 query rows per consumer), 2 K/V stages, one CTA per tile"),
    ({"head_dim": 256, "head_dim_v": 256}, "128x64 tiles (64 query rows per consumer), 2 K/V stages, one CTA per tile"),
])  # fmt: skip
def test_explain_says_the_forwards_tiles_and_schedule(kw: dict[str, object], summary: str) -> None:
    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    assert impl.notes(_problem(**kw))[0] == f"forward: {summary}"


@pytest.mark.parametrize(("kw", "note"), [
    # B4 S4k MHA causal: 4096 tiles of 1-32 key blocks on 132 SMs, 4 heads at a time.
    ({"batch": 4, "heads_kv": 32, "causal": True}, "forward's causal tiles: scheduled over 132 SMs, heaviest first, "
                                                   "a few heads at a time; the busiest SM has 0.2% more key "
                                                   "blocks than the mean"),
    ({"batch": 4, "heads_kv": 32}, None),  # full attention: tiles of one size, in turn
    ({"batch": 1, "seq_q": 16384, "seq_k": 16384, "causal": True}, None),  # one CTA per tile from 16k keys
])  # fmt: skip
def test_explain_says_how_causal_tiles_are_scheduled(kw: dict[str, object], note: str | None) -> None:
    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    said = [n for n in impl.notes(_problem(**kw)) if n.startswith("forward's causal tiles")]
    assert said == ([note] if note else [])


@pytest.mark.parametrize(("kw", "note"), [
    # B4 S4k MHA: 4096 tiles on 132 SMs leave 4, each cut 16 ways (2 of 32 key blocks a piece).
    ({"batch": 4, "heads_kv": 32}, "forward's last round: 4 tiles, each cut by keys into 16 pieces for the idle "
                                   "SMs and merged by their log-sum-exps"),
    ({"batch": 4, "heads_kv": 32, "causal": True}, None),  # causal: heavy tiles first, nothing cut
    # One CTA per tile from 16k keys: its last wave is not cut by default (it measured slower).
    ({"batch": 1, "seq_q": 16384, "seq_k": 16384}, None),
    ({"batch": 8, "seq_q": 1024, "seq_k": 1024, "heads_q": 16, "heads_kv": 16}, None),  # not worth it
])  # fmt: skip
def test_explain_says_where_the_last_round_is_cut(kw: dict[str, object], note: str | None) -> None:
    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    said = impl.notes(_problem(**kw))
    assert [n for n in said if n.startswith("forward's last round")] == ([note] if note else [])


def test_the_declared_head_dims_are_the_kernels() -> None:
    # impl declares them so that choosing imports no kernel; the kernel module is the truth.
    from jaxattn_mosaic import backward_kernel
    from jaxattn_mosaic.impl import OWN_BACKWARD_HEAD_DIMS

    assert backward_kernel.HEAD_DIMS == OWN_BACKWARD_HEAD_DIMS
